"""`tt-moge batch`: the command-line face of tt_moge.batch.run_batch (arguments, messages, exit codes).
Ray is imported only when a job runs."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from ..batch import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_RETRIES,
    DEFAULT_OBJECT_STORE_MB,
    FAILURES_FILE,
    MIN_OBJECT_STORE_MB,
    OUTPUT_FORMATS,
    RECORD_FILE,
    SHARDS_DIR,
)
from ..video.options import VideoOptions
from . import argtypes
from .commands import summary as command_summary
from .common import (
    DEFAULT_OUTPUT,
    EXIT_CODES,
    EXIT_IMAGES_FAILED,
    EXIT_OK,
    EXIT_START,
    EXIT_USAGE,
    Formatter,
    Interrupted,
    SignalGuard,
    add_call_arguments,
    add_format_arguments,
    add_model_arguments,
    add_options,
    call_options,
    chosen_formats,
    format_group_title,
    mesh_choice,
    model_kwargs,
    option_values,
    say,
)

__all__ = ["add_parser", "run"]

DESCRIPTION = (
    "Run MoGe-2 over many photos as a Ray Data job: images are read in parallel, model replicas "
    "(one MoGeModel each) predict batches and write them. Without --address a local Ray starts on this "
    "machine; with --address (or $RAY_ADDRESS) the same command runs on a Ray cluster. Rerunning it "
    "skips the images already done."
)


def _epilog(exit_codes: str, default_output: str) -> str:
    codes = exit_codes.replace("in OUT/run.json", f"in OUT/{FAILURES_FILE}")
    codes = codes.replace("  could not start: ", "  could not start (or the Ray job stopped; rerun to resume): ")
    return f"""\
output (--format files, the default): the layout of tt-moge predict, one folder per image
  OUT/NAME/result.json + the files of --maps --npz --ply --glb (--maps --glb when none is given)
output (--format parquet): OUT/{SHARDS_DIR}/part-<hash>.parquet, one shard per batch, one row per image:
  name (string), source (string: the input path), result (string: the result.json text),
  npz (bytes: the result.npz file; MoGeOutput.from_npz(row["npz"]) reads it back)
always:
  OUT/{FAILURES_FILE}  one JSON line per image that failed in this run: {{"input", "name", "error"}}
  OUT/{RECORD_FILE}       the last run: options, model, counts, seconds, images/s

resume: an image is done when OUT/NAME/result.json exists (written last) or its name is in a shard (shards
  are renamed into place when whole). A rerun does only the rest; failed images are tried again. Use a new
  OUT for other model options: done images are not recomputed when the options change.

on a cluster: every node needs tt-moge with its ray extra installed (from a clone: pip install -e "code/[ray]"),
  the inputs and OUT on a file system they all see, and the weights (a path they all see, a hub id, or
  $MOGE_WEIGHTS_DIR, which is passed on to the replicas).

examples:
  tt-moge batch photos/ -o {default_output}/           # a local Ray, 1 replica, the default files of predict
  tt-moge batch photos/ --replicas 2 --npz             # 2 CPU replicas, only result.npz (+ result.json)
  tt-moge batch 'frames/**/*.jpg' --format parquet --device cuda --replicas 4 --gpus-per-replica 0.25
  tt-moge batch /data/frames --address ray://head:10001 --device cuda --replicas 8
  RAY_ADDRESS=ray://head:10001 tt-moge batch /data/frames --device cuda

