"""Host code shared by every runner, the API, the server and the CLI: decode, canvas fit, solve, finish."""

from .canvas import CanvasPlan, fit_to_canvas, plan_canvas
from .decode import ImageNotFoundError, InputError, to_rgb_array
from .intrinsics import Intrinsics
from .pipeline import CallOptions, Forwarded, Prepared, Stopwatch, postprocess, prepare, refinish

__all__ = [
    "CallOptions",
    "CanvasPlan",
    "Forwarded",
    "ImageNotFoundError",
    "InputError",
    "Intrinsics",
    "Prepared",
    "Stopwatch",
    "fit_to_canvas",
    "plan_canvas",
    "postprocess",
    "prepare",
    "refinish",
    "to_rgb_array",
]
