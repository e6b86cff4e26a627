"""The Tenstorrent runner's whole device graph on a mock Blackhole P150 (`scripts/tt-mock-check`): every ttnn op
validated, programs created and L1 / circular buffers / DRAM allocated as on a chip (values are not computed).

Needs the mock environment (`bash scripts/tt-mock/setup.sh`: a Python 3.12 venv with ttnn, RISC-V binutils).
Where it is not set up these tests skip and say so; CI sets it up and sets MOGE_REQUIRE_MOCK=1, which turns
a missing mock into a failure.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tt_moge import env as environment

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "tt-mock-check"
WORK = Path(environment.get("MOGE_MOCK_DIR") or Path.home() / ".cache" / "tt_moge" / "tt-mock")


def _mock_ready() -> bool:
    return (WORK / "env.sh").is_file() and any(WORK.glob(".ready-*"))


pytestmark = pytest.mark.skipif(
    not _mock_ready() and environment.get("MOGE_REQUIRE_MOCK") != "1",
    reason=f"no mock P150 environment in {WORK}: run `bash scripts/tt-mock/setup.sh` (CI does)")


def _check(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "MOGE_MOCK_DIR": str(WORK),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "code"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([str(CHECK), *args], capture_output=True, text=True, timeout=timeout, env=env)
    print(done.stdout[-600:], done.stderr[-1500:], sep="\n")  # shown with -s, and on failure
    return done


def _summary(done: subprocess.CompletedProcess) -> dict:
    match = re.search(r"^OK: (\S+) at (\d+)x(\d+), (\d+) tokens, \S+: (\d+) ttnn calls \((\d+) device operations\) ran; "
                      r"peak L1 per core (\d+) B of (\d+) B", done.stdout, re.M)
    assert match, "no OK line from the mock check"
    backbone, w, h, tokens, calls, ops, peak, bank = match.groups()
    return {"backbone": backbone, "canvas": (int(w), int(h)), "tokens": int(tokens), "calls": int(calls),
            "ops": int(ops), "peak": int(peak), "bank": int(bank)}


@pytest.mark.full_size
def test_vitl_at_the_spec_canvas_runs_on_the_mock_p150():
    done = _check("--random", "vitl-normal", "--resolution", "1920x1080", "--num-tokens", "1800")
    assert done.returncode == 0
    got = _summary(done)
    assert got["backbone"] == "dinov2_vitl14" and got["canvas"] == (1920, 1080) and got["tokens"] == 1800
    assert got["calls"] > 600 and got["ops"] > 1500, "24 blocks and the decoder: far more ops than this"
    assert 0 < got["peak"] < got["bank"]


def test_vits_on_another_canvas_runs_on_the_mock_p150():
    done = _check("--random", "vits-normal", "--resolution", "640x480", "--num-tokens", "1200")
    assert done.returncode == 0
    got = _summary(done)
    assert got["backbone"] == "dinov2_vits14" and got["canvas"] == (640, 480) and got["tokens"] == 1200
    assert got["calls"] > 300 and 0 < got["peak"] < got["bank"]


def test_an_oversized_config_is_refused_by_the_mock():
    """The negative control: a matmul config whose circular buffers exceed L1 must fail the check's run."""
    done = _check("--random", "vits-normal", "--resolution", "640x480", "--num-tokens", "1200", "--oversize")
    assert done.returncode == 0 and "refused for its L1 use" in done.stdout
    assert "beyond max L1 size" in done.stdout
