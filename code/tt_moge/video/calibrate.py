"""Consistency over a clip: one set of intrinsics and one metric scale, fixed on the clip's first frames.

The calibration pass of a segment (the whole clip, or each `window` of it) runs its first `calibration_frames`
frames through the model once with `force_projection=False` (so the outputs keep the network's own lateral
geometry) and
1. unless intrinsics (or fov_x) are given, finds one focal for all of them: first the frames' median
   (`clip_focal`: each frame's own focal, the camera solve on its 64x64 samples, in its pixels; frames whose
   geometry does not fix a focal left out), with which each frame's shift is re-solved and the frames are
   registered one after the other (`registration.Tracker`); then the focal from the clip's geometry
   (`selfcal.focal_from_tracks`: the focal at which the features tracked over the frames and the frames' depth
   agree, which the camera's rotation fixes). When the motion fixes it (its standard error is at most 1 %), it
   is the clip's focal, the shifts are re-solved with it and the frames registered again; else (a camera that
   only translates) the median stays. The record says which (`focal`: source "geometry" / "median", the
   curvature and standard error, why the median was kept). The clip's intrinsics keep the model's principal
   point and pixel aspect;
2. from the registration on the depth re-solved with those intrinsics: each frame's metric scale relative to the
   first, c_i;
3. sets the metric level so that the median of the frames' scales is the model's own: level = 1 / median(c_i).
   The model's metric scale is then trusted on average over the frames, not frame by frame;
4. takes the colour range of depth.mp4 (1st and 99th percentile of the consistent depth of these frames).
The real pass then runs every frame with the clip's intrinsics (`intrinsics=`: the model solves only each
frame's shift) and chains the scale through the registration, starting at the level. A model with
`forward_many` / `finish_many` (MoGeModel) runs the calibration frames through the network once: their forwards
are kept (`Calibration.forwarded`), and the real pass only finishes them again with the clip's intrinsics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

from ..constants import SOLVE_GRID
from ..host import CallOptions
from ..host.intrinsics import Intrinsics
from ..host.solve import fast_solve_shift, objective, solve_focal_shift
from .calls import ModelCalls
from .registration import TRACK_SIDE, Tracker, lift
from .selfcal import FocalFit, focal_from_tracks, track_pairs

__all__ = ["Calibration", "calibrate", "clip_focal", "frame_samples", "shared_intrinsics"]

_RANGE_SAMPLES = 20000  # depths per frame pooled for the colour range


@dataclass
class Calibration:
    """What the calibration pass of one segment fixed. start: the clip index of its first frame; frames: how
    many it used; intrinsics: the clip's (None: `fov_x` was given and the model's own are used); level: the
    metric scale of the segment's first frame relative to the model's; depth_range: (near, far) metres for
    depth.mp4; fov_x: each frame's own field of view (the free solve, degrees; given ones when given); focal
    source: "solved", "given" or "fov_x"; registered: frames whose registration passed; focal: how the solved
    focal was found (`selfcal.FocalFit`; None when given); trigger: why the segment starts ("start", "window",
    "chain": a new chain, `VideoOptions.calibrate_chains`); note: why an earlier calibration was kept."""

    start: int
    frames: int
    intrinsics: Optional[Intrinsics]
    level: float
    depth_range: tuple
    fov_x: list = field(default_factory=list)
    source: str = "solved"
    registered: int = 0
    trigger: str = "start"  # why it ran: "start" (the clip's first frame), "window", "chain" (a new chain)
    note: Optional[str] = None  # set when the segment keeps an earlier calibration (its own could not be made)
    focal: Optional[FocalFit] = None
    # the frames' forwards (host.Forwarded) where the model can finish a forward again, else None: the real pass
    # finishes each once more with the clip's intrinsics and drops it (its entry set to None)
    forwarded: Optional[list] = field(default=None, repr=False)

    def record(self) -> dict:
        def finite(x: Any) -> Optional[float]:
            return round(float(x), 6) if math.isfinite(float(x)) else None

        k = self.intrinsics
        return {
            "start_frame": self.start,
            "trigger": self.trigger,
            "frames": self.frames,
            "intrinsics": self.source,
            "fx_fy_cx_cy": None if k is None else [round(v, 8) for v in (k.fx, k.fy, k.cx, k.cy)],
            "level": finite(self.level),
            "registered": self.registered,
            "focal": None if self.focal is None else self.focal.record(),
            "frame_fov_x_deg": [finite(f) for f in self.fov_x],
            "depth_range_m": [finite(v) for v in self.depth_range],
            "note": self.note,
        }


def frame_samples(out: Any, grid: tuple = SOLVE_GRID) -> tuple:
    """(uv (N, 2), xyz (N, 3), a): the camera solve's samples of one output made with `force_projection=False`,
    in its pixels: uv = (pixel centre - principal point) / half diagonal; xyz = the network's points (metric
    scale divided out) with y multiplied by a = fy / fx of the output's intrinsics, so that one focal
    (fx / half diagonal) fits both axes: minimising upstream's objective over (focal, shift) on these samples is
    the camera solve in the output's pixels."""
    h, w = out.depth.shape
    rows, cols = (np.arange(grid[0]) * h) // grid[0], (np.arange(grid[1]) * w) // grid[1]
    points = out.points[rows][:, cols].astype(np.float64) / out.metric_scale
    keep = out.mask[rows][:, cols] & np.isfinite(points).all(axis=-1)
    k = out.intrinsics.astype(np.float64)
    half = math.hypot(w, h) / 2
    u = (cols + 0.5 - k[0, 2] * w) / half
    v = (rows + 0.5 - k[1, 2] * h) / half
    uv = np.stack(np.meshgrid(u, v, indexing="xy"), axis=-1)[keep]
    a = (k[1, 1] * h) / (k[0, 0] * w)
    return uv, points[keep] * (1.0, a, 1.0), a


