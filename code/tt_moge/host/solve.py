"""Focal and z-shift recovery from an affine point map (MoGe's camera solve), on the valid content region.

The network predicts points up to an unknown shift along z. With uv the view-plane coordinates of each pixel
(normalised by the canvas half diagonal, see `view_plane_axes`), the camera solve is

    minimise over (focal, shift):   sum_i || focal * xy_i / (z_i + shift) - uv_i ||^2

on a 64x64 nearest-neighbour sample of the canvas, restricted to valid pixels inside the content box. For a
fixed shift the best focal is closed-form, so this is a 1-D problem in the shift. Upstream MoGe runs scipy's
Levenberg-Marquardt from shift 0 with ftol=1e-3; we run a safeguarded Newton iteration on the same objective
from the same start, to convergence, plus a search of the basins just across the nearest poles (LM can step
across one), so our objective value is at least as low.
`fov_x` given: the focal is fixed and only the shift is solved. Known intrinsics (`recover_shift`): focal
lengths and principal point are fixed; their projection onto the canvas view plane (`view_plane_camera`) turns
the problem into the same shift-only solve (x scaled by fx, y by fy, uv moved by the principal point's offset).
`recover_camera` runs the same algorithm in C++ (moge_host.cpp) when the native host library is in use; the
numpy functions here are the reference (tests/test_native.py compares the two and both against upstream).
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from .. import native
from ..constants import MASK_THRESHOLD, SOLVE_GRID
from ..network import view_plane_axes
from .canvas import CanvasPlan

__all__ = [
    "solve_samples",
    "solve_focal_shift",
    "solve_shift",
    "objective",
    "focal_from_fov_x",
    "recover_camera",
    "recover_shift",
    "view_plane_camera",
    "fast_solve_shift",
    "native_solve",
]


def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    # Nearest-neighbour downsampling as torch does it: source index floor(i * n_in / n_out).
    return (np.arange(n_out) * n_in) // n_out


def solve_samples(
    points: torch.Tensor, mask: Optional[torch.Tensor], content_box: tuple, grid: tuple = SOLVE_GRID
) -> tuple[np.ndarray, np.ndarray]:
    """(uv (N, 2), xyz (N, 3)) float64 samples of the canvas point map that the solve uses.

    `points` (H, W, 3) canvas-sized affine points; `mask` (H, W) bool or None. Samples outside the content box
    (the letterbox bars) or where the mask is False are dropped.
    """
    h, w = points.shape[:2]
    rows, cols = _nearest_index(h, grid[0]), _nearest_index(w, grid[1])
    pts = points.numpy()[rows][:, cols]
    u, v = view_plane_axes(w, h, w / h)
    uv = np.stack(np.meshgrid(u.numpy()[cols], v.numpy()[rows], indexing="xy"), axis=-1)
    x0, y0, x1, y1 = content_box
    keep = ((rows >= y0) & (rows < y1))[:, None] & ((cols >= x0) & (cols < x1))[None, :]
    if mask is not None:
        keep &= mask.numpy()[rows][:, cols]
    return uv[keep].astype(np.float64), pts[keep].astype(np.float64)


class _Problem:
    """Per-sample constants of the objective. With p_i = xy_i / (z_i + s):
    sum p.uv = sum a_i / (z_i + s) and sum p.p = sum b_i / (z_i + s)^2, a_i = xy_i.uv_i, b_i = |xy_i|^2."""

    def __init__(self, uv: np.ndarray, xyz: np.ndarray, focal: Optional[float]):
        self.a = (xyz[:, :2] * uv).sum(axis=1)
        self.b = (xyz[:, :2] ** 2).sum(axis=1)
        self.z = np.ascontiguousarray(xyz[:, 2])
        self.c = float((uv * uv).sum())
        self.focal = focal

    def cost(self, shifts: np.ndarray) -> np.ndarray:
        """The objective at many shifts at once (inf where undefined)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = 1.0 / (self.z[None, :] + shifts[:, None])
            a, b = inv @ self.a, (inv * inv) @ self.b
            f = self.focal
            costs = self.c - a * a / b if f is None else f * f * b - 2 * f * a + self.c
        return np.where(np.isfinite(costs), costs, np.inf)

    def derivatives(self, shift: float) -> tuple[float, float, float]:
        """(cost, d cost / d shift, d2 cost / d shift2) at one shift."""
        inv = 1.0 / (self.z + shift)
        inv2 = inv * inv
        ai, bi2 = self.a * inv, self.b * inv2
        a, b = ai.sum(), bi2.sum()
        da, db = -(ai @ inv), -2.0 * (bi2 @ inv)
        dda, ddb = 2.0 * (ai @ inv2), 6.0 * (bi2 @ inv2)
        f = self.focal
        if f is not None:
            return f * f * b - 2 * f * a + self.c, f * f * db - 2 * f * da, f * f * ddb - 2 * f * dda
        if not b > 0:
            return math.inf, 0.0, 0.0
        # g(s) = C - A^2 / B with the best focal A / B eliminated
        h = a * a / b
        dh = 2 * a * da / b - a * a * db / b**2
        ddh = 2 * (da * da + a * dda) / b - 4 * a * da * db / b**2 - a * a * ddb / b**2 + 2 * a * a * db * db / b**3
        return self.c - h, -dh, -ddh


