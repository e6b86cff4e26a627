"""The first real call of every warmed variant is as fast as the later calls (the spec's Warm-up promise).

Each run is a fresh process (this file run as a script): `from_pretrained(warmup_variants="default")` on a
small random-weight checkpoint (tiny-vits-normal cut to one ViT block and a narrow decoder: a ~0.3 s CPU
forward), then for each default variant one first call with a NEW image of that kind
and size (never the warm-up image; files written before the clock starts) and STEADY_CALLS more. A wrapper
around the runner's forward splits every call into its device part and its host part.

Criterion (per variant, for the whole call and for its host part alone):
    first <= steady * (1 + MOGE_FIRST_CALL_TOL) + 1.5 ms        (MOGE_FIRST_CALL_TOL default 0.10)
with steady the median of the process's own steady calls (taken seconds after its first call), required of
the best of PROCESSES fresh processes (when a variant fails, the best of twice as many: see
`_check_first_calls`). A one-time cost of a cold path (an import, a library load, a fresh
buffer's page faults, a decoder set-up) is paid in every fresh process, so it fails this check; what a
shared machine adds at random (another job taking the core, a slower forward) hits one process, not all.
The host part is checked on its own because a CPU forward
(~0.5 s here) would hide any host one-time cost inside the 10 %.

Clock: MOGE_FIRST_CALL_CLOCK = "cpu" (default: process CPU time, user + system, all threads; torch runs one
thread in the workers) or "wall". CPU time counts exactly the one-time work a cold path does (imports,
library loads, page faults of fresh buffers) but not the time other jobs on a shared machine take from us,
so the check stays meaningful on a loaded 2-core machine; "wall" is the spec's clock for a quiet machine.
The outputs of the first calls are also compared with a model loaded with warmup_variants="none": warm-up
must not change any result.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

CANVAS = (448, 252)
TOKENS = 1200
STEADY_CALLS = 3
PROCESSES = 4
PARALLEL = 2  # worker processes at a time (one per core of the development machine)
WARMUP = os.environ.get("MOGE_FIRST_CALL_WARMUP", "default")  # "none" shows what the check catches
TOL = float(os.environ.get("MOGE_FIRST_CALL_TOL", "0.10"))
CLOCK = os.environ.get("MOGE_FIRST_CALL_CLOCK", "cpu")
DEVICE_ID = int(os.environ.get("MOGE_DEVICE", "0"))  # the Tenstorrent chip of the device case
SLACK_MS = 1.5


# ------------------------------------------------------------------------------------------- worker
def _inputs(variant: dict, seed: int, folder: Path) -> list:
    """Fresh inputs of the variant's kind and size (a different synthetic photo per seed)."""
    import torch
    from PIL import Image

    from tt_moge.synthetic import synthetic_photo

    out = []
    for k in range(2 if variant["call"] == "predict_many" else 1):
        photo = synthetic_photo(variant["size"], seed=1000 + 10 * seed + k)
        kind = variant["input"]
        if kind == "array":
            out.append(photo)
        elif kind == "float":
            out.append(torch.from_numpy(photo).permute(2, 0, 1)[None].float().div_(255))
        elif kind == "pil":
            out.append(Image.fromarray(photo))
        else:
            path = folder / f"in{seed}_{k}.{'png' if kind == 'png' else 'jpg'}"
            Image.fromarray(photo).save(path, **({"quality": 90} if kind == "jpeg" else {}))
            path.read_bytes()  # in the page cache, like a file the caller just wrote
            out.append(str(path))
    return out


def _call(model, variant: dict, inputs: list):
    opts = dict(
        fit=variant["fit"],
        fov_x=60.0 if variant["fov_x"] else None,
        apply_mask=variant["apply_mask"],
        force_projection=variant["force_projection"],
    )
    if variant["call"] == "forward":
        return model.forward(inputs[0])
    if variant["call"] == "infer":
        img = inputs[0]
        return model.infer(
            img[0] if hasattr(img, "ndim") and img.ndim == 4 else img,
            fov_x=opts["fov_x"],
            apply_mask=opts["apply_mask"],
            force_projection=opts["force_projection"],
        )
    if variant["call"] == "predict_many":
        return model.predict_many(inputs, **opts)
    return model.predict(inputs[0], **opts)


