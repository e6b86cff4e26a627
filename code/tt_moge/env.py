"""The environment variables of tt_moge, read in one place: every one is named `MOGE_*`.

Earlier releases spelled a few of them `TT_MOGE_*` (`RENAMED`). Those old names are still read when the new
one is not set, with a DeprecationWarning that names the new one (once per name and process). Variables of
other tools (`TT_VISIBLE_DEVICES`, `HF_*`, `RAY_ADDRESS`, `XDG_CACHE_HOME`) are not ours and are read as they are.

This module imports nothing heavy: the Tenstorrent device graph (no torch) and the tests use it too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Optional

__all__ = ["PREFIX", "RENAMED", "get", "setting"]

PREFIX = "MOGE_"
# new name -> the name earlier releases read
RENAMED = {
    "MOGE_TTNN_TRACE": "TT_MOGE_TTNN_TRACE",
    "MOGE_CPU_MALLOC_TUNING": "TT_MOGE_CPU_MALLOC_TUNING",
    "MOGE_MOCK_DIR": "TT_MOGE_MOCK_DIR",
    "MOGE_REQUIRE_MOCK": "TT_MOGE_REQUIRE_MOCK",
    "MOGE_TTNN_VERSION": "TT_MOGE_TTNN_VERSION",
}
_warned: set = set()
_lock = threading.Lock()


def _check(name: str) -> None:
    if not name.startswith(PREFIX):
        raise ValueError(f"tt_moge's environment variables are named {PREFIX}*, got {name!r}")


def get(name: str, default: Optional[str] = None) -> Optional[str]:
    """The value of `$name` (a MOGE_* name); else, for a renamed variable, the value of its old TT_MOGE_* name
    with a DeprecationWarning; else `default`. An empty value counts as set (as with os.environ.get)."""
    _check(name)
    value = os.environ.get(name)
    if value is not None:
        return value
    old = RENAMED.get(name)
    if old is None or old not in os.environ:
        return default
    with _lock:
        first = old not in _warned
        _warned.add(old)
    if first:
        warnings.warn(
            f"${old} is deprecated: set ${name} instead (the old name is still read for now)",
            DeprecationWarning,
            stacklevel=2,
        )
    return os.environ[old]


@contextlib.contextmanager
def setting(name: str, value: Optional[str]):
    """`$name` (a MOGE_* name) set to `value` for the block, then put back as it was; None leaves it as it is. For
    a caller that loads a model under a setting (a benchmark's variants, tests): tt_moge reads it at load."""
    _check(name)
    previous = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
