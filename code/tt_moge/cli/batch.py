"""`tt-moge batch`: the command-line face of tt_moge.batch.run_batch (arguments, messages, exit codes).
Ray is imported only when a job runs."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from ..batch import FAILURES_FILE, RECORD_FILE, SHARDS_DIR, BatchJob
from ..constants import DEFAULT_CANVAS
from ..panorama.predict import PANORAMA_CANVAS
from ..video.options import VideoOptions
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
    chosen_formats,
    format_group_title,
    mesh_choice,
    model_kwargs,
    option_values,
    refuse_options_not_for_panoramas,
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
  tt-moge batch panoramas/ --panorama --replicas 2  # 360-degree photos, written as tt-moge predict --panorama
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
    add_options(parser, BatchJob, section="output")  # --format
    add_format_arguments(parser.add_argument_group("files of --format files: " + format_group_title()))
    add_call_arguments(parser)
    add_options(
        parser.add_argument_group("clips (video files as INPUT: each clip one job, as tt-moge predict clip.mp4)"),
        VideoOptions,
    )
    add_model_arguments(parser)
    add_options(parser.add_argument_group("Ray"), BatchJob)  # the job's own settings, one flag each
    parser.set_defaults(resolution=None)  # resolved in run(): the photo canvas, or the views' canvas with --panorama
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tt-moge batch` with parsed arguments -> exit code."""
    from ..batch import RayMissingError, run_batch
    from ..export import DEFAULT_FORMATS, missing_format_library
    from ..inputs import InputPathError
    from ..runs import OutputBusy

    # Every option reaches the job from its definition: the model flags as from_pretrained's arguments, and each
    # field of BatchJob that is an option (the call and clip options it includes, its own settings) by name.
    if args.resolution is None:
        args.resolution = PANORAMA_CANVAS if args.panorama else DEFAULT_CANVAS
    options = option_values(args, BatchJob)
    formats = chosen_formats(args)
    if options["output_format"] == "parquet" and formats:
        parser.error("--maps/--npz/--ply/--glb choose the files of --format files; parquet rows always hold the npz")
    formats = formats or list(DEFAULT_FORMATS)
    missing = missing_format_library(formats if options["output_format"] == "files" else [])
    if missing:
        say(missing)
        return EXIT_START

    def on_failure(path: str, error: str) -> None:  # errors print with -q too
        print(f"tt-moge: failed: {error}", file=sys.stderr, flush=True)

    job = BatchJob(
        args.inputs,
        args.output,
        model=model_kwargs(args),
        formats=formats,
        **dict(zip(("mesh_step", "mesh_faces"), mesh_choice(args))),
        **options,
    )
    try:  # options that are wrong together (fov_x and intrinsics; window < calibration_frames) are usage errors
        call = job.call_options()
        job.video_options()
    except ValueError as exc:
        parser.error(str(exc))
    if args.panorama:
        refuse_options_not_for_panoramas(call, parser)
    try:
        with SignalGuard():
            summary = run_batch(job, on_failure=on_failure)
    except Interrupted as exc:  # SIGTERM / Ctrl-C: Ray is shut down on the way out (ray_session)
        say(
            f"{exc}: the images finished so far are kept ({Path(job.out) / RECORD_FILE} counts them); rerun the "
            "same command to do the rest"
        )
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
    if not job.quiet:
        print(f"tt-moge batch: {summary.line()}; outputs in {Path(job.out)}/")
        if summary.failed:
            print(f"  failed: {summary.failed} (see {Path(job.out) / FAILURES_FILE})")
    return EXIT_IMAGES_FAILED if summary.failed else EXIT_OK


def _brief(exc: BaseException) -> str:
    """A Ray error's text is a remote traceback: keep its first line and the final error line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip() for line in str(exc).strip().splitlines()]
    lines = [line for line in lines if line.strip()]
    if len(lines) <= 2:
        return "\n  ".join(lines)
    return f"{lines[0]}\n  ...\n  {lines[-1]}"