def _digest(result) -> str:
    import numpy as np

    h = hashlib.sha256()
    items = result if isinstance(result, list) else [result]
    for item in items:
        d = item.to_dict() if hasattr(item, "to_dict") else item
        for key in sorted(d):
            h.update(key.encode() + np.ascontiguousarray(np.asarray(d[key])).tobytes())
    return h.hexdigest()


def worker(checkpoint: str, warmup_variants: str, device: str = "cpu") -> None:
    """Prints one JSON line per default variant: times (ms) of the first and the steady calls."""
    import torch

    torch.set_num_threads(1)
    from tt_moge import MoGeModel
    from tt_moge.warmup import PRESETS, canonical_variant

    model = MoGeModel.from_pretrained(
        checkpoint, device=device, resolution=CANVAS, num_tokens=TOKENS, warmup_variants=warmup_variants
    )
    device = {"wall": 0.0, "cpu": 0.0}
    forward = model._runner.forward

    def timed_forward(canvas):
        t, c = time.perf_counter(), time.process_time()
        try:
            return forward(canvas)
        finally:
            device["wall"] += time.perf_counter() - t
            device["cpu"] += time.process_time() - c

    model._runner.forward = timed_forward
    with tempfile.TemporaryDirectory(prefix="tt_moge-first-call-") as tmp:
        for index, spec in enumerate(PRESETS["default"]):
            variant = dict(canonical_variant(spec, CANVAS))
            calls = [_inputs(variant, 100 * index + n, Path(tmp)) for n in range(1 + STEADY_CALLS)]
            times, digest = [], None
            for n, inputs in enumerate(calls):
                device["wall"] = device["cpu"] = 0.0
                t, c = time.perf_counter(), time.process_time()
                result = _call(model, variant, inputs)
                wall, cpu = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
                times.append(
                    {
                        "wall": wall,
                        "cpu": cpu,
                        "host_wall": wall - device["wall"] * 1e3,
                        "host_cpu": cpu - device["cpu"] * 1e3,
                    }
                )
                if n == 0:
                    digest = _digest(result)
            print(json.dumps({"variant": spec, "times": times, "digest": digest}), flush=True)
    model.close()


# --------------------------------------------------------------------------------------------- test
def _run_workers(checkpoint, warmup_presets: list, device: str = "cpu", parallel: int = PARALLEL) -> list:
    """One fresh worker process per entry of `warmup_presets`, `parallel` at a time; their parsed JSON lines."""
    from concurrent.futures import ThreadPoolExecutor

    code_dir = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(code_dir) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run(preset: str) -> list:
        p = subprocess.run(
            [sys.executable, __file__, "--worker", str(checkpoint), preset, device],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert p.returncode == 0, f"worker failed:\n{p.stderr[-3000:]}"
        return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(run, warmup_presets))


def _small_checkpoint(folder):
    """The forward is not what this file tests: one ViT block, a narrow decoder without residual blocks."""
    from tt_moge.testing import make_checkpoint, model_config

    # the forward is not what this file tests: one ViT block, a narrow decoder without residual blocks
    config = model_config("tiny-vits-normal")
    config["encoder"]["intermediate_layers"] = [0]
    dims = [16, 8, 8, 8, 8]
    config["encoder"]["dim_out"] = dims[0]
    config["neck"]["dim_in"][0] = dims[0] + 2  # + the uv planes
    for part in ("neck", "points_head", "mask_head", "normal_head"):
        if part != "neck":
            config[part]["dim_in"] = list(dims)
        config[part]["dim_res_blocks"] = list(dims)
        config[part]["num_res_blocks"] = [0] * len(dims)
    return make_checkpoint(folder, config)


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory):
    """{"default": [PROCESSES runs], "none": [1 run]}. PARALLEL processes run at once: the default CPU clock
    does not count the time they take from each other (the wall clock does: for MOGE_FIRST_CALL_CLOCK=wall,
    set PARALLEL to 1 and run this file alone on a quiet machine)."""
    path = _small_checkpoint(tmp_path_factory.mktemp("first-call"))
    runs = _run_workers(path, [WARMUP] * PROCESSES + ["none"])
    return {"default": runs[:PROCESSES], "none": runs[PROCESSES:], "checkpoint": path}


