"""MoGeOutput: what one image gives, at the image's own resolution, plus the npz layout shared with the server.

The npz layout (`NPZ_LAYOUT`) is defined once here and used by `save_npz`, the server's `/predict` response,
the CLI and batch jobs:

| key                 | dtype   | shape     | content                                                     |
|---------------------|---------|-----------|-------------------------------------------------------------|
| `points`            | float32 | (H, W, 3) | metres, camera space (x right, y down, z forward)           |
| `depth`             | float32 | (H, W)    | metres (z)                                                  |
| `normal`            | float16 | (H, W, 3) | unit normals, camera space (absent for models without one)  |
| `mask`              | uint8   | (H, W)    | 1 = valid                                                   |
| `intrinsics`        | float32 | (3, 3)    | normalised (fx, cx by width; fy, cy by height)              |
| `intrinsics_pixels` | float32 | (3, 3)    | in pixels                                                   |
| `metric_scale`      | float32 | ()        | the predicted scale, already applied                        |
| `fov_x`, `fov_y`    | float32 | ()        | degrees                                                     |
"""
from __future__ import annotations

import io
import math
import os
import zipfile
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import numpy as np

__all__ = ["MoGeOutput", "NPZ_LAYOUT", "INFER_KEYS", "finite_or_none", "depth_p1_p99"]

NPZ_LAYOUT: dict[str, tuple] = {
    "points": ("float32", "(H, W, 3)"),
    "depth": ("float32", "(H, W)"),
    "normal": ("float16", "(H, W, 3)"),
    "mask": ("uint8", "(H, W)"),
    "intrinsics": ("float32", "(3, 3)"),
    "intrinsics_pixels": ("float32", "(3, 3)"),
    "metric_scale": ("float32", "()"),
    "fov_x": ("float32", "()"),
    "fov_y": ("float32", "()"),
}
# The keys of upstream MoGe's `infer()` dict, in its order.
INFER_KEYS = ("points", "intrinsics", "depth", "mask", "normal")


def finite_or_none(x: Any) -> Optional[float]:
    """A float for JSON: None where it is not finite."""
    x = float(x)
    return x if math.isfinite(x) else None


def depth_p1_p99(depth: np.ndarray, mask: np.ndarray) -> dict:
    """{"depth_p1_m", "depth_p99_m"}: the 1st and 99th percentile of the valid finite depths (None without any)."""
    valid = mask & np.isfinite(depth)
    p1, p99 = np.percentile(depth[valid], [1.0, 99.0]) if valid.any() else (math.nan, math.nan)
    return {"depth_p1_m": finite_or_none(p1), "depth_p99_m": finite_or_none(p99)}


