"""`tt-moge`: MoGe-2 from a shell. `tt-moge predict` turns photos into depth, normals, point clouds and meshes;
`batch` runs many on Ray Data; `info` says what would run where; `serve` starts the HTTP server; `bench` times the stages.

`main(argv)` returns the exit code (see EXIT_CODES) instead of exiting, so tests and other tools can call it.
Heavy imports (torch, the model, trimesh) happen inside the commands: `tt-moge --help` stays instant.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from . import __version__, argtypes
from .constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS, DEPTH_EDGE_RTOL, FITS, PRECISIONS

__all__ = ["main", "build_parser", "predict_images", "EXIT_CODES"]

EXIT_OK, EXIT_IMAGES_FAILED, EXIT_USAGE, EXIT_START, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    every image done
  {EXIT_IMAGES_FAILED}    some images failed (each one named on stderr and in OUT/run.json); all others are done
  {EXIT_USAGE}    bad command line: unknown option, bad value, an input that does not exist, no images
  {EXIT_START}    could not start: weights not found or unreadable, device unavailable, a library missing
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)"""
DEFAULT_OUTPUT = "moge_output"
DEFAULT_CHUNK = 4  # images per predict_many call (the next chunk decodes meanwhile); its outputs are all in memory at once
_FORMAT_FLAGS = {"maps": "depth.png (colour bar), normal.png, mask.png, depth.exr (float32 metres)",
                 "npz": "result.npz: every array, the server's npz layout",
                 "ply": "points.ply: coloured point cloud with normals",
                 "glb": "mesh.glb: textured mesh, cut at depth discontinuities"}


def _say(message: str) -> None:
    print(f"tt-moge: {message}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------- arguments
def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    from .weights import DEFAULT_REPO, DEFAULT_REVISION, WEIGHTS_DIR_ENV

    group = parser.add_argument_group("model")
    group.add_argument("--weights", default=DEFAULT_REPO, metavar="REPO|DIR|FILE",
                       help=f"a Hugging Face repo id, a folder holding model.pt, or model.pt itself (default {DEFAULT_REPO}; "
                            f"${WEIGHTS_DIR_ENV}, when set, replaces a repo id)")
    group.add_argument("--revision", default=DEFAULT_REVISION,
                       help="Hub revision of a repo id (default: the pinned revision of the published numbers; 'main' for the newest)")
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when present, else the CPU)")
    group.add_argument("--resolution", type=argtypes.canvas, default=DEFAULT_CANVAS, metavar="WxH",
                       help=f"the canvas every image is fitted onto (default {DEFAULT_CANVAS[0]}x{DEFAULT_CANVAS[1]})")
    group.add_argument("--num-tokens", type=argtypes.token_budget, default=DEFAULT_NUM_TOKENS, metavar="N",
                       help=f"ViT token budget, 1200-3600 (default {DEFAULT_NUM_TOKENS})")
    group.add_argument("--precision", default="auto", choices=PRECISIONS,
                       help="arithmetic of the forward (default auto: bf16 on CPUs with bfloat16 instructions, else "
                            "fp32; fp16 on CUDA). fp32 is the exact reference; int8 is an opt-in CPU mode")
    group.add_argument("-v", "--verbose", action="store_true", help="print model loading steps")


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
  Existing files of the same names are replaced.

examples:
  tt-moge predict photo.jpg                          # -> ./{DEFAULT_OUTPUT}/photo/
  tt-moge predict photos/ -o results/                # every PNG/JPEG below photos/
  tt-moge predict 'shots/**/*.jpg' --ply --glb       # only the 3D files (+ result.json)
  tt-moge predict photo.jpg --fov-x 65 --device cuda
  MOGE_WEIGHTS_DIR=/models/moge-2 tt-moge predict photos/

