"""The `tt-moge` commands by name, with their one-line summaries, and the exit codes they share: what the
top-level `tt-moge --help` shows. Nothing heavy is imported here, so that `tt-moge`, `tt-moge --help` and
`tt-moge --version` answer at once; a command's module is imported only when that command is given
(`entry.main`), and builds its flags from the option definitions, which import without torch (a command's
`--help` takes under a second; torch comes with the work)."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from types import ModuleType

__all__ = [
    "process_seconds",
    "COMMANDS",
    "summary",
    "command_module",
    "EXIT_OK",
    "EXIT_IMAGES_FAILED",
    "EXIT_USAGE",
    "EXIT_START",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_CODES",
    "Formatter",
    "say",
]

# name -> (module below tt_moge.cli, the summary of `tt-moge --help`), in the order the help lists them
COMMANDS = {
    "predict": (
        "predict",
        "photos or videos -> depth, normal and mask pictures, npz, PLY, GLB; trajectories and fused scenes",
    ),
    "batch": ("batch", "many photos as a Ray Data job: replicas, cluster, resume, failures file"),
    "info": ("info", "load the model and say what runs where"),
    "serve": ("serve", "the HTTP server (POST /predict)"),
    "bench": ("bench", "per-stage timing of one call"),
    "export": ("export_onnx", "write the network as a file other runtimes run (ONNX)"),
}


def summary(name: str) -> str:
    """The one-line help of command `name`."""
    return COMMANDS[name][1]


def command_module(name: str) -> ModuleType:
    """The module of command `name` (imported now: it may take seconds, torch included)."""
    return importlib.import_module(f"{__package__}.{COMMANDS[name][0]}")


EXIT_OK, EXIT_IMAGES_FAILED, EXIT_USAGE, EXIT_START = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM  # 130, 143: the shells' convention
EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    every image done: its files and the run's record written
  {EXIT_IMAGES_FAILED}    some images failed (each one named on stderr and in OUT/run.json), or the run's record
       could not be written; all others are done
  {EXIT_USAGE}    bad command line: unknown option, bad value, an input that does not exist, no images; or OUT
       is in use by another run (see --wait)
  {EXIT_START}    could not start: weights not found or unreadable, device unavailable, a library missing
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C, SIGINT); {EXIT_TERMINATED}: terminated (SIGTERM)"""


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=110)


_IMPORTED = time.perf_counter()  # when the command line was first imported: process_seconds' fallback


def process_seconds() -> float:
    """Seconds since this process started: what the user waited for, start-up and imports included (Linux:
    /proc/self/stat's start time against /proc/uptime, 10 ms ticks; elsewhere since tt_moge.cli was imported)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


SAY_PREFIX = "tt-moge:"  # what the command's own lines on stderr start with


def say(message: str) -> None:
    print(f"{SAY_PREFIX} {message}", file=sys.stderr, flush=True)
