"""What every `tt-moge` command shares: the model flags (defined once, here), the format flags, exit codes,
messages, and the one mapping from parsed flags to `MoGeModel.from_pretrained` arguments."""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any, Optional

from ..constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS, PRECISIONS
from ..export import DEFAULT_FORMATS, DEFAULT_MESH_STEP, FORMATS
from . import argtypes

__all__ = ["EXIT_OK", "EXIT_IMAGES_FAILED", "EXIT_USAGE", "EXIT_START", "EXIT_INTERRUPTED", "EXIT_CODES",
           "DEFAULT_OUTPUT", "FORMAT_MB", "FULL_MESH_MB", "Formatter", "say", "add_model_arguments",
           "add_format_arguments", "format_group_title", "chosen_formats",
           "model_kwargs", "load_model"]

EXIT_OK, EXIT_IMAGES_FAILED, EXIT_USAGE, EXIT_START, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    every image done
  {EXIT_IMAGES_FAILED}    some images failed (each one named on stderr and in OUT/run.json); all others are done
  {EXIT_USAGE}    bad command line: unknown option, bad value, an input that does not exist, no images
  {EXIT_START}    could not start: weights not found or unreadable, device unavailable, a library missing
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)"""
DEFAULT_OUTPUT = "moge_output"
# What each format group writes for one 1920x1080 photo with 3/4 of its pixels valid, in MB (10^6 bytes), as
# `python -m perf.cli.export_bench --image <a 1920x1080 photo>` measures it (docs/performance.md); the 3D files
# grow with the valid share. tests/test_first_run.py checks these numbers against a fresh measurement.
FORMAT_MB = {"maps": 7, "npz": 30, "ply": 44, "glb": 26}
FULL_MESH_MB = 91  # mesh.glb with --mesh-step 1


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=110)


def say(message: str) -> None:
    print(f"tt-moge: {message}", file=sys.stderr, flush=True)


def add_model_arguments(parser: argparse.ArgumentParser, *, warmup: int = 0, warmup_variants: str = "none") -> None:
    """The flags of `MoGeModel.from_pretrained`, for every command. `warmup` / `warmup_variants` are the
    command's defaults: a run over many images does not need its first call to be fast; a server does."""
    from ..weights import DEFAULT_REPO, DEFAULT_REVISION, WEIGHTS_DIR_ENV

    group = parser.add_argument_group("model (as MoGeModel.from_pretrained)")
    group.add_argument("--weights", default=DEFAULT_REPO, metavar="REPO|DIR|FILE",
                       help=f"a Hugging Face repo id, a folder holding model.pt, or model.pt itself (default {DEFAULT_REPO}; "
                            f"${WEIGHTS_DIR_ENV}, when set, replaces a repo id)")
    group.add_argument("--revision", default=DEFAULT_REVISION,
                       help="Hub revision of a repo id (default: the pinned revision of the published numbers; "
                            "'main' for the newest)")
    group.add_argument("--device", default=None,
                       help="cpu, cuda, cuda:N, tt or tt:N (default: a Tenstorrent chip when ttnn sees one, else CUDA "
                            "when present, else the CPU)")
    group.add_argument("--device-id", type=argtypes.non_negative_int, default=0, metavar="N",
                       help="the chip or GPU to open when --device is not given or names no index (default 0)")
    group.add_argument("--resolution", type=argtypes.canvas, default=DEFAULT_CANVAS, metavar="WxH",
                       help=f"the canvas every image is fitted onto (default {DEFAULT_CANVAS[0]}x{DEFAULT_CANVAS[1]})")
    group.add_argument("--num-tokens", type=argtypes.token_budget, default=DEFAULT_NUM_TOKENS, metavar="N",
                       help=f"ViT token budget, 1200-3600 (default {DEFAULT_NUM_TOKENS})")
    group.add_argument("--precision", default="auto", choices=PRECISIONS,
                       help="arithmetic of the forward (default auto: bf16 on CPUs with bfloat16 instructions, else "
                            "fp32; fp16 on CUDA; bf16 on a Tenstorrent chip). fp32 is the exact reference; int8 is "
                            "an opt-in CPU mode, bfp8 an opt-in Tenstorrent mode")
    group.add_argument("--dispatch", default="eth", choices=["eth", "worker"], help="Tenstorrent dispatch (default eth)")
    group.add_argument("--num-command-queues", type=int, default=None, choices=[1, 2],
                       help="Tenstorrent command queues (2: worker dispatch only)")
    group.add_argument("--warmup", type=argtypes.non_negative_int, default=warmup, metavar="N",
                       help=f"device forwards at load (default {warmup})")
    group.add_argument("--warmup-variants", type=argtypes.warmup_spec, default=warmup_variants, metavar="SPEC",
                       help="host warm-up: a preset (default, all, minimal, none), presets separated by commas, or "
                            "JSON such as '[\"default\", {\"input\": \"jpeg\", \"size\": [4032, 3024]}]' "
                            f"(default {warmup_variants})")
    group.add_argument("-v", "--verbose", action="store_true", help="print model loading steps")


def format_group_title() -> str:
    """The title of the format flags' group: the default and what the sizes in the flags' help mean."""
    default = " ".join(f"--{name}" for name in DEFAULT_FORMATS)
    return f"formats (default: {default}; MB per 1920x1080 photo with 3/4 of its pixels valid)"


def add_format_arguments(group: Any) -> None:
    """--maps --npz --ply --glb (none given: DEFAULT_FORMATS) and --mesh-step, each with what it costs."""
    for name, what in FORMATS.items():
        extra = f" ({FULL_MESH_MB} MB with --mesh-step 1)" if name == "glb" else ""
        default = "[default] " if name in DEFAULT_FORMATS else ""
        group.add_argument(f"--{name}", action="store_true", help=f"{default}{what}: about {FORMAT_MB[name]} MB{extra}")
    group.add_argument("--mesh-step", type=argtypes.positive_int, default=DEFAULT_MESH_STEP, metavar="N",
                       help=f"mesh.glb samples every Nth row and column: 1 every pixel, 2 a quarter of the vertices "
                            f"(default {DEFAULT_MESH_STEP})")


def chosen_formats(args: argparse.Namespace) -> list:
    """The format groups whose flag was given, in FORMATS order (empty: none was given, DEFAULT_FORMATS apply)."""
    return [f for f in FORMATS if getattr(args, f)]


def model_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of `MoGeModel.from_pretrained` that the model flags stand for."""
    return dict(pretrained_model_name_or_path=args.weights, revision=args.revision, device=args.device,
                device_id=args.device_id, resolution=args.resolution, num_tokens=args.num_tokens,
                precision=args.precision, dispatch=args.dispatch, num_command_queues=args.num_command_queues,
                warmup=args.warmup, warmup_variants=args.warmup_variants, verbose=args.verbose)


def load_model(args: argparse.Namespace) -> Optional[Any]:
    """The MoGeModel of the parsed model flags, or None after saying why it could not load. Warnings (e.g. no
    GPU found, running on the CPU) become one "note:" line each, in command-line terms."""
    from ..model import MoGeModel

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = MoGeModel.from_pretrained(**model_kwargs(args))
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            say(f"could not load the model: {exc}")
            return None
    for warning in caught:
        say("note: " + str(warning.message).replace("device='cpu'", "--device cpu"))
    if args.verbose:
        say(f"model {model!r} loaded in {time.perf_counter() - t0:.1f} s")
    return model
