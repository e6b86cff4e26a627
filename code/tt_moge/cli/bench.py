"""`tt-moge bench`: per-stage latency of one `model(image)` call: medians of decode, canvas, device, solve,
finish and total (also `python -m tt_moge.bench_breakdown`, the published method's name).

    tt-moge bench --weights path/to/model.pt --image media/source.png --runs 30
    tt-moge bench --random-weights tiny-vits-normal --runs 10 --json

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

from . import argtypes
from .commands import summary as command_summary
from .common import Formatter, add_model_arguments, model_kwargs

STAGES = ("decode", "canvas", "device", "solve", "finish", "total")
DEMO_IMAGE = Path(__file__).resolve().parents[3] / "media" / "source.png"

__all__ = [
    "STAGES",
    "add_parser",
    "build_parser",
    "run",
    "main",
    "add_bench_model_arguments",
    "load_bench_model",
    "default_image",
    "measure",
]


def add_bench_model_arguments(parser: argparse.ArgumentParser, warmup_variants: str = "minimal") -> None:
    """The shared model flags (host warm-up `warmup_variants` by default) plus --random-weights, for the
    benchmarks."""
    add_model_arguments(parser, warmup=2, warmup_variants=warmup_variants)
    parser.add_argument(
        "--random-weights",
        metavar="PRESET",
        help="use a random-weight checkpoint of this tt_moge.random_weights preset instead of --weights "
        "(e.g. tiny-vits-normal)",
    )


def load_bench_model(args: argparse.Namespace, scratch: str, **overrides: Any):
    """MoGeModel.from_pretrained from the parsed flags (random weights are written to `scratch`)."""
    from ..model import MoGeModel

    kwargs = {**model_kwargs(args), **overrides}
    if args.random_weights:
        from ..random_weights import make_checkpoint

        kwargs["pretrained_model_name_or_path"] = str(make_checkpoint(Path(scratch) / "random", args.random_weights))
    return MoGeModel.from_pretrained(**kwargs)


def default_image(size: tuple, scratch: str) -> str:
    """media/source.png if present, else a synthetic photo PNG of `size` written to `scratch`."""
    if DEMO_IMAGE.exists():
        return str(DEMO_IMAGE)
    from PIL import Image

    from ..synthetic import synthetic_photo

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


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_model_arguments(parser)
    parser.add_argument("--image", help="image file to run (default: media/source.png or a synthetic PNG)")
    parser.add_argument("--runs", type=argtypes.positive_int, default=20, help="timed calls (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the medians (ms)")


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser("bench", formatter_class=Formatter, help=command_summary("bench"), description=__doc__)
    _add_arguments(parser)
    return parser


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=Formatter)
    _add_arguments(parser)
    return parser


def run(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None, argv: Optional[list] = None) -> int:
    """Time the stages; print them (or --json) and the command that reruns the measurement."""
    from .. import native

    with tempfile.TemporaryDirectory(prefix="tt_moge-bench-") as scratch:
        image = args.image or default_image(args.resolution, scratch)
        with load_bench_model(args, scratch) as model:
            medians = measure(model, image, args.runs)
            host = native.host_path()
            threads = native.threads()
            device = model.device
    if args.json:
        print(json.dumps({stage: round(ms, 3) for stage, ms in medians.items()}))
        return 0
    print(
        f"image {image}; canvas {args.resolution[0]}x{args.resolution[1]}, {args.num_tokens} tokens, device {device}, "
        f"host path {host}" + (f" ({threads} threads)" if threads else "") + f"; medians of {args.runs} calls"
    )
    for stage in STAGES:
        print(f"  {stage:7s} {medians[stage]:9.2f} ms")
    shown = argv if argv is not None else sys.argv[1:]
    print("rerun: tt-moge bench " + " ".join(shlex.quote(a) for a in shown if a != "bench"))
    return 0


def main(argv: Optional[list] = None) -> int:
    """`python -m tt_moge.bench_breakdown ...`"""
    args = build_parser("python -m tt_moge.bench_breakdown").parse_args(argv)
    return run(args, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
