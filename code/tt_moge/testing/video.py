"""A stand-in model for the video path: the frames of a camera moving through the analytic scene, answered the way
an imperfect MoGe-2 would, with every error known.

`VideoOracle(renders)` has the methods the video path calls, `predict_many(images, **call options)` (and
`predict`), `forward_many` and `finish_many` (MoGeModel's two halves of `predict_many`); the same three on its
`service` take the options parsed (a `host.CallOptions`, as MoGeModel's service does: the video path calls
those, with the clip's options). It returns real
`MoGeOutput`s: for each image it builds the raw maps a network would give and runs tt_moge's own host code on
them (`host.postprocess`: the camera solve, or the shift alone when `intrinsics` or `fov_x` are given, and the
finish), on a canvas of the frame's own size. So every call option means what it means for the model. The raw
maps of frame i are its exact geometry (`tt_moge.scene.render_path`) with:

* an arbitrary scale and z-shift (affine-invariant points): the points are divided by the frame's median depth
  and shifted along z by `shifts[i]` (raw units);
* a metric scale off by `scale_errors[i]`: metric_scale = median depth x (1 + scale_errors[i]), so the frame's
  metric depth is off by that factor;
* a focal off by `focal_errors[i]`: the lateral coordinates are distorted so that the free camera solve finds a
  focal (1 + focal_errors[i]) x the truth, by a depth-dependent lateral scale x y * (1 + a (1 + m / z)) with m
  chosen so that the distortion is orthogonal (on the solve's samples) to the direction in which the shift moves
  the residuals: to first order it leaves the shift solved with the true focal unchanged. This is the near
  degeneracy of MoGe's focal and shift, and what a known or jointly solved focal removes;
* multiplicative noise along each pixel's ray (`noise`, standard deviation) and holes: random discs covering
  about `holes` of the frame, where the mask probability is 0 (as on the sky);
* spatially correlated errors (`warp`): each frame's points multiplied along their rays by a smooth field
  exp(warp x g(u, v)), g a sum of a few random cosines of one to two cycles across the image, with a
  standard deviation of 1 over the frame, drawn anew for each frame. A real network errs smoothly (a wall bent,
  a floor tilted, the far field too near), not pixel by pixel, and such errors do not average out over the
  features of a registration as per-pixel noise does.

Renders may be `tt_moge.scene.compact` (points lifted from the depth, no normal): for clips of hundreds of frames.
Raw maps are made when asked and the last `raw_cache` (RAW_CACHE) kept, so a long clip holds a bounded number of
them (about 40 MB each at 1920x1080: a bench that asks for each frame once keeps 1).

Each image is matched to its frame by its 16x12 thumbnail (the nearest in mean absolute difference), so frames
that went through a lossy video file are still recognised. `calls` records (number of images, options) per call;
`forwards` counts the images that went through the "network" (`predict_many` and `forward_many`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np

__all__ = [
    "VideoOracle",
    "PredictOnly",
    "symmetric_errors",
    "stand_in",
    "real_errors",
    "aligned_positions",
    "smooth_warp",
    "depth_ratio",
    "path_length",
    "trajectory_error",
    "walk_figures",
]

_THUMB = (16, 12)
RAW_CACHE = 64  # raw maps kept (frames asked again: the calibration's, a rewind's)


def symmetric_errors(count: int, spread: float, seed: int = 0) -> np.ndarray:
    """`count` per-frame relative errors spread evenly over [-spread, +spread] in a random order: errors of up to
    +-spread that average to zero over the clip (an unbiased model)."""
    rng = np.random.default_rng(seed)
    return rng.permutation(np.linspace(-spread, spread, count)) if count > 1 else np.zeros(count)


def _thumb(rgb: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.resize(np.ascontiguousarray(rgb), _THUMB, interpolation=cv2.INTER_AREA).astype(np.float32)


def _holes(shape: tuple, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """(H, W) bool: random discs until about `fraction` of the pixels are covered."""
    h, w = shape
    holes = np.zeros(shape, bool)
    if fraction <= 0:
        return holes
    rows, cols = np.ogrid[:h, :w]
    while holes.mean() < fraction:
        r = rng.uniform(0.03, 0.08) * w
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        holes |= (rows - cy) ** 2 + (cols - cx) ** 2 < r * r
    return holes


def smooth_warp(shape: tuple, rng: np.random.Generator, waves: int = 4) -> np.ndarray:
    """(H, W) float64: a smooth random field of mean 0 and standard deviation 1 over the frame, the sum of `waves`
    plane cosines of random direction, 1 to 2 cycles across the image's longer side, and random phase."""
    h, w = shape
    rows, cols = np.mgrid[0:h, 0:w].astype(np.float64) / max(h, w)
    field = np.zeros(shape)
    for _ in range(waves):
        angle, cycles, phase = rng.uniform(0, 2 * math.pi), rng.uniform(1.0, 2.0), rng.uniform(0, 2 * math.pi)
        field += np.cos(2 * math.pi * cycles * (cols * math.cos(angle) + rows * math.sin(angle)) + phase)
    field -= field.mean()
    return field / field.std()


