"""POST /predict/video and /predict/video/summary: a short clip in, the clip's arrays (npz) or its summary (JSON) out.

    curl --data-binary @walk.mp4 -H 'Content-Type: video/mp4' 'http://127.0.0.1:8000/predict/video?stride=2' -o walk.npz

The body is the video file itself (any container OpenCV's FFmpeg reads; Content-Type video/* or
application/octet-stream). The query parameters are the call options (`host.CallOptions`) and the clip options
(`video.VideoOptions`), both generated. The work is `tt_moge.video` on the server's model, the same as
`model.predict_video(<the same bytes>, <the same options>)`.

Limits, checked before the clip is admitted (from the file's header: size, frame count): the body
(max_body_bytes, 413), each frame's pixels (max_pixels, 413), the frames after stride and max_frames
(max_video_frames, 413; fewer than 2: 422), and its memory (`ServerSettings.clip_cost`: 413 when it could never
fit the budget, 503 + Retry-After while other requests hold it). A clip takes one queue slot. The npz holds
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
from typing import Any, Callable, Optional

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from ..constants import MIN_IMAGE_SIDE
from ..fields import options_of
from ..host import CallOptions, InputError
from ..npzio import npz_parts
from ..video import VideoOptions, VideoStream
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
    options_query,
    timing_headers,
)
from .settings import ServerSettings
from .upload import media_type, read_body

__all__ = ["VIDEO_MEDIA_TYPES", "VIDEO_OPTION_NAMES", "ClipUpload", "receive_clip", "predict_clip", "add_video_routes"]

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


@dataclass
class ClipUpload:
    """A received clip: its file (in a temporary folder that `discard` removes), bytes, frame size, the frames it
    gives after the stride and max_frames, frame rate (None: unknown) and the time its body took to arrive."""

    path: Path
    nbytes: int
    size: tuple
    frames: int
    fps: Optional[float]
    read_ms: float

    def discard(self) -> None:
        shutil.rmtree(self.path.parent, ignore_errors=True)


def _inspect(path: Path, settings: ServerSettings, video: VideoOptions) -> tuple:
    """(size, frames after stride and max_frames, fps) from the file's header (frames counted when it does not
    say), or ApiError."""
    import cv2

    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise ApiError(400, "bad_video", "the body is not a video that OpenCV's FFmpeg can read")
        w, h = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        fps = capture.get(cv2.CAP_PROP_FPS)
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        if w * h > settings.max_pixels:
            raise ApiError(
                413,
                "too_many_pixels",
                f"the clip's frames are {w}x{h} = {w * h} pixels; the limit is {settings.max_pixels} (--max-pixels)",
            )
        if w < MIN_IMAGE_SIDE or h < MIN_IMAGE_SIDE:
            minimum = f"{MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}"
            raise ApiError(422, "image_too_small", f"the clip's frames are {w}x{h}; the minimum is {minimum}")
        if count <= 0:  # the container does not say: count (stop once past the limit)
            limit = (settings.max_video_frames + 1) * video.stride
            while count < limit and capture.grab():
                count += 1
    finally:
        capture.release()
    frames = (count + video.stride - 1) // video.stride
    if video.max_frames is not None:
        frames = min(frames, video.max_frames)
    if frames > settings.max_video_frames:
        raise ApiError(
            413,
            "too_many_frames",
            f"the clip gives {frames} frames (after stride={video.stride}); the limit is {settings.max_video_frames} "
            "(--max-video-frames): send a shorter clip, or use stride / max_frames",
        )
    if frames < 2:
        raise ApiError(
            422, "clip_too_short", f"the clip gives {frames} frame(s) (after the stride); at least 2 are needed"
        )
    return (w, h), frames, float(fps) if fps and fps > 0 else None


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


async def predict_clip(
    serving: Serving, request: Request, call: CallOptions, video: VideoOptions, encode: Callable[..., Any]
) -> Prediction:
    """Receive and admit a clip, run it through `tt_moge.video` on a host thread, and `encode(result, depth,
    mask)` (the VideoOutput, (N, H, W) float32 depth and uint8 mask) there."""
    settings, model = serving.settings, serving.model

    def cost(upload: ClipUpload) -> int:
        w, h = upload.size
        cw, ch = getattr(model, "resolution", (0, 0))  # a stand-in model may have no canvas
        need = settings.clip_cost(upload.frames, w * h, upload.nbytes, video.calibration_frames, cw * ch)
        if need > settings.memory_budget_bytes:
            raise ApiError(
                413,
                "clip_too_large",
                f"the clip ({upload.frames} frames of {w}x{h}) needs {need / 2**20:.0f} MiB; the server's memory "
                f"budget is {settings.memory_budget_bytes / 2**20:.0f} MiB (--memory-budget-mb): send fewer or "
                "smaller frames (stride, max_frames)",
            )
        return need

    def job(upload: ClipUpload, timing: dict) -> Any:
        started = time.perf_counter()
        try:
            w, h = upload.size
            depth = np.empty((upload.frames, h, w), np.float32)
            mask = np.empty((upload.frames, h, w), np.uint8)
            with VideoStream(model, upload.path, call, video) as stream:
                for frame in stream:
                    if frame.index >= len(depth):  # the header undercounted: grow (rare)
                        depth = np.concatenate([depth, np.empty_like(depth[:1])])
                        mask = np.concatenate([mask, np.empty_like(mask[:1])])
                    depth[frame.index] = frame.output.depth
                    mask[frame.index] = frame.output.mask
                result = stream.result
        except InputError as exc:
            raise ApiError(400, "bad_video", str(exc)) from None
        n = len(result)
        timing["video"] = (time.perf_counter() - started) * 1e3
        t = time.perf_counter()
        payload = encode(result, depth[:n], mask[:n])
        timing["encode"] = (time.perf_counter() - t) * 1e3
        return payload

    return await serving.serve(
        lambda reserve: receive_clip(request, settings, reserve, video), cost, job, ClipUpload.discard
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
    call_query, video_query = call_options_query(), options_query(VideoOptions)
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
    call_query, video_query = call_options_query(), options_query(VideoOptions)
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