@pytest.mark.skipif(CLOCK not in ("cpu", "wall"), reason="MOGE_FIRST_CALL_CLOCK must be cpu or wall")
def test_first_call_of_each_warmed_variant_is_as_fast_as_steady(worker_runs):
    _check_first_calls(
        worker_runs["default"], CLOCK, lambda: _run_workers(worker_runs["checkpoint"], [WARMUP] * PROCESSES)
    )


def _tt_chip_present() -> bool:
    from tt_moge.runners.ttnn.device import chips_here

    return chips_here() > DEVICE_ID


@pytest.mark.skipif(
    not _tt_chip_present(),
    reason="needs a Tenstorrent chip (ttnn imports and sees one; MOGE_DEVICE "
    "names which): the CPU runs the same check above",
)
def test_first_call_on_a_tenstorrent_chip(tmp_path):
    """The same check with the ttnn runner (one process at a time: one chip), on the wall clock: the device's
    time is not process CPU time."""
    path = _small_checkpoint(tmp_path)
    runs = lambda: _run_workers(path, [WARMUP] * 2, device=f"tt:{DEVICE_ID}", parallel=1)  # noqa: E731
    _check_first_calls(runs(), "wall", runs)


def _check_first_calls(worker_runs: list, clock: str, more_runs=None) -> None:
    """The criterion of the module docstring over `worker_runs`. When a variant fails it, `more_runs()` (fresh
    processes) is asked once and the check repeated over all of them: a one-time cost of a cold path is paid in
    every fresh process and fails again; a hiccup of a shared machine that hit each of the first processes
    (seen in CI: a JPEG's first host part 33 % over in all four) does not come back in the same variant."""
    failures = _first_call_failures(worker_runs, clock)
    if failures and more_runs is not None:
        print("\nfirst round over the limit:\n" + "\n".join(failures) + "\nasking fresh processes once more")
        failures = _first_call_failures(worker_runs + more_runs(), clock)
    assert not failures, "first call slower than steady:\n" + "\n".join(failures)


def _first_call_failures(worker_runs: list, clock: str) -> list:
    from tt_moge.warmup import PRESETS

    assert all(len(run) == len(PRESETS["default"]) for run in worker_runs)
    # the wrapper around the runner's forward saw every call: each one's device part is a real forward
    # (a host part alone can be well under a millisecond on a fast CPU, so only its sign is checked below)
    devices = [t[clock] - t[f"host_{clock}"] for run in worker_runs for variant in run for t in variant["times"]]
    assert min(devices) > 0.5, f"a call's device part of {min(devices):.3f} ms: the forward was not timed"
    failures, lines = [], []
    for index, spec in enumerate(PRESETS["default"]):
        for part, key in (("call", clock), ("host", f"host_{clock}")):
            firsts = [run[index]["times"][0][key] for run in worker_runs]
            steadies = [statistics.median(t[key] for t in run[index]["times"][1:]) for run in worker_runs]
            assert min(steadies) > 0, f"{spec}: a steady {part} time of {min(steadies):.3f} ms cannot be right"
            excess = min(f - (s * (1 + TOL) + SLACK_MS) for f, s in zip(firsts, steadies))
            first, steady = statistics.median(firsts), statistics.median(steadies)
            lines.append(
                f"{json.dumps(spec):70s} {part:4s} first {first:8.2f} ms  steady {steady:8.2f} ms  "
                f"ratio {first / steady:5.2f}  over the limit by {excess:+8.2f} ms"
            )
            if excess > 0:
                failures.append(lines[-1])
    print(
        f"\nclock: {clock}; first and steady: medians of {len(worker_runs)} fresh processes; excess: the best process\n"
        + "\n".join(lines)
    )
    return failures


def test_warm_up_does_not_change_outputs(worker_runs):
    (cold,) = worker_runs["none"]
    for warm in worker_runs["default"]:
        assert [r["digest"] for r in warm] == [r["digest"] for r in cold]


if __name__ == "__main__" and len(sys.argv) in (4, 5) and sys.argv[1] == "--worker":
    worker(*sys.argv[2:])
