"""`tt-moge predict`: photos -> depth, normal and mask pictures, npz, PLY and GLB files, one folder per photo."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .. import __version__
from ..constants import DEPTH_EDGE_RTOL, FITS
from ..jobs import DEFAULT_CHUNK
from . import argtypes
from .common import (DEFAULT_OUTPUT, EXIT_CODES, EXIT_IMAGES_FAILED, EXIT_OK, EXIT_START, Formatter,
                     add_format_arguments, add_model_arguments, chosen_formats, load_model, say)

__all__ = ["add_parser", "run"]

_PREDICT_EPILOG = f"""\
inputs:
  Files are taken as given. Folders are searched recursively for .png, .jpg and .jpeg files. Anything
  else is a glob pattern (quote it; ** recurses). A missing path or an empty pattern stops before loading.
  Files inside OUT are never taken from a folder or a pattern (a rerun skips its own outputs).

formats (all of them when no format flag is given; result.json is always written):
  --maps  depth.png    inverse depth in the turbo colour map (near red, far blue, 1st-99th percentile),
                       colour bar with depth labels in metres on the right; invalid pixels black
          normal.png   normals as RGB = ((x, -y, -z) + 1) / 2 (OpenGL colours); invalid pixels black
          mask.png     255 valid, 0 invalid
          depth.exr    float32 metres, channel Y, inf where invalid: the exact depth of result.npz
  --npz   result.npz   points, depth, normal (float16), mask (uint8), intrinsics, intrinsics_pixels,
                       metric_scale, fov_x, fov_y: MoGeOutput.from_npz reads it back
  --ply   points.ply   one vertex per kept pixel: xyz (metres), normal, RGBA from the image
  --glb   mesh.glb     the same vertices joined into triangles, the image as texture
  Kept pixels: valid, and not on a depth edge (their 3x3 neighbourhood spans more than {DEPTH_EDGE_RTOL:.0%} of their depth).
  3D files use glTF/OpenGL axes: x right, y up, z towards the viewer (camera at the origin, looking down -z).

output layout:
  OUT/run.json             the run: options, model, every input with its output folder, status and error
  OUT/NAME/result.json     size, fov_x_deg, fov_y_deg, intrinsics (normalised and pixels), metric_scale,
                           valid_fraction, median_depth_m, depth percentiles, files; written last
  OUT/NAME/<format files>
  NAME is the file's stem; for a file found in a folder, its path below that folder without the extension
  (photos/trip/a.jpg -> trip/a). Clashing names get the extension (a_jpg), then a counter (a_jpg-2).
  Existing files of the same names are replaced. A folder holds a complete result exactly when it has
  result.json: an image that fails (unreadable, or its files cannot be written, e.g. on a full disk) is
  listed as failed in run.json and on stderr, and its files are removed. run.json is written last and
  atomically (a run that could not write it says so in one line and exits 1).

examples:
  tt-moge predict photo.jpg                          # -> ./{DEFAULT_OUTPUT}/photo/
  tt-moge predict photos/ -o results/                # every PNG/JPEG below photos/
  tt-moge predict 'shots/**/*.jpg' --ply --glb       # only the 3D files (+ result.json)
  tt-moge predict photo.jpg --fov-x 65 --device cuda
  MOGE_WEIGHTS_DIR=/models/moge-2 tt-moge predict photos/

