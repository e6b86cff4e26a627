"""Ending the processes of a local Ray whose driver died: a watcher started with it, and a sweep on the next run.

A local Ray (`batch.init_local_ray`) is a tree of processes: gcs_server, raylet, monitors, and the raylet's
children (DashboardAgent, RuntimeEnvAgent, workers). When the driver dies without `ray.shutdown()` (kill -9,
the OOM killer), Ray ends most of them, but its two agents, after noticing that the raylet is gone, wait on a
report to the dead GCS and live on for a minute or more.

    watcher = Watcher.start(node_id, session_dir)   # the driver, right after ray.init
    watcher.release()                               # after ray.shutdown(); or never: the driver's end does it

The watcher is `python ray_reaper.py watch ...` in a session of its own (a signal to the driver's process
group does not reach it). Until the driver ends (end of file on a pipe only the driver holds, so any end counts,
kill -9 included) it notes the node's processes every POLL_S in a record, RECORDS_DIR/<driver pid>.json; then it
gives Ray GRACE_S to stop its own processes and ends what is left: SIGTERM, and SIGKILL after KILL_AFTER_S.
It removes the record when done; should the watcher itself have been killed too, `sweep_dead()` (called by the
next local Ray start) ends the recorded processes of every record whose driver is gone.

The processes of a node: this user's processes whose command line names the node's session directory
(gcs_server, raylet, the monitors) and all their descendants (the raylet's agents and workers), plus those
noted earlier that still run (a process is a pid and its start time, so a reused pid is never taken for it).
The agents cannot be told by anything of their own once the raylet is gone: Ray rewrites their command line
and environment, and they are re-parented; hence the notes taken while the raylet lives.
Linux only (/proc); elsewhere nothing is done. Only the standard library: the watcher runs this file directly.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["Watcher", "node_processes", "end_processes", "sweep_dead", "RECORDS_DIR", "GRACE_S", "KILL_AFTER_S"]

RECORDS_DIR = Path(tempfile.gettempdir()) / f"tt_moge-ray-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
POLL_S = 0.5  # how often the watcher notes the node's processes
GRACE_S = 2.0  # after the driver's end: time for Ray to stop its own processes
KILL_AFTER_S = 5.0  # after SIGTERM: time before SIGKILL
_PROC = Path("/proc")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone, or another user's
        return b""


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22): a pid plus it names one
    process, even after the pid has been reused. None when there is no such process."""
    stat = _read(_PROC / str(pid) / "stat").decode("latin-1")
    if not stat:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    stat = _read(_PROC / str(pid) / "stat").decode("latin-1")
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has ended


def _processes() -> dict:
    """{pid: (parent pid, start time, command line)} of this user's processes."""
    uid, table = os.getuid(), {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        stat = _read(entry / "stat").decode("latin-1")
        if not stat:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            continue
        table[int(entry.name)] = (int(fields[1]), fields[19], _read(entry / "cmdline"))
    return table


def node_processes(session_dir: str, known: Iterable = (), exclude: Iterable[int] = ()) -> list:
    """[[pid, start time]] of the node's processes that run now (see the module docstring); `known`: such
    pairs noted earlier."""
    if not _PROC.is_dir() or not session_dir:
        return []
    table = _processes()
    skip = {os.getpid(), *exclude}
    marker = session_dir.rstrip("/").encode()
    found = {
        pid
        for pid, (_, _, cmdline) in table.items()  # the directory itself, or a path inside it
        if marker + b"/" in cmdline or marker + b"\0" in cmdline or cmdline.endswith(marker)
    }
    children: dict = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    found.update(pid for pid, started in known if pid in table and table[pid][1] == started)
    return sorted([pid, table[pid][1]] for pid in found - skip)


def end_processes(processes: Iterable, kill_after_s: float = KILL_AFTER_S) -> list:
    """SIGTERM the [pid, start time] processes that still run, then SIGKILL what is left after kill_after_s.
    Returns the pids it signalled."""
    pids = [pid for pid, started in processes if _start_time(pid) == started and _alive(pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + kill_after_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return pids


def _record_path(driver_pid: int) -> Path:
    return RECORDS_DIR / f"{driver_pid}.json"


def sweep_dead(records_dir: Optional[Path] = None) -> list:
    """End the processes of every recorded local Ray whose driver is gone; remove those records.
    Returns [(driver pid, [pids ended])] for the records that had processes left."""
    folder = records_dir or RECORDS_DIR
    swept = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            record = json.loads(path.read_text())
            driver, started = int(record["driver_pid"]), record["driver_start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _start_time(driver) == started and _alive(driver):
            continue  # that driver still runs
        ended = end_processes(
            node_processes(record.get("session_dir", ""), record.get("processes", ()), exclude=[driver])
        )
        if ended:
            swept.append((driver, ended))
        try:
            path.unlink()
        except OSError:
            pass
    return swept


class Watcher:
    """The driver's side of the watcher process (see the module docstring)."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def start(cls, node_id: str, session_dir: str) -> Optional["Watcher"]:
        """Start watching this process's local Ray node; None where it cannot be done (not Linux, no /proc)."""
        if not _PROC.is_dir() or not hasattr(os, "getuid"):
            return None
        RECORDS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        driver = os.getpid()
        record = {
            "driver_pid": driver,
            "driver_start": _start_time(driver),
            "node_id": node_id,
            "session_dir": session_dir,
            "processes": node_processes(session_dir, exclude=[driver]),
        }
        path = _record_path(driver)
        path.write_text(json.dumps(record))
        process = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "watch", str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        return cls(process)

    def release(self) -> None:
        """The node has been shut down: let the watcher check it and go now (not at the driver's end)."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()


def _write_record(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _watch(record_path: str) -> int:
    path = Path(record_path)
    record = json.loads(path.read_text())
    driver, session_dir = record["driver_pid"], record["session_dir"]
    stdin = sys.stdin.buffer.raw
    while True:  # until the driver closes the pipe or ends
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready and not os.read(stdin.fileno(), 4096):
            break
        now = node_processes(session_dir, record["processes"], exclude=[driver])
        if now != record["processes"]:
            record["processes"] = now
            _write_record(path, record)
    time.sleep(GRACE_S)
    end_processes(node_processes(session_dir, record["processes"], exclude=[driver]))
    try:
        path.unlink()
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "watch":
        sys.exit(_watch(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} watch RECORD.json")
