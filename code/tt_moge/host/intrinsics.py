"""Known camera intrinsics, the value of the call option `intrinsics` (`host.CallOptions`).

Given intrinsics fix the focal lengths and the principal point; the camera solve then finds only the depth
shift (`solve.recover_shift`), and the output's intrinsics are exactly the given ones. They may be given

* in pixels of the input image (the default reading): `(fx, fy, cx, cy)`, a 3x3 matrix, or the text
  "fx,fy,cx,cy" (the command line's `--intrinsics`, the server's query parameter);
* normalised (fx, cx by the image width; fy, cy by its height, as `MoGeOutput.intrinsics`):
  `Intrinsics(fx, fy, cx, cy, normalised=True)`, `Intrinsics.from_matrix(K, normalised=True)` or the text
  "fx,fy,cx,cy,normalised".

Pixel centres are at half-integers: the pixel (0, 0) is centred at (0.5, 0.5), as in `MoGeOutput.intrinsics_pixels`.
Impossible values are an InputError naming `intrinsics` (no skew; focal lengths finite and > 0; the principal
point inside the image; the field of view of each axis strictly inside `FOV_X_RANGE`, the bounds of `fov_x`:
normalised values when given, pixels once the image's size is known).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional

import numpy as np

from ..constants import FOV_X_RANGE
from .decode import InputError

__all__ = ["Intrinsics", "check_intrinsics", "NORMALISED_WORD"]

NORMALISED_WORD = "normalised"  # the fifth item of the text form that says the values are normalised


def _number(value: Any, what: str) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()  # a 0-d numpy / torch value
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InputError(f"intrinsics: {what} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise InputError(f"intrinsics: {what} must be finite, got {value}")
    return value


@dataclass(frozen=True)
class Intrinsics:
    """A pinhole camera without skew: focal lengths (fx, fy) and principal point (cx, cy), in pixels of the input
    image, or normalised (fx, cx by the width; fy, cy by the height) when `normalised` is True."""

    fx: float
    fy: float
    cx: float
    cy: float
    normalised: bool = False

    def __post_init__(self) -> None:
        for name in ("fx", "fy", "cx", "cy"):
            object.__setattr__(self, name, _number(getattr(self, name), name))
        if not isinstance(self.normalised, bool):
            raise InputError(f"intrinsics: normalised must be True or False, got {self.normalised!r}")
        if self.fx <= 0 or self.fy <= 0:
            raise InputError(f"intrinsics: the focal lengths must be > 0, got fx={self.fx:g}, fy={self.fy:g}")
        unit = "" if self.normalised else " pixels"
        if not self.normalised and self.fx <= 1 and self.fy <= 1:
            raise InputError(
                f"intrinsics: fx={self.fx:g}, fy={self.fy:g} pixels is a field of view of almost 180 degrees; "
                f"normalised intrinsics (fx, cx by the width; fy, cy by the height) need the word "
                f"'{NORMALISED_WORD}' (text 'fx,fy,cx,cy,{NORMALISED_WORD}', or Intrinsics(..., normalised=True))"
            )
        if self.normalised and not (0 < self.cx < 1 and 0 < self.cy < 1):
            raise InputError(
                f"intrinsics: a normalised principal point lies inside (0, 1), got cx={self.cx:g}, cy={self.cy:g}{unit}"
            )
        if self.normalised:
            self._check_fields_of_view(1.0, 1.0)

    def _check_fields_of_view(self, width: float, height: float) -> None:
        """Each axis's field of view strictly inside FOV_X_RANGE, as `fov_x` is bounded: 1e-300 normalised made
        fx 0 (180 degrees, no pixel valid), 1e308 pixels an infinite camera matrix."""
        low, high = FOV_X_RANGE
        for axis, focal, side in (("x", self.fx, width), ("y", self.fy, height)):
            fov = math.degrees(2.0 * math.atan2(0.5 * side, focal))
            if not low < fov < high:
                what = "normalised" if self.normalised else f"pixels of a {width:g}x{height:g} image"
                raise InputError(
                    f"intrinsics: f{axis}={focal:g} ({what}) is a field of view of {fov:.6g} degrees; expected "
                    f"{low:g} < fov_{axis} < {high:g} degrees, the bounds of fov_x"
                )

    # ------------------------------------------------------------------------------------ making one
    @classmethod
    def from_matrix(cls, matrix: Any, normalised: bool = False) -> "Intrinsics":
        """A 3x3 camera matrix [[fx, 0, cx], [0, fy, cy], [0, 0, 1]] (numpy, torch or nested lists)."""
        try:
            k = np.asarray(matrix, dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError("intrinsics: a camera matrix must be 3x3 numbers") from None
        if k.shape != (3, 3):
            raise InputError(f"intrinsics: a camera matrix must be 3x3, got shape {k.shape}")
        if not np.isfinite(k).all():
            raise InputError("intrinsics: the camera matrix has non-finite entries")
        if k[0, 1] != 0 or k[1, 0] != 0:
            raise InputError(f"intrinsics: skew is not supported (K[0, 1] = {k[0, 1]:g}, K[1, 0] = {k[1, 0]:g})")
        if not np.array_equal(k[2], [0.0, 0.0, 1.0]):
            raise InputError(f"intrinsics: the last row of a camera matrix must be [0, 0, 1], got {k[2].tolist()}")
        return cls(k[0, 0], k[1, 1], k[0, 2], k[1, 2], normalised=normalised)

    @classmethod
    def parse(cls, text: str) -> "Intrinsics":
        """Text "fx,fy,cx,cy" (pixels) or "fx,fy,cx,cy,normalised" -> Intrinsics; a ValueError says what was
        expected (the command line turns it into a usage error)."""
        if not isinstance(text, str):
            raise InputError(f"intrinsics: expected text 'fx,fy,cx,cy', got {type(text).__name__}")
        items = [t.strip() for t in text.split(",")]
        normalised = len(items) == 5 and items[4].lower() in (NORMALISED_WORD, "normalized")
        if len(items) != 4 and not normalised:
            raise InputError(
                f"intrinsics: expected 'fx,fy,cx,cy' in pixels or 'fx,fy,cx,cy,{NORMALISED_WORD}', got {text!r}"
            )
        try:
            values = [float(t) for t in items[:4]]
        except ValueError:
            raise InputError(f"intrinsics: expected four numbers 'fx,fy,cx,cy', got {text!r}") from None
        return cls(*values, normalised=normalised)

    def text(self) -> str:
        """The text form that `parse` reads back to these values."""
        values = ",".join(repr(v) for v in (self.fx, self.fy, self.cx, self.cy))
        return values + (f",{NORMALISED_WORD}" if self.normalised else "")

    def __str__(self) -> str:
        return self.text()

    # ------------------------------------------------------------------------------- for an image
    def check_image(self, size: tuple, name: str = "intrinsics") -> None:
        """An InputError when the principal point lies outside an image of `size` = (width, height)."""
        w, h = size
        cx, cy = (self.cx, self.cy) if self.normalised else (self.cx / w, self.cy / h)
        if not (0 < cx < 1 and 0 < cy < 1):
            raise InputError(
                f"{name}: the principal point ({self.cx:g}, {self.cy:g}){'' if self.normalised else ' pixels'} lies "
                f"outside the {w}x{h} image"
            )
        if not self.normalised:
            self._check_fields_of_view(float(w), float(h))

    def normalised_matrix(self, size: tuple) -> np.ndarray:
        """(3, 3) float64 normalised intrinsics for an image of `size` = (width, height)."""
        w, h = (1.0, 1.0) if self.normalised else (float(size[0]), float(size[1]))
        return np.array([[self.fx / w, 0.0, self.cx / w], [0.0, self.fy / h, self.cy / h], [0.0, 0.0, 1.0]])

    def pixel_matrix(self, size: tuple) -> np.ndarray:
        """(3, 3) float64 intrinsics in pixels of an image of `size` = (width, height)."""
        w, h = (float(size[0]), float(size[1])) if self.normalised else (1.0, 1.0)
        return np.array([[self.fx * w, 0.0, self.cx * w], [0.0, self.fy * h, self.cy * h], [0.0, 0.0, 1.0]])


def check_intrinsics(value: Any) -> Optional[Intrinsics]:
    """The call option `intrinsics`: None; an `Intrinsics`; text "fx,fy,cx,cy[,normalised]"; `(fx, fy, cx, cy)`
    or a 3x3 matrix in pixels. Anything else, or impossible values, is an InputError naming `intrinsics`."""
    if value is None or isinstance(value, Intrinsics):
        return value
    if isinstance(value, str):
        return Intrinsics.parse(value)
    if isinstance(value, dict):
        raise InputError("intrinsics: expected (fx, fy, cx, cy), a 3x3 matrix, text or an Intrinsics, got a dict")
    try:
        shape = np.shape(value)
    except (TypeError, ValueError):
        shape = None
    if shape == (3, 3):
        return Intrinsics.from_matrix(value)
    if shape == (4,):
        return Intrinsics(*list(value))
    raise InputError(
        "intrinsics: expected (fx, fy, cx, cy) or a 3x3 matrix in pixels, text 'fx,fy,cx,cy[,normalised]' or an "
        f"Intrinsics, got {type(value).__name__}{'' if shape is None else f' of shape {shape}'}"
    )
