"""The fused point cloud of a clip: every registered frame's points in world coordinates, averaged per voxel.

Each frame contributes its kept pixels (valid, finite, not on a depth edge: `export.depth_edges`) on a grid of
every `step`-th row and column, where step is chosen so that a frame gives at most FRAME_POINTS points. Points
and colours are summed per voxel of `voxel_size` metres; the cloud is the mean point and mean colour of each
voxel. Memory is the number of voxels the scene occupies (plus at most as much again of not yet merged sums),
not the number of frames: the per-frame sums are merged whenever they outgrow the merged cloud.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["FRAME_POINTS", "MERGE_EVERY", "VoxelCloud", "frame_points"]

FRAME_POINTS = 10000  # points a frame contributes at most (before the voxel averaging)
MERGE_EVERY = 200_000  # the per-frame sums are merged into the cloud when more than this (or than the cloud) wait
_BITS = 21  # per axis in a voxel key: +-2^20 voxels around the first camera
_OFFSET = 1 << (_BITS - 1)


def frame_points(output, rgb: np.ndarray, pose: np.ndarray, limit: int = FRAME_POINTS) -> tuple:
    """(points (M, 3) float64 world coordinates, colours (M, 3) uint8) of one frame's kept pixels on a grid of
    at most `limit` pixels. `pose` (4, 4) camera-to-world."""
    from ..export import depth_edges

    h, w = output.depth.shape
    step = max(1, math.ceil(math.sqrt(h * w / limit)))
    depth = output.depth[::step, ::step]
    valid = output.mask[::step, ::step] & np.isfinite(depth)
    keep = valid & ~depth_edges(depth, valid)
    camera = output.points[::step, ::step][keep].astype(np.float64)
    colours = np.asarray(rgb)[::step, ::step][keep]
    return camera @ pose[:3, :3].T + pose[:3, 3], colours


class VoxelCloud:
    """Points and colours averaged per voxel of `voxel_size` metres (None: set on the first `add`, see `auto`)."""

    def __init__(self, voxel_size: Optional[float] = None):
        self.voxel_size = voxel_size
        self._merged: Optional[tuple] = None  # (keys, sums xyz, sums rgb, counts), keys sorted and unique
        self._pending: list = []
        self._pending_size = 0

    def auto(self, median_depth: float) -> None:
        """Set the voxel to 1% of a median depth when none was given."""
        if self.voxel_size is None and math.isfinite(median_depth) and median_depth > 0:
            self.voxel_size = 0.01 * median_depth

    def add(self, points: np.ndarray, colours: np.ndarray) -> None:
        if self.voxel_size is None:
            raise ValueError("voxel_size is not set (give one, or call auto first)")
        if not len(points):
            return
        cells = np.floor(points / self.voxel_size).astype(np.int64) + _OFFSET
        inside = ((cells >= 0) & (cells < (1 << _BITS))).all(axis=1)
        cells, points, colours = cells[inside], points[inside], colours[inside]
        keys = (cells[:, 0] << (2 * _BITS)) | (cells[:, 1] << _BITS) | cells[:, 2]
        self._pending.append(_reduce(keys, points, colours.astype(np.float64), np.ones(len(keys))))
        self._pending_size += len(self._pending[-1][0])
        if self._pending_size > max(MERGE_EVERY, 0 if self._merged is None else len(self._merged[0])):
            self._merge()

    def _merge(self) -> None:
        parts = self._pending + ([self._merged] if self._merged is not None else [])
        self._pending, self._pending_size = [], 0
        if parts:
            self._merged = _reduce(*(np.concatenate([p[i] for p in parts]) for i in range(4)))

    def __len__(self) -> int:
        self._merge()
        return 0 if self._merged is None else len(self._merged[0])

    def result(self) -> tuple:
        """(points (M, 3) float32, colours (M, 3) uint8, counts (M,) int): one entry per occupied voxel."""
        self._merge()
        if self._merged is None:
            return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8), np.zeros(0, np.int64)
        _, xyz, rgb, count = self._merged
        points = (xyz / count[:, None]).astype(np.float32)
        colours = np.clip(np.rint(rgb / count[:, None]), 0, 255).astype(np.uint8)
        return points, colours, count.astype(np.int64)


def _reduce(keys: np.ndarray, xyz: np.ndarray, rgb: np.ndarray, count: np.ndarray) -> tuple:
    """Sums per unique key: (keys sorted, xyz sums, rgb sums, counts)."""
    unique, inverse = np.unique(keys, return_inverse=True)
    n = len(unique)
    sums_xyz = np.stack([np.bincount(inverse, xyz[:, i], n) for i in range(3)], axis=1)
    sums_rgb = np.stack([np.bincount(inverse, rgb[:, i], n) for i in range(3)], axis=1)
    return unique, sums_xyz, sums_rgb, np.bincount(inverse, count, n)
