"""Subprocess checks started when the session's tests are collected and run, one at a time, while other tests run.

The mock P150 runs (tests/test_ttnn_mock.py) are single-threaded and take minutes in all, and the test session
keeps the 2 cores of a CI machine only about 60 % busy: started at collection (at a lower priority, `nice`, so that
the tests running meanwhile keep their speed), they are done by the time their tests come, which then only read
the result. A test whose run was not started (its module ran alone, or with -k) runs it itself, the same way;
so does one whose run is still going when it comes (it waits for it).

A module takes part with `background_runs(items) -> {key: command}` (the runs its selected items will ask for)
and asks for a result with `run(key, command)`. Each command runs with its own scratch folder as `{tmp}`.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_lock = threading.Lock()
_futures: dict = {}
_running: set = set()
_pool: ThreadPoolExecutor | None = None
_scratch: Path | None = None


class Done:
    """A finished command: its CompletedProcess and the scratch folder its files were written to."""

    def __init__(self, process: subprocess.CompletedProcess, folder: Path):
        self.process, self.folder = process, folder


def _execute(command: list, env: dict | None, timeout: float, folder: Path, nice: bool = False) -> Done:
    folder.mkdir(parents=True, exist_ok=True)
    args = [str(a).replace("{tmp}", str(folder)) for a in command]
    args = ["nice", "-n", "10", *args] if nice and shutil.which("nice") else args
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with _lock:
        _running.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    finally:
        with _lock:
            _running.discard(proc)
    return Done(subprocess.CompletedProcess(args, proc.returncode, out, err), folder)


def start(runs: dict) -> None:
    """Queue `runs` ({key: (command, env, timeout)}) on one worker thread, in the order given."""
    global _pool, _scratch
    if not runs:
        return
    _scratch = Path(tempfile.mkdtemp(prefix="tt_moge-background-"))
    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-check")
    for i, (key, (command, env, timeout)) in enumerate(runs.items()):
        _futures[key] = _pool.submit(_execute, command, env, timeout, _scratch / str(i), True)


def run(key, command: list, env: dict | None, timeout: float, folder: Path) -> Done:
    """The result of `command`: the queued run's under `key` (waiting for it), else run now with `folder` as {tmp}."""
    future: Future | None = _futures.pop(key, None)
    if future is not None and not future.cancel():  # cancelled: not started yet; this test runs it itself
        return future.result()
    return _execute(command, env, timeout, folder)


def stop() -> None:
    """End of the session: drop what has not started, kill what runs, remove the scratch folders."""
    for future in _futures.values():
        future.cancel()
    _futures.clear()
    with _lock:
        for proc in _running:
            proc.kill()
    if _pool is not None:
        _pool.shutdown(wait=True)
    if _scratch is not None:
        shutil.rmtree(_scratch, ignore_errors=True)
