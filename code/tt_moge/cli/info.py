"""`tt-moge info`: load the model and say what runs where."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .commands import summary as command_summary
from .common import EXIT_OK, EXIT_START, EXIT_USAGE, Formatter, add_model_arguments, load_model

__all__ = ["add_parser", "run"]

EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    the model loaded and is described
  {EXIT_USAGE}    bad command line: unknown option, bad value
  {EXIT_START}    could not start: weights not found or unreadable, device unavailable, a library missing"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    info = commands.add_parser(
        "info",
        formatter_class=Formatter,
        help=command_summary("info"),
        description="Load the model (no warm-up) and print: version, weights source and revision, architecture, "
        "device and runner, canvas, token budget, normal head, and whether the host steps run on the "
        "native (C++) path or in torch.",
        epilog="examples:\n  tt-moge info\n  tt-moge info --weights /models/moge-2 --device cpu --json\n\n"
        + EXIT_CODES,
    )
    add_model_arguments(info)
    info.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    return info


def _host_path() -> str:
    """'native' or 'torch' (+ why): which implementation runs the host steps."""
    from .. import native

    try:
        return native.host_path()
    except Exception as exc:  # e.g. MOGE_HOST=native and the build fails: `info` still answers
        return f"torch (native host library unavailable: {type(exc).__name__}: {exc})"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tt-moge info` with parsed arguments -> exit code."""
    import torch

    model = load_model(args)
    if model is None:
        return EXIT_START
    with model:
        info = dict(model.info())
    info.setdefault("host", _host_path())
    info["torch"] = torch.__version__
    info["cuda_available"] = torch.cuda.is_available()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return EXIT_OK
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, (list, tuple)) and key == "canvas":
            value = "x".join(map(str, value))
        print(f"{key + ':':<16}{value}")
    return EXIT_OK
