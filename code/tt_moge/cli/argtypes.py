"""argparse types shared by every command line (tt-moge predict/info/batch/serve, the benchmarks): each
turns a bad value into a usage error (exit code 2) that says what was expected. The parsers of the model and
call options are their own (`Spec.parse` in tt_moge.options and tt_moge.host); `usage` wraps them."""

from __future__ import annotations

import argparse
import math

from .. import fields
from ..options import parse_token_budget, parse_wxh


def usage(fn):
    """An argparse type from a parser whose ValueError says what was expected."""

    def wrapped(text: str):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    wrapped.__name__ = fn.__name__  # argparse names the type in its messages
    return wrapped


wxh = usage(parse_wxh)
token_budget = usage(parse_token_budget)
non_negative_int = usage(fields.non_negative_int)


def _number(text: str, expected: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected {expected}, got {text!r}") from None


@usage
def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return int(text)


@usage
def positive_float(text: str) -> float:
    value = _number(text, "a number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a finite number > 0, got {text!r}")
    return value


@usage
def port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise ValueError(f"expected a TCP port, 0-65535 (0: any free port), got {text!r}")
    return int(text)


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum."""

    @usage
    def at_least(text: str) -> int:
        if not text.strip().isdigit() or int(text) < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)

    at_least.__name__ = f"integer >= {minimum}"
    return at_least


@usage
def non_negative_float(text: str) -> float:
    value = _number(text, "a number")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return value
