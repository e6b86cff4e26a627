"""The options of one call, `model(image, ...)`: `CallOptions` and the checks of its fields. Apart from the
pipeline that uses them (`pipeline.py`) and free of torch, so that the command line builds its flags from these
definitions without importing torch (`tt-moge predict --help` answers in a second, not seven)."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Mapping, Optional

from ..constants import FITS, FOV_X_RANGE
from ..fields import bind, checked, option, options_of, takes_options
from .decode import InputError
from .intrinsics import Intrinsics, check_intrinsics

__all__ = ["CallOptions", "check_fov_x", "parse_fov_degrees"]


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
    option (`tt_moge.fields`): the per-image flags of `tt-moge predict` / `batch`, the web page's controls, the
    fields of `BatchJob` and the keys of a warm-up variant are generated from them. The calls that take them
    (`make`, `model(...)`, `predict`, `predict_many`, ..., the server's query parameters) have them written out
    in their defs, in this order (tests/test_one_definition.py checks each against these fields)."""

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
    @takes_options("CallOptions.make")
    def make(
        cls,
        fit: str = "pad",
        fov_x: Optional[float] = None,
        apply_mask: bool = True,
        force_projection: bool = True,
        intrinsics: Any = None,
    ) -> "CallOptions":
        """Validated options (an InputError naming the option); positional arguments in field order."""
        return cls.of_arguments(locals())

    @classmethod
    def of_arguments(cls, given: Mapping) -> "CallOptions":
        """The options in `given`, a mapping that holds every option's argument (a `bind` result, or the `locals()`
        of a def that has them as its parameters), validated: a bad value is an InputError naming the option."""
        return cls(**{i.name: checked(i, given[i.argument], InputError, InputError) for i in options_of(cls)})

    @classmethod
    def of_call(cls, where: str, args: tuple = (), kwargs: Optional[dict] = None) -> "CallOptions":
        """The options of a call of `where` (e.g. "predict_many"), validated; unknown options are a TypeError
        and bad values an InputError, each naming the option."""
        return cls.of_arguments(bind(_MAKE_SIGNATURE, where, args, kwargs or {}))

    def kwargs(self) -> dict:
        """{argument: value}: these options as keyword arguments of `model(image, ...)`."""
        return {i.argument: getattr(self, i.name) for i in options_of(type(self))}


_MAKE_SIGNATURE = inspect.signature(CallOptions.make)  # the written one: (fit, fov_x, ...)
