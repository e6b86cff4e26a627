"""Video and photo sequences: one camera, one metric scale, a trajectory and a fused scene (docs/video.md).

    from tt_moge.video import predict_video
    clip = predict_video(model, "walk.mp4")          # or model.predict_video("walk.mp4")
    clip.poses, clip.scale, clip.frames[0].depth, clip.cloud_points
    clip.save("out/walk")

`predict_video` keeps every frame's output; `iter_video` streams them (`VideoStream`). The modules: `source`
(frames from files, folders, bytes, arrays, iterables), `options` (VideoOptions), `calibrate` (the clip's
intrinsics and metric level), `registration` (features, 3D lifting, the robust fit), `fusion` (the voxel cloud),
`predict` (the pipeline), `output` (VideoFrame, VideoOutput), `files` (the clip's folder).
"""

from .options import VideoOptions
from .output import VideoFrame, VideoOutput
from .predict import DEFAULT_CHUNK, VideoStream, iter_video, predict_video, split_options
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
    "split_options",
]
