"""Build the native host library with g++ into a per-user cache, safely across concurrent processes.

* Cache folder: ``$MOGE_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/tt_moge/native``, else ``~/.cache/tt_moge/native``.
* File name ``libmoge_host-<key>.so``; the key hashes the C++ sources, the compiler (resolved path, size,
  mtime and ``-dumpfullversion``), the flags and the CPU (``-march=native`` code runs only where it was built).
* Several processes may build at once: each takes an exclusive ``fcntl`` lock on ``<key>.lock``, checks again
  whether the library exists, compiles into a temporary file in the same folder and renames it into place
  (atomic), so no process ever loads a half-written library.
* Compiler: ``$MOGE_CXX`` (default ``g++``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from .. import env

__all__ = ["NativeBuildError", "FLAGS", "SOURCES", "cache_dir", "compiler", "library_path", "build"]

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("moge_host.cpp", "cpu_kernels.cpp")
HEADERS = ("thread_pool.h",)
# -ffp-contract=off: no fused multiply-adds that the compiler adds on its own, so the float results follow the
# torch reference op for op (the code writes std::fma itself where ATen's kernels fuse).
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
    "-Wall",
)
BUILD_TIMEOUT_S = 300


class NativeBuildError(RuntimeError):
    """The native host library could not be built or loaded; the message says why."""


def cache_dir() -> Path:
    explicit = env.get("MOGE_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tt_moge" / "native"


def compiler() -> str:
    """The compiler command: $MOGE_CXX or g++."""
    return env.get("MOGE_CXX") or "g++"


def _cpu_signature() -> str:
    # -march=native: the model name and feature flags decide which instructions the library may contain.
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            seen = set()
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen.add(key)
                    parts.append(line.strip())
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _compiler_signature(cxx_path: str) -> str:
    real = os.path.realpath(cxx_path)
    st = os.stat(real)
    try:
        version = subprocess.run(
            [cxx_path, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        version = "?"
    return f"{real}:{st.st_size}:{st.st_mtime_ns}:{version}"


def library_path(cxx_path: str) -> Path:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    for part in (_compiler_signature(cxx_path), " ".join(FLAGS), _cpu_signature()):
        h.update(part.encode() + b"\0")
    return cache_dir() / f"libmoge_host-{h.hexdigest()[:20]}.so"


def build(force: bool = False) -> Path:
    """Return the path of the library for this machine, compiling it first if it is not cached.

    Raises NativeBuildError (no compiler, compile error, unwritable cache) with the reason.
    """
    cxx = compiler()
    cxx_path = shutil.which(cxx)
    if cxx_path is None:
        raise NativeBuildError(f"C++ compiler {cxx!r} not found (set MOGE_CXX or install g++)")
    try:
        target = library_path(cxx_path)
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(f"cannot prepare the cache folder {cache_dir()} ({exc})") from None
    if target.exists() and not force:
        return target
    import fcntl

    lock_path = target.with_suffix(".lock")
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if target.exists() and not force:  # another process built it while we waited
            return target
        tmp = target.with_name(f"{target.stem}.{os.getpid()}.partial.so")
        cmd = [cxx_path, *FLAGS, *(str(SOURCE_DIR / s) for s in SOURCES), "-o", str(tmp)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            _remove(tmp)
            raise NativeBuildError(f"running {cxx_path} failed ({exc})") from None
        if result.returncode != 0 or not tmp.exists():
            _remove(tmp)
            tail = (result.stderr or result.stdout).strip().splitlines()[-8:]
            raise NativeBuildError(f"{' '.join(cmd)} exited with {result.returncode}:\n" + "\n".join(tail))
        os.replace(tmp, target)
    return target


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
