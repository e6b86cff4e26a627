"""The host half of one prediction, in one place: options -> decode -> canvas fit | device | solve -> finish.

`MoGeModel`, the HTTP server and the CLI all go through these functions, so the same image and options give
the same arrays everywhere. Stage times (milliseconds) go into an optional `timing` dict.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional

import torch

from ..constants import FITS, FOV_X_RANGE
from ..fields import bind, checked, option, options_of, signature
from ..output import MoGeOutput
from ..runners.base import RawMaps
from .canvas import CanvasPlan, fit_to_canvas, plan_canvas
from .decode import InputError, to_rgb_array
from .finish import finish
from .intrinsics import Intrinsics, check_intrinsics
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


def check_fov_x(fov_x: Any) -> Optional[float]:
    """fov_x: None, or a horizontal field of view in degrees strictly inside FOV_X_RANGE (a 0-d array counts)."""
    if fov_x is None:
        return None
    if hasattr(fov_x, "item") and getattr(fov_x, "ndim", 0) == 0:
        fov_x = fov_x.item()  # a 0-d numpy / torch value
    if isinstance(fov_x, bool) or not isinstance(fov_x, Real):
        raise InputError(f"fov_x must be a number of degrees or None, got {type(fov_x).__name__}")
    low, high = FOV_X_RANGE
    fov_x = float(fov_x)
    if not (math.isfinite(fov_x) and low < fov_x < high):
        raise InputError(
            f"fov_x must be a horizontal field of view in degrees, {low:g} < fov_x < {high:g}, got {fov_x}"
        )
    return fov_x


def parse_fov_degrees(text: str) -> float:
    """Command-line text -> a horizontal field of view in degrees."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected degrees, e.g. 60, got {text!r}") from None
    low, high = FOV_X_RANGE
    if not (math.isfinite(value) and low < value < high):
        raise ValueError(f"the horizontal field of view must be in degrees, {low:g} < fov_x < {high:g}, got {text}")
    return value


@dataclass(frozen=True)
class CallOptions:
    """The per-call options of `model(image, ...)`, validated (`make`). Each field is the one definition of its
    option (`tt_moge.fields`): the signatures of `model(...)`, `predict` and `predict_many`, the per-image flags
    of `tt-moge predict` / `batch`, the query parameters of the server and of its web page, the fields of
    `BatchJob` and the keys of a warm-up variant are generated from them."""

    fit: str = option(
        "pad",
        "pad: keep the aspect ratio, gray bars around the image; stretch: resize it to fill the canvas",
        choices=FITS,
    )
    fov_x: Optional[float] = option(
        None,
        "the horizontal field of view in degrees, if known (then only the depth shift is solved)",
        metavar="DEG",
        parse=parse_fov_degrees,
        bounds=FOV_X_RANGE,
        check=check_fov_x,
        warm=60.0,
    )
    apply_mask: bool = option(True, "set invalid pixels to inf (depth, points) and 0 (normal)")
    force_projection: bool = option(True, "compute the points from the depth and the intrinsics (as upstream does)")
    intrinsics: Optional[Intrinsics] = option(
        None,
        "the camera intrinsics, if known: fx,fy,cx,cy in pixels of the input image (or normalised, fx and cx by "
        "the width, fy and cy by the height, followed by ',normalised'); then the focal lengths and the principal "
        "point are fixed and only the depth shift is solved",
        metavar="FX,FY,CX,CY",
        parse=Intrinsics.parse,
        check=check_intrinsics,
        warm=Intrinsics(0.6, 1.0, 0.5, 0.5, normalised=True),
        argtype=Any,
    )

    def __post_init__(self) -> None:
        if self.fov_x is not None and self.intrinsics is not None:
            raise InputError("fov_x and intrinsics: give one of them (the intrinsics fix the focal already)")

    @classmethod
    def make(cls, *args: Any, **kwargs: Any) -> "CallOptions":
        """Validated options (an InputError naming the option); positional arguments in field order."""
        return cls.of_call("CallOptions.make", args, kwargs)

    @classmethod
    def of_call(cls, where: str, args: tuple = (), kwargs: Optional[dict] = None) -> "CallOptions":
        """The options of a call of `where` (e.g. "predict_many"), validated; unknown options are a TypeError
        and bad values an InputError, each naming the option."""
        given = bind(_MAKE_SIGNATURE, where, args, kwargs or {})
        return cls(**{i.name: checked(i, given[i.argument], InputError, InputError) for i in options_of(cls)})

    def kwargs(self) -> dict:
        """{argument: value}: these options as keyword arguments of `model(image, ...)`."""
        return {i.argument: getattr(self, i.name) for i in options_of(type(self))}


_MAKE_SIGNATURE = signature(CallOptions, keyword_only=False)
CallOptions.make.__func__.__signature__ = signature(
    CallOptions,
    keyword_only=False,
    leading=(inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD),),
    returns="CallOptions",
)


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
