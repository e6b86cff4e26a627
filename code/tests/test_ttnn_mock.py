"""The Tenstorrent runner's whole device graph on a mock Blackhole P150 (`scripts/tt-mock-check`): every ttnn op
validated, programs created and L1 / circular buffers / DRAM allocated as on a chip (values are not computed).

Needs the mock environment (`bash scripts/tt-mock/setup.sh`: a Python 3.12 venv with ttnn, RISC-V binutils).
Where it is not set up these tests skip and say so; CI sets it up and sets MOGE_REQUIRE_MOCK=1, which turns
a missing mock into a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tt_moge import env as environment

from . import background

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "tt-mock-check"
WORK = Path(environment.get("MOGE_MOCK_DIR") or Path.home() / ".cache" / "tt_moge" / "tt-mock")


def _mock_ready() -> bool:
    return (WORK / "env.sh").is_file() and any(WORK.glob(".ready-*"))


pytestmark = pytest.mark.skipif(
    not _mock_ready() and environment.get("MOGE_REQUIRE_MOCK") != "1",
    reason=f"no mock P150 environment in {WORK}: run `bash scripts/tt-mock/setup.sh` (CI does)",
)


def _env() -> dict:
    return {
        **os.environ,
        "PYTHON": sys.executable,
        "MOGE_MOCK_DIR": str(WORK),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "code"), os.environ.get("PYTHONPATH", "")]),
    }


def _shown(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    print(done.stdout[-600:], done.stderr[-1500:], sep="\n")  # shown with -s, and on failure
    return done


def _check(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return _shown(subprocess.run([str(CHECK), *args], capture_output=True, text=True, timeout=timeout, env=_env()))


def _report_command(*args: str) -> list:
    return [str(CHECK), *args, "--json", "{tmp}/report.json"]


def _report(tmp_path, *args: str) -> dict:
    """Run the check with --json (or take the run started at collection: tests/background.py); the report, with
    the OK line's numbers under "summary"."""
    done = background.run(args, _report_command(*args), _env(), 900, tmp_path)
    assert _shown(done.process).returncode == 0, done.process.stdout[-2000:]
    report = json.loads((done.folder / "report.json").read_text())
    report["summary"] = _summary(done.process)
    return report


def _summary(done: subprocess.CompletedProcess) -> dict:
    match = re.search(
        r"^OK: (\S+) at (\d+)x(\d+), (\d+) tokens, \S+: (\d+) ttnn calls \((\d+) device operations\) ran; "
        r"peak L1 per core (\d+|\?) B of (\d+|\?) B",  # "?" without the L1 bisection (--no-l1-headroom)
        done.stdout,
        re.M,
    )
    assert match, "no OK line from the mock check"
    backbone, w, h, tokens, calls, ops, peak, bank = match.groups()
    return {
        "backbone": backbone,
        "canvas": (int(w), int(h)),
        "tokens": int(tokens),
        "calls": int(calls),
        "ops": int(ops),
        "peak": None if peak == "?" else int(peak),
        "bank": None if bank == "?" else int(bank),
    }


# The spec's P150 grid (12x10) and current P150 firmware's (11x10); the mock's full grid (13x10) is not run at the spec
# case any more: the graph plans from whatever grid the device reports, and the two smaller grids are the harder ones.
GRIDS = ("12x10", "11x10")

# The fast graph's estimated network forward at the spec case must not grow past this, per grid (docs/performance.md:
# the estimates under the calibrated model of issue 27: 12.37 and 13.04 ms, 12.88 and 13.57 with issue 47's HiFi2 at
# the decoder's coarse levels, a deliberate precision change, the same margin kept). The input and output sides on the
# device (pre.py, post.py: group "input_output") have their own budget: 1.38 / 1.46 ms estimated
# (docs/performance.md), 4.7 ms before the per-head output side. Issue 27's goal, the whole forward (network + sides)
# <= 15 ms on both grids, is FORWARD_GOAL_MS.
FORWARD_BUDGET_MS = {"12x10": 13.1, "11x10": 13.8}  # + issue 47's HiFi2 at the decoder's coarse levels (0.51, 0.53)
INPUT_OUTPUT_BUDGET_MS = 1.6
FORWARD_GOAL_MS = 15.0

