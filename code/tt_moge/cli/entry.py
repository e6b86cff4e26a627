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
from .commands import COMMANDS, EXIT_CODES, EXIT_INTERRUPTED, EXIT_USAGE, Formatter, command_module, say, summary

__all__ = ["main", "build_parser"]


def build_parser(commands: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The `tt-moge` parser with every command's full parser (`commands`: only those, the others listed by their
    summary alone, so that their modules, and torch, are not imported)."""
    parser = argparse.ArgumentParser(
        prog="tt-moge",
        formatter_class=Formatter,
        description="MoGe-2 monocular geometry from the command line: one RGB photo in; metric depth, a camera-space "
        "point map, normals, a validity mask and the camera intrinsics out, at the photo's own resolution.",
        epilog="Each command has its own manual: tt-moge COMMAND --help.\n\n" + EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"tt-moge {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMANDS:
        if commands is None or name in commands:
            module = command_module(name)
            module.add_parser(subparsers).set_defaults(command_parser=None, command_module=module)
        else:
            subparsers.add_parser(name, help=summary(name), add_help=False)
    for action in subparsers.choices.values():  # each command's parser, for its own usage errors
        action.set_defaults(command_parser=action)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `tt-moge` command. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # the first word that is no option is the command (the top level has only -h and --version): only its
        # module is imported; `tt-moge`, `tt-moge --help` and a misspelt command import none
        command = next((a for a in argv if not a.startswith("-")), None)
        parser = build_parser([command] if command in COMMANDS else [])
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
                return int(args.command_module.run(args, args.command_parser, argv) or 0)
            if args.command == "serve":
                return int(args.command_module.run(args) or 0)
            return args.command_module.run(args, args.command_parser)
        except SystemExit as exc:  # argparse: --help / --version (0) or a usage error (2)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        say("interrupted")
        return EXIT_INTERRUPTED
