"""Saying what a slow step is doing: a step that takes longer than `SLOW_STEP_S` (loading weights, a warm-up
forward, an ONNX export, a clip's calibration) names itself on stderr once that time has passed, and says how
long it took when it ends. Steps that end sooner print nothing.

Shown when stderr is a terminal (a person is waiting), or when asked (`show=True`, e.g. a `verbose` load):
piped and captured output (servers, batch replicas, tests) stays as it was.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

__all__ = ["SLOW_STEP_S", "slow_step", "to_a_person"]

SLOW_STEP_S = 2.0  # a step longer than this says what it is doing


def to_a_person(stream: Any = None) -> bool:
    """True when `stream` (default: sys.stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced by something without isatty
        return False


class slow_step:
    """`with slow_step("loading the weights"):` -- after `after_s` seconds (default SLOW_STEP_S) in the block, one line
    "[tt_moge] loading the weights ..." on stderr; at its end (only if that line was printed) one more with the
    seconds it took. `show`: None shows it when stderr is a terminal, True / False always / never."""

    def __init__(
        self, what: str, *, show: Optional[bool] = None, after_s: Optional[float] = None, prefix: str = "[tt_moge]"
    ):
        self.what, self.prefix = what, prefix
        self.after_s = SLOW_STEP_S if after_s is None else after_s
        self.show = to_a_person() if show is None else show
        self._said = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def _say(self, text: str) -> None:
        try:
            print(f"{self.prefix} {text}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed: nothing to tell
            pass

    def _watch(self) -> None:
        if not self._done.wait(self.after_s):
            with self._lock:
                if not self._done.is_set():
                    self._say(f"{self.what} ...")
                    self._said.set()

    def __enter__(self) -> "slow_step":
        self._t0 = time.perf_counter()
        if self.show:
            self._thread = threading.Thread(target=self._watch, name="tt_moge-slow-step", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        with self._lock:
            self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self._said.is_set():
            how = "" if kind is None else f" (stopped: {kind.__name__})"
            self._say(f"{self.what}: {time.perf_counter() - self._t0:.1f} s{how}")