_LOG_STEP = 0.02  # the focal step (in log) of the curvature that says how well a frame fixes its focal
DETERMINED = 0.25  # frames whose curvature is below this share of the clip's median do not vote on its focal


def clip_focal(samples: list) -> tuple:
    """(focal, [own focal], [determined]): one focal for several frames' samples [(uv, xyz)] (`frame_samples`).

    Each frame's own focal f_k is its camera solve. How well its geometry fixes the focal is the curvature,
    in log focal, of its objective with the shift re-solved at every focal, C_k(f) = min_s objective_k(f, s):
    near 0 for a frame filled by one plane, which fits any focal with some shift. Frames whose curvature is
    below DETERMINED x the clip's median are left out; the clip's focal is the median of the others' f_k (the
    geometric mean of the two middle ones for an even count). The median, not a weighted mean and not the
    minimiser of sum_k C_k: both lean towards the shorter focals (the objective's curvature grows as 1 / f^2),
    by 0.5-1.4 % on the stand-in clips of tests/test_video.py, whose per-frame focals are off by +-10 %
    around the truth."""
    own, curvature = [], []
    for uv, xyz in samples:
        focal = solve_focal_shift(uv, xyz)[0] if len(uv) >= 2 else math.nan
        if not (math.isfinite(focal) and focal > 0):
            own.append(math.nan)
            curvature.append(0.0)
            continue
        cost = [
            objective(uv, xyz, fast_solve_shift(uv, xyz, f), f)
            for f in (focal * math.exp(-_LOG_STEP), focal, focal * math.exp(_LOG_STEP))
        ]
        own.append(focal)
        curvature.append(max(0.0, (cost[0] + cost[2] - 2 * cost[1]) / _LOG_STEP**2))
    curvature = np.asarray(curvature)
    positive = curvature[curvature > 0]
    if not positive.size:
        raise ValueError("samples: no frame has a camera solve that fixes a focal")
    determined = curvature >= DETERMINED * float(np.median(positive))
    focal = float(np.exp(np.median(np.log(np.asarray(own)[determined]))))
    return focal, own, determined.tolist()


