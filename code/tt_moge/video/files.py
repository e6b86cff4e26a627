"""The folder of a clip, written as its frames come (`ClipWriter`): what `tt-moge predict clip.mp4`, batch jobs and
`VideoOutput.save` write.

    OUT/clip/frames/000000/...   each frame's files, as for a photo (`export.write_outputs`; the format groups
                                 chosen, VIDEO_FRAME_FORMATS by default) and its result.json (+ frame, time,
                                 pose, scales, registration)
    OUT/clip/depth.mp4           the depth of every frame in one colour range (the calibration's 1st-99th
                                 percentile, inverse depth in turbo as depth.png, with its colour bar), so a
                                 colour means one distance across frames
    OUT/clip/poses.json          per frame: pose (camera-to-world, metres), scales, intrinsics, registration
    OUT/clip/trajectory.txt      the registered frames' poses, TUM format (time tx ty tz qx qy qz qw)
    OUT/clip/scene.ply           the fused cloud (xyz, RGB) with the camera path as edges between its positions
    OUT/clip/scene.glb           the fused cloud, the camera path and a frustum per camera (a sample of them)
    (after a cut: trajectory.txt and the scenes are the main chain's, `VideoOutput.main_chain`; poses.json holds
    every chain, each frame with its chain)
    OUT/clip/result.json         the clip's summary (`VideoOutput.summary`) and the files; written last

3D files use glTF / OpenGL axes as the photo exports do: the first camera at the origin looking down -z, y up.
Per-frame files are written by `writers` threads (at most 2 x writers frames wait, so finished maps do not pile up
in memory); depth.mp4 by one thread, in frame order.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from ..export import (
    DEFAULT_MESH_STEP,
    RESULT_FILE,
    check_formats,
    colorize_depth,
    remove_outputs,
    to_json,
    write_outputs,
    write_text_atomic,
)

__all__ = [
    "ClipWriter",
    "VIDEO_FRAME_FORMATS",
    "FRAMES_FOLDER",
    "frame_folder",
    "scene_ply_bytes",
    "scene_glb_bytes",
    "scene_files",
]

VIDEO_FRAME_FORMATS = ("maps",)  # per-frame files by default: light (no per-frame mesh; scene.glb is the clip's 3D)
FRAMES_FOLDER = "frames"
_OPENGL = np.array([1.0, -1.0, -1.0])
_PATH_COLOUR = (255, 40, 40)
_FRUSTA = 40  # frusta drawn in scene.glb at most (evenly over the registered frames)


def frame_folder(index: int) -> str:
    """The per-frame folder of clip frame `index`, relative to the clip's folder."""
    return f"{FRAMES_FOLDER}/{index:06d}"


def scene_ply_bytes(points: np.ndarray, colours: np.ndarray, path: np.ndarray) -> bytes:
    """A binary PLY: the cloud's vertices (float32 xyz, uint8 RGB), then the camera positions `path` (K, 3) as
    vertices in _PATH_COLOUR joined by K - 1 edges (written here: trimesh's PLY export has no edge element).
    All in OpenGL axes already."""
    n, k = len(points), len(path)
    vertex = np.zeros(
        n + k, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")]
    )
    xyz = np.concatenate([points.reshape(-1, 3), path.reshape(-1, 3)]).astype(np.float32)
    rgb = np.concatenate([colours.reshape(-1, 3), np.tile(np.array(_PATH_COLOUR, np.uint8), (k, 1))])
    for i, name in enumerate(("x", "y", "z")):
        vertex[name] = xyz[:, i]
    for i, name in enumerate(("red", "green", "blue")):
        vertex[name] = rgb[:, i]
    edges = np.zeros(max(k - 1, 0), dtype=[("vertex1", "<i4"), ("vertex2", "<i4")])
    edges["vertex1"] = np.arange(n, n + max(k - 1, 0))
    edges["vertex2"] = edges["vertex1"] + 1
    header = (
        "ply\nformat binary_little_endian 1.0\ncomment tt_moge fused cloud + camera path, OpenGL axes, metres\n"
        f"element vertex {n + k}\nproperty float x\nproperty float y\nproperty float z\n"
        "property uchar red\nproperty uchar green\nproperty uchar blue\n"
        f"element edge {len(edges)}\nproperty int vertex1\nproperty int vertex2\nend_header\n"
    )
    return header.encode("ascii") + vertex.tobytes() + edges.tobytes()


