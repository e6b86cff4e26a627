"""`tt-moge predict`: photos -> depth, normal and mask pictures, npz, PLY and GLB files, one folder per photo."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .. import __version__
from ..constants import DEFAULT_CANVAS, DEPTH_EDGE_RTOL
from ..jobs import DEFAULT_CHUNK
from ..panorama.predict import PANORAMA_CANVAS
from ..runs import RUN_FILE, OutputBusy, OutputLock
from . import argtypes
from .commands import process_seconds
from .commands import summary as command_summary
from .common import (
    DEFAULT_OUTPUT,
    EXIT_CODES,
    EXIT_IMAGES_FAILED,
    EXIT_OK,
    EXIT_START,
    EXIT_USAGE,
    FORMAT_MB,
    FULL_MESH_MB,
    Formatter,
    Interrupted,
    SignalGuard,
    Ticker,
    add_call_arguments,
    add_format_arguments,
    add_model_arguments,
    call_options,
    chosen_formats,
    format_group_title,
    load_model,
    mesh_choice,
    refuse_options_not_for_panoramas,
    say,
)
from .video import VIDEO_EPILOG, add_video_arguments, run_videos, wants_video

__all__ = ["add_parser", "run"]

_MB = {name: f"about {mb} MB" for name, mb in FORMAT_MB.items()}  # for the epilog's lines
_EDGE = f"{DEPTH_EDGE_RTOL:.0%}"
_PREDICT_EPILOG = f"""\
inputs:
  Files are taken as given. Folders are searched recursively for .png, .jpg and .jpeg files. Anything
  else is a glob pattern (quote it; ** recurses). A missing path or an empty pattern stops before loading.
  Files inside OUT are never taken from a folder or a pattern (a rerun skips its own outputs).
  A file that is no image by its header is reported before the model loads.

formats (--maps --glb when no format flag is given; result.json is always written). Sizes: one 1920x1080
photo with 3/4 of its pixels valid (the 3D files grow with that share):
  --maps  depth.png    inverse depth in the turbo colour map (near red, far blue, 1st-99th percentile),
                       colour bar with depth labels in metres on the right; invalid pixels black
          normal.png   normals as RGB = ((x, -y, -z) + 1) / 2 (OpenGL colours); invalid pixels black
          mask.png     255 valid, 0 invalid
          depth.exr    float32 metres, channel Y, inf where invalid: the exact depth of result.npz
                       (the four files: {_MB["maps"]})
  --npz   result.npz   points, depth, normal (float16), mask (uint8), intrinsics, intrinsics_pixels,
                       metric_scale, fov_x, fov_y, deflated: MoGeOutput.from_npz reads it back ({_MB["npz"]})
  --ply   points.ply   one vertex per kept pixel: xyz (metres), normal, RGBA from the image ({_MB["ply"]})
  --glb   mesh.glb     the kept pixels of every Nth row and column (--mesh-step N, default 2) joined into
                       triangles, the full image as texture ({_MB["glb"]}; {FULL_MESH_MB} MB with --mesh-step 1).
                       By default a larger photo gets a coarser step: at most about 1 M faces (24 MP: step 7);
                       a --mesh-step given, or --mesh-full (every pixel), is kept. A photo too small for a
                       triangle (e.g. 16x16) gets no mesh.glb; its result.json says so in "note".
  Kept pixels: valid, and not on a depth edge (their 3x3 neighbourhood spans more than {_EDGE} of their depth).
  3D files use glTF/OpenGL axes: x right, y up, z towards the viewer (camera at the origin, looking down -z).

output layout:
  OUT/run.json             the run: options, model, every input with its output folder, status and error
  OUT/NAME/result.json     size, fov_x_deg, fov_y_deg, intrinsics (normalised and pixels), metric_scale,
                           valid_fraction, median_depth_m, depth percentiles, files; written last
  OUT/NAME/<format files>
  NAME is the file's stem; for a file found in a folder, its path below that folder without the extension
  (photos/trip/a.jpg -> trip/a). A NAME always stays inside OUT: control characters become _, a part that
  is only dots (from ..png, ...png) becomes _ or __, and the run's own names (run.json, batch.json,
  failures.jsonl, parquet, hidden names) get a _ in front. Clashing names get the extension (a_jpg), then a
  counter (a_jpg-2). run.json says which inputs were renamed, and why.
  Existing files of the same names are replaced. A folder holds a complete result exactly when it has
  result.json: an image that fails (unreadable, or its files cannot be written, e.g. on a full disk) is
  listed as failed in run.json and on stderr, and the files written for it are removed (nothing else in
  OUT is ever removed). run.json is written last and atomically (a run that could not write it says so in
  one line and exits 1).

