"""The frames of a clip, from whatever holds them: a video file, a folder of frames, encoded video bytes, a 4-D
array, or a list or any iterable of images.

* A video file: whatever OpenCV's bundled FFmpeg reads (mp4, mov, mkv, webm, avi, ...), decoded frame by frame
  (frames skipped by the stride are only grabbed, not decoded). Its frame rate gives the frames' times.
* A folder: its PNG and JPEG files in name order, numbers compared as numbers (frame2 before frame10).
* Bytes: the content of a video file (the server's upload); written to a temporary file that `close` removes.
* An (N, H, W, 3) array, a list, or any iterable (a generator): each item is an image as `model(...)` takes it.

Frames come out as (index in the source, (H, W, 3) uint8 RGB). Nothing is read before iteration, and only one
frame at a time, so an hour-long video streams. An unreadable or empty source is a ValueError naming `source`.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from ..host import ImageNotFoundError, InputError, to_rgb_array

__all__ = ["VIDEO_SUFFIXES", "FRAME_SUFFIXES", "FrameSource", "open_source", "is_video_file", "frame_files"]

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv", ".ts")
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")


def is_video_file(path: Any) -> bool:
    """A path whose suffix is a video container's (VIDEO_SUFFIXES)."""
    return isinstance(path, (str, os.PathLike)) and Path(path).suffix.lower() in VIDEO_SUFFIXES


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def frame_files(folder: Path) -> list:
    """The PNG and JPEG files of a folder (not its sub-folders), in name order with numbers as numbers."""
    files = [p for p in Path(folder).iterdir() if p.is_file() and p.suffix.lower() in FRAME_SUFFIXES]
    return sorted(files, key=lambda p: _natural(p.name))


def _uint8(rgb: np.ndarray) -> np.ndarray:
    if rgb.dtype == np.uint8:
        return rgb
    from ..host.decode import float_to_uint8

    return float_to_uint8(rgb)


class FrameSource:
    """An iterable of (source index, RGB uint8 frame), every `stride`-th frame, at most `max_frames` of them.
    `name` (for an output folder), `fps` (None when unknown) and `count` (frames the source says it holds
    before the stride; None when unknown) describe it. `close()` releases the file (and a temporary copy)."""

    def __init__(
        self,
        kind: str,
        target: Any,
        name: str,
        *,
        stride: int = 1,
        max_frames: Optional[int] = None,
        described: Optional[str] = None,
    ):
        self.kind, self.target, self.name = kind, target, name
        self.described = described  # what errors call it (default: the video file's path, or `name`)
        self.stride, self.max_frames = stride, max_frames
        self.fps: Optional[float] = None
        self.count: Optional[int] = None
        self._capture = None
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        if kind == "video":
            self._open_capture()
        elif kind == "files":
            self.count = len(target)
        elif kind == "array":
            self.count = len(target)
        elif kind == "list":
            self.count = len(target) if hasattr(target, "__len__") else None

    def _open_capture(self) -> None:
        import cv2

        capture = cv2.VideoCapture(os.fspath(self.target))
        if not capture.isOpened():
            capture.release()
            raise InputError(f"source: OpenCV's FFmpeg cannot read {self.label()} as a video")
        self._capture = capture
        fps = capture.get(cv2.CAP_PROP_FPS)
        self.fps = float(fps) if fps and np.isfinite(fps) and fps > 0 else None
        count = capture.get(cv2.CAP_PROP_FRAME_COUNT)
        self.count = int(count) if count and np.isfinite(count) and count > 0 else None

    def label(self) -> str:
        if self.described is not None:
            return self.described
        return f"video file '{self.target}'" if self.kind == "video" else self.name

    @property
    def expected(self) -> Optional[int]:
        """How many frames iteration yields, when the source says how many it holds (else None)."""
        if self.count is None:
            return None
        n = (self.count + self.stride - 1) // self.stride
        return n if self.max_frames is None else min(n, self.max_frames)

    def __iter__(self) -> Iterator[tuple]:
        kept = 0
        for index, frame in self._frames():
            if self.max_frames is not None and kept >= self.max_frames:
                break
            kept += 1
            yield index, frame

    def _frames(self) -> Iterator[tuple]:
        if self.kind == "video":
            yield from self._video_frames()
            return
        items = self.target
        for index, item in enumerate(items):
            if index % self.stride:
                continue
            name = str(item) if self.kind == "files" else f"source[{index}]"
            yield index, _uint8(to_rgb_array(item, name))

    def _video_frames(self) -> Iterator[tuple]:
        import cv2

        capture, index = self._capture, 0
        while True:
            if index % self.stride:
                if not capture.grab():
                    return
            else:
                ok, bgr = capture.read()
                if not ok:
                    return
                if bgr.ndim == 2:
                    bgr = cv2.cvtColor(bgr, cv2.COLOR_GRAY2BGR)
                yield index, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            index += 1

    def close(self) -> None:
        if self._capture is not None:
            self._capture.release()
            self._capture = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "FrameSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_source(source: Any, *, stride: int = 1, max_frames: Optional[int] = None) -> FrameSource:
    """A FrameSource for a video file, a folder of frames, video bytes, an (N, H, W, 3) array or an iterable of
    images (see the module doc). Errors name `source` and say what was expected."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            files = frame_files(path)
            if not files:
                raise InputError(f"source: the folder '{path}' holds no PNG or JPEG frames")
            return FrameSource("files", files, path.resolve().name or "clip", stride=stride, max_frames=max_frames)
        if not path.exists():
            raise ImageNotFoundError(f"source: no such file or folder: '{path}'")
        if path.suffix.lower() in FRAME_SUFFIXES:
            raise InputError(
                f"source: '{path}' is one image; a clip is a video file, a folder of frames or a list of images"
            )
        return FrameSource("video", path, path.stem or "clip", stride=stride, max_frames=max_frames)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if not len(source):
            raise InputError("source: empty video bytes")
        tmp = tempfile.TemporaryDirectory(prefix="tt_moge-video-")
        path = Path(tmp.name) / "upload.video"
        path.write_bytes(bytes(source))
        try:
            # errors name "the video bytes": the temporary file is nothing the caller knows of
            frames = FrameSource(
                "video", path, "clip", stride=stride, max_frames=max_frames, described="the clip in the video bytes"
            )
        except BaseException:
            tmp.cleanup()
            raise
        frames._tmp = tmp
        return frames
    if isinstance(source, np.ndarray):
        if source.ndim != 4:
            raise InputError(f"source: an array of frames must be (N, H, W, 3), got shape {source.shape}")
        return FrameSource("array", source, "clip", stride=stride, max_frames=max_frames)
    if isinstance(source, dict) or not hasattr(source, "__iter__"):
        raise InputError(
            "source: expected a video file, a folder of frames, video bytes, an (N, H, W, 3) array or a list of "
            f"images, got {type(source).__name__}"
        )
    return FrameSource("list", source, "clip", stride=stride, max_frames=max_frames)
