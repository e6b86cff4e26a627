"""Which CPU kernel runs each step of the CPU graph, chosen by measurement on this machine, at load.

The fastest kernel for a step depends on the CPU, not only on its flags: the fused native bfloat16 attention
beats PyTorch's SDPA several times over on an AVX512-BF16 EPYC without AMX, and loses to it several times over
on an AMX Xeon (oneDNN's AMX kernels). So for each choice point the CPU runner times the candidates once on
the loaded graph's real shapes (a few calls each, after one warm-up call) and keeps the fastest. Every
candidate meets the accuracy limits of `tests/test_runners.py` (each is tested there), so speed alone decides.

Choices are cached in the user cache (`$MOGE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tt_moge/kernels.json`, else
`~/.cache/tt_moge/kernels.json`) under a key made of the CPU model and flags, the torch version, the thread
count, the choice point and its shape, so later loads on the same machine skip the timing. The first choice
written for a key wins: processes that time the same key at once (the replicas of a batch job starting
together) all take the choice of the first to finish, so one machine never mixes kernels for one shape.

`$MOGE_CPU_KERNELS` forces choices, e.g. ``attention=sdpa,vit_linear=aten,int8_matmul=bf16`` (a forced kernel
that cannot run here is an error). `describe()` of the runner says what was chosen and why (the milliseconds
measured, or "cached" / "forced").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from .. import env

__all__ = [
    "KernelChoice",
    "KernelCache",
    "choose",
    "fastest",
    "forced_choices",
    "forcing",
    "cpu_signature",
    "screened",
    "SCREEN_FACTOR",
    "FORCE_ENV",
    "CACHE_ENV",
]

FORCE_ENV = "MOGE_CPU_KERNELS"
CACHE_ENV = "MOGE_KERNEL_CACHE"
_lock = threading.Lock()


@dataclass
class KernelChoice:
    """The kernel chosen for one choice point, and why."""

    point: str  # e.g. "attention"
    kernel: str  # e.g. "native"
    how: str  # "measured", "cached" or "forced"
    times_ms: dict = field(default_factory=dict)  # candidate -> median ms of one call (measured or cached)

    def describe(self) -> str:
        if not self.times_ms:
            return f"{self.kernel} ({self.how})"
        times = ", ".join(f"{name} {ms:.1f} ms" for name, ms in sorted(self.times_ms.items(), key=lambda kv: kv[1]))
        return f"{self.kernel} ({self.how}: {times})"


def fastest(times_ms: Mapping[str, float]) -> str:
    """The candidate with the smallest time; ties go to the first one listed (the candidates' order of
    preference)."""
    if not times_ms:
        raise ValueError("no candidate to choose from")
    return min(times_ms, key=lambda name: (times_ms[name], list(times_ms).index(name)))


def forced_choices(text: Optional[str] = None) -> dict:
    """{choice point: kernel} from $MOGE_CPU_KERNELS ("point=kernel,point=kernel")."""
    text = (env.get(FORCE_ENV) or "") if text is None else text
    forced = {}
    for part in filter(None, (p.strip() for p in text.replace(";", ",").split(","))):
        point, sep, kernel = part.partition("=")
        if not sep or not point.strip() or not kernel.strip():
            raise ValueError(f"{FORCE_ENV}: expected 'point=kernel[,point=kernel]', got {text!r}")
        forced[point.strip()] = kernel.strip()
    return forced


def forcing(setting: Optional[str]):
    """A context: $MOGE_CPU_KERNELS set to `setting` for the block (a runner's chooser reads it when it loads),
    then put back; None leaves it as it is."""
    return env.setting(FORCE_ENV, setting)


def cpu_signature() -> str:
    """The CPU model name and its flags (the same CPU model can ship with features turned off)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()} | {hashlib.sha1(flags.encode()).hexdigest()[:12]}"


