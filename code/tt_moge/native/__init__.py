"""The native host library (the C++ in this folder): fused finish pass, camera solve, PNG unfiltering and
the uint8 -> float canvas.

No Python build step: the first use compiles it with g++ into a per-user cache (see `build.py`) and loads it
with ctypes. Which host path runs is chosen per process:

* ``$MOGE_HOST`` or `set_host_path()`: ``"auto"`` (default) = native when the library builds and loads, else
  the torch/numpy path with one RuntimeWarning; ``"native"`` = native or a NativeBuildError; ``"torch"`` = the
  torch/numpy reference path (`tt_moge/host/finish.py`, `solve.py`, `canvas.py`, Pillow for PNG).
  Both paths give the same results: masks identical, floats within a few ulp (tests/test_native.py).
* ``$MOGE_SERVE_THREADS``: threads of the native kernels (default: the usable cores, at most 16);
  `set_threads()` changes it at run time.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import Optional

from .. import env
from .build import NativeBuildError, build

__all__ = [
    "HOST_PATHS",
    "NativeBuildError",
    "host_path",
    "library",
    "set_host_path",
    "set_threads",
    "threads",
    "default_threads",
]

HOST_PATHS = ("auto", "native", "torch")
ABI_VERSION = 6  # must match kAbiVersion in moge_host.cpp
MAX_DEFAULT_THREADS = 16

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None  # why the library is unavailable (auto mode warns once, then stays on torch)
_override: Optional[str] = None


def _requested() -> str:
    mode = (_override or env.get("MOGE_HOST") or "auto").strip().lower()
    if mode not in HOST_PATHS:
        raise ValueError(f"MOGE_HOST must be one of {HOST_PATHS}, got {mode!r}")
    return mode


def set_host_path(mode: Optional[str]) -> Optional[str]:
    """Force the host path of this process: "native", "torch" or "auto"; None follows $MOGE_HOST again.

    Returns the previous setting (for tests: ``prev = set_host_path("torch") ... set_host_path(prev)``).
    """
    global _override
    if mode is not None and mode not in HOST_PATHS:
        raise ValueError(f"host path must be one of {HOST_PATHS} or None, got {mode!r}")
    previous, _override = _override, mode
    return previous


def host_path() -> str:
    """ "native" or "torch": the path the next host call takes (builds and loads the library if needed)."""
    return "native" if library() is not None else "torch"


def default_threads() -> int:
    """$MOGE_SERVE_THREADS, else the cores this process may use (at most MAX_DEFAULT_THREADS)."""
    value = (env.get("MOGE_SERVE_THREADS") or "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"MOGE_SERVE_THREADS must be a positive integer (threads of the native host kernels), got {value!r}"
            )
        return int(value)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_THREADS))


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None when the torch path is chosen or (auto) the library is unavailable."""
    global _lib, _failure
    mode = _requested()
    if mode == "torch":
        return None
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None and (_failure is None or mode == "native"):
            try:
                _lib = _load()
                _failure = None
            except NativeBuildError as exc:
                if mode == "native":
                    raise
                _failure = str(exc)
                warnings.warn(
                    f"tt_moge: the native host library is unavailable ({exc}); using the torch host path "
                    "(same results, slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _lib


def reset() -> None:
    """Forget the loaded library and any failure, so the next `library()` builds/loads again (for tests).
    An already loaded shared object stays mapped; only this module's reference is dropped."""
    global _lib, _failure
    with _lock:
        _lib, _failure = None, None


def set_threads(count: int) -> int:
    """Use `count` threads (>= 1) in the native kernels; returns the count in effect (0: torch path)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"threads must be a positive int, got {count!r}")
    lib = library()
    return 0 if lib is None else int(lib.moge_set_threads(count))


def threads() -> int:
    """Threads of the native kernels (0 when the torch path is in use)."""
    lib = library()
    return 0 if lib is None else int(lib.moge_threads())


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = {
    "moge_abi_version": (ctypes.c_int, []),
    "moge_set_threads": (ctypes.c_int, [ctypes.c_int]),
    "moge_threads": (ctypes.c_int, []),
    "moge_finish": (
        ctypes.c_int,
        [
            _P,
            _I64,
            _I64,
            _I64,
            _P,
            _I64,
            _I64,
            _I64,
            ctypes.c_int,
            _P,
            _I64,
            _I64,
            ctypes.c_int,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            ctypes.c_float,
            ctypes.c_float,
            ctypes.c_float,
            ctypes.c_int,
            _P,
            _P,
            ctypes.c_int,
            _P,
            _P,
            _P,
            _P,
        ],
    ),
    "moge_solve": (ctypes.c_int, [_P, _P, _I64, ctypes.c_double, _P, _P]),
    "moge_recover_camera": (
        _I64,
        [
            _P,
            _I64,
            _I64,
            _I64,
            _P,
            _P,
            ctypes.c_int,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            _P,
            _P,
            _I64,
            _I64,
            ctypes.c_float,
            ctypes.c_double,
            _P,
            _P,
        ],
    ),
    "moge_png_unfilter": (ctypes.c_int, [_P, _I64, _I64, _I64, ctypes.c_int, _P, _P]),
    "moge_canvas_to_unit": (ctypes.c_int, [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_int, _P]),
    "moge_canvas_planes_u8": (ctypes.c_int, [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_int, _P]),
    # cpu_kernels.cpp (the CPU runner's int8 matmul glue and fused bfloat16 attention)
    "moge_runner_set_threads": (ctypes.c_int, [ctypes.c_int]),
    "moge_quantize_rows": (ctypes.c_int, [_P, ctypes.c_int, _I64, _I64, _I64, _P, _P, _P]),
    "moge_dequantize": (ctypes.c_int, [_P, _I64, _I64, _P, _P, _P, ctypes.c_int, _P]),
    "moge_attention_supported": (ctypes.c_int, []),
    "moge_attention_amx_supported": (ctypes.c_int, []),
    "moge_attention_bf16": (ctypes.c_int, [_P, _I64, _I64, _I64, ctypes.c_int, _P]),
}


def _load() -> ctypes.CDLL:
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {path} ({exc})") from None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise NativeBuildError(f"{path} has no symbol {name}")
        fn.restype, fn.argtypes = restype, argtypes
    if lib.moge_abi_version() != ABI_VERSION:
        raise NativeBuildError(f"{path}: ABI version {lib.moge_abi_version()} != {ABI_VERSION}")
    lib.moge_set_threads(default_threads())
    return lib