class VideoOracle:
    """A stand-in for MoGeModel over the frames of `renders` (a list of `tt_moge.scene.SceneRender`, one camera)."""

    def __init__(
        self,
        renders: Sequence,
        *,
        scale_errors: Optional[Sequence[float]] = None,
        focal_errors: Optional[Sequence[float]] = None,
        shifts: Optional[Sequence[float]] = None,
        noise: float = 0.0,
        holes: float = 0.0,
        warp: float = 0.0,
        seed: int = 0,
        has_normal: bool = True,
        raw_cache: int = RAW_CACHE,
    ):
        n = len(renders)
        # listed (a copy), except a sequence of another kind: a bench's frames rendered when asked
        lazy = hasattr(renders, "__getitem__") and not isinstance(renders, (list, tuple))
        self.renders = renders if lazy else list(renders)
        self.raw_cache = raw_cache
        self.scale_errors = np.zeros(n) if scale_errors is None else np.asarray(scale_errors, np.float64)
        self.focal_errors = np.zeros(n) if focal_errors is None else np.asarray(focal_errors, np.float64)
        self.shifts = np.zeros(n) if shifts is None else np.asarray(shifts, np.float64)
        self.noise, self.holes, self.warp, self.seed = noise, holes, warp, seed
        self.has_normal = has_normal and all(r.normal is not None for r in self.renders)
        self._thumbs = np.stack([_thumb(r.image) for r in self.renders])
        self._raw: OrderedDict = OrderedDict()
        self.calls: list = []
        self.forwards = 0

    # --------------------------------------------------------------------------------- the model
    def frame_of(self, rgb: np.ndarray) -> int:
        """The index of the frame whose thumbnail is nearest to the image's."""
        return int(np.abs(self._thumbs - _thumb(rgb)[None]).mean(axis=(1, 2, 3)).argmin())

    def predict_many(self, images: Any, **options: Any) -> list:
        from ..host import CallOptions

        return self.service.predict_many(images, CallOptions.make(**options))

    def predict(self, image: Any, **options: Any) -> Any:
        return self.predict_many([image], **options)[0]

    def forward_many(self, images: Any, **options: Any) -> list:
        from ..host import CallOptions

        return self.service.forward_many(images, CallOptions.make(**options))

    def finish_many(self, forwarded: Any, **options: Any) -> list:
        from ..host import CallOptions

        return self.service.finish_many(forwarded, CallOptions.make(**options))

    @property
    def service(self) -> "_OracleService":
        """The calls with the options already parsed (a `host.CallOptions`), as MoGeModel's `service`: what the
        video path calls, with the clip's options."""
        return _OracleService(self)

    def _forward(self, images: Any, call: Any) -> list:
        """[(host.Forwarded, CallOptions)] of the images: each frame's raw maps on a canvas of its own size."""
        from ..host import Forwarded, plan_canvas, to_rgb_array

        images = list(images)
        self.calls.append((len(images), call))
        self.forwards += len(images)
        done = []
        for i, image in enumerate(images):
            rgb = to_rgb_array(image, f"images[{i}]")
            h, w = rgb.shape[:2]
            index = self.frame_of(rgb)
            if self.renders[index].image.shape[:2] != (h, w):
                known = self.renders[index].image.shape[1::-1]
                raise ValueError(f"the stand-in knows frames of {known}, got {w}x{h}")
            if call.intrinsics is not None:
                call.intrinsics.check_image((w, h))
            done.append((Forwarded(self.raw_maps(index), plan_canvas((w, h), (w, h), call.fit)), call))
        return done

    # -------------------------------------------------------------------------------- raw maps
    def raw_maps(self, index: int) -> Any:
        """The raw maps (`runners.base.RawMaps`, at the frame's size) of frame `index` (the same every time: its
        errors are drawn from (seed, index); the last RAW_CACHE are kept)."""
        if index not in self._raw:
            self._raw[index] = self._make_raw(index)
            while len(self._raw) > self.raw_cache:
                self._raw.popitem(last=False)
        self._raw.move_to_end(index)
        return self._raw[index]

    def _make_raw(self, index: int) -> Any:
        import torch

        from ..runners.base import RawMaps

        truth = self.renders[index]
        rng = np.random.default_rng((self.seed, index))
        h, w = truth.depth.shape
        valid = truth.mask & ~_holes((h, w), self.holes, rng)
        scale = float(np.median(truth.depth[valid]))
        points = truth.points if truth.points is not None else _lifted(truth)
        along = 1.0 + self.noise * rng.standard_normal((h, w))
        if self.warp:
            along *= np.exp(self.warp * smooth_warp((h, w), np.random.default_rng((self.seed, index, 1))))
        points = points * along[..., None] / scale
        if self.focal_errors[index] != 0:
            points[..., :2] *= self._lateral_factor(points, valid, self.focal_errors[index])[..., None]
        points[..., 2] += self.shifts[index]
        points[~valid] = (0.0, 0.0, 1.0)  # whatever a network says there is masked out
        normal = torch.from_numpy(truth.normal.astype(np.float32)) if self.has_normal else None
        return RawMaps(
            torch.from_numpy(points.astype(np.float32)),
            normal,
            torch.from_numpy(valid.astype(np.float32)),
            scale * (1.0 + self.scale_errors[index]),
        )

    @staticmethod
    def _lateral_factor(points: np.ndarray, valid: np.ndarray, focal_error: float) -> np.ndarray:
        """(H, W) factors 1 + a (1 + m / z) for the lateral coordinates: m makes the distortion orthogonal to the
        shift's direction on the valid pixels; a is found (secant steps on the free solve's focal) so that the
        free solve lands at (1 + focal_error) x the undistorted focal."""
        from .. import native
        from ..host.solve import native_solve, solve_focal_shift

        solve = native_solve if native.library() is not None else solve_focal_shift  # the same solver, faster

        z = points[..., 2]
        ray2 = np.where(valid, (points[..., 0] ** 2 + points[..., 1] ** 2) / np.where(valid, z * z, 1.0), 0.0)
        inv = np.where(valid, 1.0 / np.where(valid, z, 1.0), 0.0)
        m = -float((ray2 * inv).sum() / (ray2 * inv * inv).sum())
        shape = 1.0 + m * inv
        step = max(1, int(math.sqrt(valid.sum() / 4096)))  # about the solve's 64x64 samples
        sub = valid[::step, ::step]
        xyz = points[::step, ::step][sub]
        uv_true = xyz[:, :2] / xyz[:, 2:3]  # the view plane of focal 1 (the undistorted solve's focal is 1)

        def focal(a: float) -> float:
            distorted = xyz.copy()
            distorted[:, :2] *= (1.0 + a * shape[::step, ::step][sub])[:, None]
            return solve(uv_true, distorted)[0]

        target, f0 = 1.0 + focal_error, focal(0.0)
        a0, a1 = 0.0, -focal_error
        f_a0, f_a1 = f0, focal(a1)
        for _ in range(6):  # secant steps on focal(a) = target * f0
            if f_a1 == f_a0:
                break
            a0, a1, f_a0 = a1, a1 + (target * f0 - f_a1) * (a1 - a0) / (f_a1 - f_a0), f_a1
            f_a1 = focal(a1)
            if abs(f_a1 / f0 - target) < 1e-5:
                break
        return 1.0 + a1 * shape


