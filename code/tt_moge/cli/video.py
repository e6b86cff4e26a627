"""`tt-moge predict clip.mp4` and `tt-moge predict --sequence frames/`: each clip -> one folder of consistent frames,
its trajectory and its fused scene (`tt_moge.video`; docs/video.md).

    OUT/run.json                 the run: options, model, each clip (folder, status, frames, registered,
                                 relocalised, chains)
    OUT/NAME/frames/000000/...   each frame's files, as for a photo (the format flags; --maps by default)
    OUT/NAME/depth.mp4 poses.json trajectory.txt scene.ply scene.glb result.json (written last)

NAME is the clip's output name (`inputs.output_name`: a video file's stem, a folder's name), made unique in the
run as photos' names are (`inputs.unique_names`: a.mp4 and a.mov -> a_mp4, a_mov; run.json's `renamed`). A
clip whose model call or files fail is reported and the run goes on; frames whose registration fails are
flagged in the clip's files, not failures of the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from .. import __version__
from ..runs import RUN_FILE
from .commands import process_seconds
from .common import (
    EXIT_IMAGES_FAILED,
    EXIT_OK,
    EXIT_START,
    Interrupted,
    SignalGuard,
    Ticker,
    add_options,
    call_options,
    chosen_formats,
    load_model,
    option_values,
    say,
)

__all__ = ["add_video_arguments", "wants_video", "run_videos", "VIDEO_EPILOG"]

VIDEO_EPILOG = """\
videos (a video file as INPUT, or --sequence with folders of frames):
  Each clip runs with one set of intrinsics (--intrinsics, --fov-x, or solved on its first --calibration-frames
  frames) and one metric scale; the frames are registered one to the next. OUT/NAME/ holds frames/NNNNNN/ (each
  frame's files: the format flags, --maps by default), depth.mp4 (one colour range for the whole clip),
  poses.json, trajectory.txt (TUM), scene.ply and scene.glb (the fused cloud and the camera path), result.json.
  docs/video.md says what each holds.
"""


def add_video_arguments(parser: argparse.ArgumentParser) -> None:
    """--sequence and the clip options (`video.VideoOptions`, generated) of `tt-moge predict`."""
    from ..video import VideoOptions

    group = parser.add_argument_group("video (a video file as INPUT, or --sequence; docs/video.md)")
    group.add_argument(
        "--sequence",
        action="store_true",
        help="each folder INPUT is one clip: its PNG/JPEG frames in name order (numbers compared as numbers)",
    )
    add_options(group, VideoOptions)


def wants_video(args: argparse.Namespace) -> bool:
    """The run is a video run: --sequence, or an input that is a video file (by its suffix)."""
    from ..video import is_video_file

    return bool(args.sequence) or any(is_video_file(i) for i in args.inputs)


def _clips(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list:
    """[(input path, output name, why renamed or "")] of the run's clips, names unique by the rules of photos
    (`inputs.unique_names`: a.mp4 and a.mov -> a_mp4, a_mov); usage errors for anything else."""
    from ..inputs import output_name, unique_names
    from ..video import is_video_file

    clips = []
    for text in args.inputs:
        path = Path(text).expanduser()
        if args.sequence:
            if not path.is_dir():
                parser.error(f"input {text!r}: --sequence takes folders of frames, and this is not one")
            clips.append((path, *output_name(path.resolve().name)))
        elif not is_video_file(path):
            parser.error(f"input {text!r} is not a video file: give photos and videos in separate runs")
        elif not path.is_file():
            parser.error(f"input {text!r}: no such file")
        else:
            clips.append((path, *output_name(path)))
    return [(path, name, why) for (path, _, _), (name, why) in zip(clips, unique_names(clips))]


def _asked(path: Path, sequence: bool) -> str:
    """The name a clip asks for (`inputs.asked_name`): a video file's stem, a folder's name."""
    from ..inputs import asked_name

    return path.resolve().name if sequence else asked_name(path)


def _clip_row(path: Path, name: str, renamed: Any = None) -> dict:
    """A clip's entry in run.json, before it runs ("not done" until it is done or failed)."""
    row: dict = {"input": str(path), "output": name, "status": "not done", "error": None}
    if renamed:
        row["renamed"] = renamed
    return row


def _run_clip(
    args: argparse.Namespace,
    model: Any,
    path: Path,
    folder: Path,
    call: Any,
    video: Any,
    formats: list,
    row: dict,
    guard: SignalGuard,
) -> int:
    """One clip into `folder`; fills `row` (status done / failed with its error / not done when a signal
    stops it: Interrupted goes on). Returns the frames written."""
    from tqdm import tqdm

    from ..host import InputError
    from ..video import VideoStream
    from ..video.files import ClipWriter

    writer, stage = None, ["opening the clip"]
    # the bar exists before the clip opens, and each stage is drawn as it starts (the Ticker then redraws it once
    # a second): a stage shorter than the Ticker's second (a quick calibration) would otherwise never be shown
    bar = tqdm(unit="frame", desc=folder.name, file=sys.stderr, dynamic_ncols=True, disable=args.quiet)

    def on_stage(text: str) -> None:
        stage[0] = text
        bar.set_postfix_str(text)

    try:
        with bar, Ticker(bar, lambda: stage[0]):  # the stage (a calibration: minutes on a CPU) and the clock
            bar.set_postfix_str(stage[0])
            with VideoStream(model, path, call, video, on_stage=on_stage) as stream:
                fps = None if stream.fps is None else stream.fps / video.stride
                writer = ClipWriter(
                    folder,
                    formats,
                    mesh_step=1 if args.mesh_full else args.mesh_step,
                    fps=fps,
                    writers=args.writers,
                )
                bar.total = stream.expected_frames
                bar.refresh()
                for frame in stream:
                    writer.add(frame.index, frame.output, frame.image, frame.record(), frame.depth_range)
                    bar.update(1)
                record = writer.finish(stream.result)
    except (InputError, OSError, RuntimeError, ValueError) as exc:
        if writer is not None:
            writer.abort(remove=True)  # a failed clip leaves no folder (its frames written so far go too)
        row.update(status="failed", error=f"{path}: {exc}")
        say(f"failed: {row['error']}")
        return 0
    except Interrupted:  # SIGTERM / Ctrl-C: this clip stays incomplete (no result.json), as documented
        guard.raising = False
        if writer is not None:
            writer.abort()
        raise
    row.update(
        status="done",
        frames=record["frames"],
        registered=record["registered"],
        relocalised=record["relocalised"],
        chains=len(record["chains"]),
    )
    if record["failed"] and not args.quiet:
        say(f"{folder.name}: {len(record['failed'])} frame(s) not registered (flagged in {folder.name}/poses.json)")
    return record["frames"]


def run_videos(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tt-moge predict` on clips -> exit code."""
    from ..export import missing_format_library, to_json, write_text_atomic
    from ..host import InputError
    from ..video import VideoOptions
    from ..video.files import VIDEO_FRAME_FORMATS

    if args.panorama:
        parser.error("--panorama does not apply to videos")
    try:
        call = call_options(args)
        video = VideoOptions.make(**option_values(args, VideoOptions))
    except InputError as exc:
        parser.error(str(exc))
    clips = _clips(args, parser)
    renamed = {name: {"asked": _asked(path, args.sequence), "why": why} for path, name, why in clips if why}
    formats = chosen_formats(args) or list(VIDEO_FRAME_FORMATS)
    out_root = Path(args.output)
    try:
        out_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"cannot prepare the output folder {str(out_root)!r}: {exc}")
    missing = missing_format_library(list(formats) + ["glb"])  # scene.glb needs trimesh
    if missing:
        say(missing)
        return EXIT_START
    t_start = t_loaded = time.perf_counter()
    rows: list = []
    frames_done, info = 0, None
    # the handler from the start: a signal during the model load (a minute on a CPU) is a run interrupted,
    # with its run.json, not a process killed (exit -15) or a KeyboardInterrupt traceback
    guard, interrupted = SignalGuard(), None
    with guard:
        try:
            guard.check()  # a signal that the imports above swallowed (trimesh's catch BaseException)
            model = load_model(args)
            if model is None:
                return EXIT_START  # nothing was done: an earlier run's run.json stays, as on a usage error
            guard.check()  # a signal while loading that a library swallowed
            try:  # from here on this is OUT's last run: an earlier run.json must not stand for it
                (out_root / RUN_FILE).unlink(missing_ok=True)
            except OSError as exc:
                parser.error(f"cannot replace {str(out_root / RUN_FILE)!r}: {exc}")
            t_loaded = time.perf_counter()
            with model:
                try:
                    for path, name, _ in clips:
                        guard.check()
                        row = _clip_row(path, name, renamed.get(name))
                        rows.append(row)
                        frames_done += _run_clip(args, model, path, out_root / name, call, video, formats, row, guard)
                finally:
                    info = model.info()
        except Interrupted as exc:  # during the load, in a clip (it stays incomplete, as documented), between two
            interrupted = exc
            where = f"{rows[-1]['output']} is not done; " if rows and rows[-1]["status"] == "not done" else ""
            say(f"{exc}: {where}writing {out_root / RUN_FILE}")
        finally:
            guard.raising = False  # from here on a signal only sets the exit code: run.json gets written
    if interrupted is None and guard.signum is not None:  # swallowed after the last check
        interrupted = Interrupted(guard.signum)
    rows += [_clip_row(p, n, renamed.get(n)) for p, n, _ in clips[len(rows) :]]
    seconds = time.perf_counter() - t_loaded
    total = process_seconds()  # what the user waited for: start-up and imports too
    startup = max(0.0, total - (time.perf_counter() - t_start))
    failed = [r for r in rows if r["status"] == "failed"]
    record = {
        "tt_moge": __version__,
        "model": info,
        "kind": "video",
        "formats": list(formats),
        "options": {
            **call.kwargs(),
            **video.kwargs(),
            "intrinsics": None if call.intrinsics is None else str(call.intrinsics),
        },
        "done": sum(r["status"] == "done" for r in rows),
        "failed": len(failed),
        "not_done": sum(r["status"] == "not done" for r in rows),
        "interrupted": None if interrupted is None else interrupted.name,
        "startup_seconds": round(startup, 3),
        "load_seconds": round(t_loaded - t_start, 3),
        "seconds": round(seconds, 3),
        "total_seconds": round(total, 3),  # the process so far: start-up, model load, clips, this record
        "clips": rows,
    }
    indexed = True
    try:
        write_text_atomic(out_root / RUN_FILE, to_json(record))
    except OSError as exc:
        say(f"could not write {out_root / RUN_FILE}: {exc}")
        indexed = False
    if not args.quiet:
        rate = f": {frames_done / seconds:.2f} frames/s" if seconds > 0 and frames_done else ""
        print(
            f"tt-moge predict: {record['done']} of {len(rows)} clips done ({frames_done} frames), "
            f"{len(failed)} failed, in {total:.1f} s (start-up {startup:.1f} s, model load {t_loaded - t_start:.1f} s, "
            f"clips {seconds:.1f} s{rate}); outputs in {out_root}/"
        )
    if guard.exit_code is not None:
        return guard.exit_code
    return EXIT_IMAGES_FAILED if failed or not indexed else EXIT_OK
