"""Shared helpers of the benchmarks: the full-size random checkpoint, the test photo, medians, upstream, the
rerun line. The benchmarks are modules of the `perf` package: run them from the repository root as
`python -m perf.<group>.<name>` (tt_moge itself comes from `pip install -e code/`)."""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import tt_moge  # noqa: F401  (before any benchmark imports torch: OpenMP's wait policy, see tt_moge.openmp)

ROOT = Path(__file__).resolve().parents[1]  # the repository root
DEMO_IMAGE = ROOT / "media" / "source.png"

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tt_moge" / "bench"


def full_size_checkpoint(path: str | None, preset: str = "vitl-normal") -> Path:
    """The given model.pt, or a random-weight, well-posed ViT-L checkpoint written once into the cache (1.3 GB)."""
    if path:
        return Path(path)
    from tt_moge.testing import make_checkpoint

    target = DEFAULT_CACHE / preset / "model.pt"
    if not target.is_file():
        print(f"writing a random-weight {preset} checkpoint to {target} (once; about 30 s)", flush=True)
        make_checkpoint(target, preset)
    return target


def photo(size: tuple):
    """The benchmark image: a photo-like (H, W, 3) uint8 array of `size` = (width, height)."""
    from tt_moge.synthetic import synthetic_photo

    return synthetic_photo(size, seed=1)


def load_upstream(path: Path):
    """microsoft/MoGe's own MoGeModel (PyPI dlr-moge) on the same checkpoint, checked to load every weight."""
    import moge.model.v2 as upstream_v2

    from tt_moge.weights import read_checkpoint

    model = upstream_v2.MoGeModel.from_pretrained(str(path)).eval()
    _, state = read_checkpoint(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"upstream did not load the checkpoint cleanly: missing {missing}, unexpected {unexpected}")
    return model


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed_both(fn) -> tuple:
    """(wall seconds, CPU seconds of this process) of one call. On a shared machine the CPU seconds move much
    less with other jobs' load than the wall time does (but count OpenMP spin-waiting too)."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def median_min_ms(fn, calls: int, sync=None) -> tuple:
    """(median, min) milliseconds of `calls` calls of `fn` after one warm call; `sync()` after each call (e.g.
    torch.cuda.synchronize) so that asynchronous work is inside the time."""
    fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t) * 1e3)
    return median(times), min(times)


def median(values: list) -> float:
    return statistics.median(values)


def cpu_line() -> str:
    """This machine's CPU for a benchmark's output: model name, cores, and the flags that decide its fast paths."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")
    have = [f for f in wanted if f in flags]
    return f"CPU: {model}, {os.cpu_count()} logical cores; {' '.join(have) or 'none of ' + ' '.join(wanted)}"


def kernel_line(runner_info: dict) -> str:
    """The CPU runner's chosen kernels (and why) from `model.info()["runner"]` / `runner.describe()`."""
    chosen = [f"{key[:-4]}: {value}" for key, value in runner_info.items() if key.endswith("_why")]
    return "kernels: " + ("; ".join(chosen) if chosen else "none chosen (not the CPU graph runner)")


def rerun_command(argv=None) -> str:
    """The command that reruns the running benchmark with the same arguments: python -m perf.<group>.<name> ..."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    module = spec.name if spec is not None else sys.argv[0]
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module] + [shlex.quote(str(a)) for a in args])


def finish_report(result: dict, json_path: str | None) -> None:
    """The last lines of every benchmark: how to rerun it, and the numbers as JSON when asked (--json)."""
    print(f"rerun: {rerun_command()}")
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