class _OracleService:
    """`VideoOracle.service`: predict_many / forward_many / finish_many taking a validated `host.CallOptions`
    (`PredictionService`'s signatures); each call is recorded in the oracle's `calls`."""

    def __init__(self, oracle: VideoOracle):
        self.oracle = oracle

    def predict_many(self, images: Any, options: Any) -> list:
        from ..host import refinish

        return [refinish(f, call) for f, call in self.oracle._forward(images, options)]

    def forward_many(self, images: Any, options: Any) -> list:
        return [f for f, _ in self.oracle._forward(images, options)]

    def finish_many(self, forwarded: Any, options: Any) -> list:
        from ..host import refinish

        forwarded = list(forwarded)
        self.oracle.calls.append((len(forwarded), options))
        return [refinish(f, options, f"forwarded[{i}]") for i, f in enumerate(forwarded)]


def _lifted(frame: Any) -> np.ndarray:
    """(H, W, 3) camera-space points of a compact render: depth x K^-1 [u, v, 1] at the pixel centres (0 on sky)."""
    h, w = frame.depth.shape
    k = np.asarray(frame.intrinsics, np.float64)
    u = (np.arange(w) + 0.5 - k[0, 2]) / k[0, 0]
    v = (np.arange(h) + 0.5 - k[1, 2]) / k[1, 1]
    z = np.where(frame.mask, frame.depth, 0.0).astype(np.float64)
    return np.stack([u[None, :] * z, v[:, None] * z, z], axis=-1)


