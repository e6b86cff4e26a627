"""How many intra-op threads a CPU forward uses: chosen by measurement, and re-checked when the machine gets busier.

On a quiet machine, one thread per usable core is fastest. On a machine whose cores other processes share, a
team of that many threads can lose to a smaller one: every operator of the forward ends at a barrier, and a
thread that the OS has descheduled holds the others there for as long as it waits for a core (and with
OpenMP's default wait policy the others spin meanwhile, on the cores it needs; `import tt_moge` makes them sleep:
`tt_moge.openmp`). What a busy machine costs depends on the CPU, the OS scheduler and the
other jobs, so it is measured, never guessed from the CPU's name (docs/performance.md has the numbers).

`ThreadGovernor` runs each forward with the thread count it holds, times it, and probes another count (the next
forward runs with it; the faster of the two measured counts is kept) when:
* a forward took more than RECHECK_FACTOR times as long as its count did when it was chosen (the machine got
  busier; fewer threads are tried), or less than 1 / RECHECK_FACTOR of it (quieter: more are tried);
* the number of other runnable tasks (the run queue, `/proc/loadavg`) crossed the number of usable cores,
  either way, since the last forward (then the held count is timed again too, before the two are compared);
* PROBE_EVERY forwards have passed without a probe (the machine may have become quieter), and right after the
  first timed forward: the warm-up forwards of `from_pretrained` make the first choice at load.
The candidates are torch's thread count at load (all usable cores, or what the caller set), its halves, and
1. It is opt-in, `MOGE_CPU_THREADS=auto`: float sums depend on the thread count, so a count that changes between
calls changes their results in the last bits, and the API, the server and `predict_many` promise the same bits
for the same image. Unset, the count stays torch's (fixed); `MOGE_CPU_THREADS=N` fixes it at N. torch's
process-wide thread count is set for each forward and restored after it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator, Optional

from .. import env

__all__ = ["ThreadGovernor", "THREADS_ENV", "RECHECK_FACTOR", "PROBE_EVERY", "runnable_others", "usable_cores"]

THREADS_ENV = "MOGE_CPU_THREADS"
RECHECK_FACTOR = 1.3  # a forward this much slower than the fastest at its count: probe another count
PROBE_EVERY = 16  # forwards between probes when nothing else triggers one


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def runnable_others() -> Optional[int]:
    """Runnable tasks on the machine besides the reader (the 4th field of /proc/loadavg, `running/total`,
    counts the reading thread itself), or None where the OS does not say."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - 1)


def _candidates(top: int) -> list:
    counts, n = [], max(1, top)
    while n > 1:
        counts.append(n)
        n //= 2
    return counts + [1]