{EXIT_CODES}
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=110)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tt-moge", formatter_class=_Formatter,
        description="MoGe-2 monocular geometry from the command line: one RGB photo in; metric depth, a camera-space "
                    "point map, normals, a validity mask and the camera intrinsics out, at the photo's own resolution.",
        epilog="Each command has its own manual: tt-moge COMMAND --help.\n\n" + EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"tt-moge {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    predict = commands.add_parser(
        "predict", formatter_class=_Formatter, help="photos -> depth, normal and mask pictures, npz, PLY, GLB",
        description="Run MoGe-2 on PNG/JPEG photos and write, per photo, the chosen formats into its own folder. "
                    "Unreadable images are reported and skipped; the run goes on.", epilog=_PREDICT_EPILOG)
    predict.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders (recursive) or glob patterns")
    predict.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="OUT", help=f"output folder (default ./{DEFAULT_OUTPUT})")
    fmt = predict.add_argument_group("formats (default: all)")
    for name, what in _FORMAT_FLAGS.items():
        fmt.add_argument(f"--{name}", action="store_true", help=what)
    call = predict.add_argument_group("per-image options")
    call.add_argument("--fit", choices=FITS, default="pad",
                      help="pad: keep the aspect ratio, gray bars (default); stretch: fill the canvas")
    call.add_argument("--fov-x", type=argtypes.fov_degrees, metavar="DEG", help="the horizontal field of view, if known (then only the depth shift is solved)")
    _add_model_arguments(predict)
    run = predict.add_argument_group("run")
    run.add_argument("--chunk-size", type=argtypes.positive_int, default=DEFAULT_CHUNK, metavar="N",
                     help=f"images per predict_many call; the next chunk is decoded meanwhile (default {DEFAULT_CHUNK})")
    run.add_argument("--writers", type=argtypes.positive_int, default=2, metavar="N", help="threads writing files (default 2)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary; errors still print")
    predict.set_defaults(command_parser=predict)

    from . import batch_cli

    batch = commands.add_parser("batch", formatter_class=_Formatter, description=batch_cli.DESCRIPTION,
                                help="many photos as a Ray Data job: replicas, cluster, resume, failures file",
                                epilog=batch_cli.epilog(EXIT_CODES, DEFAULT_OUTPUT))
    batch_cli.add_arguments(batch)
    batch.set_defaults(command_parser=batch)

    info = commands.add_parser(
        "info", formatter_class=_Formatter, help="load the model and say what runs where",
        description="Load the model (no warm-up) and print: version, weights source and revision, architecture, "
                    "device and runner, canvas, token budget, normal head, and whether the host steps run on the "
                    "native (C++) path or in torch.",
        epilog="examples:\n  tt-moge info\n  tt-moge info --weights /models/moge-2 --device cpu --json\n\n" + EXIT_CODES)
    _add_model_arguments(info)
    info.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    info.set_defaults(command_parser=info)

    commands.add_parser("serve", help="the HTTP server (POST /predict); see tt-moge serve --help", add_help=False)
    commands.add_parser("bench", help="per-stage timing (tt_moge.bench_breakdown); see tt-moge bench --help", add_help=False)
    return parser


# ----------------------------------------------------------------------------------- the model
def _load_model(args: argparse.Namespace) -> Any:
    """MoGeModel for the parsed model arguments, or None after saying why it could not load."""
    from .model import MoGeModel

    t0 = time.perf_counter()
    revision = None if args.revision in ("main", "") else args.revision
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # No warm-up: a run over many images does not need its first call to be fast.
            model = MoGeModel.from_pretrained(args.weights, device=args.device, revision=revision,
                                              resolution=args.resolution, num_tokens=args.num_tokens,
                                              precision=args.precision, warmup=0, warmup_variants="none", verbose=args.verbose)
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            _say(f"could not load the model: {exc}")
            return None
    for warning in caught:  # e.g. "no CUDA GPU found ... running on the CPU", as one line, in CLI terms
        _say("note: " + str(warning.message).replace("device='cpu'", "--device cpu"))
    if args.verbose:
        _say(f"model {model!r} loaded in {time.perf_counter() - t0:.1f} s")
    return model