while it runs:
  The progress bar names the images the model is on and its clock moves from the start (the first chunk of
  photos can take minutes on a CPU). OUT is locked while a run writes it (OUT/.tt-moge.lock, removed at the
  end): a second run into the same OUT stops at once with exit code 2, or waits for the first with --wait.
  The lock dies with its process, so a killed run (kill -9) never blocks the next one.
  SIGTERM or Ctrl-C (SIGINT): the files being written are finished, the images not reached have no folder
  and are "not done" in run.json, the summary and run.json are written, and the exit code is 143 or 130. A
  second signal stops at once, without clean-up.

examples:
  tt-moge predict photo.jpg                          # -> ./{DEFAULT_OUTPUT}/photo/: the maps and mesh.glb
  tt-moge predict photos/ -o results/                # every PNG/JPEG below photos/
  tt-moge predict photo.jpg --maps --npz --ply --glb --mesh-step 1   # every format, the full-resolution mesh
  tt-moge predict 'shots/**/*.jpg' --ply --glb       # only the 3D files (+ result.json)
  tt-moge predict photo.jpg --fov-x 65 --device cuda
  tt-moge predict --panorama pano.jpg                # a 360-degree equirectangular photo (2:1), 512x512 canvas
  MOGE_WEIGHTS_DIR=/models/moge-2 tt-moge predict photos/