{EXIT_CODES}
"""



def add_parser(commands: Any) -> argparse.ArgumentParser:
    predict = commands.add_parser(
        "predict", formatter_class=Formatter, help="photos -> depth, normal and mask pictures, npz, PLY, GLB",
        description="Run MoGe-2 on PNG/JPEG photos and write, per photo, the chosen formats into its own folder. "
                    "Images that cannot be read or written are reported as failed; the run goes on.", epilog=_PREDICT_EPILOG)
    predict.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders (recursive) or glob patterns")
    predict.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="OUT", help=f"output folder (default ./{DEFAULT_OUTPUT})")
    add_format_arguments(predict.add_argument_group("formats (default: all)"))
    call = predict.add_argument_group("per-image options")
    call.add_argument("--fit", choices=FITS, default="pad",
                      help="pad: keep the aspect ratio, gray bars (default); stretch: fill the canvas")
    call.add_argument("--fov-x", type=argtypes.fov_degrees, metavar="DEG", help="the horizontal field of view, if known (then only the depth shift is solved)")
    add_model_arguments(predict)
    group = predict.add_argument_group("run")
    group.add_argument("--chunk-size", type=argtypes.positive_int, default=DEFAULT_CHUNK, metavar="N",
                     help=f"images per predict_many call; the next chunk is decoded meanwhile (default {DEFAULT_CHUNK})")
    group.add_argument("--writers", type=argtypes.positive_int, default=2, metavar="N", help="threads writing files (default 2)")
    group.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary; errors still print")
    return predict


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tt-moge predict` with parsed arguments -> exit code."""
    from ..export import FORMATS, missing_format_library, to_json, write_text_atomic
    from ..inputs import InputPathError, collect_images
    from ..jobs import predict_images

    formats = chosen_formats(args) or list(FORMATS)
    out_root = Path(args.output)
    try:
        images = collect_images(args.inputs, exclude=out_root)  # never our own depth.png files as photos
    except InputPathError as exc:
        parser.error(str(exc))
    if not images:
        parser.error(f"no PNG or JPEG images found in {', '.join(args.inputs)}")
    try:
        out_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"cannot create the output folder {str(out_root)!r}: {exc}")
    run_json = out_root / "run.json"
    try:  # it describes the last run: an earlier one's must not stand for this run if this one cannot write its own
        run_json.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        parser.error(f"cannot replace {str(run_json)!r}: {exc}")
    missing = missing_format_library(formats)
    if missing:
        say(missing)
        return EXIT_START

    t_start = time.perf_counter()
    model = load_model(args)
    if model is None:
        return EXIT_START
    t_loaded = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=len(images), unit="img", desc="tt-moge predict", file=sys.stderr, dynamic_ncols=True,
               disable=args.quiet or len(images) < 2)

    def on_done(image: Any, error: Optional[str]) -> None:
        if error is not None:
            bar.write(f"tt-moge: failed: {error}", file=sys.stderr)
        bar.update(1)

    try:
        with model:
            status = predict_images(model, images, out_root, formats, fit=args.fit, fov_x=args.fov_x,
                                    chunk_size=args.chunk_size, writers=args.writers, on_done=on_done)
            info = model.info()
    finally:
        bar.close()
    seconds = time.perf_counter() - t_loaded
    failed = [(images[i], err) for i, err in sorted(status.items()) if err is not None]
    done = len(images) - len(failed)
    record = {
        "tt_moge": __version__, "model": info, "formats": formats,
        "options": {"fit": args.fit, "fov_x": args.fov_x, "resolution": list(args.resolution), "num_tokens": args.num_tokens},
        "done": done, "failed": len(failed), "load_seconds": round(t_loaded - t_start, 3), "seconds": round(seconds, 3),
        "images": [{"input": str(img.path), "output": img.name, "status": "failed" if status.get(i) else "done",
                    "error": status.get(i)} for i, img in enumerate(images)],
    }
    try:
        write_text_atomic(run_json, to_json(record))
        index = f"index: {run_json}"
    except OSError as exc:
        say(f"could not write {run_json}: {exc}")
        index = "no index: run.json could not be written"
    if not args.quiet:
        rate = f", {done / seconds:.2f} images/s" if seconds > 0 and done else ""
        print(f"tt-moge predict: {done} of {len(images)} images done, {len(failed)} failed, in {seconds:.1f} s{rate} "
              f"(model load {t_loaded - t_start:.1f} s); outputs in {out_root}/ ({index})")
        for image, error in failed:
            print(f"  failed: {error}")
    return EXIT_IMAGES_FAILED if failed or not run_json.exists() else EXIT_OK


