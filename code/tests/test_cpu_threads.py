"""The CPU runners' thread governor (`runners/cpu_threads.py`): on a simulated machine whose forward times depend on
the thread count and on how busy it is, it keeps the faster count, finds the other one within a forward or two of
a change, does not keep probing while nothing changes, and restores torch's thread count after each forward."""

from __future__ import annotations

import pytest

from tt_moge.runners.cpu_threads import PROBE_EVERY, THREADS_ENV, ThreadGovernor


class Machine:
    """Forward times (s) by thread count in the current state ("quiet" or "busy"), a clock, a run queue."""

    TIMES = {"quiet": {4: 1.0, 2: 1.8, 1: 3.4}, "busy": {4: 6.0, 2: 4.0, 1: 3.6}}

    def __init__(self):
        self.state = "quiet"
        self.now = 0.0
        self.others = 0  # runnable tasks besides ours
        self.torch_threads = 4
        self.used = []

    def run(self, governor: ThreadGovernor) -> int:
        with governor.forward() as threads:
            assert self.torch_threads == threads
            self.now += self.TIMES[self.state][threads]
        self.used.append(threads)
        return threads

    def governor(self, **kwargs) -> ThreadGovernor:
        def set_threads(n):
            self.torch_threads = n

        return ThreadGovernor(
            4,
            cores=4,
            run_queue=lambda: self.others,
            clock=lambda: self.now,
            set_threads=set_threads,
            get_threads=lambda: self.torch_threads,
            **kwargs,
        )


def test_quiet_machine_keeps_all_cores_and_probes_only_now_and_then():
    machine = Machine()
    governor = machine.governor()
    for _ in range(3 * PROBE_EVERY + 3):
        machine.run(governor)
        assert machine.torch_threads == 4  # restored after every forward
    assert governor.current == 4
    probes = [t for t in machine.used if t != 4]
    assert 1 <= len(probes) <= 3, machine.used  # one periodic probe per PROBE_EVERY forwards, no more


def test_busier_machine_moves_to_fewer_threads_and_back_when_quiet():
    machine = Machine()
    governor = machine.governor()
    for _ in range(4):
        machine.run(governor)
    machine.state = "busy"  # the run queue says nothing here: only the forward times tell
    for _ in range(6):
        machine.run(governor)
    assert governor.current == 2, (machine.used, governor.history)
    settled = machine.used[-3:]
    assert settled == [2, 2, 2], machine.used  # no probing back and forth while the load stays
    before = len(machine.used)
    machine.state = "quiet"
    for _ in range(3):
        machine.run(governor)
    assert governor.current == 4, (machine.used[before:], governor.history)  # faster calls: more threads tried
    assert "threads" in governor.describe()


def test_a_fuller_run_queue_triggers_a_probe_before_any_forward_is_slow():
    machine = Machine()
    governor = machine.governor()
    for _ in range(3):
        machine.run(governor)
    machine.others = 8  # busier by the run queue: the very next forward tries fewer threads, the one after
    machine.state = "busy"  # times the held count again (its last time is from the quiet machine)
    assert [machine.run(governor), machine.run(governor)] == [2, 4]
    assert governor.current == 2
    assert machine.run(governor) == 2


def test_a_fixed_count_is_never_changed(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "1")
    governor = ThreadGovernor.from_env(4)
    assert governor.fixed == 1 and governor.candidates == [1]
    machine = Machine()
    fixed = machine.governor(fixed=1)
    machine.state = "busy"
    for _ in range(PROBE_EVERY + 4):
        machine.run(fixed)
    assert set(machine.used) == {1} and THREADS_ENV in fixed.describe()
    monkeypatch.setenv(THREADS_ENV, "auto")
    assert ThreadGovernor.from_env(4).fixed is None
    monkeypatch.delenv(THREADS_ENV)  # the default: torch's count, fixed (results stay bit-reproducible)
    assert ThreadGovernor.from_env(4).candidates == [4] and "torch's count" in ThreadGovernor.from_env(4).describe()
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            ThreadGovernor.from_env(4)


def test_runners_time_their_forwards_with_the_governor(checkpoint, monkeypatch):
    """The CPU runners set torch's thread count per forward and restore it (here: fixed by the environment)."""
    import torch

    from tt_moge.runners import make_runner
    from tt_moge.weights import load_network

    monkeypatch.setenv(THREADS_ENV, "1")
    network, _ = load_network(checkpoint("tiny-vits-normal"), None)
    runner = make_runner(network, (224, 168), 1200, "cpu", "fp32")
    seen = []
    original = runner.network.forward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(runner.network, "forward", spy)
    before = torch.get_num_threads()
    runner.forward(torch.rand(1, 3, 168, 224))
    assert seen == [1] and torch.get_num_threads() == before
    assert runner.describe()["threads"].startswith("1 ")
