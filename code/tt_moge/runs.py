"""A run of many photos into one output folder (`tt-moge predict`, `tt-moge batch`, and any later command that
writes OUT/NAME/ folders): the names the run itself writes at the top of OUT, and a check that a path stays
inside OUT.

The output name of each input is made by `inputs.output_name` / `inputs.collect_images`; they map the names
below (case-insensitively) and every hidden top-level name to other, safe names, so that no photo's folder can
take the place of a file the run writes itself.

`OutputLock` keeps a second run out of a folder that a run is writing: two runs into one OUT would mix their
files silently, and run.json would describe a result that the folder does not hold. It is an `fcntl.flock` on
OUT/.tt-moge.lock, so the operating system releases it when the holder dies, however it dies (kill -9
included): a lock can never be left stale.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = [
    "RUN_FILE",
    "BATCH_RECORD_FILE",
    "FAILURES_FILE",
    "SHARDS_DIR",
    "RESERVED_NAMES",
    "is_reserved",
    "inside",
    "LOCK_FILE",
    "OutputBusy",
    "OutputLock",
]

RUN_FILE = "run.json"  # tt-moge predict's record of the run: options, model, every input's folder and status
BATCH_RECORD_FILE = "batch.json"  # tt-moge batch's record of the last run
FAILURES_FILE = "failures.jsonl"  # tt-moge batch: one JSON line per image that failed in the last run
SHARDS_DIR = "parquet"  # tt-moge batch --format parquet: OUT/parquet/part-<hash>.parquet
LOCK_FILE = ".tt-moge.lock"  # held (flock) by the run writing OUT; it holds that run's pid and command
# Names at the top of OUT that belong to the run, not to a photo. Hidden names (a leading ".": the temporary
# files of atomic writes) are the run's too (`is_reserved`).
RESERVED_NAMES = (RUN_FILE, BATCH_RECORD_FILE, FAILURES_FILE, SHARDS_DIR)


def is_reserved(top_level_name: str) -> bool:
    """True for a name at the top of OUT that a photo's folder must not take: one of RESERVED_NAMES (ignoring
    case, as file systems on macOS and Windows do) or a hidden name (leading ".")."""
    return top_level_name.startswith(".") or top_level_name.casefold() in {n.casefold() for n in RESERVED_NAMES}


def inside(path: Union[str, os.PathLike], root: Union[str, os.PathLike]) -> bool:
    """True when `path` is `root` or below it, after resolving `..` and symbolic links of both."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutputBusy(RuntimeError):
    """Another process holds the lock of the output folder (its pid and command, when known, in the message)."""


class OutputLock:
    """An exclusive lock on an output folder, held while a run writes it (a context manager).

    `acquire(wait=False)` raises OutputBusy when another process holds it; `wait=True` blocks until that one
    ends (`on_wait(message)` is called once first, e.g. to tell the user why nothing happens). The lock is an
    `fcntl.flock` on OUT/LOCK_FILE: the OS drops it when its process dies, so a killed run never blocks the
    next one. The file holds the holder's pid and command line (for the message) and is removed on release;
    a run that took the lock on a file another run has just removed takes it again on the new file, so two
    runs never both hold it. Where flock does not exist (Windows) or the file system refuses it (ENOLCK,
    EOPNOTSUPP: some network mounts), the run goes on without the lock (`unsupported` says why)."""

    def __init__(self, out: Union[str, os.PathLike]) -> None:
        self.path = Path(out) / LOCK_FILE
        self._fd: Optional[int] = None
        self.unsupported = ""  # why the lock could not be taken where the file system has no locks ("" otherwise)

    def holder(self) -> str:
        """Who holds the lock, as its file says ("" when unknown)."""
        try:
            return self.path.read_text(errors="replace").strip()
        except OSError:
            return ""

    def acquire(self, wait: bool = False, on_wait: Optional[Callable[[str], None]] = None) -> "OutputLock":
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return self
        told = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in _NO_LOCKS:  # a file system without locks (some network mounts): run unlocked
                        os.close(fd)
                        with contextlib.suppress(OSError):
                            self.path.unlink()
                        self.unsupported = f"{self.path.parent} cannot be locked ({exc.strerror})"
                        return self
                    if not isinstance(exc, BlockingIOError):
                        raise
                    holder = self.holder()
                    message = (
                        f"the output folder {str(self.path.parent)!r} is in use by another run"
                        f"{f' ({holder})' if holder else ''}"
                    )
                    if not wait:
                        raise OutputBusy(
                            f"{message}; wait for it to end (or pass --wait), or choose another output folder"
                        ) from None
                    if not told and on_wait is not None:
                        on_wait(f"{message}: waiting for it to end")
                        told = True
                    fcntl.flock(fd, fcntl.LOCK_EX)
                # the holder before us may have removed the file after we opened it: then this lock guards nothing
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    time.sleep(0.01)
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode(errors="replace"))
                self._fd = fd
                return self
            except BaseException:
                if self._fd != fd:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                raise

    def release(self) -> None:
        """Remove the lock file and drop the lock (no-op when not held)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # before unlocking: a waiter then sees that its file is gone, and tries again
        with contextlib.suppress(OSError):
            os.close(self._fd)  # closing drops the flock
        self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()