def shared_intrinsics(outputs: list) -> tuple:
    """(Intrinsics (normalised), [shift of each output (raw units)], [own fov_x of each, degrees]): one focal for
    outputs of one camera made with `force_projection=False` (`clip_focal` on their `frame_samples`, the frames'
    median); the principal point and pixel aspect are those of the first output (the model's: the centre, square
    pixels with fit="pad")."""
    camera = _SharedCamera(outputs)
    return camera.intrinsics(camera.median), camera.shifts(camera.median), camera.own_fov_x()


class _SharedCamera:
    """One focal for the calibration outputs: the frames' samples, the median focal, and for any focal (fx,
    pixels) the clip's intrinsics and each frame's shift re-solved with it."""

    def __init__(self, outputs: list):
        self.outputs = outputs
        w, h = self.size = outputs[0].size
        self.half = math.hypot(w, h) / 2
        self.samples = [frame_samples(out) for out in outputs]
        self.aspect = self.samples[0][2]
        focal, _, _ = clip_focal([(uv, xyz) for uv, xyz, _ in self.samples])
        self.median = focal * self.half  # fx, pixels
        self.principal = outputs[0].intrinsics.astype(np.float64)[:2, 2]

    def intrinsics(self, fx: float) -> Intrinsics:
        w, h = self.size
        cx, cy = self.principal
        return Intrinsics(fx / w, fx * self.aspect / h, cx, cy, normalised=True)

    def shifts(self, fx: float) -> list:
        """Each frame's shift (raw units) re-solved with the focal fx (pixels)."""
        focal = fx / self.half
        return [fast_solve_shift(uv, xyz, focal) if len(uv) >= 2 else 0.0 for uv, xyz, _ in self.samples]

    def offsets(self, fx: float) -> list:
        """Each frame's depth offset (metres of its output) with the focal fx: its shift x its metric scale."""
        return [s * out.metric_scale for s, out in zip(self.shifts(fx), self.outputs)]

    def own_fov_x(self) -> list:
        w, _ = self.size
        own = []
        for uv, xyz, _ in self.samples:
            f = solve_focal_shift(uv, xyz)[0] if len(uv) >= 2 else math.nan
            own.append(math.degrees(2 * math.atan(w / 2 / (f * self.half))) if f > 0 else math.nan)
        return own


def _register(frames: list, outputs: list, k_pixels: np.ndarray, offsets: list, seed: int, features=None) -> list:
    """Each frame's metric scale relative to the first (NaN where its registration failed), registering the frames
    one after the other on their depth + `offsets` with `k_pixels`. `features`, a dict, receives for the first
    and every registered frame (its index) its features as a reference: (ids, pixel positions, depth), the
    tracks the focal search reads (`selfcal.track_pairs`)."""
    tracker = Tracker(seed=seed)
    relative = [1.0] + [math.nan] * (len(outputs) - 1)

    def keep(i: int) -> None:
        if features is not None:
            out = outputs[i]
            ids, pixels = tracker.features(out.depth.shape)
            features[i] = (ids, pixels, lift(pixels, out.depth, out.mask, k_pixels, offsets[i])[:, 2])

    tracker.start(frames[0][1], outputs[0].depth, outputs[0].mask, k_pixels, offsets[0], 1.0)
    keep(0)
    for i in range(1, len(outputs)):
        out = outputs[i]
        reg = tracker.register(frames[i][1], out.depth, out.mask, k_pixels, offsets[i])
        if reg.ok:
            relative[i] = 1.0 / reg.scale
            tracker.advance(relative[i])
            keep(i)
    return relative


