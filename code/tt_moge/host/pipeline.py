"""The host half of one prediction, in one place: options -> decode -> canvas fit | device | solve -> finish.

`MoGeModel`, the HTTP server and the CLI all go through these functions, so the same image and options give
the same arrays everywhere. Stage times (milliseconds) go into an optional `timing` dict.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional

import torch

from ..output import MoGeOutput
from ..runners.base import RawMaps
from .canvas import CanvasPlan, fit_to_canvas, plan_canvas, validate_fit
from .decode import InputError, to_rgb_array
from .finish import finish
from .solve import recover_camera

__all__ = ["CallOptions", "Prepared", "prepare", "postprocess", "Stopwatch"]


class Stopwatch:
    """Accumulates named stage durations in milliseconds into a dict (or does nothing without one)."""

    def __init__(self, timing: Optional[dict]):
        self.timing = timing
        self._t = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        if self.timing is not None:
            self.timing[stage] = self.timing.get(stage, 0.0) + (now - self._t) * 1e3
        self._t = now


@dataclass(frozen=True)
class CallOptions:
    """The per-call options of `model(image, ...)`, validated."""

    fit: str = "pad"
    fov_x: Optional[float] = None
    apply_mask: bool = True
    force_projection: bool = True

    @classmethod
    def make(cls, fit: Any = "pad", fov_x: Any = None, apply_mask: Any = True, force_projection: Any = True) -> "CallOptions":
        validate_fit(fit)
        if fov_x is not None:
            if hasattr(fov_x, "item") and getattr(fov_x, "ndim", 0) == 0:
                fov_x = fov_x.item()  # a 0-d numpy / torch value
            if isinstance(fov_x, bool) or not isinstance(fov_x, Real):
                raise InputError(f"fov_x must be a number of degrees or None, got {type(fov_x).__name__}")
            fov_x = float(fov_x)
            if not (math.isfinite(fov_x) and 0.0 < fov_x < 180.0):
                raise InputError(f"fov_x must be a horizontal field of view in degrees, 0 < fov_x < 180, got {fov_x}")
        for name, value in (("apply_mask", apply_mask), ("force_projection", force_projection)):
            if not isinstance(value, bool):
                raise InputError(f"{name} must be True or False, got {value!r}")
        return cls(fit, fov_x, apply_mask, force_projection)


@dataclass
class Prepared:
    canvas: torch.Tensor  # (1, 3, H, W) float32 in [0, 1]
    plan: CanvasPlan


def prepare(image: Any, canvas_size: tuple, options: CallOptions, timing: Optional[dict] = None,
            name: str = "image") -> Prepared:
    """Decode and fit one image onto the canvas."""
    watch = Stopwatch(timing)
    rgb = to_rgb_array(image, name)
    watch.lap("decode")
    plan = plan_canvas((rgb.shape[1], rgb.shape[0]), canvas_size, options.fit)
    canvas = fit_to_canvas(rgb, plan)
    watch.lap("canvas")
    return Prepared(canvas, plan)


def postprocess(raw: RawMaps, plan: CanvasPlan, options: CallOptions, timing: Optional[dict] = None) -> MoGeOutput:
    """Solve the camera on the valid content region, then finish at the input resolution."""
    watch = Stopwatch(timing)
    # the probability goes in as is: the solve thresholds only the pixels it samples
    focal, shift = recover_camera(raw.points, raw.mask, plan, options.fov_x)
    watch.lap("solve")
    out = finish(raw, plan, focal, shift, apply_mask=options.apply_mask, force_projection=options.force_projection)
    watch.lap("finish")
    return out