def host_path() -> str:
    """'native' or 'torch' (+ why): which implementation runs the host steps."""
    from .host import native

    try:
        return native.host_path()
    except Exception as exc:  # e.g. MOGE_HOST=native and the build fails: `info` still answers
        return f"torch (native host library unavailable: {type(exc).__name__}: {exc})"


def _run_info(args: argparse.Namespace) -> int:
    import torch

    model = _load_model(args)
    if model is None:
        return EXIT_START
    with model:
        info = dict(model.info())
    info.setdefault("host", host_path())
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


# ---------------------------------------------------------------------------------- prediction
def _decode(path: Path) -> Any:
    from .host.decode import to_rgb_array

    return to_rgb_array(path, name=str(path))


def _decoded_chunks(images: Sequence, size: int, reader: ThreadPoolExecutor) -> Iterator[list]:
    """Yield [(ImageInput, Future of its RGB array)] per chunk, with the next chunk already decoding."""
    chunks = [images[i:i + size] for i in range(0, len(images), size)]
    pending = [reader.submit(_decode, image.path) for image in chunks[0]] if chunks else []
    for k, chunk in enumerate(chunks):
        current = pending
        if k + 1 < len(chunks):
            pending = [reader.submit(_decode, image.path) for image in chunks[k + 1]]
        yield list(zip(chunk, current))