class ThreadGovernor:
    """The intra-op thread count of one runner's forwards (see the module docstring). Not re-entrant: the
    runners call it under the service's device lock, one forward at a time."""

    def __init__(
        self,
        threads: int,
        *,
        fixed: Optional[int] = None,
        cores: Optional[int] = None,
        run_queue: Callable[[], Optional[int]] = runnable_others,
        clock: Callable[[], float] = time.perf_counter,
        set_threads: Optional[Callable[[int], None]] = None,
        get_threads: Optional[Callable[[], int]] = None,
    ):
        if set_threads is None or get_threads is None:
            import torch

            set_threads, get_threads = torch.set_num_threads, torch.get_num_threads
        self._set, self._get = set_threads, get_threads
        self.fixed = fixed
        self.source = f"${THREADS_ENV}"  # what fixed the count (describe())
        self.candidates = [fixed] if fixed else _candidates(threads)
        self.current = self.candidates[0]
        self.cores = cores or usable_cores()
        self._run_queue, self._clock = run_queue, clock
        self.best: dict = {}  # threads -> fastest forward seen (s)
        self.last: dict = {}  # threads -> the latest forward's time (s)
        self.reference: Optional[float] = None  # the held count's time when it was chosen (s)
        self.calls = 0
        self._since_probe = PROBE_EVERY  # the first timed forward is followed by a probe: chosen at load
        self._probe: Optional[int] = None  # the count the next forward tries
        self._probing_from: Optional[int] = None
        self._stale = False  # the probe's trigger made the held count's last time stale (run queue)
        self._confirm: Optional[tuple] = None  # (probe count, its time, held count): re-measure the held one
        self._busy: Optional[bool] = None
        self._pin: Optional[int] = None  # pinned(): the count of every forward, nothing recorded
        self.history: list = []  # (threads, seconds, why) of the probes, the latest last (describe())
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, threads: int) -> "ThreadGovernor":
        """`threads` = torch's count at load. $MOGE_CPU_THREADS: "auto" measures (see the module docstring); a
        count fixes it; unset or empty keeps torch's count, fixed: the default, because float sums depend on the
        thread count, so a count that changes between calls changes their results in the last bits (and the API,
        the server and `predict_many` promise the same bits for the same image)."""
        text = (env.get(THREADS_ENV) or "").strip().lower()
        if text == "auto":
            return cls(threads)
        if not text:
            governor = cls(threads, fixed=max(1, threads))
            governor.source = "torch's count"
            return governor
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"${THREADS_ENV} must be 'auto' or a thread count >= 1, got {text!r}")
        return cls(threads, fixed=int(text))

    def _neighbour(self, down: bool) -> Optional[int]:
        i = self.candidates.index(self.current)
        j = i + 1 if down else i - 1
        return self.candidates[j] if 0 <= j < len(self.candidates) else None

    def _plan(self) -> int:
        """The thread count of the next forward (a probe, or the current count)."""
        if self._pin is not None:
            return self._pin
        if self.fixed or len(self.candidates) == 1:
            return self.current
        if self._confirm is not None:  # the held count's time from before the run queue changed is stale
            return self._confirm[2]
        busy = None
        others = self._run_queue()
        if others is not None:
            busy = others >= self.cores
        why = None
        if self._busy is not None and busy is not None and busy != self._busy:
            why = "run queue: busier" if busy else "run queue: quieter"
        self._busy = busy if busy is not None else self._busy
        last, ref = self.last.get(self.current), self.reference
        if why is None and last is not None and ref is not None:
            if last > RECHECK_FACTOR * ref:
                why = f"slower: {last:.3g} s against {ref:.3g} s"
            elif last * RECHECK_FACTOR < ref:
                why = f"faster: {last:.3g} s against {ref:.3g} s"
        if why is None and self._since_probe >= PROBE_EVERY and last is not None:
            why = "first check" if not self.history else "periodic"
        if why is None:
            return self.current
        # slower or busier: try fewer threads (more where there are none fewer); quieter or faster: more
        down = not why.startswith(("run queue: quieter", "faster"))
        probe = self._neighbour(down) or self._neighbour(not down)
        if probe is None:
            return self.current
        self._probe, self._probing_from = probe, self.current
        self._stale = why.startswith("run queue")
        self.history.append((probe, None, why))
        return probe

    def _decide(self, probe: int, probe_s: float, held: int, held_s: Optional[float]) -> None:
        if held_s is None or probe_s < held_s:
            self.current = probe
        self.reference = self.last[self.current]  # the chosen count's time now: what "slower" is against
        self._since_probe = 0

    def _record(self, threads: int, seconds: float) -> None:
        if self._pin is not None:
            return  # pinned forwards (benchmarks) teach the governor nothing
        self.calls += 1
        if self.calls == 1:
            return  # the first forward pays one-time costs (allocations, kernel selection): no measure of speed
        self.last[threads] = seconds
        self.best[threads] = min(seconds, self.best.get(threads, seconds))
        if self._probe == threads and self._probing_from is not None:
            self.history[-1] = (threads, seconds, self.history[-1][2])
            if self._stale:  # measure the held count again, in the new conditions, before deciding
                self._confirm = (threads, seconds, self._probing_from)
            else:
                self._decide(threads, seconds, self._probing_from, self.last.get(self._probing_from))
            self._probe = self._probing_from = None
        elif self._confirm is not None and threads == self._confirm[2]:
            probe, probe_s, _ = self._confirm
            self._confirm = None
            self._decide(probe, probe_s, threads, seconds)
        else:
            if self.reference is None:
                self.reference = seconds
            self._since_probe += 1
        del self.history[:-8]

    @contextlib.contextmanager
    def forward(self) -> Iterator[int]:
        """Around one forward: sets torch's thread count for it (yielded), times it, restores the count."""
        with self._lock:
            threads = self._plan()
        previous = self._get()
        self._set(threads)
        start = self._clock()
        try:
            yield threads
        finally:
            elapsed = self._clock() - start
            self._set(previous)
            with self._lock:
                self._record(threads, elapsed)

    @contextlib.contextmanager
    def pinned(self, threads: int) -> Iterator[None]:
        """Forwards inside the block run with `threads` threads and are not recorded (to time a fixed count
        beside the governed one in one process: perf/runners/bench_cpu.py --busy)."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        with self._lock:
            self._pin = threads
        try:
            yield
        finally:
            with self._lock:
                self._pin = None

    def describe(self) -> str:
        if self.fixed:
            return f"{self.fixed} ({self.source}; {THREADS_ENV}=auto measures per forward)"
        probes = "; ".join(
            f"{t} threads {'?' if s is None else f'{s:.3g} s'} ({why})" for t, s, why in self.history[-3:]
        )
        return (
            f"{self.current} of {self.candidates} (measured per forward"
            + (f"; probes: {probes}" if probes else "")
            + ")"
        )
