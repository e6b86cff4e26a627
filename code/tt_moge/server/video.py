"""POST /predict/video and /predict/video/summary: a short clip in, the clip's arrays (npz) or its summary (JSON) out.

    curl --data-binary @walk.mp4 -H 'Content-Type: video/mp4' 'http://127.0.0.1:8000/predict/video?stride=2' -o walk.npz

The body is the video file itself (any container OpenCV's FFmpeg reads; Content-Type video/* or
application/octet-stream). The query parameters are the call options (`host.CallOptions`) and the clip options
(`video.VideoOptions`), both generated. The work is `tt_moge.video` on the server's model, the same as
`model.predict_video(<the same bytes>, <the same options>)`.

Limits: the body (max_body_bytes, 413); then, from the file's header (size, frame count), each frame's pixels
(max_pixels, 413), the frames after stride and max_frames (max_video_frames, 413; fewer than 2: 422), and its
memory (`ServerSettings.clip_cost`: 413 when it could never fit the budget, 503 + Retry-After while other requests
hold it), which admit it. A header can lie: the same limits hold as the frames are decoded (`ClipFrames`), so a
clip whose header undercounts its frames or understates their size is stopped at the limit (413), and its memory
grows with the frames really read. A clip takes one queue slot. The npz holds
`video.output.VIDEO_NPZ_LAYOUT`, with every frame's depth (float32) and mask (uint8); the summary is
`VideoOutput.summary()`: intrinsics, poses, per-frame scales and registration flags.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from ..constants import MIN_IMAGE_SIDE
from ..fields import options_of
from ..host import CallOptions, InputError
from ..npzio import npz_parts
from ..video import VideoOptions, VideoStream
from ..video.options import DEFAULT_CALIBRATION_FRAMES, DEFAULT_NEW_CHAIN_AFTER
from ..video.output import VIDEO_NPZ_LAYOUT
from .errors import ApiError
from .serving import (
    CALL_OPTION_NAMES,
    COMPRESS_QUERY,
    NPZ_MEDIA_TYPE,
    Prediction,
    Serving,
    call_options_query,
    check_query,
    deflate_query,
    json_response,
    npz_response,
    option_query,
    options_of_query,
    timing_headers,
)
from .settings import ServerSettings
from .upload import media_type, read_body

__all__ = [
    "VIDEO_MEDIA_TYPES",
    "VIDEO_OPTION_NAMES",
    "ClipUpload",
    "receive_clip",
    "predict_clip",
    "add_video_routes",
    "video_options_query",
]

VIDEO_MEDIA_TYPES = (
    "video/mp4",
    "video/quicktime",
    "video/x-matroska",
    "video/webm",
    "video/x-msvideo",
    "video/mpeg",
    "application/octet-stream",
)
VIDEO_OPTION_NAMES = tuple(info.argument for info in options_of(VideoOptions))


def video_options_query(
    *,
    stride: Annotated[int, option_query(VideoOptions, "stride")] = 1,
    max_frames: Annotated[Optional[int], option_query(VideoOptions, "max_frames")] = None,
    calibration_frames: Annotated[int, option_query(VideoOptions, "calibration_frames")] = DEFAULT_CALIBRATION_FRAMES,
    window: Annotated[Optional[int], option_query(VideoOptions, "window")] = None,
    new_chain_after: Annotated[int, option_query(VideoOptions, "new_chain_after")] = DEFAULT_NEW_CHAIN_AFTER,
    calibrate_chains: Annotated[bool, option_query(VideoOptions, "calibrate_chains")] = True,
    voxel_size: Annotated[Optional[float], option_query(VideoOptions, "voxel_size")] = None,
) -> VideoOptions:
    """A FastAPI dependency with one query parameter per field of `video.VideoOptions` (written out, as
    `serving.call_options_query`'s) -> the VideoOptions; 422 for a bad value."""
    return options_of_query(VideoOptions, locals())


@dataclass
class ClipUpload:
    """A received clip: its file (in a temporary folder that `discard` removes), bytes, frame size and the frames
    it gives after the stride and max_frames, both as its header says (or, for the count, as counted when the
    header does not say), frame rate (None: unknown) and the time its body took to arrive. The header is only
    what the clip is admitted at: `ClipFrames` counts the frames as they are decoded."""

    path: Path
    nbytes: int
    size: tuple
    frames: int
    fps: Optional[float]
    read_ms: float

    def discard(self) -> None:
        shutil.rmtree(self.path.parent, ignore_errors=True)


_MOST_FRAMES = 1 << 31  # a frame count above this is not a count (OpenCV gives INT64_MIN for a raw stream)


def _header_count(capture: Any) -> Optional[int]:
    """The frame count the container states, or None when it states none that could be true."""
    import cv2

    count = capture.get(cv2.CAP_PROP_FRAME_COUNT)
    return int(count) if np.isfinite(count) and 0 < count < _MOST_FRAMES else None


def _too_many_frames(gives: str, limit: int, stride: int) -> ApiError:
    return ApiError(
        413,
        "too_many_frames",
        f"the clip gives {gives} (after stride={stride}); the limit is {limit} (--max-video-frames): send a "
        "shorter clip, or use stride / max_frames",
    )


def _check_frame_size(w: int, h: int, settings: ServerSettings) -> None:
    if w * h > settings.max_pixels:
        raise ApiError(
            413,
            "too_many_pixels",
            f"the clip's frames are {w}x{h} = {w * h} pixels; the limit is {settings.max_pixels} (--max-pixels)",
        )
    if w < MIN_IMAGE_SIDE or h < MIN_IMAGE_SIDE:
        minimum = f"{MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}"
        raise ApiError(422, "image_too_small", f"the clip's frames are {w}x{h}; the minimum is {minimum}")


def _inspect(path: Path, settings: ServerSettings, video: VideoOptions) -> tuple:
    """(size, frames after stride and max_frames, fps) from the file's header, or ApiError. The frames are counted
    (up to just past the limit) when the header gives no count that could be true, or fewer than 2."""
    import cv2

    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise ApiError(400, "bad_video", "the body is not a video that OpenCV's FFmpeg can read")
        w, h = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        fps = capture.get(cv2.CAP_PROP_FPS)
        _check_frame_size(w, h, settings)
        count = _header_count(capture)
        if count is None or count < 2 * video.stride:  # no count, or one too small to be trusted: count them
            count, limit = 0, (settings.max_video_frames + 1) * video.stride
            while count < limit and capture.grab():
                count += 1
    finally:
        capture.release()
    frames = (count + video.stride - 1) // video.stride
    if video.max_frames is not None:
        frames = min(frames, video.max_frames)
    if frames > settings.max_video_frames:
        raise _too_many_frames(f"{frames} frames", settings.max_video_frames, video.stride)
    if frames < 2:
        raise ApiError(
            422, "clip_too_short", f"the clip gives {frames} frame(s) (after the stride); at least 2 are needed"
        )
    return (w, h), frames, float(fps) if fps and np.isfinite(fps) and fps > 0 else None


async def receive_clip(
    request: Request, settings: ServerSettings, reserve: Callable[[int], None], video: VideoOptions
) -> ClipUpload:
    """Read a clip's body (a video file) and check it from its header, or raise ApiError (4xx)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    kind = media_type(request)
    if kind not in VIDEO_MEDIA_TYPES and not kind.startswith("video/"):
        got = f"Content-Type {kind!r}" if kind else "no Content-Type"
        raise ApiError(
            415, "unsupported_media_type", f"got {got}; send the video file as the body with a video/* Content-Type"
        )
    body = await read_body(request, settings, reserve)
    if not body:
        raise ApiError(400, "empty_body", "the clip is empty (0 bytes)")
    read_ms = (loop.time() - start) * 1e3
    folder = Path(tempfile.mkdtemp(prefix="tt_moge-clip-"))
    path = folder / "clip"
    try:
        path.write_bytes(body)
        del body
        size, frames, fps = await asyncio.to_thread(_inspect, path, settings, video)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return ClipUpload(path, path.stat().st_size, size, frames, fps, read_ms)


class ClipFrames:
    """An admitted clip's frames as they are really decoded, not as its header says: each is counted against
    --max-video-frames (413 too_many_frames) and its size against --max-pixels, and the clip's cost at the frames
    and size seen so far is taken from the request's reservation (413 clip_too_large when it could never fit the
    budget, 503 memory_full while it does not fit now), before the frame goes to the model. `check` runs on the
    stream's reader thread (`VideoStream(on_frame=...)`).

    Every frame's depth and mask are kept for the answer: in one block of the admitted frame count, and past it
    (a header that undercounted) one array per frame, joined once at the end; such frames are counted twice."""

    def __init__(
        self, upload: ClipUpload, stride: int, need: Callable[[int, int], int], reservation: Any, serving: Serving
    ):
        self.upload, self.stride, self.need, self.reservation, self.serving = upload, stride, need, reservation, serving
        self.size = upload.size
        self._depth: Optional[np.ndarray] = None
        self._mask: Optional[np.ndarray] = None
        self._extra: list = []

    def check(self, count: int, shape: tuple) -> None:
        h, w = shape
        settings, admitted = self.serving.settings, self.upload.frames
        if (w, h) != self.size:  # the header's size is not the frames': judge and count the frames'
            _check_frame_size(w, h, settings)
            self.size = (w, h)
        if count > settings.max_video_frames:
            gives = f"more than {settings.max_video_frames} frames as decoded (its header said {admitted})"
            raise _too_many_frames(gives, settings.max_video_frames, self.stride)
        frames = admitted if count <= admitted else admitted + 2 * (count - admitted)
        need = self.need(frames, w * h)
        if need > self.reservation.nbytes and not self.reservation.resize(need):
            raise self.serving.memory_full(f"the clip ({count} frames of {w}x{h} decoded so far)", need)

    def put(self, index: int, depth: np.ndarray, mask: np.ndarray) -> None:
        if index < self.upload.frames:
            if self._depth is None:
                self._depth = np.empty((self.upload.frames, *depth.shape), np.float32)
                self._mask = np.empty((self.upload.frames, *depth.shape), np.uint8)
            self._depth[index], self._mask[index] = depth, mask
        else:
            self._extra.append((index, depth.astype(np.float32, copy=True), mask.astype(np.uint8)))

    def arrays(self, n: int) -> tuple:
        """The (n, H, W) float32 depth and uint8 mask of the frames 0..n-1."""
        depth, mask = self._depth[: min(n, self.upload.frames)], self._mask[: min(n, self.upload.frames)]
        if self._extra:
            extra = sorted(self._extra, key=lambda item: item[0])[: n - len(depth)]
            depth = np.concatenate([depth, np.stack([d for _, d, _ in extra])])
            mask = np.concatenate([mask, np.stack([m for _, _, m in extra])])
            self._extra.clear()
        return depth, mask


async def predict_clip(
    serving: Serving, request: Request, call: CallOptions, video: VideoOptions, encode: Callable[..., Any]
) -> Prediction:
    """Receive and admit a clip, run it through `tt_moge.video` on a host thread, and `encode(result, depth,
    mask)` (the VideoOutput, (N, H, W) float32 depth and uint8 mask) there."""
    settings, model = serving.settings, serving.model
    cw, ch = getattr(model, "resolution", (0, 0))  # a stand-in model may have no canvas

    def need(upload: ClipUpload, frames: int, pixels: int) -> int:
        """The clip's cost at `frames` frames of `pixels` pixels, or 413 when it could never fit the budget."""
        cost = settings.clip_cost(frames, pixels, upload.nbytes, video.calibration_frames, cw * ch)
        if cost > settings.memory_budget_bytes:
            w, h = upload.size
            raise ApiError(
                413,
                "clip_too_large",
                f"the clip ({frames} frames of {pixels} pixels) needs {cost / 2**20:.0f} MiB; the server's memory "
                f"budget is {settings.memory_budget_bytes / 2**20:.0f} MiB (--memory-budget-mb): send fewer or "
                "smaller frames (stride, max_frames)",
            )
        return cost

    def job(upload: ClipUpload, timing: dict, reservation: Any) -> Any:
        started = time.perf_counter()
        frames = ClipFrames(upload, video.stride, lambda n, pixels: need(upload, n, pixels), reservation, serving)
        try:
            with VideoStream(model, upload.path, call, video, on_frame=frames.check) as stream:
                for frame in stream:
                    frames.put(frame.index, frame.output.depth, frame.output.mask)
                result = stream.result
        except InputError as exc:  # the message names the server's own file: say "the uploaded clip"
            detail = str(exc).replace(f"video file '{upload.path}'", "the uploaded clip")
            raise ApiError(400, "bad_video", detail) from None
        n = len(result)
        timing["video"] = (time.perf_counter() - started) * 1e3
        t = time.perf_counter()
        payload = encode(result, *frames.arrays(n))
        timing["encode"] = (time.perf_counter() - t) * 1e3
        return payload

    return await serving.serve(
        lambda reserve: receive_clip(request, settings, reserve, video),
        lambda upload: need(upload, upload.frames, upload.size[0] * upload.size[1]),
        job,
        ClipUpload.discard,
    )