def _reason(image: Any, exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if str(image.path) in text else f"{image.path}: {text}"


def predict_images(model: Any, images: Sequence, out_root: Path, formats: Sequence[str], *, fit: str = "pad",
                   fov_x: Optional[float] = None, chunk_size: int = DEFAULT_CHUNK, writers: int = 2,
                   on_done: Optional[Callable[[Any, Optional[str]], None]] = None) -> dict:
    """Run `model` over [ImageInput] and write each result to out_root / image.name with `write_outputs`.

    Decoding of the next chunk, the model on this chunk (`predict_many`) and the writing of finished images
    overlap. An image that fails (unreadable, or its writing fails) is recorded and skipped. Returns
    {image index: error message or None}; `on_done(image, error)` is called for each image as it finishes.
    """
    from .export import write_outputs

    status: dict = {}

    def finish(index: int, image: Any, error: Optional[str]) -> None:
        status[index] = error
        if on_done is not None:
            on_done(image, error)

    reader = ThreadPoolExecutor(1, thread_name_prefix="tt_moge-read")
    writer = ThreadPoolExecutor(writers, thread_name_prefix="tt_moge-write")
    writing: list = []  # [(index, image, Future)], oldest first

    def collect(limit: int) -> None:
        while len(writing) > limit:
            index, image, future = writing.pop(0)
            exc = future.exception()
            finish(index, image, None if exc is None else _reason(image, exc))

    try:
        index = 0
        for chunk in _decoded_chunks(images, chunk_size, reader):
            decoded = []
            for image, future in chunk:
                exc = future.exception()
                if exc is None:
                    decoded.append((index, image, future.result()))
                else:
                    finish(index, image, _reason(image, exc))
                index += 1
            for (i, image, rgb), output in zip(decoded, _predict_chunk(model, [d[2] for d in decoded], fit, fov_x)):
                if isinstance(output, BaseException):
                    finish(i, image, _reason(image, output))
                    continue
                job: Future = writer.submit(write_outputs, output, rgb, out_root / image.name, formats, source=str(image.path))
                writing.append((i, image, job))
                collect(2 * writers)  # bounded: finished maps wait for a writer, not pile up in memory
        collect(0)
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        writer.shutdown(wait=True, cancel_futures=True)
    return status


def _predict_chunk(model: Any, arrays: list, fit: str, fov_x: Optional[float]) -> list:
    """MoGeOutputs for decoded arrays; if the chunk call fails, image by image, so one bad image costs only itself."""
    if not arrays:
        return []
    try:
        return model.predict_many(arrays, fit=fit, fov_x=fov_x)
    except Exception:
        results: list = []
        for rgb in arrays:
            try:
                results.append(model.predict(rgb, fit=fit, fov_x=fov_x))
            except Exception as exc:
                results.append(exc)
        return results


def _check_format_libraries(formats: Sequence[str]) -> Optional[str]:
    needs = {"maps": ("OpenEXR", "openexr"), "ply": ("trimesh", "trimesh"), "glb": ("trimesh", "trimesh")}
    import importlib

    for fmt in formats:
        if fmt in needs:
            module, package = needs[fmt]
            try:
                importlib.import_module(module)
            except ImportError:
                return f"--{fmt} needs the {package} package: pip install {package}"
    return None


def _run_predict(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .export import FORMATS, to_json
    from .inputs import InputPathError, collect_images

    formats = [f for f in FORMATS if getattr(args, f)] or list(FORMATS)
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
    missing = _check_format_libraries(formats)
    if missing:
        _say(missing)
        return EXIT_START

    t_start = time.perf_counter()
    model = _load_model(args)
    if model is None:
        return EXIT_START
    t_loaded = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=len(images), unit="img", desc="tt-moge predict", file=sys.stderr, dynamic_ncols=True,
               disable=args.quiet or len(images) < 2)

    def on_done(image: Any, error: Optional[str]) -> None:
        if error is not None:
            bar.write(f"tt-moge: skipped: {error}", file=sys.stderr)
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
    (out_root / "run.json").write_text(to_json(record))
    if not args.quiet:
        rate = f", {done / seconds:.2f} images/s" if seconds > 0 and done else ""
        print(f"tt-moge predict: {done} of {len(images)} images done, {len(failed)} failed, in {seconds:.1f} s{rate} "
              f"(model load {t_loaded - t_start:.1f} s); outputs in {out_root}/ (index: {out_root / 'run.json'})")
        for image, error in failed:
            print(f"  failed: {error}")
    return EXIT_IMAGES_FAILED if failed else EXIT_OK


# ------------------------------------------------------------------------------- other commands
def _run_forwarded(command: str, argv: list) -> int:
    """`serve` and `bench` hand their arguments to modules that may be absent from this build."""
    try:
        if command == "bench":
            from .bench_breakdown import main as bench_main
        else:
            from .server.cli import EXIT_CODES as SERVE_EXIT_CODES, add_arguments, run
    except ImportError as exc:
        where = "tt_moge.bench_breakdown" if command == "bench" else "tt_moge.server.cli (install the server extra: pip install 'tt-moge[server]')"
        _say(f"{command}: not available in this installation: {where} could not be imported ({exc})")
        return EXIT_START
    try:
        if command == "bench":
            return int(bench_main(argv) or 0)
        parser = argparse.ArgumentParser(prog="tt-moge serve", formatter_class=_Formatter,
                                         description="Serve MoGe-2 over HTTP (POST /predict); one model, loaded at start-up.",
                                         epilog=SERVE_EXIT_CODES)
        add_arguments(parser)
        return int(run(parser.parse_args(argv)) or 0)
    except SystemExit as exc:  # argparse inside the command: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `tt-moge` command. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("serve", "bench"):
            return _run_forwarded(argv[0], argv[1:])
        parser = build_parser()
        try:
            args, unknown = parser.parse_known_args(argv)
            if args.command is None:
                parser.print_help(sys.stderr)
                return EXIT_USAGE
            if unknown:  # reported by the command's own parser, with its usage line and a hint
                hint = " (formats are chosen with --maps, --npz, --ply, --glb)" if args.command in ("predict", "batch") else ""
                args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
            if args.command == "info":
                return _run_info(args)
            if args.command == "batch":
                from .batch_cli import run as run_batch_command

                return run_batch_command(args, args.command_parser)
            return _run_predict(args, args.command_parser)
        except SystemExit as exc:  # argparse: --help / --version (0) or a usage error (2)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