def calibrate(
    model: Any, frames: list, call: CallOptions, start: int = 0, seed: int = 0, trigger: str = "start"
) -> Calibration:
    """The calibration pass of the segment that starts with `frames` ([(source index, RGB)]): see the module
    docstring. `call`: the clip's call options, validated (its intrinsics or fov_x, if given, are kept), which
    the model gets as they are (`calls.ModelCalls`) with apply_mask and force_projection off; `trigger`: why the
    segment starts (`Calibration.trigger`)."""
    options = replace(call, apply_mask=False, force_projection=False)  # valid: call's, two bools
    images, forwarded, calls = [rgb for _, rgb in frames], None, ModelCalls(model)
    if calls.keeps_forwards:
        forwarded = calls.forward_many(images, options)
        outputs = calls.finish_many(forwarded, options)
    else:
        outputs = calls.predict_many(images, options)
    w, h = outputs[0].size
    focal_fit = None
    if call.intrinsics is not None:
        intrinsics, offsets, source = call.intrinsics, [0.0] * len(outputs), "given"
        fov_x = [out.fov_x for out in outputs]
        relative = _register(frames, outputs, intrinsics.pixel_matrix((w, h)), offsets, seed)
    elif call.fov_x is not None:
        k = outputs[0].intrinsics.astype(np.float64)
        intrinsics = Intrinsics(k[0, 0], k[1, 1], k[0, 2], k[1, 2], normalised=True)
        offsets, source, fov_x = [0.0] * len(outputs), "fov_x", [out.fov_x for out in outputs]
        relative = _register(frames, outputs, intrinsics.pixel_matrix((w, h)), offsets, seed)
    else:
        source = "solved"
        camera = _SharedCamera(outputs)
        fov_x = camera.own_fov_x()
        offsets = camera.offsets(camera.median)
        features: dict = {}
        k_median = camera.intrinsics(camera.median).pixel_matrix((w, h))
        relative = _register(frames, outputs, k_median, offsets, seed, features)
        focal_fit = _focal_from_motion(camera, track_pairs(features), offsets, frames[0][1].shape[:2])
        if focal_fit.source == "geometry":  # the frames' depth and scales again, with the geometry's focal
            offsets = camera.offsets(focal_fit.focal)
            relative = _register(
                frames, outputs, camera.intrinsics(focal_fit.focal).pixel_matrix((w, h)), offsets, seed
            )
        intrinsics = camera.intrinsics(focal_fit.focal)

    found = np.array([c for c in relative if math.isfinite(c)])
    level = 1.0 / float(np.median(found))

    pooled = []
    rng = np.random.default_rng(seed)
    for out, c, offset in zip(outputs, relative, offsets):
        depth = out.depth[out.mask]
        if depth.size > _RANGE_SAMPLES:
            depth = rng.choice(depth, _RANGE_SAMPLES, replace=False)
        depth = (depth + offset) * level * (c if math.isfinite(c) else 1.0)
        pooled.append(depth[np.isfinite(depth) & (depth > 0)])
    pooled = np.concatenate(pooled) if pooled else np.zeros(0)
    near, far = np.percentile(pooled, [1.0, 99.0]) if pooled.size else (math.nan, math.nan)
    return Calibration(
        start=start,
        frames=len(outputs),
        intrinsics=intrinsics if source != "fov_x" else None,
        level=level,
        depth_range=(float(near), float(far)),
        fov_x=[float(f) for f in fov_x],
        source=source,
        registered=int(len(found) - 1),
        focal=focal_fit,
        trigger=trigger,
        forwarded=forwarded,
    )


def _focal_from_motion(camera: _SharedCamera, pairs: list, offsets: list, image_shape: tuple) -> FocalFit:
    """`selfcal.focal_from_tracks` on the registered pairs, starting from (and falling back to) the median."""
    w, h = camera.size
    base = camera.intrinsics(camera.median).pixel_matrix((w, h))

    def depth_at(fx: float) -> list:
        moved = camera.offsets(fx)
        return [p.depth + (moved[p.reference] - offsets[p.reference]) for p in pairs]

    track_px = max(image_shape) / min(TRACK_SIDE, max(image_shape))
    return focal_from_tracks(pairs, base, depth_at, camera.median, track_px)
