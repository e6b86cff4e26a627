"""The clip's focal from the clip's own geometry: self-calibration from the calibration pass's feature tracks.

The registration (`registration.Tracker`) follows features from frame to frame, each with an id it keeps while it
is followed. Where the camera rotates, those tracks fix the focal: the image motion of a rotation R is the
homography K R K^-1, which depends on K, while the image motion of a translation depends on the depth, and any
focal fits it with a translation scaled to match. So for a candidate focal f, the reference frame's features are
lifted to 3D with K(f) and their depth, the motion (R, t) is fitted to their positions in the current frame
(perspective-n-point: SQPnP to start, then Levenberg-Marquardt, OpenCV), and the mean squared reprojection error
over all pairs is a function C(f) of the focal alone, whose minimum is the focal at which the tracked motion and
the depth agree.

* Pairs (`track_pairs`): each calibration frame with the frames GAPS = 1, 2, 4, 8 and 16 before it, over the
  tracks seen in both. A frame-to-frame rotation of a degree moves the image by a few pixels, of which the part
  that depends on the focal is a hundredth of a pixel per percent; pairs further apart see more rotation, while
  a track's error grows slowly along it.
* The depth. The model's depth of a frame is its raw depth plus a shift solved with a focal; with another focal
  the shift (`host.solve.fast_solve_shift`) and so the depth change. A search holds the depth fixed (re-solved at
  the focal it starts from), finds the minimiser of C, re-solves the depth there and searches again, until the
  focal moves by less than 0.1 % (a fixed point: the focal at which the model's depth, re-solved for it as the
  real pass will, and the tracked motion agree). Holding the depth keeps the focal's information in the image
  motion: under a pure translation C does not depend on f (the translation absorbs it), and no focal is read
  from the model's depth a second time.
* The search: C on 11 focals over +-SPAN in log f around the frames' median, a parabola through the lowest three,
  then a parabola through three focals 2 % apart around its minimum (after a depth re-solve, that refit alone).
* How well the motion fixes the focal: the curvature C'' of C in log f. With sigma^2 the squared residual per
  degree of freedom, the standard error of log f is sqrt(2 sigma^2 / (tracks x C'')) (least squares). When it is
  above MAX_UNCERTAINTY over the whole span (a camera that only translates: C is flat), at the minimum (too few
  or too poor tracks), or C has no minimum inside the span, the frames' median focal (`calibrate.clip_focal`) is
  kept and `FocalFit.reason` says why. The standard error counts the tracks' errors as independent; they are
  not quite (the same texture, the same depth), so the real error is larger: on the test clips up to 0.3 % with
  a claimed 0.2 % over 24 frames, up to 1.5 % with a claimed 0.4 % over 12 frames of less rotation (320x240).
* The tracks: per pair, those whose reprojection error at the search's starting focal is within
  MAX_RESIDUAL_SIGMAS robust standard deviations (at least MIN_RESIDUAL_PX pixels of the tracked image) are kept
  for that search, so that C is a smooth function of f; they are chosen again after each depth re-solve.

Only the focal is found here; the principal point and the pixel aspect stay the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

__all__ = ["TrackPair", "FocalFit", "track_pairs", "focal_from_tracks", "GAPS", "MAX_UNCERTAINTY", "SPAN"]

SPAN = 0.25  # the search covers log f within +-SPAN of the starting focal (about -22 % ... +28 %)
_GRID = 11  # focals of the coarse search over that span
_FINE = 0.02  # log-focal step of the parabola refit around the coarse minimum
MAX_UNCERTAINTY = 0.01  # the geometry's focal is used when its relative standard error is at most this
MAX_RESIDUAL_SIGMAS = 3.0
MIN_RESIDUAL_PX = 0.5  # pixels of the tracked (shrunk) image
_ITERATIONS = 4  # depth re-solved at the new focal at most this many times
_CONVERGED = 1e-3  # ... until the focal moves by less than this (log)
_MIN_POINTS = 8  # tracks per pair for the pair to count


@dataclass
class TrackPair:
    """Features of frame `reference` followed into frame `current` (indices of the calibration frames):
    reference_pixels, current_pixels (N, 2) full-resolution pixel positions (centres at +0.5); depth (N,) the
    reference frame's depth (metres of its output) at its features as the registration lifted it, with the
    frame's shift solved at the focal it used (the `depth_at` of `focal_from_tracks` moves it to other focals)."""

    reference: int
    current: int
    reference_pixels: np.ndarray
    current_pixels: np.ndarray
    depth: np.ndarray


GAPS = (1, 2, 4, 8, 16)  # frames between the two frames of a pair: the longer, the more rotation to read