def clip_npz_arrays(result: Any, depth: np.ndarray, mask: np.ndarray) -> dict:
    """The arrays of a clip's npz (VIDEO_NPZ_LAYOUT): the result's and every frame's depth and mask."""
    return {**result.npz_arrays(), "depth": depth, "mask": mask}


_VIDEO_BODY = {
    "requestBody": {
        "required": True,
        "description": "The video file as the body (mp4, mov, mkv, webm, avi: what OpenCV's FFmpeg reads), with a "
        "video/* (or application/octet-stream) Content-Type. Not a path: the server never opens files a client "
        "names.",
        "content": {kind: {"schema": {"type": "string", "format": "binary"}} for kind in ("video/mp4",)},
    }
}


def add_video_routes(app: FastAPI, serving: Serving, responses: dict) -> None:
    """POST /predict/video (npz) and /predict/video/summary (JSON) on `app` (see the module docstring)."""
    call_query, video_query = call_options_query, video_options_query
    names = (*CALL_OPTION_NAMES, *VIDEO_OPTION_NAMES)
    layout = ", ".join(f"{k} {dt} {shape}" for k, (dt, shape, _) in VIDEO_NPZ_LAYOUT.items())

    @app.post(
        "/predict/video",
        dependencies=[Depends(serving.authorize)],
        openapi_extra=_VIDEO_BODY,
        response_class=Response,
        summary="Predict a clip: video in, npz of the clip out (intrinsics, poses, scales, depth and mask per frame)",
        responses={200: npz_response(f"The clip's npz: {layout}"), **responses},
    )
    async def predict_video(
        request: Request,
        options: CallOptions = Depends(call_query),
        video: VideoOptions = Depends(video_query),
        deflate: bool = Depends(deflate_query),
    ) -> Response:
        check_query(request, (*names, COMPRESS_QUERY))
        done = await predict_clip(
            serving, request, options, video, lambda r, d, m: npz_parts(clip_npz_arrays(r, d, m), compress=deflate)
        )
        return serving.answer(done.payload, NPZ_MEDIA_TYPE, timing_headers(done.timing), done.ticket)

    @app.post(
        "/predict/video/summary",
        dependencies=[Depends(serving.authorize)],
        openapi_extra=_VIDEO_BODY,
        response_class=Response,
        summary="Predict a clip: video in, its summary out (intrinsics, poses, per-frame scales and registration)",
        responses={
            200: json_response(
                "VideoOutput.summary(): size, frames, intrinsics, per-frame poses, scales and registration flags "
                "(poses), calibration, timing_ms"
            ),
            **responses,
        },
    )
    async def predict_video_summary(
        request: Request,
        options: CallOptions = Depends(call_query),
        video: VideoOptions = Depends(video_query),
    ) -> Response:
        check_query(request, names)
        done = await predict_clip(serving, request, options, video, lambda r, d, m: r.summary())
        return serving.answer_json({**done.payload, "timing_ms": done.timing}, done.timing, done.ticket)


