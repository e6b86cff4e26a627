"""The host half of one prediction, in one place: options -> decode -> canvas fit | device | solve -> finish.

`MoGeModel`, the HTTP server and the CLI all go through these functions, so the same image and options give
the same arrays everywhere. Stage times (milliseconds) go into an optional `timing` dict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..output import MoGeOutput
from ..runners.base import RawMaps
from .call_options import CallOptions, check_fov_x, parse_fov_degrees
from .canvas import CanvasPlan, fit_to_canvas, plan_canvas
from .decode import InputError, to_rgb_array
from .finish import finish
from .solve import recover_camera, recover_shift

__all__ = [
    "CallOptions",
    "Forwarded",
    "Prepared",
    "prepare",
    "postprocess",
    "refinish",
    "Stopwatch",
    "check_fov_x",
    "parse_fov_degrees",
]


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


@dataclass
class Prepared:
    canvas: torch.Tensor  # (1, 3, H, W) float32 in [0, 1], or uint8 (0..255) when `prepare` was asked for uint8
    plan: CanvasPlan


def prepare(
    image: Any,
    canvas_size: tuple,
    options: CallOptions,
    timing: Optional[dict] = None,
    name: str = "image",
    *,
    exif: bool = False,
    uint8: bool = False,
) -> Prepared:
    """Decode and fit one image onto the canvas; `exif`: turn it by its EXIF orientation first (`to_rgb_array`);
    `uint8`: an 8-bit canvas where the image has one (`fit_to_canvas`; for runners that take it)."""
    watch = Stopwatch(timing)
    rgb = to_rgb_array(image, name, exif=exif)
    if options.intrinsics is not None:  # before the device: a principal point outside this image is impossible
        options.intrinsics.check_image((rgb.shape[1], rgb.shape[0]))
    watch.lap("decode")
    plan = plan_canvas((rgb.shape[1], rgb.shape[0]), canvas_size, options.fit)
    canvas = fit_to_canvas(rgb, plan, uint8)
    watch.lap("canvas")
    return Prepared(canvas, plan)


def postprocess(raw: RawMaps, plan: CanvasPlan, options: CallOptions, timing: Optional[dict] = None) -> MoGeOutput:
    """Solve the camera on the valid content region (only the shift when `intrinsics` are given), then finish at
    the input resolution."""
    watch = Stopwatch(timing)
    given = None
    # the probability goes in as is: the solve thresholds only the pixels it samples
    if options.intrinsics is None:
        focal, shift = recover_camera(raw.points, raw.mask, plan, options.fov_x)
    else:
        given = options.intrinsics
        focal, shift = None, recover_shift(raw.points, raw.mask, plan, given.normalised_matrix(plan.image_size))
    watch.lap("solve")
    out = finish(
        raw,
        plan,
        focal,
        shift,
        apply_mask=options.apply_mask,
        force_projection=options.force_projection,
        intrinsics=given,
    )
    watch.lap("finish")
    return out


@dataclass(frozen=True)
class Forwarded:
    """One image's forward without its host steps: the raw maps on its canvas (`raw`, float32 on the host, about
    28 bytes per canvas pixel) and where the image sits there (`plan`). `refinish` (`MoGeModel.finish_many`)
    turns it into a MoGeOutput with any call options of the same `fit`, as often as asked: one forward, several
    finishes (the video path finishes its calibration frames twice, with their own focal and with the clip's)."""

    raw: RawMaps
    plan: CanvasPlan


def refinish(forwarded: Forwarded, options: CallOptions, name: str = "forwarded") -> MoGeOutput:
    """`postprocess` of a forward with these options: the output `predict` gives for its image with them. The
    raw maps are only read, so a forward can be finished again. An InputError names `name` when the options do
    not fit it: another `fit` (the canvas depends on it), intrinsics whose principal point is outside its image."""
    if not isinstance(forwarded, Forwarded):
        raise InputError(f"{name}: expected a forward of MoGeModel.forward_many, got {type(forwarded).__name__}")
    plan = forwarded.plan
    if options.fit != plan.fit:
        raise InputError(
            f"fit: {name} was forwarded with fit={plan.fit!r}, got fit={options.fit!r} (the canvas depends on it; "
            "forward it again)"
        )
    if options.intrinsics is not None:
        options.intrinsics.check_image(plan.image_size)
    return postprocess(forwarded.raw, plan, options)
