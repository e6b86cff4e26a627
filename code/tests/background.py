"""Subprocess checks started when the session's tests are collected and run, one at a time, while other tests run.

The mock P150 runs (tests/test_ttnn_mock.py) are single-threaded and take minutes in all, and the test session
keeps the 2 cores of a CI machine only about 60 % busy: started at collection under Linux's idle scheduling class
(`chrt --idle 0`: they get a core only when no test wants it, so the tests running meanwhile keep their speed; at
`nice 10` they took cycles from the Ray workers, which run niced themselves), they are done by the time their
tests come, which then only read the result. A test whose run was not started (its module ran alone, or with -k)
runs it itself, the same way; so does one whose run is still going when it comes (it waits for it). A run in the
idle class may wait for cycles, so its timeout is four times the one asked for.

A module takes part with `background_runs(items) -> {key: command}` (the runs its selected items will ask for)
and asks for a result with `run(key, command)`. Each command runs with its own scratch folder as `{tmp}`.
`tally()` counts what happened to the runs; a run asked for but not queued, or queued but never asked for, means
the module's `background_runs` no longer lists what its tests ask (they still pass, only slower): conftest.py
prints the tally at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_lock = threading.Lock()
_futures: dict = {}
_running: set = set()
_pool: ThreadPoolExecutor | None = None
_scratch: Path | None = None
_tally: Counter = Counter()


class Done:
    """A finished command: its CompletedProcess and the scratch folder its files were written to."""

    def __init__(self, process: subprocess.CompletedProcess, folder: Path):
        self.process, self.folder = process, folder


def _idle(args: list) -> list:
    """`args` under SCHED_IDLE where util-linux's chrt is there, else at the lowest priority nice gives."""
    if shutil.which("chrt"):
        return ["chrt", "--idle", "0", *args]
    return ["nice", "-n", "19", *args] if shutil.which("nice") else args


def _execute(command: list, env: dict | None, timeout: float, folder: Path, idle: bool = False) -> Done:
    folder.mkdir(parents=True, exist_ok=True)
    args = [str(a).replace("{tmp}", str(folder)) for a in command]
    command = _idle(args) if idle else args
    # a session of its own: a kill reaches the processes the command starts, too
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    with _lock:
        _running.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    finally:
        with _lock:
            _running.discard(proc)
    return Done(subprocess.CompletedProcess(args, proc.returncode, out, err), folder)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start(runs: dict) -> None:
    """Queue `runs` ({key: (command, env, timeout)}) on one worker thread, in the order given."""
    global _pool, _scratch
    if not runs:
        return
    _scratch = Path(tempfile.mkdtemp(prefix="tt_moge-background-"))
    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-check")
    for i, (key, (command, env, timeout)) in enumerate(runs.items()):
        _futures[key] = _pool.submit(_execute, command, env, timeout, _scratch / str(i), idle=True)


def run(key, command: list, env: dict | None, timeout: float, folder: Path) -> Done:
    """The result of `command`: the queued run's under `key` (waiting for it), else run now with `folder` as {tmp}."""
    future: Future | None = _futures.pop(key, None)
    if future is not None and not future.cancel():  # cancelled: not started yet; this test runs it itself
        _tally["taken from the background"] += 1
        return future.result()
    _tally["run by its test, not started in time" if future is not None else "asked for but not queued"] += 1
    return _execute(command, env, timeout, folder)


def tally() -> Counter:
    """What happened to the runs so far (after `stop`: including the ones queued but never asked for)."""
    return _tally


def stop() -> None:
    """End of the session: drop what has not started, kill what runs, remove the scratch folders."""
    for future in _futures.values():
        future.cancel()
        _tally["queued but never asked for"] += 1
    _futures.clear()
    with _lock:
        for proc in _running:
            _kill(proc)
    if _pool is not None:
        _pool.shutdown(wait=True)
    if _scratch is not None:
        shutil.rmtree(_scratch, ignore_errors=True)