def objective(uv: np.ndarray, xyz: np.ndarray, shift: float, focal: Optional[float] = None) -> float:
    """Upstream's least-squares cost at (focal, shift); focal None = the best focal for this shift."""
    p = xyz[:, :2] / (xyz[:, 2:3] + shift)
    if focal is None:
        focal = (p * uv).sum() / max((p * p).sum(), 1e-300)
    return float(np.square(focal * p - uv).sum())


_COST_ROUND_OFF = 1e-12  # relative to sum |uv|^2: below this a cost difference is round-off (see `_newton`)


def _newton(problem: _Problem, shift: float, scale: float, max_iter: int = 100) -> tuple[float, float]:
    """Safeguarded Newton descent on the shift from `shift`; returns (shift, cost).

    A step is taken when the cost does not increase, or, near the minimum, when it increases by no more than
    the cost's round-off (it is a difference of terms of the size of sum |uv|^2) while the gradient shrinks:
    there the cost no longer resolves the shift (to ~1e-8 on a typical photo), the gradient does, and without
    this the descent stops wherever round-off first makes a step look uphill (different places for the numpy
    and the native code)."""
    noise = _COST_ROUND_OFF * problem.c
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        cost, grad, curv = problem.derivatives(shift)
        if not math.isfinite(cost):
            return shift, math.inf
        for _ in range(max_iter):
            step = -grad / curv if curv > 0 else -math.copysign(0.1 * scale, grad)
            # Backtrack until the cost does not increase (a pole where z + shift = 0 has infinite cost).
            for _ in range(60):
                trial = shift + step
                t_cost, t_grad, t_curv = problem.derivatives(trial)
                if math.isfinite(t_cost) and (t_cost <= cost or (t_cost <= cost + noise and abs(t_grad) < abs(grad))):
                    break
                step *= 0.5
            else:
                break
            converged = abs(trial - shift) <= 1e-12 * (scale + abs(trial))
            shift, cost, grad, curv = trial, t_cost, t_grad, t_curv
            if converged or grad == 0.0:
                break
    return shift, cost


_BEYOND_POLES = 16  # pole-free intervals past the nearest poles that are searched for a lower basin
_SAMPLES = np.linspace(0.05, 0.95, 9)  # where each interval is sampled, as fractions of its width


