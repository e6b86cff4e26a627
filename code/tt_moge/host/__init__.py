"""Host code shared by every runner, the API, the server and the CLI: decode, canvas fit, solve, finish.

The names are imported on first use (as in `runners`): `CallOptions`, `InputError`, `Intrinsics` and the decoders
import without torch, so that the command line builds its flags from their definitions without it."""

from __future__ import annotations

from typing import Any

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

_LAZY = {
    "CallOptions": "call_options",
    "CanvasPlan": "canvas",
    "fit_to_canvas": "canvas",
    "plan_canvas": "canvas",
    "ImageNotFoundError": "decode",
    "InputError": "decode",
    "to_rgb_array": "decode",
    "Intrinsics": "intrinsics",
    "Forwarded": "pipeline",
    "Prepared": "pipeline",
    "Stopwatch": "pipeline",
    "postprocess": "pipeline",
    "prepare": "pipeline",
    "refinish": "pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
