"""`tt-moge export onnx`: write the raw fixed-shape forward as an ONNX file and check it with ONNX Runtime."""

from __future__ import annotations

import argparse
import time
from typing import Any

from .commands import SAY_PREFIX as PREFIX
from .commands import summary as command_summary
from .common import EXIT_OK, EXIT_START, EXIT_USAGE, Formatter, add_model_arguments, model_kwargs, say

__all__ = ["add_parser", "run", "EXPORT_FLAGS", "EXIT_MISMATCH", "POINTS_TOLERANCE"]

EXPORT_FLAGS = ("weights", "revision", "resolution", "num_tokens", "verbose")  # the model flags that apply
EXIT_MISMATCH = 1
POINTS_TOLERANCE = 1e-4  # max |ONNX Runtime - ours| of the points over their scale, float32 on both sides
EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    written, and ONNX Runtime's outputs match ours (or --no-check)
  {EXIT_MISMATCH}    written, but ONNX Runtime's points differ from ours by over {POINTS_TOLERANCE:g} of their scale
  {EXIT_USAGE}    bad command line: unknown option, bad value
  {EXIT_START}    could not start: weights not found or unreadable, the export extra missing"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    export = commands.add_parser(
        "export",
        formatter_class=Formatter,
        help=command_summary("export"),
        description="Write the raw fixed-shape forward, the graph our runners run, in float32: input `image` "
        "(1, 3, H, W) float32 in [0, 1] at the canvas size; outputs `points`, `normal` (where the checkpoint "
        "has a normal head), `mask`, `metric_scale`, as model.forward returns them; the canvas and the token "
        "budget in the model's metadata. Then run the file with ONNX Runtime on a photo-like canvas and print "
        "the largest difference from our forward. The camera solve and the finish are host steps: "
        "docs/export.md shows how to apply them to the file's outputs. Needs the export extra "
        '(from a clone: pip install -e "code/[export]").',
        epilog="examples:\n  tt-moge export onnx -o moge2.onnx\n"
        "  tt-moge export onnx -o small.onnx --weights /models/moge-2 --resolution 640x480 --num-tokens 1200\n\n"
        + EXIT_CODES,
    )
    export.add_argument("format", choices=("onnx",), help="the file format (onnx)")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write (model.onnx)")
    export.add_argument(
        "--no-check", action="store_true", help="write the file only (no ONNX Runtime run, no comparison)"
    )
    add_model_arguments(export, only=EXPORT_FLAGS)
    return export


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tt-moge export onnx` with parsed arguments -> exit code."""
    from ..onnx_export import check_onnx, export_onnx
    from ..options import LoadOptions
    from ..progress import slow_step
    from ..weights import load_network

    t0 = time.perf_counter()
    try:
        options = LoadOptions.resolve(**model_kwargs(args, only=EXPORT_FLAGS), device="cpu", warmup_variants="none")
        with slow_step(f"loading the weights {options.weights}", prefix=PREFIX):
            network, checkpoint = load_network(options.weights, options.revision)
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        say(f"could not load the model: {exc}")
        return EXIT_START
    width, height = options.resolution
    try:
        with slow_step(f"exporting the {width}x{height} forward to {args.output} (torch.onnx)", prefix=PREFIX):
            names = export_onnx(
                network,
                args.output,
                options.resolution,
                options.num_tokens,
                metadata={"tt_moge.weights": checkpoint.source},
            )
    except ImportError as exc:
        say(str(exc))
        return EXIT_START
    except ValueError as exc:  # e.g. an architecture the fixed-shape graph cannot fold
        say(f"could not export: {exc}")
        return EXIT_USAGE
    say(
        f"wrote {args.output}: input image (1, 3, {height}, {width}), outputs {', '.join(names)}, "
        f"{options.num_tokens} tokens ({time.perf_counter() - t0:.1f} s)"
    )
    if args.no_check:
        return EXIT_OK
    try:
        with slow_step(f"checking {args.output} with ONNX Runtime against our forward", prefix=PREFIX):
            check = check_onnx(args.output, network, options.num_tokens)
    except ImportError as exc:
        say(f"{exc} (or pass --no-check)")
        return EXIT_START
    print(check.summary())
    if check.points_max_rel > POINTS_TOLERANCE:
        say(f"ONNX Runtime's points differ from ours by more than {POINTS_TOLERANCE:g} of their scale")
        return EXIT_MISMATCH
    return EXIT_OK
