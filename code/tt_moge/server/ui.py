"""The web page of `tt-moge serve`: drop a photo, see depth, normals, mask and the 3D scene, download the files.

    mount_ui(app)      adds the page to an app made by `create_app` (the CLI does, unless --no-ui): its routes
                       and its lifespan, as one APIRouter

Routes (none is in the OpenAPI schema: the API is /predict and /predict/summary):

    GET  /, /ui                     the page (HTML, our own JS and CSS from tt_moge/server/static/, nothing else)
    GET  /ui/static/<file>          its script, viewer and style sheet
    GET  /ui/api/config             whether an API key is needed, the call options (the page's controls) and the
                                    summary's numbers (the rows of the page's numbers table)
    GET  /ui/demo.png               the demo image: the pixels of media/source.png (tt_moge.scene)
    POST /ui/api/predict            the image and the call options, as for POST /predict/summary -> JSON: the
                                    same summary, plus the URLs of the maps, the 3D view and the downloads
    POST /ui/api/predict_panorama   an equirectangular photo and apply_mask, as for POST /predict/panorama/summary
                                    -> JSON: that summary, plus the URLs of its distance map, mask, 3D view (the
                                    sphere's mesh) and downloads
    POST /ui/api/predict_video      a short clip and the call and clip options, as for /predict/video/summary
                                    -> JSON: that summary, plus the URLs of its scene view and files
    GET  /ui/clips/<id>/<file>      a clip's view.glb (the fused cloud thinned, the camera path) and its files
                                    (clip.npz, poses.json, trajectory.txt, scene.ply, scene.glb), made with it
    GET  /ui/results/<id>/<file>    depth.jpg, normal.jpg, mask.png, view.glb (made with the result), and the
                                    downloads result.npz, mesh.glb, points.ply, depth.exr (made on first request)
    GET  /ui/results/<id>/points?at=X,Y&at=...
                                    the result's 3D points (metres, camera space), depth and mask at those pixels,
                                    read from its stored arrays: the page's measuring tool

A page request goes through the API's own path, the app's `Serving`: the same bearer key, body and pixel
limits, admission and query parameters (one per call option); the maps and the 3D view are made on the host
thread of the admitted request. The full-resolution downloads are made when asked for, each admitted like a prediction
(a full-resolution mesh is large and slow to make), so the page does not wait for files nobody takes.

The 3D view is a lighter mesh than mesh.glb: the same rule (`tt_moge.export.image_mesh`, cut at depth edges) on
every `step`-th pixel, so its longer side has at most VIEW_MAX_SIDE vertices, textured with the photo scaled to at
most TEXTURE_MAX_SIDE, as a GLB of at most VIEW_MAX_BYTES for any image (the mesh alone stays well below: at
most VIEW_MAX_SIDE^2 vertices; a texture that would not fit is scaled down).

Results live in a temporary folder (`ResultStore`): at most KEEP_RESULTS results and KEEP_BYTES bytes, none
older than KEEP_SECONDS; the oldest goes first; a dropped result that is still being read or written is deleted
once its last holder is done. The folder is removed when the server stops. Result URLs carry a random 128-bit
id: they work without the API key (an <img> cannot send one) for whoever was given them, until the result is
dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from .. import __version__
from ..constants import DEPTH_EDGE_RTOL
from ..fields import options_of
from ..host import CallOptions
from ..host.decode import decode_bytes
from ..output import SUMMARY_FIELDS, SUMMARY_SHOWN, MoGeOutput
from ..panorama.geometry import ASPECT_TOLERANCE
from ..video import VideoOptions
from .app import MoGeApp, Summary
from .errors import ApiError
from .panorama import PANORAMA_QUERY, apply_mask_query, predict_pano
from .serving import CALL_OPTION_NAMES, NPZ_MEDIA_TYPE, Serving, call_options_query, check_query, client_is_loopback
from .upload import EXIF_QUERY, ImageUpload, exif_query
from .video import add_video_page

__all__ = [
    "mount_ui",
    "ResultStore",
    "view_mesh",
    "VIEW_MAX_BYTES",
    "UI_PATHS",
    "VIEW_MAX_SIDE",
    "TEXTURE_MAX_SIDE",
    "KEEP_RESULTS",
    "KEEP_BYTES",
    "KEEP_SECONDS",
    "DOWNLOADS",
    "MEASURE_MAX_PIXELS",
    "VIEW_FILES",
]

UI_PATHS = ("/", "/ui")
VIEW_MAX_SIDE = 480  # vertices along the longer side of the 3D view's mesh
TEXTURE_MAX_SIDE = 1536  # pixels along the longer side of its texture (JPEG)
VIEW_MAX_BYTES = 14 * 1024**2  # view.glb never exceeds this (the texture shrinks when needed)
KEEP_RESULTS = 8  # results kept for the page's images and downloads
KEEP_BYTES = 2 * 1024**3  # their files together (arrays, upload, pictures, view and the downloads made)
KEEP_SECONDS = 3600
MEASURE_MAX_PIXELS = 16  # pixels per GET /ui/results/<id>/points
_PNG_FAST = 1  # zlib level of the page's mask PNG: quick to write
_MAP_JPEG_QUALITY = 90  # the depth and normal pictures are viewed, not archived (the downloads hold the values);
# JPEG writes these noisy colour maps much faster than PNG

# The files of a result the page shows (made with the result) and the downloads (made when first asked for).
VIEW_FILES = {
    "depth.jpg": "image/jpeg",
    "normal.jpg": "image/jpeg",
    "mask.png": "image/png",
    "view.glb": "model/gltf-binary",
}
DOWNLOADS = {
    "result.npz": NPZ_MEDIA_TYPE,
    "mesh.glb": "model/gltf-binary",
    "points.ply": "application/octet-stream",
    "depth.exr": "image/x-exr",
}
_ARRAYS = "arrays.npz"  # the MoGeOutput of the result, every array as predicted (float32 normals): exact downloads
_STATIC = Path(__file__).with_name("static")
_STATIC_FILES = {"app.js": "text/javascript", "viewer.js": "text/javascript", "style.css": "text/css"}
# The page loads nothing from elsewhere: same-origin scripts, styles, images and requests only.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'self'"
)
_PAGE_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


# ------------------------------------------------------------------------------------------ result store
@dataclass(eq=False)
class _Entry:
    rid: str
    path: Path
    created: float
    users: int = 0
    dropped: bool = False
    nbytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # one maker of each download at a time
    saved: Optional[Future] = None  # the arrays and the upload, written after the page's answer
    exif: bool = False  # the stored upload is decoded turned by its EXIF orientation (as the model saw it)


class ResultStore:
    """Bounded temporary storage of the page's results (see the module docstring). Thread-safe."""

    def __init__(
        self,
        keep: int = KEEP_RESULTS,
        keep_bytes: int = KEEP_BYTES,
        keep_seconds: float = KEEP_SECONDS,
        parent: Optional[str] = None,
    ):
        self.keep, self.keep_bytes, self.keep_seconds = keep, keep_bytes, keep_seconds
        self.root = Path(tempfile.mkdtemp(prefix="tt_moge-ui-", dir=parent))
        self._entries: dict = {}  # rid -> _Entry, oldest first
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tt_moge-ui-store")

    def create(self) -> _Entry:
        """A new, empty result folder, held by the caller (release it when done)."""
        rid = secrets.token_urlsafe(16)
        path = self.root / rid
        path.mkdir()
        entry = _Entry(rid, path, time.monotonic(), users=1)
        with self._lock:
            self._entries[rid] = entry
            self._trim_locked()
        return entry

    def acquire(self, rid: str) -> _Entry:
        """Hold a stored result while reading or adding to it; ApiError 404 when it is unknown or dropped."""
        with self._lock:
            self._trim_locked()
            entry = self._entries.get(rid)
            if entry is None:
                raise ApiError(
                    404,
                    "result_expired",
                    "this result is no longer kept (the server keeps the last "
                    f"{self.keep} results for up to {self.keep_seconds / 60:g} min); run the image again",
                )
            entry.users += 1
            return entry

    def save_later(self, entry: _Entry, files: dict, write: Callable[[], Path]) -> None:
        """Write a result's large files off the request's path: `files` ({name: bytes}) and `write()` (which
        returns the path it wrote) run on the store's writer thread, holding the entry; `entry.saved` says when
        they are there."""
        with self._lock:
            entry.users += 1

        def job() -> None:
            try:
                for name, data in files.items():
                    (entry.path / name).write_bytes(data)
                self.added(entry, write(), *(entry.path / name for name in files))
            finally:
                self.release(entry)

        entry.saved = self._writer.submit(job)

    def release(self, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            delete = entry.dropped and entry.users == 0
        if delete:
            shutil.rmtree(entry.path, ignore_errors=True)

    def added(self, entry: _Entry, *paths: Path) -> None:
        """Count files just written into a result against KEEP_BYTES (older results go when over)."""
        size = sum(p.stat().st_size for p in paths)
        with self._lock:
            entry.nbytes += size
            self._trim_locked()

    def drop(self, entry: _Entry) -> None:
        """Forget a result now (its folder goes when its last holder releases it)."""
        with self._lock:
            if self._entries.pop(entry.rid, None) is not None:
                entry.dropped = True

    def _trim_locked(self) -> None:
        now = time.monotonic()
        while self._entries:
            total = sum(e.nbytes for e in self._entries.values())
            oldest = next(iter(self._entries.values()))
            if not (
                len(self._entries) > self.keep or total > self.keep_bytes or now - oldest.created > self.keep_seconds
            ):
                return
            # the oldest result nobody holds goes first; if every one is held, the oldest (deleted when released)
            victim = next((e for e in self._entries.values() if e.users == 0), oldest)
            if len(self._entries) == 1 and victim.users > 0:
                return  # never drop the only result while it is being made
            del self._entries[victim.rid]
            victim.dropped = True
            if victim.users == 0:
                shutil.rmtree(victim.path, ignore_errors=True)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._writer.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._entries.clear()
        shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------------------------------ the 3D view
def view_step(size: tuple, max_side: int = VIEW_MAX_SIDE) -> int:
    """The pixel step of the view mesh for an image of `size` = (width, height)."""
    return max(1, math.ceil(max(size) / max_side))


def view_mesh(
    output: MoGeOutput,
    image_rgb: np.ndarray,
    max_side: int = VIEW_MAX_SIDE,
    texture_side: int = TEXTURE_MAX_SIDE,
    max_bytes: int = VIEW_MAX_BYTES,
) -> tuple:
    """(GLB bytes, record) of the light mesh for the page's 3D view, of a photo's MoGeOutput or a PanoramaOutput
    (whose mesh closes at the seam).

    Every `step`-th pixel (the centre pixel of each step x step block) becomes a vertex where it is kept at full
    resolution (`kept_pixels`) and is not on a depth edge of the coarse grid (the same relative rule, scaled by
    the step: a smooth slope changes depth `step` times more between coarse neighbours). Triangles, axes and
    the edge cut are those of `tt_moge.export.image_mesh`; the UVs point at the sampled pixels of the full
    image, whose texture is the photo scaled to at most `texture_side` (JPEG), halved until the GLB fits in
    `max_bytes`. No normals: the view is unlit.
    """
    import cv2
    from PIL import Image

    from ..export import image_mesh, kept_pixels

    w, h = output.size
    step = view_step((w, h), max_side)
    first = step // 2
    rows, cols = slice(first, None, step), slice(first, None, step)
    coarse = output.sliced(rows, cols)
    if coarse.normal is not None:
        coarse = dataclasses.replace(coarse, normal=None)  # unlit: no vertex normals
    keep = kept_pixels(coarse, rtol=DEPTH_EDGE_RTOL * step)
    if step > 1:
        keep &= kept_pixels(output)[rows, cols]
    record = {"step": step, "grid": [coarse.size[0], coarse.size[1]], "vertices": int(keep.sum()), "faces": 0}
    if not keep.any():
        return None, record
    mesh = image_mesh(
        coarse,
        image_rgb[rows, cols],
        keep,
        wrap_columns=getattr(output, "is_panorama", False),
        uv_grid=(first, step, (w, h)),
    )
    side = texture_side
    while True:
        scale = min(1.0, side / max(w, h))
        texture = (
            image_rgb
            if scale == 1.0
            else cv2.resize(
                image_rgb, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA
            )
        )
        picture = Image.fromarray(np.ascontiguousarray(texture))
        picture.format = "JPEG"  # trimesh's GLB export then embeds a JPEG (quality 75), not a PNG
        mesh.visual.material.baseColorTexture = picture
        glb = mesh.export(file_type="glb")
        if len(glb) <= max_bytes or side <= 64:
            break
        side //= 2  # a texture that does not compress (noise) would push the view over its budget
    record.update(faces=int(len(mesh.faces)), texture=[picture.width, picture.height], bytes=len(glb))
    return glb, record


# ------------------------------------------------------------------------------------------ a page result
def _encode(rgb_or_gray: np.ndarray, kind: str) -> bytes:
    """An RGB (or gray) picture as ".png" (fast zlib level) or ".jpg" bytes."""
    import cv2

    image = rgb_or_gray[..., ::-1] if rgb_or_gray.ndim == 3 else rgb_or_gray
    params = (
        [cv2.IMWRITE_PNG_COMPRESSION, _PNG_FAST] if kind == ".png" else [cv2.IMWRITE_JPEG_QUALITY, _MAP_JPEG_QUALITY]
    )
    ok, data = cv2.imencode(kind, np.ascontiguousarray(image), params)
    if not ok:
        raise RuntimeError(f"{kind} encoding failed")
    return data.tobytes()


def _save_arrays(path: Path, out: Any) -> Path:
    """Every array of a MoGeOutput as predicted, or a PanoramaOutput's npz arrays (float32 maps, the mask)."""
    with open(path, "wb") as f:
        np.savez(f, **(out.npz_arrays() if getattr(out, "is_panorama", False) else out.exact_arrays()))
    return path


def _load_arrays(path: Path) -> Any:
    """The result `_save_arrays` wrote: a PanoramaOutput when it has a distance map, else a MoGeOutput."""
    from ..panorama.predict import PanoramaOutput

    with np.load(path) as arrays:
        panorama = "distance" in arrays.files
    return PanoramaOutput.from_npz(path) if panorama else MoGeOutput.from_npz(path)


def make_page_result(out: Any, upload: ImageUpload, store: ResultStore, rgb: Optional[np.ndarray] = None) -> dict:
    """On the request's host thread: the maps, the 3D view and the stored arrays of one result (a photo's
    MoGeOutput, or a PanoramaOutput with its decoded image `rgb`) -> its record."""
    from ..export import colorize_depth, colorize_normal

    times: dict = {}
    t = time.perf_counter()
    entry = store.create()
    entry.exif = upload.exif
    try:
        if rgb is None:
            rgb = decode_bytes(upload.data, exif=upload.exif)  # the pixels the model saw (the same decoder)
        summary = out.summary(depth_percentiles=True)
        known = (summary.pop("depth_p1_m"), summary.pop("depth_p99_m"))
        depth_picture, (near, far) = colorize_depth(out.depth, out.mask, None if None in known else known)
        files = {
            "depth.jpg": _encode(depth_picture, ".jpg"),
            "mask.png": _encode(out.mask.astype(np.uint8) * 255, ".png"),
        }
        if out.normal is not None:
            files["normal.jpg"] = _encode(colorize_normal(out.normal, out.mask), ".jpg")
        times["maps"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        glb, view = view_mesh(out, rgb)
        if glb is not None:
            files["view.glb"] = glb
        times["view"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for name, data in files.items():
            (entry.path / name).write_bytes(data)
        store.added(entry, *(entry.path / name for name in files))
        # The arrays for the downloads (tens of MB) are written after the answer; downloads wait for them.
        store.save_later(
            entry,
            {"input.png" if upload.format == "PNG" else "input.jpg": upload.data},
            lambda: _save_arrays(entry.path / _ARRAYS, out),
        )
        times["store"] = (time.perf_counter() - t) * 1e3
    except BaseException:
        store.drop(entry)
        raise
    finally:
        store.release(entry)
    base = f"/ui/results/{entry.rid}/"
    return {
        "id": entry.rid,
        "kind": "panorama" if getattr(out, "is_panorama", False) else "photo",
        "summary": summary,
        "depth_range_m": [None if not math.isfinite(v) else v for v in (near, far)],
        "images": {
            "depth": base + "depth.jpg",
            "normal": base + "normal.jpg" if "normal.jpg" in files else None,
            "mask": base + "mask.png",
        },
        "view": {**view, "url": base + "view.glb" if glb is not None else None},
        "downloads": {name: base + name for name in (*DOWNLOADS, "view.glb") if name != "view.glb" or glb is not None},
        "points": base + "points",
        "page_ms": times,
    }


def _make_download(store: ResultStore, entry: _Entry, name: str, compress: bool) -> Any:
    """A download of a stored result: npz bytes (encoded as POST /predict encodes them), or the path of a file
    written by tt_moge.export exactly as `tt-moge predict` writes it (made once, then served from the folder)."""
    from ..export import write_depth_exr, write_outputs

    entry.saved.result()  # the arrays are written
    if name == "result.npz":
        return _load_arrays(entry.path / _ARRAYS).to_npz_bytes(compress=compress)
    target = entry.path / name
    with entry.lock:
        if target.exists():
            return target
        out = _load_arrays(entry.path / _ARRAYS)
        if name == "depth.exr":
            write_depth_exr(target, out.depth)
        else:
            rgb = decode_bytes(next(entry.path.glob("input.*")).read_bytes(), exif=entry.exif)  # as the model saw it
            with tempfile.TemporaryDirectory(dir=entry.path) as tmp:
                record = write_outputs(out, rgb, tmp, formats=("glb" if name == "mesh.glb" else "ply",))
                made = Path(tmp) / name
                if not made.exists():
                    raise ApiError(422, "nothing_to_export", record.get("note", f"{name} was not written"))
                made.replace(target)
        store.added(entry, target)
    return target


def parse_pixels(at: list, size: tuple) -> list:
    """The `at` query values ("X,Y", pixel column and row from the top left) -> [(x, y)]; ApiError 422 naming
    `at` and what it expects when one is malformed or outside the image of `size` (width, height)."""
    width, height = size
    if not 1 <= len(at) <= MEASURE_MAX_PIXELS:
        raise ApiError(422, "invalid_option", f"at: expected 1 to {MEASURE_MAX_PIXELS} pixels, got {len(at)}")
    pixels = []
    for value in at:
        try:
            x, y = (int(v) for v in value.split(","))
        except ValueError:
            raise ApiError(
                422, "invalid_option", f"at: expected X,Y in whole pixels (e.g. at=10,20), got {value!r}"
            ) from None
        if not (0 <= x < width and 0 <= y < height):
            raise ApiError(
                422,
                "invalid_option",
                f"at: pixel {x},{y} is outside the {width}x{height} image (0 <= X < {width}, 0 <= Y < {height})",
            )
        pixels.append((x, y))
    return pixels


def points_at(entry: _Entry, at: list) -> dict:
    """The stored result's 3D point (camera space, metres: x right, y down, z forward; a panorama's axes are the
    same), depth (a panorama's: the distance from the viewpoint) and mask at each pixel of `at` (see
    `parse_pixels`); a point or depth that is not finite (masked out) is None."""
    entry.saved.result()  # the arrays are written after the page's answer
    with np.load(entry.path / _ARRAYS) as arrays:
        mask = arrays["mask"]
        pixels = parse_pixels(at, (mask.shape[1], mask.shape[0]))
        rows, cols = [y for _, y in pixels], [x for x, _ in pixels]
        depth = arrays["distance" if "distance" in arrays.files else "depth"][rows, cols]  # a panorama: distance
        points, valid = arrays["points"][rows, cols], mask[rows, cols]

    def finite(values: np.ndarray) -> Any:
        return values.tolist() if np.isfinite(values).all() else None

    return {
        "points": [
            {"pixel": [x, y], "valid": bool(v), "point": finite(p), "depth_m": finite(d)}
            for (x, y), p, d, v in zip(pixels, points, depth, valid)
        ]
    }


# ------------------------------------------------------------------------------------------------ routes
class _HeldFile(FileResponse):
    """A file response that calls `release` when it is done, also when the client leaves half-way."""

    def __init__(self, path: Path, release: Any, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


WARM_UP_JOIN_S = 60.0  # the longest a stopping server waits for the page's warm-up imports


def _warm_up() -> None:
    """Import and run once what the first page result needs (trimesh, OpenCV, the GLB export), so that the
    first person to use the page does not wait for the imports."""
    try:
        import torch

        from ..host.canvas import plan_canvas
        from ..host.finish import finish
        from ..runners.base import RawMaps

        side = 16
        v, u = torch.meshgrid(torch.linspace(-0.5, 0.5, side), torch.linspace(-0.5, 0.5, side), indexing="ij")
        raw = RawMaps(points=torch.stack([u, v, torch.zeros_like(u)], -1), normal=None, mask=None, metric_scale=1.0)
        out = finish(raw, plan_canvas((side, side), (side, side), "pad"), focal=1.0, shift=2.0)  # a wall 2 m away
        view_mesh(out, np.zeros((side, side, 3), np.uint8))
        from ..export import colorize_depth

        _encode(colorize_depth(out.depth, out.mask)[0], ".jpg")
    except Exception:  # only a head start: a real failure shows on the first request
        pass


def _demo_png() -> bytes:
    """media/source.png, rendered from the analytic scene (our own image, shipped as code)."""
    from ..scene import render

    return _encode(render(1920, 1080).image, ".png")


def _option_controls(record: type = CallOptions) -> list:
    """The page's option controls, one per option of `record` (the call options, `host.CallOptions`; the clip
    options, `video.VideoOptions`): what app.js builds its form from."""
    controls = []
    for info in options_of(record):
        spec = info.spec
        kind = (
            "bool"
            if info.type is bool
            else "choice"
            if spec.choices is not None
            else "number"
            if spec.bounds is not None
            else "text"
        )
        controls.append(
            {
                "name": info.argument,
                "kind": kind,
                "default": info.default,
                "help": info.describe(),
                "choices": [c for c in spec.choices if c is not None] if spec.choices else None,
                "bounds": list(spec.bounds) if spec.bounds else None,
            }
        )
    return controls


def _summary_numbers() -> list:
    """The rows of the page's numbers table, one per number of the summary that `output.SUMMARY_SHOWN` says how
    to show (generated from the output definitions): key, label, digits, unit, scale, and what it is."""
    return [
        {"key": key, **dataclasses.asdict(shown), "help": SUMMARY_FIELDS[key][1]}
        for key, shown in SUMMARY_SHOWN.items()
    ]


def mount_ui(app: MoGeApp, store: Optional[ResultStore] = None) -> ResultStore:
    """Add the web page to an app made by `tt_moge.server.app.create_app`; returns its result store (whose
    folder is removed when the app stops, after the app's host threads have ended)."""
    store = ResultStore() if store is None else store
    serving: Serving = app.serving
    settings = serving.settings
    page = (_STATIC / "index.html").read_text()
    static = {name: (_STATIC / name).read_bytes() for name in _STATIC_FILES}
    controls = _option_controls()
    video_controls = _option_controls(VideoOptions)
    numbers = _summary_numbers()
    demo: dict = {}
    demo_lock = threading.Lock()

    @asynccontextmanager
    async def lifespan(_: Any):
        warm = threading.Thread(target=_warm_up, name="tt_moge-ui-warmup", daemon=True)
        warm.start()
        try:
            yield
        finally:
            # a process that stops while the warm-up still imports OpenCV / SciPy / trimesh aborts in C++
            # ("terminate called without an active exception"): let the imports end first
            await asyncio.get_running_loop().run_in_executor(None, warm.join, WARM_UP_JOIN_S)

    serving.close_after_work(store.close)
    router = APIRouter(lifespan=lifespan, include_in_schema=False)  # FastAPI runs it inside the app's lifespan

    async def show_page() -> HTMLResponse:
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    for path in (*UI_PATHS, "/ui/"):
        router.add_api_route(path, show_page, methods=["GET"], response_class=HTMLResponse)

    @router.get("/ui/static/{name}")
    async def static_file(name: str) -> Response:
        if name not in static:
            raise ApiError(404, "not_found", f"no page file {name!r}")
        return Response(static[name], media_type=_STATIC_FILES[name], headers={"Cache-Control": "no-cache"})

    @router.get("/ui/api/config")
    async def config() -> dict:  # no key needed: it says whether the page must ask for one, and what it can send
        return {
            "auth": settings.api_key is not None,
            "version": __version__,
            "options": controls,
            "video_options": video_controls,
            "numbers": numbers,
            "panorama_aspect_tolerance": ASPECT_TOLERANCE,  # the page offers a 2:1 image as a panorama
        }

    @router.get("/ui/demo.png")
    async def demo_image() -> Response:
        def render() -> bytes:
            with demo_lock:
                if "png" not in demo:
                    demo["png"] = _demo_png()
                return demo["png"]

        data = demo.get("png") or await asyncio.get_running_loop().run_in_executor(None, render)
        return Response(data, media_type="image/png", headers={"Cache-Control": "max-age=86400"})

    @router.post("/ui/api/predict", dependencies=[Depends(serving.authorize)])
    async def predict(
        request: Request, options: CallOptions = Depends(call_options_query), exif: bool = Depends(exif_query)
    ) -> Response:
        check_query(request, (*CALL_OPTION_NAMES, EXIF_QUERY))
        done = await serving.predict(request, options, lambda out, upload: make_page_result(out, upload, store), exif)
        record = done.payload
        try:
            record["summary"] = Summary(**record["summary"], timing_ms=done.timing).model_dump()
        except BaseException:
            done.ticket.done("answer")
            raise
        return serving.answer_json(record, done.timing, done.ticket)

    @router.post("/ui/api/predict_panorama", dependencies=[Depends(serving.authorize)])
    async def predict_panorama_page(
        request: Request, apply_mask: bool = Depends(apply_mask_query), exif: bool = Depends(exif_query)
    ) -> Response:
        check_query(request, PANORAMA_QUERY)
        done = await predict_pano(
            serving, request, apply_mask, exif, lambda out, upload, rgb: make_page_result(out, upload, store, rgb)
        )
        record = done.payload
        record["summary"]["timing_ms"] = done.timing
        return serving.answer_json(record, done.timing, done.ticket)

    @router.get("/ui/results/{rid}/points")
    async def result_points(rid: str, at: list[str] = Query(default=[])) -> dict:
        entry = store.acquire(rid)
        try:  # a few pixels out of the stored arrays (tens of MB read): off the event loop
            return await asyncio.get_running_loop().run_in_executor(None, points_at, entry, at)
        finally:
            store.release(entry)

    @router.get("/ui/results/{rid}/{name}")
    async def result_file(request: Request, rid: str, name: str) -> Response:
        if name not in VIEW_FILES and name not in DOWNLOADS:
            raise ApiError(
                404, "not_found", f"no result file {name!r}; expected one of {sorted({**VIEW_FILES, **DOWNLOADS})}"
            )
        entry = store.acquire(rid)
        held = True
        try:
            if name in VIEW_FILES:
                path = entry.path / name
                if not path.exists():
                    raise ApiError(404, "not_found", f"this result has no {name}")
                return Response(
                    path.read_bytes(), media_type=VIEW_FILES[name], headers={"Cache-Control": "private, max-age=3600"}
                )
            # a download is made like a prediction: admitted (its arrays read back and encoded: about twice their
            # bytes), on a host thread, answered through the same answer path
            made, ticket = await serving.run_admitted(
                lambda: _make_download(store, entry, name, not client_is_loopback(request)), 2 * entry.nbytes
            )
            headers = {"Content-Disposition": f'attachment; filename="{name}"', "Cache-Control": "no-store"}
            if isinstance(made, bytes):
                return serving.answer([made], DOWNLOADS[name], headers, ticket)
            held = False  # the file is streamed after this returns: the result is released once it is sent

            def sent() -> None:
                store.release(entry)
                ticket.done("answer")

            return _HeldFile(made, sent, media_type=DOWNLOADS[name], headers=headers)
        finally:
            if held:
                store.release(entry)

    add_video_page(router, serving, store)
    app.include_router(router)
    return store
