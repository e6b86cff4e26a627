"""argparse types shared by every command line (tt-moge predict/info/batch/serve, the benchmarks): each
turns a bad value into a usage error (exit code 2) that says what was expected."""
from __future__ import annotations

import argparse
import math
import re


def _usage(fn):
    def wrapped(text: str):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    wrapped.__name__ = fn.__name__  # argparse names the type in its messages
    return wrapped


@_usage
def wxh(text: str) -> tuple:
    """'1920x1080' -> (1920, 1080)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"expected WIDTHxHEIGHT, e.g. 1920x1080, got {text!r}")
    return int(match[1]), int(match[2])


@_usage
def canvas(text: str) -> tuple:
    """A canvas size WxH that MoGeModel.from_pretrained accepts."""
    from ..options import validate_resolution

    return validate_resolution(wxh(text))


@_usage
def token_budget(text: str) -> int:
    from ..network import validate_token_budget

    if not text.strip().lstrip("-").isdigit():
        raise ValueError(f"expected an integer, got {text!r}")
    return validate_token_budget(int(text))


def _number(text: str, expected: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected {expected}, got {text!r}") from None


@_usage
def fov_degrees(text: str) -> float:
    value = _number(text, "degrees, e.g. 60")
    if not (math.isfinite(value) and 0 < value < 180):
        raise ValueError(f"the horizontal field of view must be in (0, 180) degrees, got {text}")
    return value


@_usage
def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return int(text)


@_usage
def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return int(text)


@_usage
def positive_float(text: str) -> float:
    value = _number(text, "a number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a finite number > 0, got {text!r}")
    return value


@_usage
def port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise ValueError(f"expected a TCP port, 0-65535 (0: any free port), got {text!r}")
    return int(text)


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum."""
    @_usage
    def at_least(text: str) -> int:
        if not text.strip().isdigit() or int(text) < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)
    at_least.__name__ = f"integer >= {minimum}"
    return at_least


@_usage
def non_negative_float(text: str) -> float:
    value = _number(text, "a number")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return value


def warmup_spec(text: str):
    """--warmup-variants: a preset name, a comma-separated list of presets, or JSON (a variant dict or a list)."""
    import json

    if text.lstrip().startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    names = [part.strip() for part in text.split(",") if part.strip()]
    return names[0] if len(names) == 1 else names