def stand_in(renders: Sequence[Any], **overrides: Any) -> "VideoOracle":
    """The video tests' stand-in model on `renders`: metric scale off by up to +-15 % per frame, focal by up to
    +-10 %, a shift from -0.3 to 0.3 over the clip, pixel noise 0.005, holes 5 % (`overrides` replace any of these
    VideoOracle arguments). The perf scripts' gaps bench uses the same, so its numbers are the tests' case."""
    n = len(renders)
    errors = dict(
        scale_errors=symmetric_errors(n, 0.15, 1),
        focal_errors=symmetric_errors(n, 0.10, 2),
        shifts=np.linspace(-0.3, 0.3, n),
        noise=0.005,
        holes=0.05,
    )
    return VideoOracle(renders, **{**errors, **overrides})


def aligned_positions(poses: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """The camera positions of `poses` (N, 4, 4) after the similarity that best maps them onto `truth`'s
    (Umeyama): what a trajectory error is measured on, the clip's world being arbitrary up to a similarity."""
    from ..video.registration import umeyama

    s, r, t = umeyama(poses[:, :3, 3], truth[:, :3, 3])
    return (s * (r @ poses[:, :3, 3].T)).T + t


def real_errors(renders: Sequence[Any], draw: int = 0, **more: Any) -> "VideoOracle":
    """The stand-in with issue 45's errors of a real network: metric scale +-5 % per frame, 2 % noise along each
    ray, 3 % holes (and `more`: `warp=0.03` for the correlated ones); `draw` picks another draw of them (0: the
    tests' own)."""
    n = len(renders)
    scales = symmetric_errors(n, 0.05, draw + 1)
    return VideoOracle(renders, scale_errors=scales, noise=0.02, holes=0.03, seed=draw, **more)


def depth_ratio(out: Any, truth: Any) -> float:
    """The median of a frame's depth / the true depth over the pixels valid in both."""
    both = out.mask & truth.mask & np.isfinite(out.depth)
    return float(np.median(out.depth[both] / truth.depth[both]))


def path_length(poses: np.ndarray) -> float:
    return float(np.linalg.norm(np.diff(poses[:, :3, 3], axis=0), axis=1).sum())


def trajectory_error(poses: np.ndarray, truth: np.ndarray) -> float:
    """The trajectory error (root mean square, after a similarity alignment) as a share of the true path's length."""
    aligned = aligned_positions(poses, truth)
    return math.sqrt(np.mean(np.sum((aligned - truth[:, :3, 3]) ** 2, axis=1))) / path_length(truth)


def walk_figures(clip: Any, poses: np.ndarray, renders: Sequence[Any]) -> dict:
    """A clip's figures against the truth: the spread (standard deviation / mean) of each frame's depth / true
    depth, its drift from the first frame to the last, the ATE as a share of the path, and the first and last
    ratios (`predict_video`'s result with its frames, the true camera-to-world poses, the renders)."""
    ratio = np.array([depth_ratio(out, truth) for out, truth in zip(clip.frames, renders)])
    return {
        "spread": float(ratio.std() / ratio.mean()),
        "drift": float(abs(ratio[-1] / ratio[0] - 1)),
        "ate": trajectory_error(clip.poses, poses),
        "first_last": (float(ratio[0]), float(ratio[-1])),
    }


class PredictOnly:
    """`model` seen with `predict_many` only, the least the video path asks of a model: its calibration frames then
    run through the model twice, as they did before the video path kept their forwards (`finish_many`). For
    comparisons: the same clip, exactly, at the old cost."""

    def __init__(self, model: Any):
        self.model = model

    def predict_many(self, images: Any, **options: Any) -> list:
        return self.model.predict_many(images, **options)