{codes}
"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "batch",
        formatter_class=Formatter,
        description=DESCRIPTION,
        help=command_summary("batch"),
        epilog=_epilog(EXIT_CODES, DEFAULT_OUTPUT),
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders (recursive) or glob patterns")
    parser.add_argument(
        "-o", "--output", default=DEFAULT_OUTPUT, metavar="OUT", help=f"output folder (default ./{DEFAULT_OUTPUT})"
    )
    parser.add_argument(
        "--format",
        choices=OUTPUT_FORMATS,
        default="files",
        dest="output_format",
        help="files: a folder per image, as tt-moge predict (default); parquet: sharded Parquet rows",
    )
    add_format_arguments(parser.add_argument_group("files of --format files: " + format_group_title()))
    add_call_arguments(parser)
    add_options(
        parser.add_argument_group("clips (video files as INPUT: each clip one job, as tt-moge predict clip.mp4)"),
        VideoOptions,
    )
    add_model_arguments(parser)
    ray = parser.add_argument_group("Ray")
    ray.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="a Ray cluster, e.g. ray://head:10001 or auto (default: $RAY_ADDRESS, else a local Ray)",
    )
    ray.add_argument(
        "--replicas",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="model replicas (actors), one model each (default 1)",
    )
    ray.add_argument(
        "--cpus-per-replica",
        type=argtypes.positive_float,
        default=None,
        metavar="X",
        help="CPUs per replica, also its torch threads (default: local CPU runs, the cores / replicas; else 1)",
    )
    ray.add_argument(
        "--gpus-per-replica",
        type=argtypes.non_negative_float,
        default=None,
        metavar="X",
        help="GPUs per replica, fractions share a GPU (default: 1 when the replicas run on CUDA: --device "
        "cuda, or no --device where torch sees a GPU and Ray is local; else 0)",
    )
    ray.add_argument(
        "--batch-size",
        type=argtypes.positive_int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"images per replica call, one predict_many (default {DEFAULT_BATCH_SIZE})",
    )
    ray.add_argument(
        "--writers",
        type=argtypes.positive_int,
        default=2,
        metavar="N",
        help="file-writing threads per replica (default 2)",
    )
    ray.add_argument(
        "--max-retries",
        type=argtypes.non_negative_int,
        default=DEFAULT_MAX_RETRIES,
        metavar="N",
        help=f"restarts of a replica that died, and retries of its batch (default {DEFAULT_MAX_RETRIES})",
    )
    ray.add_argument(
        "--object-store-mb",
        type=argtypes.int_at_least(MIN_OBJECT_STORE_MB),
        default=DEFAULT_OBJECT_STORE_MB,
        metavar="MB",
        help=f"object store of a local Ray, at least {MIN_OBJECT_STORE_MB} (Ray's minimum; "
        f"default {DEFAULT_OBJECT_STORE_MB})",
    )
    ray.add_argument("-q", "--quiet", action="store_true", help="no progress output and no summary; errors still print")
    ray.add_argument(
        "--wait",
        action="store_true",
        help="OUT is in use by another run: wait for it to end (default: stop at once, exit code 2)",
    )
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tt-moge batch` with parsed arguments -> exit code."""
    from ..batch import BatchJob, RayMissingError, run_batch
    from ..export import DEFAULT_FORMATS, missing_format_library
    from ..inputs import InputPathError
    from ..runs import OutputBusy

    formats = chosen_formats(args)
    if args.output_format == "parquet" and formats:
        parser.error("--maps/--npz/--ply/--glb choose the files of --format files; parquet rows always hold the npz")
    formats = formats or list(DEFAULT_FORMATS)
    missing = missing_format_library(formats if args.output_format == "files" else [])
    if missing:
        say(missing)
        return EXIT_START

    def on_failure(path: str, error: str) -> None:  # errors print with -q too
        print(f"tt-moge: failed: {error}", file=sys.stderr, flush=True)

    job = BatchJob(
        args.inputs,
        args.output,
        model=model_kwargs(args),
        **call_options(args).kwargs(),
        **option_values(args, VideoOptions),
        formats=formats,
        **dict(zip(("mesh_step", "mesh_faces"), mesh_choice(args))),
        output_format=args.output_format,
        replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica,
        batch_size=args.batch_size,
        writers=args.writers,
        max_retries=args.max_retries,
        address=args.address,
        object_store_mb=args.object_store_mb,
        quiet=args.quiet,
        wait=args.wait,
    )
    try:
        with SignalGuard():
            summary = run_batch(job, on_failure=on_failure)
    except Interrupted as exc:  # SIGTERM / Ctrl-C: Ray is shut down on the way out (ray_session)
        say(f"{exc}: the images finished so far are kept (OUT/NAME/result.json); rerun the same command to do the rest")
        return 128 + exc.signum
    except RayMissingError as exc:
        say(str(exc))
        return EXIT_START
    except InputPathError as exc:
        parser.error(str(exc))
    except OutputBusy as exc:
        say(str(exc))
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:  # options; weights not found (CheckpointError is a ValueError)
        say(f"could not start: {exc}")
        return EXIT_START
    except Exception as exc:  # Ray could not start, the replicas could not load, or the job stopped
        say(
            f"the batch job stopped: {type(exc).__name__}: {_brief(exc)}\n"
            f"  images finished so far are kept; rerun the same command to do the rest"
        )
        return EXIT_START
    if not args.quiet:
        print(f"tt-moge batch: {summary.line()}; outputs in {Path(args.output)}/")
        if summary.failed:
            print(f"  failed: {summary.failed} (see {Path(args.output) / FAILURES_FILE})")
    return EXIT_IMAGES_FAILED if summary.failed else EXIT_OK


def _brief(exc: BaseException) -> str:
    """A Ray error's text is a remote traceback: keep its first line and the final error line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip() for line in str(exc).strip().splitlines()]
    lines = [line for line in lines if line.strip()]
    if len(lines) <= 2:
        return "\n  ".join(lines)
    return f"{lines[0]}\n  ...\n  {lines[-1]}"
