"""Finish: raw canvas maps + solved camera -> MoGeOutput at the input image's resolution.

Steps, in order (each as upstream `MoGeModel.infer` does it, after the crop and resize that the fixed canvas
adds):
  1. crop the content box out of the canvas maps (drops the letterbox bars);
  2. z += shift (depth);
  3. if the content box and the input differ in size: resize to the input size (bilinear, half-pixel
     centres) the inverse depth, the ray directions x/z and y/z (only without force_projection), the normals
     (then re-normalised) and the mask probability. Inverse depth and ray directions are linear in pixel
     coordinates across a plane, so flat surfaces stay exact (resizing z itself would bend them);
  4. mask = probability > 0.5 and depth > 0;
  5. intrinsics of the input image from the focal, the canvas and the content box;
  6. force_projection: points = depth * K^-1 [u, v, 1] at the input pixel centres;
  7. multiply points and depth by the metric scale;
  8. apply_mask: points and depth inf, normal 0 where the mask is False.
The torch code below is the reference; with the native host library the same steps run as one multithreaded
C++ pass that reads the canvas maps once and writes each output once (moge_finish in native/moge_host.cpp).
The normal and the mask probability may be bfloat16 (the Tenstorrent runner reads its normals back so, half the
bytes over PCIe): the native pass reads them as they are, the torch path converts them to float32 first; bfloat16
normals are normalised again (rounding leaves them up to 2^-8 off unit length). The points are always float32
(depth = exp(z) needs its 24 bits).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .. import native
from ..constants import MASK_THRESHOLD
from ..output import MoGeOutput
from ..runners.base import RawMaps
from . import buffers
from .canvas import CanvasPlan
from .intrinsics import Intrinsics

__all__ = ["camera_intrinsics", "finish", "projection_factors"]


def camera_intrinsics(focal: float, plan: CanvasPlan) -> np.ndarray:
    """Normalised intrinsics (fx, cx by image width; fy, cy by image height) of the input image.

    `focal` is relative to the canvas half diagonal, for square canvas pixels with the principal point at the
    canvas centre. Under fit="stretch" the input's pixels are the canvas pixels scaled per axis, so the
    intrinsics in input pixels have fx != fy unless the image has the canvas aspect.
    """
    cw, ch = plan.canvas_size
    f_px = focal * math.hypot(cw, ch) / 2  # canvas pixels
    x0, y0, _, _ = plan.content_box
    w, h = plan.content_size
    return np.array(
        [[f_px / w, 0.0, (cw / 2 - x0) / w], [0.0, f_px / h, (ch / 2 - y0) / h], [0.0, 0.0, 1.0]], dtype=np.float32
    )


def _resize_maps(maps: list[torch.Tensor], size: tuple) -> list[torch.Tensor]:
    """Bilinearly resize (h, w, C) maps to (H, W) = size[::-1] in one pass."""
    chans = [m.shape[-1] if m.ndim == 3 else 1 for m in maps]
    stacked = torch.cat([m if m.ndim == 3 else m[..., None] for m in maps], dim=-1).permute(2, 0, 1)[None]
    resized = F.interpolate(stacked, (size[1], size[0]), mode="bilinear", align_corners=False)[0].permute(1, 2, 0)
    out = list(resized.split(chans, dim=-1))
    return [o if m.ndim == 3 else o[..., 0] for o, m in zip(out, maps)]


def projection_factors(intrinsics: np.ndarray, size: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """((u - cx) / fx (W,), (v - cy) / fy (H,)) float32 at the input pixel centres, u and v normalised to
    [0, 1]: the factors that turn depth into x and y under force_projection (shared by both host paths)."""
    w, h = size
    fx, fy, cx, cy = (float(v) for v in (intrinsics[0, 0], intrinsics[1, 1], intrinsics[0, 2], intrinsics[1, 2]))
    u = torch.linspace(0.5 / w, 1 - 0.5 / w, w, dtype=torch.float32)
    v = torch.linspace(0.5 / h, 1 - 0.5 / h, h, dtype=torch.float32)
    return (u - cx) / fx, (v - cy) / fy


def finish(
    raw: RawMaps,
    plan: CanvasPlan,
    focal: float,
    shift: float,
    *,
    apply_mask: bool = True,
    force_projection: bool = True,
    intrinsics: Optional[Intrinsics] = None,
) -> MoGeOutput:
    """Raw canvas maps + camera (focal relative to the canvas half diagonal, z shift) -> MoGeOutput at the
    input size. Known `intrinsics` (then `focal` is not used) are the output's, exactly: in the unit they were
    given in, the float32 rounding of the given numbers. Runs the native fused pass when the native host library
    is in use (same results), else the torch steps below, which are the reference."""
    if intrinsics is None:
        normalised = camera_intrinsics(focal, plan).astype(np.float64)
        pixels = normalised * np.array([[plan.image_size[0]], [plan.image_size[1]], [1.0]])
    else:
        normalised, pixels = intrinsics.normalised_matrix(plan.image_size), intrinsics.pixel_matrix(plan.image_size)
    lib = native.library()
    if lib is not None:
        maps = _finish_native(lib, raw, plan, normalised, shift, apply_mask, force_projection)
    else:
        maps = _finish_torch(raw, plan, normalised, shift, apply_mask, force_projection)
    return _output(*maps, normalised, pixels, raw.metric_scale)


def _finish_torch(
    raw: RawMaps, plan: CanvasPlan, intrinsics: np.ndarray, shift: float, apply_mask: bool, force_projection: bool
) -> tuple:
    x0, y0, x1, y1 = plan.content_box
    points = raw.points[y0:y1, x0:x1]
    normal = None if raw.normal is None else _host_float32(raw.normal[y0:y1, x0:x1])  # bfloat16 -> float32
    if normal is not None and raw.normal.dtype == torch.bfloat16 and (x1 - x0, y1 - y0) == plan.image_size:
        normal = F.normalize(normal, dim=-1)  # unit length again (a resize normalises below)
    prob = None if raw.mask is None else _host_float32(raw.mask[y0:y1, x0:x1])
    w, h = plan.image_size
    depth = points[..., 2] + torch.tensor(shift, dtype=torch.float32)
    xy = points[..., :2]
    if (x1 - x0, y1 - y0) != (w, h):
        # Perspective-correct resampling: inverse depth and the ray directions x/z, y/z are linear in pixel
        # coordinates across a plane, so resizing them (not z) keeps flat surfaces exact.
        ahead = depth > 0
        inv_depth = torch.where(ahead, 1.0 / depth, 0.0)
        maps = [inv_depth] + ([] if force_projection else [xy * inv_depth[..., None]])
        maps += [m for m in (normal, prob) if m is not None]
        resized = iter(_resize_maps(maps, (w, h)))
        inv_depth = next(resized)
        depth = torch.where(inv_depth > 0, 1.0 / inv_depth, -1.0)
        xy = None if force_projection else next(resized) * depth[..., None]
        normal = None if normal is None else F.normalize(next(resized), dim=-1)
        prob = None if prob is None else next(resized)

    mask = prob > MASK_THRESHOLD if prob is not None else torch.ones((h, w), dtype=torch.bool)
    mask &= depth > 0

    if force_projection:
        col, row = projection_factors(intrinsics, (w, h))
        points = torch.stack([depth * col[None, :], depth * row[:, None], depth], dim=-1)
    else:
        points = torch.cat([xy, depth[..., None]], dim=-1)

    scale = raw.metric_scale
    if scale is not None:
        points = points * scale
        depth = depth * scale
    if apply_mask:
        invalid = ~mask
        points = points.masked_fill(invalid[..., None], math.inf)
        depth = depth.masked_fill(invalid, math.inf)
        if normal is not None:
            normal = normal.masked_fill(invalid[..., None], 0.0)
    normal = None if normal is None else np.ascontiguousarray(normal.numpy())
    return points.numpy(), depth.numpy(), normal, mask.numpy()


def _host_float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.device.type == "cpu" else t.to("cpu", torch.float32)


def _host_plane(t: torch.Tensor) -> torch.Tensor:
    """A normal or mask map as the native pass reads it: float32, or bfloat16 as it is (the Tenstorrent runner
    reads those back in bfloat16; the pass widens each element as it loads it, no float32 copy)."""
    return t if t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu" else t.to("cpu", torch.float32)


def _finish_native(
    lib, raw: RawMaps, plan: CanvasPlan, intrinsics: np.ndarray, shift: float, apply_mask: bool, force_projection: bool
) -> tuple:
    """The same steps in one multithreaded C++ pass over the content box (moge_finish in moge_host.cpp)."""
    x0, y0, x1, y1 = plan.content_box
    w, h = plan.image_size
    points = _host_float32(raw.points)
    normal = None if raw.normal is None else _host_plane(raw.normal)
    prob = None if raw.mask is None else _host_plane(raw.mask)
    out_points = buffers.empty((h, w, 3), np.float32)
    out_depth = buffers.empty((h, w), np.float32)
    out_normal = None if normal is None else buffers.empty((h, w, 3), np.float32)
    out_mask = buffers.empty((h, w), np.bool_)
    col = row = None
    if force_projection:
        col, row = projection_factors(intrinsics, (w, h))
    scale = raw.metric_scale
    lib.moge_finish(
        points.data_ptr(),
        *points.stride(),
        None if normal is None else normal.data_ptr(),
        *(normal.stride() if normal is not None else (0, 0, 0)),
        normal is not None and normal.dtype == torch.bfloat16,
        None if prob is None else prob.data_ptr(),
        *(prob.stride() if prob is not None else (0, 0)),
        prob is not None and prob.dtype == torch.bfloat16,
        x0,
        y0,
        x1 - x0,
        y1 - y0,
        w,
        h,
        shift,
        1.0 if scale is None else scale,
        MASK_THRESHOLD,
        scale is not None,
        None if col is None else col.data_ptr(),
        None if row is None else row.data_ptr(),
        apply_mask,
        out_points.ctypes.data,
        out_depth.ctypes.data,
        None if out_normal is None else out_normal.ctypes.data,
        out_mask.ctypes.data,
    )
    return out_points, out_depth, out_normal, out_mask


def _output(
    points: np.ndarray,
    depth: np.ndarray,
    normal: Optional[np.ndarray],
    mask: np.ndarray,
    intrinsics: np.ndarray,
    pixels: np.ndarray,
    scale: Optional[float],
) -> MoGeOutput:
    fx_n, fy_n = float(intrinsics[0, 0]), float(intrinsics[1, 1])
    return MoGeOutput(
        points=points,
        depth=depth,
        normal=normal,
        mask=mask,
        intrinsics=intrinsics.astype(np.float32),
        intrinsics_pixels=pixels.astype(np.float32),
        metric_scale=float(scale) if scale is not None else 1.0,
        fov_x=math.degrees(2 * math.atan(0.5 / fx_n)),
        fov_y=math.degrees(2 * math.atan(0.5 / fy_n)),
    )