SPEC_CASE = ("--random", "vitl-normal", "--resolution", "1920x1080", "--num-tokens", "1800")


def _network_ms(est: dict) -> float:
    """The estimate of the network alone: the device call less its input and output sides."""
    return est["total"] - est["input_output"]


@pytest.fixture(scope="module", params=GRIDS)
def fast_vitl_report(request, tmp_path_factory) -> dict:
    """The mock check's report of the fast graph (the default) on ViT-L at 1920x1080 / 1800 tokens, run once per
    grid; the calibration (which does not depend on the grid: stored op lists) with the first grid only."""
    grid = request.param
    return _report(tmp_path_factory.mktemp(f"fast-vitl-{grid}"), *_fast_vitl_args(grid))


def _fast_vitl_args(grid: str) -> tuple:
    first = grid == GRIDS[0]  # the calibration and the back-to-back calls do not depend on the grid
    return (*SPEC_CASE, "--grid", grid, *(() if first else ("--no-calibration", "--pipeline-calls", "0")))


@pytest.mark.full_size
def test_vitl_at_the_spec_canvas_runs_on_the_mock_p150_within_its_estimated_budget(fast_vitl_report):
    """The fast graph (the default) at 1920x1080 / 1800 tokens on each P150 grid: the device reports the grid asked
    for, every op accepted, L1 fitting (with headroom: the bisection found a reservation it survives), the cost
    model's estimate of the forward within budget, and (first grid) the report's calibration block: one entry per
    published figure of tt-metal's Blackhole demos, at least half held out, the held-out errors within the
    issue's goals."""
    report = fast_vitl_report
    grid = report["grid"]
    assert grid in GRIDS and report["estimate_ms"]["grid"] == grid
    got = report["summary"]
    assert got["backbone"] == "dinov2_vitl14" and got["canvas"] == (1920, 1080) and got["tokens"] == 1800
    assert got["calls"] > 600 and got["ops"] > 700, "24 blocks and the decoder: far more ops than this"
    assert 0 < got["peak"] < got["bank"]
    assert report["graph"]["encoder_in_l1"] and report["graph"]["decoder_chained"]
    assert report["graph"]["grid"] == [int(v) for v in grid.split("x")]
    # the maps come back as views of the read host tensors (post.host_view), not through to_numpy's copy
    assert report["outputs"]["finite"] and report["outputs"]["readback"].endswith("viewed in place"), report["outputs"]
    est = report["estimate_ms"]
    assert _network_ms(est) <= FORWARD_BUDGET_MS[grid], est
    assert 0 < est["input_output"] <= INPUT_OUTPUT_BUDGET_MS, est
    assert est["total"] == pytest.approx(
        sum(est[g] for g in ("encoder", "sdpa", "norms_adds", "decoder", "transfers", "input_output")), abs=0.01
    )
    assert est["total"] == pytest.approx(est["kernel"] + est["dispatch"], abs=0.01)
    assert len(est["top"]) == 10 and est["device_ops"] > 400
    if grid != GRIDS[0]:
        assert "calibration" not in report and "pipeline" not in report
        return
    _assert_back_to_back_calls(report["pipeline"])
    calibration = report["calibration"]
    points = calibration["points"]
    from tt_moge.ttnn_tools.calibration import POINTS

    assert [(p["model"], p["config"]) for p in points] == [(p.model, p.config) for p in POINTS]
    assert calibration["blind"]["points"] + calibration["seen_held_out"]["points"] == calibration["held_out_points"]
    assert all({"model", "config", "published_ms", "estimate_ms", "fitted"} <= set(p) for p in points)
    held = [p for p in points if not p["fitted"]]
    assert len(held) >= len(points) / 2 and calibration["held_out_points"] == len(held)
    assert calibration["held_out_mean_abs_error"] <= 0.08 and calibration["held_out_max_abs_error"] <= 0.15


