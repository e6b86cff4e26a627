"""Per-stage latency of one `model(image)` call: medians of decode, canvas, device, solve, finish and total.

    python -m tt_moge.bench_breakdown --weights path/to/model.pt --image media/source.png --runs 30
    python -m tt_moge.bench_breakdown --random-weights tiny-vits-normal --runs 10 --json

The stages are the ones `MoGeModel.predict(..., timing=dict)` records (the same code path as every call);
total is the wall time of the whole call. Without --image: media/source.png when the repo has it, else a
synthetic photo-like PNG of the canvas size. `--json` prints one JSON object of the medians in milliseconds.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

STAGES = ("decode", "canvas", "device", "solve", "finish", "total")
DEMO_IMAGE = Path(__file__).resolve().parents[2] / "media" / "source.png"

__all__ = ["STAGES", "main", "add_model_arguments", "load_model", "default_image"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model options shared by the benchmark scripts."""
    from .argtypes import wxh
    from .constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS

    parser.add_argument("--weights", help="hub id, folder with model.pt, or model.pt (default: the published model)")
    parser.add_argument("--random-weights", metavar="PRESET",
                        help="use a random-weight checkpoint of this tt_moge.testing preset instead (e.g. tiny-vits-normal)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: CUDA if present, else the CPU)")
    parser.add_argument("--resolution", type=wxh, default=DEFAULT_CANVAS, help="canvas WxH (default %(default)s)")
    parser.add_argument("--num-tokens", type=int, default=DEFAULT_NUM_TOKENS)


def load_model(args: argparse.Namespace, scratch: str, **kwargs: Any):
    """MoGeModel.from_pretrained from the parsed model arguments (random weights are written to `scratch`)."""
    from .model import MoGeModel

    weights = args.weights
    if args.random_weights:
        from .testing import make_checkpoint

        weights = str(make_checkpoint(Path(scratch) / "random", args.random_weights))
    elif weights is None:
        from .weights import DEFAULT_REPO

        weights = DEFAULT_REPO
    return MoGeModel.from_pretrained(weights, device=args.device, resolution=args.resolution,
                                     num_tokens=args.num_tokens, **kwargs)


def default_image(size: tuple, scratch: str) -> str:
    """media/source.png if present, else a synthetic photo PNG of `size` written to `scratch`."""
    if DEMO_IMAGE.exists():
        return str(DEMO_IMAGE)
    from PIL import Image

    from .warmup import synthetic_photo

    path = Path(scratch) / f"synthetic_{size[0]}x{size[1]}.png"
    Image.fromarray(synthetic_photo(size, seed=1)).save(path)
    return str(path)


def measure(model: Any, image: Any, runs: int, **options: Any) -> dict:
    """{stage: median ms} over `runs` calls (after one untimed call)."""
    model.predict(image, **options)
    samples: dict = {stage: [] for stage in STAGES}
    for _ in range(runs):
        timing: dict = {}
        t = time.perf_counter()
        model.predict(image, timing=timing, **options)
        timing["total"] = (time.perf_counter() - t) * 1e3
        for stage in STAGES:
            samples[stage].append(timing.get(stage, 0.0))
    return {stage: statistics.median(values) for stage, values in samples.items()}


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tt_moge.bench_breakdown", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--image", help="image file to run (default: media/source.png or a synthetic PNG)")
    parser.add_argument("--runs", type=int, default=20, help="timed calls (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the medians (ms)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    from .host import native

    with tempfile.TemporaryDirectory(prefix="tt_moge-bench-") as scratch:
        image = args.image or default_image(args.resolution, scratch)
        with load_model(args, scratch, warmup_variants="minimal") as model:
            medians = measure(model, image, args.runs)
            host = native.host_path()
            threads = native.threads()
            device = model.device
    if args.json:
        print(json.dumps({stage: round(ms, 3) for stage, ms in medians.items()}))
        return 0
    print(f"image {image}; canvas {args.resolution[0]}x{args.resolution[1]}, {args.num_tokens} tokens, device {device}, "
          f"host path {host}" + (f" ({threads} threads)" if threads else "") + f"; medians of {args.runs} calls")
    for stage in STAGES:
        print(f"  {stage:7s} {medians[stage]:9.2f} ms")
    shown = argv if argv is not None else sys.argv[1:]
    print("rerun: python -m tt_moge.bench_breakdown " + " ".join(shlex.quote(a) for a in shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
