"""Video and photo sequences: one camera, one metric scale, a trajectory and a fused scene (docs/video.md).

    from tt_moge.video import predict_video
    clip = predict_video(model, "walk.mp4")          # or model.predict_video("walk.mp4")
    clip.poses, clip.scale, clip.frames[0].depth, clip.cloud_points
    clip.save("out/walk")

`predict_video` keeps every frame's output; `iter_video` streams them (`VideoStream`). The modules: `source`
(frames from files, folders, bytes, arrays, iterables), `options` (VideoOptions), `calibrate` (the clip's
intrinsics and metric level), `registration` (features, 3D lifting, the robust fit), `fusion` (the voxel cloud),
`predict` (the pipeline), `output` (VideoFrame, VideoOutput), `files` (the clip's folder). The pipeline's names
are imported on first use: the options and the sources import without torch (the command line's flags).
"""

from __future__ import annotations

from typing import Any

from .options import VideoOptions
from .source import VIDEO_SUFFIXES, is_video_file, open_source

__all__ = [
    "DEFAULT_CHUNK",
    "VIDEO_SUFFIXES",
    "VideoFrame",
    "VideoOptions",
    "VideoOutput",
    "VideoStream",
    "is_video_file",
    "iter_video",
    "open_source",
    "predict_video",
]

_LAZY = {
    "VideoFrame": "output",
    "VideoOutput": "output",
    "DEFAULT_CHUNK": "predict",
    "VideoStream": "predict",
    "iter_video": "predict",
    "predict_video": "predict",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