# ------------------------------------------------------------------------------------------- the web page
PAGE_VIEW_POINTS = 200_000  # points of the page's 3D scene at most (the cloud thinned evenly)
CLIP_FILES = {
    "view.glb": "model/gltf-binary",
    "scene.glb": "model/gltf-binary",
    "scene.ply": "application/octet-stream",
    "poses.json": "application/json",
    "trajectory.txt": "text/plain",
    "clip.npz": NPZ_MEDIA_TYPE,
}


def make_clip_page_result(result: Any, depth: np.ndarray, mask: np.ndarray, store: Any) -> dict:
    """On the request's host thread: the page's files of one clip, stored (`ui.ResultStore`) -> its record."""
    from ..npzio import npz_bytes
    from ..video.files import scene_files

    entry = store.create()
    try:
        files = scene_files(result)
        view = scene_files(result, max_points=PAGE_VIEW_POINTS)["scene.glb"]
        files.update({"view.glb": view, "clip.npz": npz_bytes(clip_npz_arrays(result, depth, mask), compress=True)})
        for name, data in files.items():
            (entry.path / name).write_bytes(data)
        store.added(entry, *(entry.path / name for name in files))
    except BaseException:
        store.drop(entry)
        raise
    finally:
        store.release(entry)
    base = f"/ui/clips/{entry.rid}/"
    ahead = result.cloud_points[:, 2][result.cloud_points[:, 2] > 0]  # the world is the first camera's
    first = float(np.median(ahead)) if ahead.size else None
    return {
        "id": entry.rid,
        "kind": "video",
        "summary": result.summary(),
        "view": {
            "url": base + "view.glb",
            "points": int(min(len(result.cloud_points), PAGE_VIEW_POINTS)),
            "cameras": int(result.in_main_chain.sum()),
            "distance": first,
        },
        "downloads": {name: base + name for name in CLIP_FILES if name != "view.glb"},
    }