def _assert_back_to_back_calls(pipeline: dict) -> None:
    """The runner's two calls back to back on the mock, two command queues (`mock_check.pipeline_calls`, the trace
    off): the same ttnn calls each time, both calls' maps back, and tt-metal's order for ops on queue 0 with uploads
    and reads on queue 1: each forward waits for its upload, the second canvas goes up before the first call's maps
    are read (the read waits for the first forward, not the second), each read waits for its own forward."""
    assert pipeline["queues"] == 2 and pipeline["same_ops_every_call"]
    assert sum(pipeline["ttnn_calls_per_call"][0].values()) > 400
    assert [m["points"] for m in pipeline["maps"]] == [[3, 1080, 1920]] * 2
    order = [re.sub(r"ops cq0: \d+ ttnn calls", "ops cq0", step) for step in pipeline["order"]]
    reads = ["read cq1: outputs[{0}].points", "read cq1: outputs[{0}].normal", "read cq1: outputs[{0}].mask"]
    expected = [
        "write cq1: input[uint8,0]", "record cq1: e1", "wait cq0: e1 (logged)", "ops cq0", "record cq0: e2",
        "write cq1: input[uint8,1]", "record cq1: e3", "wait cq0: e3 (logged)", "ops cq0", "record cq0: e4",
        "wait cq1: e2 (logged)", *[r.format(0) for r in reads], "read cq1: cls[0]", "record cq1: e5",
        "host waits: e5",
        "wait cq1: e4 (logged)", *[r.format(1) for r in reads], "read cq1: cls[1]", "record cq1: e6",
        "host waits: e6",
    ]  # fmt: skip
    assert order == expected, order


@pytest.mark.full_size
def test_the_forward_meets_issue_27s_goal(fast_vitl_report, request):
    """Issue 27's goal: the whole forward (network and the input and output sides) within 15 ms on both P150 grids,
    by the cost model. Not met at 11x10 since issue 47's HiFi2 at the decoder's two coarsest levels (which a
    decoder level's 0.02 bound needs: 15.15 ms, 14.62 before; 12x10 14.38): a known failure, strict (it fails the
    day it passes), not traded against that bound here (docs/tenstorrent.md)."""
    if fast_vitl_report["grid"] == "11x10":
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 47, item 2"))
    est = fast_vitl_report["estimate_ms"]
    assert est["total"] <= FORWARD_GOAL_MS, est


SAFE_ARGS = (*SPEC_CASE, "--grid", GRIDS[0], "--config", "safe", "--no-calibration", "--no-l1-headroom")


@pytest.mark.full_size
def test_the_safe_graph_still_runs_and_costs_more(tmp_path):
    """$MOGE_TTNN_GRAPH=safe, the switch back: the first graph (DRAM activations, HiFi4) runs on the mock too (on
    the spec's grid; no L1 bisection), and the cost model sees what the fast graph buys."""
    report = _report(tmp_path, *SAFE_ARGS)
    assert not report["graph"]["encoder_in_l1"] and not report["graph"]["decoder_chained"]
    assert _network_ms(report["estimate_ms"]) > 2 * FORWARD_BUDGET_MS[GRIDS[0]]


def test_an_impossible_grid_is_refused_before_anything_runs():
    """--grid takes what harvesting can give (C columns of 1 to 13, 10 rows); anything else is a usage error."""
    for grid in ("12x8", "14x10", "twelve"):
        done = _check("--random", "vits", "--grid", grid)
        assert done.returncode == 2 and f"--grid {grid}: expected CxR" in done.stderr


CAPTURE_COMMAND = [
    "bash",
    "-c",
    'cd "$2" && . ./env.sh && exec python "$0" --capture-calibration "$1"',
    str(ROOT / "code" / "tt_moge" / "ttnn_tools" / "mock_check.py"),
    "{tmp}/runs.json.gz",
    str(WORK),
]


def test_the_stored_calibration_runs_are_what_the_mock_runs_now(tmp_path):
    """The calibration reads the demo models' op lists from `calibration.RUNS_FILE` (so that it does not depend on
    the mock's grid); a fresh capture of every demo model on the mock must give the same op lists."""
    from tt_moge.ttnn_tools import calibration
    from tt_moge.ttnn_tools.cost import ops_to_json

    done = background.run("capture-calibration", CAPTURE_COMMAND, None, 900, tmp_path)
    assert done.process.returncode == 0, done.process.stdout[-1500:] + done.process.stderr[-1500:]
    stored, captured = calibration.load_runs(), calibration.load_runs(done.folder / "runs.json.gz")
    assert sorted(captured) == sorted(stored) == sorted({p.run for p in calibration.POINTS})
    for run in stored:
        assert ops_to_json(captured[run]) == ops_to_json(stored[run]), run


