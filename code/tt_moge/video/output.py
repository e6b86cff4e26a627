"""What a clip gives: `VideoFrame` (one frame, as the stream yields it) and `VideoOutput` (the whole clip).

Poses are camera-to-world 4x4 rigid transforms in metres; the world is the first frame's camera (OpenCV axes:
x right, y down, z forward), so the first pose is the identity. A frame whose registration failed has a pose of
NaN and `registered` False; it is left out of the trajectory and of the fused cloud, and `failures` says why.
After a cut (frames in a row that fail: `VideoOptions.new_chain_after`) a new chain starts: `chain[i]` numbers
the chain of frame i, and each chain's poses are in its own world, its first frame's camera (identity). The
trajectory, the fused cloud and the 3D files are the main chain's (`main_chain`: the one with the most
registered frames); the per-frame arrays and poses.json hold every chain.
`scale[i]` is the metric scale applied to frame i (its `MoGeOutput.metric_scale`: depth = scale x the network's
affine depth), `model_scale[i]` the one the model predicted for it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..output import finite_or_none

__all__ = ["VideoFrame", "VideoOutput", "VIDEO_NPZ_LAYOUT", "rotation_to_quaternion"]

# The npz layout of a clip (VideoOutput.npz_arrays: the server's /predict/video, `save(..., npz=True)`).
VIDEO_NPZ_LAYOUT: dict = {
    "intrinsics": ("float32", "(3, 3)", "the clip's normalised intrinsics (fx, cx by width; fy, cy by height)"),
    "intrinsics_pixels": ("float32", "(3, 3)", "the same in pixels"),
    "frame_intrinsics": ("float32", "(N, 3, 3)", "each frame's normalised intrinsics (differ only with window)"),
    "frame_intrinsics_pixels": ("float32", "(N, 3, 3)", "the same in pixels"),
    "poses": ("float64", "(N, 4, 4)", "camera-to-world, metres, in its chain's world; NaN where registration failed"),
    "chain": ("int32", "(N,)", "the chain of each frame (0, then one more after each cut)"),
    "scale": ("float64", "(N,)", "the metric scale applied to each frame"),
    "model_scale": ("float64", "(N,)", "the metric scale the model predicted for each frame alone"),
    "registered": ("uint8", "(N,)", "1 = the frame's registration passed its checks"),
    "inliers": ("int32", "(N,)", "the registration's inlier matches"),
    "times": ("float64", "(N,)", "seconds from the source's start (frame numbers when it has no frame rate)"),
    "source_frames": ("int64", "(N,)", "each frame's index in the source"),
    "cloud_points": ("float32", "(M, 3)", "the fused cloud of the main chain, its world's metres"),
    "cloud_colors": ("uint8", "(M, 3)", "its RGB colours"),
    "depth": ("float32", "(N, H, W)", "each frame's depth, metres (only when the frames are kept)"),
    "mask": ("uint8", "(N, H, W)", "each frame's mask (only when the frames are kept)"),
}


def rotation_to_quaternion(rotation: np.ndarray) -> np.ndarray:
    """(qx, qy, qz, qw) of a 3x3 rotation (scipy), as TUM trajectories write it."""
    from scipy.spatial.transform import Rotation

    return Rotation.from_matrix(rotation).as_quat()


@dataclass
class VideoFrame:
    """One frame of a clip, as `iter_video` yields it: index in the clip and in the source, time (seconds; the
    frame number when the source has no frame rate), the RGB image, its consistent MoGeOutput, pose, applied and
    model metric scale, registration (`registration.Registration`), the clip's depth colour range and the
    frame's chain (0, then one more after each cut; its pose is in that chain's world)."""

    index: int
    source_index: int
    time: float
    image: np.ndarray
    output: Any
    pose: np.ndarray
    scale: float
    model_scale: float
    registration: Any
    depth_range: tuple
    chain: int = 0

    @property
    def registered(self) -> bool:
        return bool(self.registration.ok)

    def record(self) -> dict:
        """The JSON-ready numbers of this frame (poses.json, the frame's result.json)."""
        pose = self.pose if self.registered else None
        return {
            "frame": self.index,
            "source_frame": self.source_index,
            "time": round(float(self.time), 6),
            "chain": int(self.chain),
            "pose": None if pose is None else [[round(float(v), 9) for v in row] for row in pose],
            "scale": finite_or_none(self.scale),
            "model_scale": finite_or_none(self.model_scale),
            "intrinsics": [[round(float(v), 9) for v in row] for row in self.output.intrinsics],
            **self.registration.record(),
        }


@dataclass(repr=False, eq=False)
class VideoOutput:
    """The result for a clip (see the module docstring). Per frame (N of them): frame_intrinsics (N, 3, 3)
    normalised and frame_intrinsics_pixels (N, 3, 3), poses (N, 4, 4), scale (N,), model_scale (N,),
    registered (N,) bool, chain (N,) int (see the module docstring), inliers (N,), residual (N,) (root mean
    square of the registration's inlier residuals / depth), failures (None or why),
    source_frames (N,), times (N,) seconds. The clip: intrinsics / intrinsics_pixels (3, 3) (of its first
    frame: the clip's, unless `window` re-estimated them), size (width, height), fps (None: unknown),
    cloud_points (M, 3) float32 world metres and cloud_colors (M, 3) uint8 (the fused, voxel-averaged cloud of
    the main chain),
    voxel_size (metres), depth_range (the colour range of depth.mp4), calibrations (one record per calibrated
    segment), seconds (what it cost). frames (MoGeOutputs) and images (RGB) when the frames were kept
    (`predict_video`), else None."""

    name: str
    size: tuple
    fps: Optional[float]
    frame_intrinsics: np.ndarray
    frame_intrinsics_pixels: np.ndarray
    poses: np.ndarray
    scale: np.ndarray
    model_scale: np.ndarray
    registered: np.ndarray
    chain: np.ndarray
    inliers: np.ndarray
    residual: np.ndarray
    failures: list
    source_frames: np.ndarray
    times: np.ndarray
    cloud_points: np.ndarray
    cloud_colors: np.ndarray
    voxel_size: float
    depth_range: tuple
    calibrations: list
    records: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    frames: Optional[list] = None
    images: Optional[list] = None

    kind = "video"

    def __len__(self) -> int:
        return len(self.poses)

    @property
    def intrinsics(self) -> np.ndarray:
        return self.frame_intrinsics[0].astype(np.float32)

    @property
    def intrinsics_pixels(self) -> np.ndarray:
        return self.frame_intrinsics_pixels[0].astype(np.float32)

    @property
    def main_chain(self) -> int:
        """The chain with the most registered frames (the first of those with as many): the one the trajectory,
        the fused cloud and the 3D files show."""
        return int(np.bincount(self.chain[self.registered], minlength=max(self.chains, 1)).argmax())

    @property
    def in_main_chain(self) -> np.ndarray:
        """(N,) bool: the registered frames of the main chain (the trajectory's, the 3D files' cameras)."""
        return self.registered & (self.chain == self.main_chain)

    @property
    def chains(self) -> int:
        return int(self.chain.max()) + 1 if len(self.chain) else 0

    def chain_path_length(self, chain: int) -> float:
        """Metres the camera travelled between the registered frames of one chain (in order)."""
        positions = self.poses[self.registered & (self.chain == chain), :3, 3]
        return float(np.linalg.norm(np.diff(positions, axis=0), axis=1).sum()) if len(positions) > 1 else 0.0

    @property
    def path_length(self) -> float:
        """Metres the camera travelled between registered frames (in order), over every chain (not across a cut)."""
        return sum(self.chain_path_length(c) for c in range(self.chains))

    def trajectory_tum(self) -> str:
        """The main chain's registered frames' poses as a TUM trajectory: one line "time tx ty tz qx qy qz qw" per
        frame."""
        lines = ["# tt_moge video trajectory (TUM format): time tx ty tz qx qy qz qw, camera-to-world, metres"]
        if self.chains > 1:
            main = self.main_chain
            first = int(np.argmax(self.chain == main))
            lines.append(f"# chain {main} of {self.chains} (its world: frame {first}'s camera)")
        for i in np.flatnonzero(self.in_main_chain):
            q = rotation_to_quaternion(self.poses[i, :3, :3])
            t = self.poses[i, :3, 3]
            lines.append(" ".join(f"{v:.9g}" for v in (self.times[i], *t, *q)))
        return "\n".join(lines) + "\n"

    def summary(self) -> dict:
        """The numbers of this clip without the maps (JSON-ready): the server's /predict/video/summary and
        result.json of `tt-moge predict clip.mp4`."""
        w, h = self.size
        finite = self.scale[np.isfinite(self.scale)]
        return {
            "kind": "video",
            "name": self.name,
            "width": w,
            "height": h,
            "fps": finite_or_none(self.fps) if self.fps is not None else None,
            "frames": len(self),
            "registered": int(self.registered.sum()),
            "relocalised": sum(1 for r in self.records if r.get("registered") and r.get("relocalised")),
            "chains": [self._chain_record(c) for c in range(self.chains)],
            "main_chain": self.main_chain,
            "failed": [{"frame": i, "error": e} for i, e in enumerate(self.failures) if e],
            "intrinsics": [[round(float(v), 9) for v in row] for row in self.intrinsics],
            "intrinsics_pixels": [[round(float(v), 6) for v in row] for row in self.intrinsics_pixels],
            "fov_x_deg": round(math.degrees(2 * math.atan(0.5 / float(self.frame_intrinsics[0, 0, 0]))), 6),
            "scale": {
                "median": finite_or_none(np.median(finite)) if finite.size else None,
                "min": finite_or_none(finite.min()) if finite.size else None,
                "max": finite_or_none(finite.max()) if finite.size else None,
            },
            "path_length_m": round(self.path_length, 6),
            "cloud_points": int(len(self.cloud_points)),
            "voxel_size_m": finite_or_none(self.voxel_size),
            "depth_range_m": [finite_or_none(v) for v in self.depth_range],
            "calibrations": self.calibrations,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "poses": self.records,
        }

    def _chain_record(self, chain: int) -> dict:
        members = self.chain == chain
        return {
            "chain": chain,
            "first_frame": int(np.argmax(members)),
            "frames": int(members.sum()),
            "registered": int((self.registered & members).sum()),
            "path_length_m": round(self.chain_path_length(chain), 6),
        }

    def npz_arrays(self) -> dict:
        """The arrays of VIDEO_NPZ_LAYOUT (depth and mask only when the frames are kept)."""
        values = {
            "intrinsics": self.intrinsics,
            "intrinsics_pixels": self.intrinsics_pixels,
            "frame_intrinsics": self.frame_intrinsics,
            "frame_intrinsics_pixels": self.frame_intrinsics_pixels,
            "poses": self.poses,
            "scale": self.scale,
            "model_scale": self.model_scale,
            "registered": self.registered,
            "chain": self.chain,
            "inliers": self.inliers,
            "times": self.times,
            "source_frames": self.source_frames,
            "cloud_points": self.cloud_points,
            "cloud_colors": self.cloud_colors,
        }
        if self.frames is not None:
            values["depth"] = np.stack([f.depth for f in self.frames])
            values["mask"] = np.stack([f.mask for f in self.frames])
        return {k: np.asarray(v, dtype=VIDEO_NPZ_LAYOUT[k][0]) for k, v in values.items()}

    def save(self, folder: Any, formats: Any = None, *, mesh_step: Optional[int] = None) -> dict:
        """Write the clip's folder (see `video.files`): per-frame files (`formats` as for photos; default the
        maps; needs the kept frames), poses.json, trajectory.txt, scene.ply, scene.glb, depth.mp4, result.json.
        Returns the result.json record."""
        from .files import ClipWriter

        if self.frames is None or self.images is None:
            raise ValueError("save: this VideoOutput did not keep its frames; stream into a ClipWriter instead")
        writer = ClipWriter(folder, formats, mesh_step=mesh_step, fps=self.fps)
        try:
            for i, (out, rgb) in enumerate(zip(self.frames, self.images)):
                writer.add(i, out, rgb, self.records[i], self.depth_range)
            return writer.finish(self)
        except BaseException:
            writer.abort()
            raise

    def __repr__(self) -> str:
        w, h = self.size
        return (
            f"VideoOutput({self.name}: {len(self)} frames {w}x{h}, {int(self.registered.sum())} registered, "
            f"{self.chains} chain{'s' * (self.chains != 1)}, "
            f"fov_x {math.degrees(2 * math.atan(0.5 / float(self.frame_intrinsics[0, 0, 0]))):.1f} deg, "
            f"path {self.path_length:.2f} m, cloud {len(self.cloud_points)} points)"
        )