def add_video_page(router: Any, serving: Serving, store: Any) -> None:
    """The web page's clip routes on its router (`ui.mount_ui`): POST /ui/api/predict_video (as POST
    /predict/video/summary, plus the stored files' URLs) and GET /ui/clips/<id>/<file> (CLIP_FILES)."""
    call_query, video_query = call_options_query, video_options_query
    names = (*CALL_OPTION_NAMES, *VIDEO_OPTION_NAMES)

    @router.post("/ui/api/predict_video", dependencies=[Depends(serving.authorize)])
    async def predict_video_page(
        request: Request, options: CallOptions = Depends(call_query), video: VideoOptions = Depends(video_query)
    ) -> Response:
        check_query(request, names)
        done = await predict_clip(
            serving, request, options, video, lambda r, d, m: make_clip_page_result(r, d, m, store)
        )
        record = done.payload
        record["summary"]["timing_ms"] = done.timing
        return serving.answer_json(record, done.timing, done.ticket)

    @router.get("/ui/clips/{rid}/{name}")
    async def clip_file(rid: str, name: str) -> Response:
        if name not in CLIP_FILES:
            raise ApiError(404, "not_found", f"no clip file {name!r}; expected one of {sorted(CLIP_FILES)}")
        entry = store.acquire(rid)
        try:
            path = entry.path / name
            if not path.exists():
                raise ApiError(404, "not_found", f"this result has no {name}")
            headers = {"Cache-Control": "private, max-age=3600"}
            if name != "view.glb":
                headers["Content-Disposition"] = f'attachment; filename="{name}"'
            return Response(path.read_bytes(), media_type=CLIP_FILES[name], headers=headers)
        finally:
            store.release(entry)
