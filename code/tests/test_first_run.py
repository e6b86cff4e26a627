"""The first run without weights: the quickstart, `tt-moge predict` and `tt-moge serve` with an unreachable Hub
answer fast, without a traceback, in a few lines that name the three ways out; Python callers get the same text
as a CheckpointError.

"Unreachable" is a closed port on this machine given as HF_ENDPOINT (refused at once, like a machine without
network), with an empty Hugging Face cache and HF_HUB_OFFLINE unset, so the hub client's real code path runs.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tt_moge.weights import DEFAULT_REPO, DEFAULT_REVISION, RANDOM_WEIGHTS_ONE_LINER

CODE = Path(__file__).resolve().parents[1]
QUICKSTART = CODE / "examples" / "quickstart.py"
DEMO = CODE.parent / "media" / "source.png"
DEADLINE_S = 10.0  # the bound for the whole process, start-up included
MAX_LINES = 8


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


def _offline_env(tmp_path: Path, how: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MOGE_WEIGHTS_DIR", "HF_HUB_OFFLINE", "HF_ENDPOINT")}
    env.update(PYTHONPATH=str(CODE), HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(tmp_path / "hf-home" / "hub"))
    if how == "unreachable":
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    else:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _run(command: list, tmp_path: Path, how: str) -> tuple:
    t = time.perf_counter()
    run = subprocess.run(command, cwd=tmp_path, env=_offline_env(tmp_path, how), capture_output=True, text=True,
                         timeout=120)
    return run, time.perf_counter() - t


def _check_the_ways_out(text: str) -> None:
    assert f"hf download {DEFAULT_REPO} model.pt --revision {DEFAULT_REVISION}" in text, text  # 1. the pinned download
    assert "MOGE_WEIGHTS_DIR=" in text and "--weights" in text, text  # 2. weights you have
    assert RANDOM_WEIGHTS_ONE_LINER in text, text  # 3. random weights


@pytest.mark.parametrize("how", ["unreachable", "HF_HUB_OFFLINE"])
@pytest.mark.parametrize("surface", ["quickstart", "predict"])
def test_no_weights_and_no_hub_is_a_short_fast_answer(surface, how, tmp_path):
    command = ([sys.executable, str(QUICKSTART)] if surface == "quickstart"
               else [sys.executable, "-m", "tt_moge", "predict", str(DEMO), "-o", str(tmp_path / "out")])
    run, seconds = _run(command, tmp_path, how)
    assert run.returncode != 0
    assert seconds < DEADLINE_S, f"{surface} took {seconds:.1f} s to fail"
    assert "Traceback" not in run.stderr and "Retrying" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) <= MAX_LINES, run.stderr
    _check_the_ways_out(run.stderr)
    assert ("cannot be reached" if how == "unreachable" else "HF_HUB_OFFLINE is set") in run.stderr


def test_serve_without_weights_exits_fast_with_the_ways_out(tmp_path):
    run, seconds = _run([sys.executable, "-m", "tt_moge", "serve", "--port", "0", "--no-access-log"], tmp_path, "unreachable")
    assert run.returncode == 1 and seconds < DEADLINE_S, (seconds, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    _check_the_ways_out(run.stderr)


def test_python_callers_get_a_checkpoint_error_with_the_same_text(tmp_path):
    script = ("from tt_moge import MoGeModel\n"
              "from tt_moge.weights import CheckpointError\n"
              "try:\n"
              "    MoGeModel.from_pretrained(device='cpu')\n"
              "except CheckpointError as exc:\n"
              "    print(exc)\n")
    run, seconds = _run([sys.executable, "-c", script], tmp_path, "unreachable")
    assert run.returncode == 0 and seconds < DEADLINE_S, (seconds, run.stderr)
    _check_the_ways_out(run.stdout)
    cli, _ = _run([sys.executable, "-m", "tt_moge", "predict", str(DEMO), "--device", "cpu"], tmp_path, "unreachable")
    reason = run.stdout.strip().split("(ConnectError")[0]
    assert reason in cli.stderr  # the CLI prints the exception's own text, after its prefix