class KernelCache:
    """A JSON file of earlier choices: {key: {"kernel": name, "times_ms": {...}}}. Safe across threads and
    processes: a write replaces the file atomically (no reader sees half a file), under a lock file where the
    OS has one, and `settle` keeps the first choice written for a key."""

    def __init__(self, path: Optional[Path] = None):
        if path is None:
            explicit = env.get(CACHE_ENV)
            base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            path = Path(explicit) if explicit else Path(base) / "tt_moge" / "kernels.json"
        self.path = Path(path)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> Optional[dict]:
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) and isinstance(entry.get("kernel"), str) else None

    @contextlib.contextmanager
    def _locked(self):
        """This process's threads, and other processes (an flock on a lock file beside the cache, where the
        OS has flock and the folder is writable), one at a time."""
        with _lock:
            try:
                import fcntl

                self.path.parent.mkdir(parents=True, exist_ok=True)
                handle = open(self.path.with_name(f".{self.path.name}.lock"), "a")
            except (ImportError, OSError):
                yield
                return
            with handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                yield

    def settle(self, key: str, kernel: str, times_ms: dict, candidates=None) -> dict:
        """Record `kernel` for `key` unless a usable choice is there already (another process timed the same
        key meanwhile); returns the entry that stands."""
        with self._locked():
            data = self._read()
            entry = data.get(key)
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("kernel"), str)
                and (candidates is None or entry["kernel"] in candidates)
            ):
                return entry
            data[key] = entry = {"kernel": kernel, "times_ms": {k: round(v, 3) for k, v in times_ms.items()}}
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
            except OSError:
                pass  # a read-only cache only costs the timing again next time
            return entry


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call allocations, lazy kernel selection in oneDNN
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


SCREEN_FACTOR = 4.0  # a candidate this much slower than the fastest on the screening shape is not timed in full


def screened(
    screen: Mapping[str, Callable[[], object]], timer: Optional[Callable[[Callable[[], object]], float]] = None
) -> tuple:
    """({name: ms} of one call of each candidate on a small shape, [the names within SCREEN_FACTOR of the
    fastest]): a kernel that the CPU only emulates (bfloat16 or int8 without the instructions) can take minutes
    on the real shape, so it is measured on a small one first and left out there."""
    timer = timer or (lambda fn: _median_ms(fn, 1))  # one warm-up call, one timed
    times = {name: timer(fn) for name, fn in screen.items()}
    best = min(times.values())
    return times, [name for name, ms in times.items() if ms <= SCREEN_FACTOR * best]


def choose(
    point: str,
    candidates: Mapping[str, Callable[[], object]],
    key: str,
    *,
    cache: Optional[KernelCache] = None,
    forced: Optional[Mapping[str, str]] = None,
    repeats: int = 3,
    timer: Callable[[Callable[[], object], int], float] = _median_ms,
    screen: Optional[Mapping[str, Callable[[], object]]] = None,
) -> KernelChoice:
    """Pick the kernel for `point` among `candidates` ({name: a call of that kernel on the real shape}, in
    order of preference): forced (`forced`, else $MOGE_CPU_KERNELS), else cached under `key`, else timed with
    `timer` and cached. With `screen` ({name: a call on a small shape}), candidates more than SCREEN_FACTOR
    slower than the fastest there are not timed on the real shape (their small-shape time is kept, marked)."""
    forced = forced_choices() if forced is None else forced
    if point in forced:
        if forced[point] not in candidates:
            raise ValueError(f"{FORCE_ENV}: {point}={forced[point]} cannot run here; candidates: {sorted(candidates)}")
        return KernelChoice(point, forced[point], "forced")
    if len(candidates) == 1:
        return KernelChoice(point, next(iter(candidates)), "only candidate")
    full_key = f"{point} | {key}"
    hit = cache.get(full_key) if cache is not None else None
    if hit is not None and hit["kernel"] in candidates:
        return KernelChoice(point, hit["kernel"], "cached", dict(hit.get("times_ms") or {}))
    left_out: dict = {}
    if screen:
        small, kept = screened({name: screen[name] for name in candidates if name in screen}, lambda fn: timer(fn, 1))
        left_out = {f"{name} (small shape, left out)": ms for name, ms in small.items() if name not in kept}
        candidates = {name: fn for name, fn in candidates.items() if name in kept or name not in screen}
    times = {name: timer(fn, repeats) for name, fn in candidates.items()}
    kernel = fastest(times)
    times.update(left_out)
    if cache is not None:
        entry = cache.settle(full_key, kernel, times, candidates)
        if entry["kernel"] != kernel:  # another process chose first: one kernel per shape on this machine
            return KernelChoice(point, entry["kernel"], "cached", dict(entry.get("times_ms") or {}))
    return KernelChoice(point, kernel, "measured", times)