def _minimise_shift(uv: np.ndarray, xyz: np.ndarray, focal: Optional[float]) -> float:
    """The shift minimising upstream's objective.

    Newton from shift 0 finds the basin that upstream's LM starts in. LM can also step across a pole (a
    shift where some z + shift = 0, typically an outlier with a small z) into a lower basin, so we also sample
    the pole-free intervals just beyond the nearest poles and refine every interval that holds a sample below
    the best cost so far; the lowest refined cost wins.
    """
    problem = _Problem(uv, xyz, focal)
    scale = max(1e-12, float(np.abs(problem.z).mean()))
    best, best_cost = _newton(problem, 0.0, scale)
    poles = np.unique(problem.z)[: _BEYOND_POLES + 1]  # shift = -z: nearest poles first (the smallest z)
    if len(poles) < 2:
        return best
    near, far = poles[:-1], poles[1:]
    shifts = -(near[:, None] + _SAMPLES[None, :] * (far - near)[:, None])  # (intervals, samples)
    costs = problem.cost(shifts.ravel()).reshape(shifts.shape)
    for k in np.flatnonzero(costs.min(axis=1) < best_cost):
        shift, cost = _newton(problem, float(shifts[k, costs[k].argmin()]), scale)
        if cost < best_cost:
            best, best_cost = shift, cost
    return best


def solve_focal_shift(uv: np.ndarray, xyz: np.ndarray) -> tuple[float, float]:
    """Best (focal, shift) for the samples; (1, 0) when fewer than 2 samples (as upstream)."""
    if len(uv) < 2:
        return 1.0, 0.0
    shift = _minimise_shift(uv, xyz, None)
    p = xyz[:, :2] / (xyz[:, 2:3] + shift)
    denom = float((p * p).sum())
    focal = float((p * uv).sum()) / denom if denom > 0 else 1.0
    return focal, shift


def solve_shift(uv: np.ndarray, xyz: np.ndarray, focal: float) -> float:
    if len(uv) < 2:
        return 0.0
    return _minimise_shift(uv, xyz, float(focal))


def focal_from_fov_x(fov_x_deg: float, plan: CanvasPlan) -> float:
    """The focal (relative to the canvas half diagonal) of an image whose horizontal field of view is given."""
    cw, ch = plan.canvas_size
    content_w = plan.content_size[0]
    fx_canvas_px = (content_w / 2) / math.tan(math.radians(fov_x_deg) / 2)
    return fx_canvas_px / (math.hypot(cw, ch) / 2)


@lru_cache(maxsize=8)
def _canvas_axes(width: int, height: int) -> tuple[torch.Tensor, torch.Tensor]:
    u, v = view_plane_axes(width, height, width / height)
    return u.contiguous(), v.contiguous()


def recover_camera(
    points: torch.Tensor, mask: Optional[torch.Tensor], plan: CanvasPlan, fov_x: Optional[float] = None
) -> tuple[float, float]:
    """(focal, shift) for canvas-sized raw points (H, W, 3), solved on the valid content region.

    `mask` (H, W): a bool validity mask, or the float mask probability (valid where > MASK_THRESHOLD; only
    the sampled pixels are thresholded), or None. Runs the native solver when the native host library is in
    use (same algorithm and samples), else the numpy solver above.
    """
    focal = None if fov_x is None else focal_from_fov_x(fov_x, plan)
    lib = native.library()
    if lib is not None:
        return _recover_camera_native(lib, points, mask, plan, focal)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > MASK_THRESHOLD
    uv, xyz = solve_samples(points, mask, plan.content_box)
    if focal is None:
        return solve_focal_shift(uv, xyz)
    return focal, solve_shift(uv, xyz, focal)


def _recover_camera_native(
    lib, points: torch.Tensor, mask: Optional[torch.Tensor], plan: CanvasPlan, focal: Optional[float]
) -> tuple[float, float]:
    points = (
        points if points.dtype == torch.float32 and points.device.type == "cpu" else points.to("cpu", torch.float32)
    )
    h, w = points.shape[:2]
    u, v = _canvas_axes(w, h)
    mask_u8 = prob = None
    if mask is not None:
        mask = mask.cpu()
        if mask.dtype == torch.bool:
            mask_u8 = mask
        else:  # float32, or bfloat16 as it is (the Tenstorrent runner's read-back): no converted copy of the plane
            prob = mask if mask.dtype in (torch.float32, torch.bfloat16) else mask.to(torch.float32)
    m = mask_u8 if mask_u8 is not None else prob
    x0, y0, x1, y1 = plan.content_box
    out = (ctypes.c_double * 2)()
    lib.moge_recover_camera(
        points.data_ptr(),
        *points.stride(),
        None if mask_u8 is None else mask_u8.data_ptr(),
        None if prob is None else prob.data_ptr(),
        prob is not None and prob.dtype == torch.bfloat16,
        *(m.stride() if m is not None else (0, 0)),
        w,
        h,
        x0,
        y0,
        x1,
        y1,
        u.data_ptr(),
        v.data_ptr(),
        SOLVE_GRID[0],
        SOLVE_GRID[1],
        MASK_THRESHOLD,
        math.nan if focal is None else focal,
        ctypes.addressof(out),
        ctypes.addressof(out) + 8,
    )
    return float(out[0]), float(out[1])