def scene_glb_bytes(points: np.ndarray, colours: np.ndarray, poses: np.ndarray, frustum: float) -> bytes:
    """A GLB: the cloud (POINTS), the camera path and the frusta of up to _FRUSTA cameras (LINES), OpenGL axes."""
    import trimesh

    geometry = []
    if len(points):
        alpha = np.full((len(colours), 1), 255, np.uint8)
        geometry.append(trimesh.PointCloud(points, colors=np.concatenate([colours, alpha], axis=1)))
    segments = []
    centres = poses[:, :3, 3] * _OPENGL
    segments += [np.stack([centres[i], centres[i + 1]]) for i in range(len(centres) - 1)]
    corners = np.array([[-1, -0.75, 1.5], [1, -0.75, 1.5], [1, 0.75, 1.5], [-1, 0.75, 1.5]]) * frustum  # OpenCV
    for i in np.unique(np.linspace(0, len(poses) - 1, min(_FRUSTA, len(poses))).astype(int)) if len(poses) else []:
        world = (corners @ poses[i, :3, :3].T + poses[i, :3, 3]) * _OPENGL
        segments += [np.stack([centres[i], c]) for c in world]
        segments += [np.stack([world[j], world[(j + 1) % 4]]) for j in range(4)]
    if segments:
        path = trimesh.load_path(np.array(segments))
        path.colors = np.tile(np.array([*_PATH_COLOUR, 255], np.uint8), (len(path.entities), 1))
        geometry.append(path)
    return trimesh.Scene(geometry).export(file_type="glb")


def scene_files(result: Any, max_points: Optional[int] = None) -> dict:
    """{name: bytes} of a clip's poses.json, trajectory.txt, scene.ply and scene.glb (`max_points`: the cloud
    thinned to at most that many points, evenly, as the web page's view does)."""
    poses = result.poses[result.in_main_chain]  # the cloud's chain
    points, colours = result.cloud_points.astype(np.float64) * _OPENGL, result.cloud_colors
    if max_points is not None and len(points) > max_points:
        keep = np.linspace(0, len(points) - 1, max_points).astype(int)
        points, colours = points[keep], colours[keep]
    depth = np.nanmedian(-points[:, 2]) if len(points) else 1.0
    frustum = 0.05 * float(depth) if math.isfinite(depth) and depth > 0 else 0.1
    path = poses[:, :3, 3] * _OPENGL if len(poses) else np.zeros((0, 3))
    return {
        "poses.json": (json.dumps({"frames": result.records}, indent=1) + "\n").encode(),
        "trajectory.txt": result.trajectory_tum().encode(),
        "scene.ply": scene_ply_bytes(points, colours, path),
        "scene.glb": scene_glb_bytes(points, colours, poses, frustum),
    }