{EXIT_CODES}
"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    predict = commands.add_parser(
        "predict",
        formatter_class=Formatter,
        help=command_summary("predict"),
        description="Run MoGe-2 on PNG/JPEG photos and write, per photo, the chosen formats into its own folder "
        "(or on video clips: one folder per clip, see 'videos' below). Images that cannot be read or written are "
        "reported as failed; the run goes on.",
        epilog=_PREDICT_EPILOG + "\n" + VIDEO_EPILOG,
    )
    predict.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="image files, folders (recursive) or glob patterns; or video files"
    )
    predict.add_argument(
        "-o", "--output", default=DEFAULT_OUTPUT, metavar="OUT", help=f"output folder (default ./{DEFAULT_OUTPUT})"
    )
    add_format_arguments(predict.add_argument_group(format_group_title()))
    add_call_arguments(predict).add_argument(
        "--panorama",
        action="store_true",
        help="the inputs are 360-degree equirectangular panoramas (width = 2 x height): 12 perspective "
        "views, merged into one distance map of the sphere; depth.exr/png then hold the distance "
        "from the centre, the mesh closes around the viewer. The canvas defaults to "
        f"{PANORAMA_CANVAS[0]}x{PANORAMA_CANVAS[1]} (the views' size); see docs/panorama.md",
    )
    add_video_arguments(predict)
    add_model_arguments(predict)
    predict.set_defaults(resolution=None)  # resolved in run(): the photo canvas, or the views' canvas with --panorama
    group = predict.add_argument_group("run")
    group.add_argument(
        "--chunk-size",
        type=argtypes.positive_int,
        default=DEFAULT_CHUNK,
        metavar="N",
        help=f"images per predict_many call; the next chunk is decoded meanwhile (default {DEFAULT_CHUNK})",
    )
    group.add_argument(
        "--writers", type=argtypes.positive_int, default=2, metavar="N", help="threads writing files (default 2)"
    )
    group.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary; errors still print")
    group.add_argument(
        "--exif",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="turn each photo by its EXIF orientation tag, as image viewers show it (a phone photo taken upright "
        "is stored sideways); the outputs then have the displayed width and height. --no-exif: the stored pixel "
        "order, as the Python API reads photos (default: on)",
    )
    group.add_argument(
        "--wait",
        action="store_true",
        help="OUT is in use by another run: wait for it to end (default: stop at once, exit code 2)",
    )
    return predict


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tt-moge predict` with parsed arguments -> exit code."""
    from ..export import DEFAULT_FORMATS
    from ..inputs import InputPathError, collect_images

    if args.resolution is None:
        args.resolution = PANORAMA_CANVAS if args.panorama else DEFAULT_CANVAS
    if wants_video(args):
        try:
            return _locked(args, parser, Path(args.output), lambda: run_videos(args, parser))
        except Interrupted as exc:  # between two clips' steps, outside run_videos' own handling
            say(f"{exc}: stopped")
            return 128 + exc.signum
    options = call_options(args)
    if args.panorama:
        refuse_options_not_for_panoramas(options, parser)
    formats = chosen_formats(args) or list(DEFAULT_FORMATS)
    out_root = Path(args.output)
    try:
        images = collect_images(args.inputs, exclude=out_root)  # never our own depth.png files as photos
    except InputPathError as exc:
        parser.error(str(exc))
    if not images:
        parser.error(f"no PNG or JPEG images found in {', '.join(args.inputs)}")
    with SignalGuard() as guard:
        try:
            return _locked(
                args, parser, out_root, lambda: _run_locked(args, parser, images, options, formats, out_root, guard)
            )
        except Interrupted as exc:  # while waiting for the other run
            say(f"{exc}: nothing was done")
            return 128 + exc.signum


def _locked(args: argparse.Namespace, parser: argparse.ArgumentParser, out_root: Path, work: Callable[[], int]) -> int:
    """`work()` with OUT created and locked (runs.OutputLock): exit code 2 when another run has it, unless
    --wait, which waits for that run to end."""
    try:
        out_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"cannot create the output folder {str(out_root)!r}: {exc}")
    lock = OutputLock(out_root)
    try:
        lock.acquire(wait=args.wait, on_wait=say)
    except OutputBusy as exc:
        say(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        parser.error(f"cannot lock the output folder {str(out_root)!r}: {exc}")
    if lock.unsupported:
        say(f"note: {lock.unsupported}; a second run into it would not be stopped")
    try:
        return work()
    finally:
        lock.release()


def _run_locked(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    images: list,
    options: Any,
    formats: list,
    out_root: Path,
    guard: SignalGuard,
) -> int:
    """The run, once OUT is locked. SIGINT / SIGTERM (`guard`) stop it between steps: the files being
    written are finished, run.json lists the images not reached as "not done", and the exit code is 130 / 143."""
    from ..export import missing_format_library, to_json, write_text_atomic
    from ..inputs import unreadable_images
    from ..jobs import predict_images, predict_panoramas, written_bytes

    run_json = out_root / RUN_FILE
    missing = missing_format_library(formats)  # imports the writers' libraries: trimesh's swallow a signal
    if missing:
        say(missing)
        return EXIT_START
    mesh_step, mesh_faces = mesh_choice(args)
    status: dict = {}  # image index -> error message or None (done); absent: not done
    index_of = {id(image): i for i, image in enumerate(images)}
    t_start = t_loaded = time.perf_counter()
    info, interrupted = None, None
    bar: Any = None
    try:
        guard.check()  # a signal during those imports
        unreadable = unreadable_images(images)  # found by their headers, before the model loads
        for i, reason in unreadable.items():
            status[i] = reason
            say(f"failed: {reason}")
        todo = [i for i in range(len(images)) if i not in unreadable]
        t_start = t_loaded = time.perf_counter()
        model = load_model(args) if todo else None
        if todo and model is None:
            return EXIT_START  # nothing was done: an earlier run's run.json stays, as on a usage error
        guard.check()  # a signal while loading that a library swallowed
        _remove_earlier_record(run_json, parser)
        t_loaded = time.perf_counter()
        from tqdm import tqdm

        bar = tqdm(
            total=len(todo),
            unit="img",
            desc="tt-moge predict",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=args.quiet or not todo,  # one photo too: its clock shows the model is at work
        )
        ticker = Ticker(bar)

        def on_done(image: Any, error: Optional[str]) -> None:
            status[index_of[id(image)]] = error
            if error is not None:
                bar.write(f"tt-moge: failed: {error}", file=sys.stderr)
            bar.update(1)

        def on_stage(text: str) -> None:
            guard.check()  # between chunks: a signal that a library swallowed stops the run here
            bar.set_postfix_str(text)

        if model is not None:
            with model, ticker:
                todo_images = [images[i] for i in todo]
                if args.panorama:
                    predict_panoramas(
                        model,
                        todo_images,
                        out_root,
                        formats,
                        on_done=on_done,
                        mesh_step=mesh_step,
                        mesh_faces=mesh_faces,
                        on_stage=on_stage,
                        exif=args.exif,
                        apply_mask=options.apply_mask,
                    )
                else:
                    predict_images(
                        model.service,
                        todo_images,
                        out_root,
                        formats,
                        options=options,
                        chunk_size=args.chunk_size,
                        writers=args.writers,
                        on_done=on_done,
                        mesh_step=mesh_step,
                        mesh_faces=mesh_faces,
                        on_stage=on_stage,
                        exif=args.exif,
                    )
                info = model.info()
    except Interrupted as exc:
        interrupted = exc
    finally:
        guard.raising = False  # from here on a signal only sets the exit code: the record gets written
        if bar is not None:
            bar.close()
    if interrupted is None and guard.signum is not None:  # swallowed after the last check: still an interruption
        interrupted = Interrupted(guard.signum)
    if interrupted is not None:
        t_loaded = min(t_loaded, time.perf_counter())
        say(f"{interrupted}: the files being written were finished; writing {run_json}")
    seconds = time.perf_counter() - t_loaded
    total = process_seconds()  # what the user waited for: start-up and imports too
    startup = max(0.0, total - (time.perf_counter() - t_start))
    failed = [(images[i], err) for i, err in sorted(status.items()) if err is not None]
    done = sum(1 for err in status.values() if err is None)
    not_done = len(images) - len(status)
    nbytes = written_bytes(out_root, [images[i].name for i, err in status.items() if err is None])

    def state(i: int) -> str:
        return "not done" if i not in status else "failed" if status[i] else "done"

    record = {
        "tt_moge": __version__,
        "model": info,
        "formats": formats,
        "mesh_step": mesh_step if "glb" in formats else None,  # the step asked for; each result.json: the one used
        "mesh_faces": mesh_faces if "glb" in formats else None,  # the bound that made a step coarser (None: none)
        "bytes_written": nbytes,
        "options": {
            "panorama": args.panorama,
            "exif": args.exif,
            **options.kwargs(),
            "resolution": list(args.resolution),
            "num_tokens": args.num_tokens,
        },
        "done": done,
        "failed": len(failed),
        "not_done": not_done,
        "interrupted": None if interrupted is None else interrupted.name,
        "startup_seconds": round(startup, 3),
        "load_seconds": round(t_loaded - t_start, 3),
        "seconds": round(seconds, 3),
        "total_seconds": round(total, 3),  # the process so far: start-up, model load, images, this record
        "images": [
            {
                "input": str(img.path),
                "output": img.name,
                "status": state(i),
                "error": status.get(i),
                **({"renamed": {"asked": img.wanted, "why": img.renamed}} if img.renamed else {}),
            }
            for i, img in enumerate(images)
        ],
    }
    try:
        write_text_atomic(run_json, to_json(record))
        index, indexed = f"index: {run_json}", True
    except OSError as exc:
        say(f"could not write {run_json}: {exc}")
        index, indexed = f"no index: {RUN_FILE} could not be written", False
    if not args.quiet or interrupted is not None:
        rate = f": {done / seconds:.2f} images/s" if seconds > 0 and done else ""
        stopped = f", {not_done} not done ({interrupted.name})" if interrupted is not None else ""
        print(
            f"tt-moge predict: {done} of {len(images)} images done, {len(failed)} failed{stopped}, in {total:.1f} s "
            f"(start-up {startup:.1f} s, model load {t_loaded - t_start:.1f} s, images {seconds:.1f} s{rate}); "
            f"outputs in {out_root}/ ({index})"
        )
        if done:
            mesh = ""
            if "glb" in formats:
                steps = _mesh_steps(out_root, [images[i].name for i, err in status.items() if err is None])
                if len(steps) > 1:
                    mesh = f" (mesh every {steps[0]}-{steps[-1]} px: at most ~1 M faces each)"
                elif steps != [1]:
                    mesh = f" (mesh every {steps[0] if steps else mesh_step} px)"
            print(
                f"  wrote {' '.join('--' + f for f in formats)}{mesh}: {nbytes / 1e6:.1f} MB, "
                f"{nbytes / 1e6 / done:.1f} MB per image (each format's size: tt-moge predict --help)"
            )
        for _image, error in failed:
            print(f"  failed: {error}")
    if guard.exit_code is not None:
        return guard.exit_code
    return EXIT_IMAGES_FAILED if failed or not indexed else EXIT_OK


def _remove_earlier_record(run_json: Path, parser: argparse.ArgumentParser) -> None:
    """Remove an earlier run's run.json once this run starts writing OUT: it must not stand for this run if this
    one cannot write its own. (A run that stops before, on a usage error or a model that cannot load, leaves it.)"""
    try:
        run_json.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        parser.error(f"cannot replace {str(run_json)!r}: {exc}")


def _mesh_steps(out_root: Path, names: list) -> list:
    """The grid steps the meshes of these output folders were made with (their result.json), sorted."""
    import json

    steps = set()
    for name in names:
        try:
            steps.add(int(json.loads((out_root / name / "result.json").read_text())["mesh_step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(steps)