@dataclass(repr=False, eq=False)
class MoGeOutput:
    """The result for one image. Arrays are numpy, at the input image's resolution.

    points (H, W, 3) float32 metres, depth (H, W) float32 metres (inf where mask is False when masked),
    normal (H, W, 3) float32 unit vectors or None, mask (H, W) bool, intrinsics (3, 3) float32 normalised,
    intrinsics_pixels (3, 3) float32, metric_scale float, fov_x / fov_y float degrees.
    """

    points: np.ndarray
    depth: np.ndarray
    normal: Optional[np.ndarray]
    mask: np.ndarray
    intrinsics: np.ndarray
    intrinsics_pixels: np.ndarray
    metric_scale: float
    fov_x: float
    fov_y: float

    @property
    def size(self) -> tuple:
        """(width, height)."""
        return self.depth.shape[1], self.depth.shape[0]

    @property
    def valid_fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0

    @property
    def median_depth(self) -> float:
        d = self.depth[self.mask]
        d = d[np.isfinite(d)]
        return float(np.median(d)) if d.size else math.nan

    def summary(self, depth_percentiles: bool = False) -> dict:
        """The numbers of this result without the maps (JSON-ready; non-finite values are None): size, field of
        view (degrees), intrinsics (normalised and pixels), metric scale, valid fraction, median depth of the
        valid pixels (metres), whether there is a normal map; with `depth_percentiles`, also the 1st and 99th
        percentile depth (one pass over the valid pixels). The server's /predict/summary, result.json of the CLI
        and of batch jobs are this record (result.json adds the percentiles)."""
        w, h = self.size
        record = {
            "width": w, "height": h,
            "fov_x_deg": finite_or_none(self.fov_x), "fov_y_deg": finite_or_none(self.fov_y),
            "intrinsics": [[finite_or_none(v) for v in row] for row in np.asarray(self.intrinsics, np.float64)],
            "intrinsics_pixels": [[finite_or_none(v) for v in row] for row in np.asarray(self.intrinsics_pixels, np.float64)],
            "metric_scale": finite_or_none(self.metric_scale),
            "valid_fraction": float(self.valid_fraction),
            "median_depth_m": finite_or_none(self.median_depth),
            "has_normal": self.normal is not None,
        }
        if depth_percentiles:
            record.update(depth_p1_p99(self.depth, self.mask))
        return record

    def __repr__(self) -> str:
        w, h = self.size
        med = self.median_depth
        med_s = f"{med:.3f} m" if math.isfinite(med) else "n/a"
        return (f"MoGeOutput({w}x{h}, valid {100 * self.valid_fraction:.1f}%, median depth {med_s}, "
                f"fov_x {self.fov_x:.1f} deg, metric_scale {self.metric_scale:.4f})")

    # --- the upstream infer() dict view -------------------------------------------------------------
    def keys(self) -> list:
        """The keys of upstream `infer()`'s dict that this output has (normal only with a normal head)."""
        return [k for k in INFER_KEYS if getattr(self, k) is not None]

    def __getitem__(self, key: str) -> Any:
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        value = getattr(self, key)
        if value is None:
            raise KeyError(f"{key} (this model has no {key} head)")
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())

    def to_dict(self) -> dict:
        """{key: numpy array} with the upstream `infer()` keys."""
        return {k: getattr(self, k) for k in self.keys()}

    def to_torch(self) -> dict:
        """The upstream `infer()` dict: torch tensors (points, intrinsics, depth, mask (bool), normal)."""
        import torch

        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.to_dict().items()}

    # --- npz ---------------------------------------------------------------------------------------
    def npz_arrays(self) -> dict:
        """The arrays of the npz layout, with its dtypes."""
        out = {}
        for key, (dtype, _) in NPZ_LAYOUT.items():
            value = getattr(self, key)
            if value is not None:
                out[key] = np.asarray(value, dtype=dtype)
        return out

    def to_npz_bytes(self, compress: bool = False) -> bytes:
        """The npz file as bytes; compress=True deflates the maps (ISA-L when installed, see `tt_moge.npzio`)."""
        from .npzio import npz_bytes

        return npz_bytes(self.npz_arrays(), compress=compress)

    def save_npz(self, path: Union[str, os.PathLike], compress: bool = False) -> None:
        """Write the npz layout (normal float16, mask uint8) to `path`, part by part (no copy of the whole file
        in memory)."""
        from .npzio import npz_parts

        with open(path, "wb") as f:
            f.writelines(npz_parts(self.npz_arrays(), compress=compress))

    @classmethod
    def from_npz(cls, source: Union[str, os.PathLike, bytes]) -> "MoGeOutput":
        """Read an npz written by `save_npz` or returned by the server (normal comes back as float32)."""
        try:
            data = np.load(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source, allow_pickle=False)
        except (zipfile.BadZipFile, EOFError, ValueError) as exc:
            raise ValueError(f"not a tt_moge npz ({exc})") from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("not a tt_moge npz (a single .npy array)")
        with data:  # closes the file
            return cls._from_arrays(data)

    @classmethod
    def _from_arrays(cls, data) -> "MoGeOutput":
        try:
            normal = data["normal"].astype(np.float32) if "normal" in data.files else None
            return cls(
                points=data["points"], depth=data["depth"], normal=normal, mask=data["mask"].astype(bool),
                intrinsics=data["intrinsics"], intrinsics_pixels=data["intrinsics_pixels"],
                metric_scale=float(data["metric_scale"]), fov_x=float(data["fov_x"]), fov_y=float(data["fov_y"]),
            )
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ValueError(f"not a tt_moge npz ({exc})") from None