def track_pairs(features: dict, gaps: tuple = GAPS) -> list:
    """`TrackPair`s of the frames' features (`features`: frame index -> (ids, pixels (N, 2), depth (N,)), as the
    registration's references, `calibrate._register`): for each frame c and gap g of `gaps`, the pair (c - g, c)
    over the tracks seen in both (a track is one feature id followed from frame to frame). Longer gaps see more
    rotation, which is what fixes the focal, while a track's error grows slowly along it."""
    pairs = []
    for current in sorted(features):
        ids_c, pixels_c, _ = features[current]
        for gap in gaps:
            if current - gap not in features:
                continue
            ids_r, pixels_r, depth_r = features[current - gap]
            _, r, c = np.intersect1d(ids_r, ids_c, assume_unique=True, return_indices=True)
            if len(r) >= _MIN_POINTS:
                pairs.append(TrackPair(current - gap, current, pixels_r[r], pixels_c[c], depth_r[r]))
    return pairs


@dataclass
class FocalFit:
    """What `focal_from_tracks` found (focals in pixels, fx). focal: the one to use; source: "geometry" or
    "median"; median: the frames' median focal it started from; geometry: the minimiser of the reprojection
    error (NaN when the search found none); curvature: d^2 C / d(log f)^2 at the minimum (over the
    whole span when the motion does not fix the focal), C the mean squared reprojection error per track
    (pixels^2); uncertainty: the relative standard error of the geometry's focal; pairs, points: the pairs and
    tracks used; iterations: searches (the depth re-solved between them); reason: why the median was kept."""

    focal: float
    source: str
    median: float = math.nan
    geometry: float = math.nan
    curvature: float = math.nan
    uncertainty: float = math.nan
    pairs: int = 0
    points: int = 0
    iterations: int = 0
    reason: Optional[str] = None

    def record(self) -> dict:
        def finite(x: float, digits: int = 6) -> Optional[float]:
            return round(float(x), digits) if math.isfinite(x) else None

        return {
            "source": self.source,
            "median_fx": finite(self.median, 4),
            "geometry_fx": finite(self.geometry, 4),
            "curvature": finite(self.curvature, 4),
            "uncertainty": finite(self.uncertainty, 6),
            "pairs": self.pairs,
            "points": self.points,
            "reason": self.reason,
        }


def _camera(focal: float, base: np.ndarray) -> np.ndarray:
    """`base` (3, 3) pixel intrinsics with its focal lengths scaled to `focal` (fx; fy keeps its ratio)."""
    k = base.astype(np.float64).copy()
    k[1, 1] *= focal / k[0, 0]
    k[0, 0] = focal
    return k


def _lift(pixels: np.ndarray, depth: np.ndarray, k: np.ndarray) -> np.ndarray:
    return np.stack(
        [(pixels[:, 0] - k[0, 2]) / k[0, 0] * depth, (pixels[:, 1] - k[1, 2]) / k[1, 1] * depth, depth], axis=1
    )


def _residuals(points: np.ndarray, pixels: np.ndarray, rvec: np.ndarray, tvec: np.ndarray, k: np.ndarray):
    import cv2

    moved = points @ cv2.Rodrigues(rvec)[0].T + tvec.ravel()
    z = np.where(moved[:, 2] > 1e-9, moved[:, 2], np.nan)
    projected = np.stack([k[0, 0] * moved[:, 0] / z + k[0, 2], k[1, 1] * moved[:, 1] / z + k[1, 2]], axis=1)
    return projected - pixels


class _Pairs:
    """The pairs' tracks with their fixed inlier sets and starting motions; `cost(f, depths)` is C(f)."""

    def __init__(self, pairs: list, base: np.ndarray, depths: list, focal: float, track_px: float):
        import cv2

        self.base, self.items = base, []  # (position in pairs, the pair, its kept tracks, rvec, tvec)
        k = _camera(focal, base)
        for n, (pair, depth) in enumerate(zip(pairs, depths)):
            good = np.isfinite(depth) & (depth > 0)
            if good.sum() < _MIN_POINTS:
                continue
            ref, cur = pair.reference_pixels[good], pair.current_pixels[good]
            points = _lift(ref, depth[good], k)
            try:
                ok, rvec, tvec = cv2.solvePnP(points, cur, k, None, flags=cv2.SOLVEPNP_SQPNP)
                if not ok:
                    continue
                rvec, tvec = cv2.solvePnPRefineLM(points, cur, k, None, rvec, tvec)
                error = np.linalg.norm(_residuals(points, cur, rvec, tvec, k), axis=1)
                spread = 1.4826 * float(np.nanmedian(error))
                keep = error <= max(MAX_RESIDUAL_SIGMAS * spread, MIN_RESIDUAL_PX * track_px)  # NaN: not kept
                if keep.sum() < _MIN_POINTS:
                    continue
                rvec, tvec = cv2.solvePnPRefineLM(points[keep], cur[keep], k, None, rvec, tvec)
            except cv2.error:  # degenerate tracks (all on a line, ...): the pair is left out
                continue
            self.items.append((n, pair, np.flatnonzero(good)[keep], rvec, tvec))
        self.points = int(sum(len(item[2]) for item in self.items))

    def cost(self, focal: float, depths: list) -> float:
        """The mean squared reprojection error (pixels^2 per track) of all pairs at `focal`, with the reference
        depths `depths` (per pair, all its tracks), each pair's motion refitted."""
        import cv2

        k = _camera(focal, self.base)
        total = 0.0
        for n, pair, index, rvec, tvec in self.items:
            points = _lift(pair.reference_pixels[index], depths[n][index], k)
            pixels = pair.current_pixels[index]
            try:
                r, t = cv2.solvePnPRefineLM(points, pixels, k, None, rvec.copy(), tvec.copy())
            except cv2.error:
                return math.nan
            total += float(np.square(_residuals(points, pixels, r, t, k)).sum())
        return total / max(self.points, 1)  # NaN when a track went behind the camera: no minimum here