class ClipWriter:
    """Writes one clip's folder (see the module docstring) from frames given in order with `add`, then `finish`.
    A failure removes nothing already written but leaves no result.json (its presence marks a complete clip)."""

    def __init__(
        self,
        folder: Any,
        formats: Optional[Iterable[str]] = None,
        *,
        mesh_step: Optional[int] = None,
        fps: Optional[float] = None,
        writers: int = 2,
        depth_video: bool = True,
    ):
        self.folder = Path(folder)
        self.formats = check_formats(VIDEO_FRAME_FORMATS if formats is None else formats)
        self.mesh_step = DEFAULT_MESH_STEP if mesh_step is None else mesh_step
        self.fps = fps
        self.depth_video = depth_video
        self._created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]  # deepest first
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            (self.folder / RESULT_FILE).unlink()
        except FileNotFoundError:
            pass
        self._written: list = []  # what this writer has made in the folder: frame folders, clip files
        self._pool = ThreadPoolExecutor(writers, thread_name_prefix="tt_moge-video-write")
        self._video_pool = ThreadPoolExecutor(1, thread_name_prefix="tt_moge-video-mp4")
        self._pending: list = []
        self._limit = 2 * writers
        self._video: Any = None
        self._video_size: Optional[tuple] = None
        self.frames = 0

    def add(self, index: int, output: Any, rgb: np.ndarray, record: dict, depth_range: tuple) -> None:
        """Frame `index`'s files (its folder under frames/, in writer threads) and its depth.mp4 frame."""
        self._written.append(self.folder / frame_folder(index))
        self._pending.append(
            self._pool.submit(
                write_outputs,
                output,
                rgb,
                self.folder / frame_folder(index),
                self.formats,
                source=f"frame {record.get('source_frame', index)}",
                extra={"video": record},
                mesh_step=self.mesh_step,
            )
        )
        if self.depth_video:
            self._pending.append(self._video_pool.submit(self._depth_frame, output.depth, output.mask, depth_range))
        self.frames += 1
        self._collect(self._limit)

    def _collect(self, limit: int) -> None:
        while len(self._pending) > limit:
            future: Future = self._pending.pop(0)
            future.result()  # raises a writer's error here

    def _depth_frame(self, depth: np.ndarray, mask: np.ndarray, depth_range: tuple) -> None:
        import cv2

        known = None if not all(math.isfinite(v) and v > 0 for v in depth_range) else depth_range
        picture, _ = colorize_depth(depth, mask, known)
        h, w = picture.shape[:2]
        if self._video is None:
            size = (w + w % 2, h + h % 2)  # the codec wants even sides
            fps = self.fps if self.fps and self.fps > 0 else 10.0
            self._written.append(self.folder / "depth.mp4")
            self._video = cv2.VideoWriter(
                os.fspath(self.folder / "depth.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), fps, size
            )
            if not self._video.isOpened():
                raise OSError(f"could not open {self.folder / 'depth.mp4'} for writing (OpenCV's FFmpeg, mp4v)")
            self._video_size = size
        frame = np.zeros((self._video_size[1], self._video_size[0], 3), np.uint8)
        frame[:h, :w] = picture[..., ::-1]
        self._video.write(frame)

    def finish(self, result: Any) -> dict:
        """After the last frame: the clip files and result.json (last). Returns the result.json record."""
        self._collect(0)
        self._close_video()
        self._shutdown()
        written = [f for f in ("depth.mp4",) if self.depth_video and (self.folder / f).exists()]
        for name, data in scene_files(result).items():
            self._written.append(self.folder / name)
            if name.endswith((".json", ".txt")):
                write_text_atomic(self.folder / name, data.decode())
            else:
                (self.folder / name).write_bytes(data)
            written.append(name)
        record = {
            **result.summary(),
            "frame_files": list(self.formats),
            "frames_folder": FRAMES_FOLDER,
            "files": written + [RESULT_FILE],
        }
        record.pop("poses", None)  # they are in poses.json
        write_text_atomic(self.folder / RESULT_FILE, to_json(record))
        return record

    def _close_video(self) -> None:
        self._video_pool.shutdown(wait=True)
        if self._video is not None:
            self._video.release()
            self._video = None

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def abort(self, remove: bool = False) -> None:
        """Stop writing (after an error): wait for the writer threads, close depth.mp4. `remove`: also remove
        what this writer wrote (frame folders, depth.mp4, clip files), then the clip's folder and the parents it
        created when they are left empty: a failed clip leaves no folder (an earlier run's other files stay)."""
        for future in self._pending:
            future.cancel()
        self._pending = []
        self._shutdown()
        self._close_video()
        if not remove:
            return
        for path in self._written:
            if path.is_dir():
                remove_outputs(path, self.folder)  # a frame's folder, and frames/ once it is empty
            else:
                try:
                    path.unlink()
                except OSError:
                    pass
        for folder in [self.folder] + [p for p in self._created if p != self.folder]:  # then the parents it made
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