def native_solve(uv: np.ndarray, xyz: np.ndarray, focal: Optional[float] = None) -> tuple[float, float]:
    """The native solver on given samples (uv (N, 2), xyz (N, 3) float64): (focal, shift), like
    `solve_focal_shift` (focal None) or (focal, `solve_shift`). Raises NativeBuildError without the library."""
    lib = native.library()
    if lib is None:
        raise native.NativeBuildError("the native host library is not in use (MOGE_HOST=torch or unavailable)")
    uv = np.ascontiguousarray(uv, dtype=np.float64)
    xyz = np.ascontiguousarray(xyz, dtype=np.float64)
    out = (ctypes.c_double * 2)()
    lib.moge_solve(
        uv.ctypes.data,
        xyz.ctypes.data,
        len(uv),
        math.nan if focal is None else float(focal),
        ctypes.addressof(out),
        ctypes.addressof(out) + 8,
    )
    return float(out[0]), float(out[1])


def view_plane_camera(intrinsics: np.ndarray, plan: CanvasPlan) -> tuple[float, float, float, float]:
    """(fx, fy, ox, oy): normalised image intrinsics (3, 3) seen on the canvas view plane, where a camera point
    (x, y, z) lands at (fx x / z + ox, fy y / z + oy) in the units of `view_plane_axes` (the canvas half diagonal).

    The image's normalised coordinate u (0 at its left edge, 1 at its right) sits at canvas pixel x0 + u * content
    width, so fx = content_w * fx_n / (D / 2) and ox = (x0 + content_w * cx_n - canvas_w / 2) / (D / 2); likewise
    for y. For the intrinsics that `finish.camera_intrinsics` makes from a focal f, this gives (f, f, 0, 0)."""
    cw, ch = plan.canvas_size
    x0, y0, _, _ = plan.content_box
    w, h = plan.content_size
    half = math.hypot(cw, ch) / 2
    fx, fy, cx, cy = (float(intrinsics[i, j]) for i, j in ((0, 0), (1, 1), (0, 2), (1, 2)))
    return w * fx / half, h * fy / half, (x0 + w * cx - cw / 2) / half, (y0 + h * cy - ch / 2) / half


def fast_solve_shift(uv: np.ndarray, xyz: np.ndarray, focal: float) -> float:
    """`solve_shift`, by the native solver when the native host library is in use (the same algorithm)."""
    if len(uv) < 2:
        return 0.0
    if native.library() is not None:
        return native_solve(uv, xyz, focal)[1]
    return solve_shift(uv, xyz, focal)


def recover_shift(
    points: torch.Tensor, mask: Optional[torch.Tensor], plan: CanvasPlan, intrinsics: np.ndarray
) -> float:
    """The z-shift for canvas-sized raw points (H, W, 3) when the image's normalised intrinsics (3, 3) are known.

    On the same samples as `recover_camera`, it minimises sum ||(fx x / (z + s) + ox, fy y / (z + s) + oy) - uv||^2
    over s (`view_plane_camera`), which is upstream's shift-only objective with focal 1 after x -> fx x,
    y -> fy y, uv -> uv - (ox, oy)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > MASK_THRESHOLD
    uv, xyz = solve_samples(points, mask, plan.content_box)
    fx, fy, ox, oy = view_plane_camera(intrinsics, plan)
    return fast_solve_shift(uv - (ox, oy), xyz * (fx, fy, 1.0), 1.0)