def _parabola(x: np.ndarray, y: np.ndarray) -> tuple:
    """(argmin, curvature, minimum) of the least-squares parabola through the points (NaN where it has none)."""
    if not np.isfinite(y).all():
        return math.nan, math.nan, math.nan
    c2, c1, c0 = np.polyfit(x, y, 2)
    if not c2 > 0:
        return math.nan, 2.0 * c2, math.nan
    x0 = -c1 / (2.0 * c2)
    return x0, 2.0 * c2, c0 + c1 * x0 + c2 * x0 * x0


def focal_from_tracks(
    pairs: list,
    base: np.ndarray,
    depth_at: Callable[[float], list],
    start: float,
    track_px: float = 1.0,
) -> FocalFit:
    """The clip's focal (pixels, fx) from the calibration frames' tracks (see the module docstring).

    pairs: `TrackPair`s; base: the model's pixel intrinsics (principal point, pixel aspect); depth_at(f): per
    pair, its reference depths (N,) with the frame's depth re-solved at focal f (pixels); start: the focal to start
    from and to keep when the motion does not fix one (the frames' median); track_px: full-resolution pixels per
    pixel of the tracked (shrunk) image."""
    median = FocalFit(focal=start, source="median", median=start)
    focal, depth, grid = start, depth_at(start), np.linspace(-SPAN, SPAN, _GRID)
    for iterations in range(1, _ITERATIONS + 1):
        tracks = _Pairs(pairs, base, depth, focal, track_px)  # inliers and motions at this focal and depth
        median.pairs, median.points, median.iterations = len(tracks.items), tracks.points, iterations
        if not tracks.items:
            median.reason = "no registered pair of calibration frames with enough tracks"
            return median
        dof = 2 * tracks.points - 6 * len(tracks.items) - 1
        around, x = focal, 0.0
        if iterations == 1:  # the whole span: does the motion fix the focal at all, and where is the minimum
            costs = np.array([tracks.cost(around * math.exp(v), depth) for v in grid])
            if not np.isfinite(costs).all():
                median.reason = "the reprojection error is not defined over the whole span (degenerate tracks)"
                return median
            _, curvature, _ = _parabola(grid, costs)  # flat for a pure translation
            uncertainty = _uncertainty(float(np.min(costs)), curvature, dof)
            if not uncertainty <= MAX_UNCERTAINTY:
                median.curvature, median.uncertainty = curvature, uncertainty
                median.reason = f"the tracked motion does not fix the focal ({_spread(uncertainty)}: {_TRANSLATES})"
                return median
            i = int(np.argmin(costs))
            x = _parabola(grid[i - 1 : i + 2], costs[i - 1 : i + 2])[0] if 0 < i < len(grid) - 1 else math.nan
        if math.isfinite(x):  # then a parabola through three focals close to the minimum
            fine = x + np.array([-_FINE, 0.0, _FINE])
            x, curvature, best = _parabola(fine, np.array([tracks.cost(around * math.exp(v), depth) for v in fine]))
        if not (math.isfinite(x) and abs(math.log(around / start) + x) <= SPAN):
            median.reason = f"the reprojection error has no minimum within {SPAN} of the log focal"
            return median
        focal = around * math.exp(x)
        if abs(x) < _CONVERGED or iterations == _ITERATIONS:
            break
        depth = depth_at(focal)
    uncertainty = _uncertainty(best, curvature, dof)
    fit = FocalFit(
        focal, "geometry", start, focal, curvature, uncertainty, len(tracks.items), tracks.points, iterations
    )
    if not uncertainty <= MAX_UNCERTAINTY:
        fit.focal, fit.source = start, "median"
        fit.reason = f"the tracked motion does not fix the focal ({_spread(uncertainty)})"
    return fit


def _uncertainty(best: float, curvature: float, dof: int) -> float:
    """The relative standard error of the focal at a minimum `best` of C (mean squared error per track) with
    curvature C'' (in log f), `dof` residuals less parameters: least squares gives var(log f) = 2 sigma^2 / S''
    with S = tracks x C and sigma^2 = S_min / dof."""
    if not (curvature > 0 and dof > 0 and best >= 0):
        return math.inf
    return math.sqrt(2.0 * best / (dof * curvature))


_TRANSLATES = "too little rotation over the calibration frames, as of a camera that translates without turning"


def _spread(uncertainty: float) -> str:
    if math.isfinite(uncertainty):
        return f"standard error {uncertainty:.2%} > {MAX_UNCERTAINTY:.0%}"
    return "the reprojection error does not curve up around any focal"
