"""Canvas fit: place an RGB image on the fixed canvas the device runs on, and remember where it went.

* ``fit="pad"``: scale by min(canvas_w / w, canvas_h / h) keeping the aspect ratio, centre it, fill the bars
  with gray (PAD_GRAY). The content box is the rectangle of canvas pixels that hold the image.
* ``fit="stretch"``: resize to the whole canvas (the content box is the canvas).

Resampling uses OpenCV: INTER_AREA when shrinking on both axes (no aliasing), INTER_LINEAR otherwise.
An image that already has the canvas size is used as is (a float one without any 8-bit rounding).
With the native host library, the gray bars and the uint8 -> [0, 1] float conversion are one pass into a
recycled buffer (the same values: value / 255 by IEEE division, as torch's div_).

`uint8=True` (runners that take 8-bit canvases: `Runner.takes_uint8`, the Tenstorrent runner, whose device does
the / 255) gives the same canvas as (1, 3, H, W) uint8 planes, contiguous: 4x fewer bytes to convert, copy and
send. Every canvas is 8-bit but one: a float image of the canvas size, used as is; that one stays float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import native
from ..constants import PAD_GRAY
from . import buffers
from .decode import float_to_uint8

__all__ = ["CanvasPlan", "plan_canvas", "fit_to_canvas"]


@dataclass(frozen=True)
class CanvasPlan:
    """Where an image of `image_size` sits on a canvas of `canvas_size` (both (width, height))."""

    canvas_size: tuple
    image_size: tuple
    content_box: tuple  # (x0, y0, x1, y1) canvas pixels, end exclusive
    fit: str

    @property
    def content_size(self) -> tuple:
        x0, y0, x1, y1 = self.content_box
        return x1 - x0, y1 - y0

    @property
    def is_identity(self) -> bool:
        """The image is the canvas: no resize, no bars."""
        return self.image_size == self.canvas_size


def plan_canvas(image_size: tuple, canvas_size: tuple, fit: str) -> CanvasPlan:
    w, h = image_size
    cw, ch = canvas_size
    if fit == "stretch" or (w, h) == (cw, ch):
        return CanvasPlan(tuple(canvas_size), (w, h), (0, 0, cw, ch), fit)
    scale = min(cw / w, ch / h)
    nw, nh = min(cw, max(1, round(w * scale))), min(ch, max(1, round(h * scale)))
    x0, y0 = (cw - nw) // 2, (ch - nh) // 2
    return CanvasPlan(tuple(canvas_size), (w, h), (x0, y0, x0 + nw, y0 + nh), fit)


def _resize(rgb: np.ndarray, size: tuple) -> np.ndarray:
    import cv2

    w, h = rgb.shape[1], rgb.shape[0]
    shrink = size[0] <= w and size[1] <= h
    return cv2.resize(rgb, size, interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)


def _uint8_to_unit(rgb: np.ndarray) -> torch.Tensor:
    # astype makes a writable float copy (decoded images can be read-only views)
    return torch.from_numpy(rgb.astype(np.float32)).permute(2, 0, 1)[None].div_(255.0)


def _native_fill(kernel, content: np.ndarray, plan: CanvasPlan, out: np.ndarray) -> None:
    """The uint8 content on the gray canvas into `out` by a native kernel (`moge_canvas_to_unit`: (H, W, 3) float32
    in [0, 1]; `moge_canvas_planes_u8`: (3, H, W) uint8); both take the same arguments."""
    if content.strides[2] != 1:
        content = np.ascontiguousarray(content)
    cw, ch = plan.canvas_size
    x0, y0, _, _ = plan.content_box
    kernel(
        content.ctypes.data,
        content.strides[0],
        content.strides[1],
        content.shape[1],
        content.shape[0],
        x0,
        y0,
        cw,
        ch,
        PAD_GRAY,
        out.ctypes.data,
    )


def _canvas_native(lib, content: np.ndarray, plan: CanvasPlan) -> torch.Tensor:
    cw, ch = plan.canvas_size
    out = buffers.empty((ch, cw, 3), np.float32)
    _native_fill(lib.moge_canvas_to_unit, content, plan, out)
    return torch.from_numpy(out).permute(2, 0, 1)[None]


def _planes_u8(lib, content: np.ndarray, plan: CanvasPlan) -> torch.Tensor:
    """The content on the gray canvas as (1, 3, H, W) uint8 planes (a recycled buffer)."""
    cw, ch = plan.canvas_size
    x0, y0, x1, y1 = plan.content_box
    out = buffers.empty((3, ch, cw), np.uint8)
    if lib is not None:
        _native_fill(lib.moge_canvas_planes_u8, content, plan, out)
    else:
        out.fill(PAD_GRAY)
        out[:, y0:y1, x0:x1] = content.transpose(2, 0, 1)
    return torch.from_numpy(out)[None]


def fit_to_canvas(rgb: np.ndarray, plan: CanvasPlan, uint8: bool = False) -> torch.Tensor:
    """(H, W, 3) uint8 or float32 RGB -> (1, 3, canvas_h, canvas_w) float32 tensor in [0, 1] (a channels-last
    view of an (H, W, 3) buffer); with `uint8`, (1, 3, canvas_h, canvas_w) uint8 planes (0..255, contiguous)
    unless the image is a float one of the canvas size (then the float32 canvas, which has no 8-bit form)."""
    lib = native.library()
    if plan.is_identity:
        if rgb.dtype == np.uint8:
            if uint8:
                return _planes_u8(lib, rgb, plan)
            return _canvas_native(lib, rgb, plan) if lib is not None else _uint8_to_unit(rgb)
        return torch.from_numpy(np.ascontiguousarray(rgb, dtype=np.float32)).permute(2, 0, 1)[None].contiguous()
    if rgb.dtype != np.uint8:
        rgb = float_to_uint8(rgb)  # non-canvas float images go through 8 bit, as over HTTP
    cw, ch = plan.canvas_size
    x0, y0, x1, y1 = plan.content_box
    content = _resize(rgb, (x1 - x0, y1 - y0)) if (x1 - x0, y1 - y0) != plan.image_size else rgb
    if uint8:
        return _planes_u8(lib, content, plan)
    if lib is not None:
        return _canvas_native(lib, content, plan)
    if (x1 - x0, y1 - y0) == (cw, ch):
        canvas = content
    else:
        canvas = np.full((ch, cw, 3), PAD_GRAY, dtype=np.uint8)
        canvas[y0:y1, x0:x1] = content
    return _uint8_to_unit(canvas)