VITS_ARGS = ("--random", "vits-normal", "--resolution", "640x480", "--num-tokens", "1200", "--no-calibration")


def test_vits_on_another_canvas_runs_on_the_mock_p150(tmp_path):
    report = _report(tmp_path, *VITS_ARGS)
    got = report["summary"]
    assert got["backbone"] == "dinov2_vits14" and got["canvas"] == (640, 480) and got["tokens"] == 1200
    assert got["calls"] > 300 and 0 < got["peak"] < got["bank"]
    assert report["graph"]["decoder_chained"] and report["estimate_ms"]["total"] > 0


def _square_args(grid: str, tokens: int) -> tuple:
    square = ("--random", "vits", "--resolution", "896x896", "--grid", grid, "--no-calibration")
    return (*square, "--num-tokens", str(tokens), *(("--no-l1-headroom",) if tokens > 1600 else ()))


@pytest.mark.parametrize("grid", GRIDS)
def test_no_normal_head_on_square_canvases_runs_on_the_mock_p150(tmp_path, grid):
    """A checkpoint without a normal head (two heads) on a square canvas, on each P150 grid: at 1600 tokens
    chained in L1, at the top of the token budget (3600; first grid only) the decoder falls back to DRAM slicing
    (its finest maps no longer fit L1)."""
    small = _report(tmp_path, *_square_args(grid, 1600))
    assert small["grid"] == grid and small["summary"]["canvas"] == (896, 896) and small["graph"]["decoder_chained"]
    shapes = small["outputs"]["shapes"]  # channels-first planes, as the device reads them back
    assert shapes.get("normal") is None and shapes["mask"] == [1, 896, 896] and shapes["points"] == [3, 896, 896]
    if grid == GRIDS[0]:
        large = _report(tmp_path, *_square_args(grid, 3600))
        assert large["graph"]["encoder_in_l1"] and not large["graph"]["decoder_chained"]


def test_an_oversized_config_is_refused_by_the_mock():
    """The negative control: a matmul config whose circular buffers exceed L1 must fail the check's run."""
    done = _check("--random", "vits-normal", "--resolution", "640x480", "--num-tokens", "1200", "--oversize")
    assert done.returncode == 0 and "refused for its L1 use" in done.stdout
    assert "beyond max L1 size" in done.stdout


def background_runs(items) -> dict:
    """The mock runs the selected `items` will ask for, keyed as they ask (tests/background.py): started at
    collection, one at a time, while the tests before them run. None where the mock is not set up (the tests
    skip, or fail under MOGE_REQUIRE_MOCK=1, without them)."""
    if not _mock_ready():
        return {}
    runs = {}
    for item in items:
        grid = getattr(item, "callspec", None) and item.callspec.params.get(
            "fast_vitl_report", item.callspec.params.get("grid")
        )
        name = item.originalname
        if name.startswith("test_vitl_at_the_spec_canvas"):
            arg_sets = [_fast_vitl_args(grid)]
        elif name == "test_the_safe_graph_still_runs_and_costs_more":
            arg_sets = [SAFE_ARGS]
        elif name == "test_vits_on_another_canvas_runs_on_the_mock_p150":
            arg_sets = [VITS_ARGS]
        elif name == "test_no_normal_head_on_square_canvases_runs_on_the_mock_p150":
            arg_sets = [_square_args(grid, 1600)] + ([_square_args(grid, 3600)] if grid == GRIDS[0] else [])
        elif name == "test_the_stored_calibration_runs_are_what_the_mock_runs_now":
            runs["capture-calibration"] = (CAPTURE_COMMAND, None, 900)
            continue
        else:
            continue
        for args in arg_sets:
            runs[args] = (_report_command(*args), _env(), 900)
    return runs
