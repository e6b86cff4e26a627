"""`tt-moge`: MoGe-2 from a shell. `predict` turns photos into depth, normals, point clouds and meshes; `batch`
runs many on Ray Data; `info` says what would run where; `serve` starts the HTTP server; `bench` times the stages.

`main(argv)` returns the exit code (see `common.EXIT_CODES`) instead of exiting, so tests and other tools can
call it. Heavy imports (the model, trimesh, Ray, uvicorn) happen inside the commands.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .. import __version__
from . import batch, bench, export_onnx, info, predict, serve
from .common import EXIT_CODES, EXIT_INTERRUPTED, EXIT_USAGE, Formatter, say

__all__ = ["main", "build_parser"]

COMMANDS = {"predict": predict, "batch": batch, "info": info, "serve": serve, "bench": bench, "export": export_onnx}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tt-moge",
        formatter_class=Formatter,
        description="MoGe-2 monocular geometry from the command line: one RGB photo in; metric depth, a camera-space "
        "point map, normals, a validity mask and the camera intrinsics out, at the photo's own resolution.",
        epilog="Each command has its own manual: tt-moge COMMAND --help.\n\n" + EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"tt-moge {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in COMMANDS.values():
        module.add_parser(commands).set_defaults(command_parser=None, command_module=module)
    for action in commands.choices.values():  # each command's parser, for its own usage errors
        action.set_defaults(command_parser=action)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `tt-moge` command. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        try:
            args, unknown = parser.parse_known_args(argv)
            if args.command is None:
                parser.print_help(sys.stderr)
                return EXIT_USAGE
            if unknown:  # reported by the command's own parser, with its usage line and a hint
                hint = (
                    " (formats are chosen with --maps, --npz, --ply, --glb)"
                    if args.command in ("predict", "batch")
                    else ""
                )
                args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
            if args.command == "bench":
                return int(bench.run(args, args.command_parser, argv) or 0)
            if args.command == "serve":
                return int(serve.run(args) or 0)
            return args.command_module.run(args, args.command_parser)
        except SystemExit as exc:  # argparse: --help / --version (0) or a usage error (2)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        say("interrupted")
        return EXIT_INTERRUPTED
