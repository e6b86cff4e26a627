"""Recycled memory for the large arrays of the host steps (decoded images, canvases, the finish outputs).

Why: one result holds tens of MB of maps (4 + 12 + 12 + 1 bytes per pixel of float32 depth, points, normal and
the mask). Fresh memory costs a page fault per 4 KiB page on its first write (more than the finish pass itself:
docs/performance.md), and glibc hands freed blocks of this size back to the OS, so a loop of calls would pay it
on every call.

`empty(shape, dtype)` returns a numpy array on a pooled block. The array's base is a small "lease" object (numpy keeps
the object that offered `__array_interface__` as the base); when the last array or view (or torch tensor made with
`torch.from_numpy`) that uses the lease is gone, the block goes back to the pool. A block is reused only after nothing
can see it any more. Small arrays (< MIN_POOLED_BYTES) use plain `np.empty`. The pool keeps at most MAX_FREE_BYTES of
released blocks; when a release would exceed that, the blocks released longest ago go first (so a server whose photo
sizes change keeps the sizes it sees now, not the first ones it saw).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from math import prod

import numpy as np

__all__ = ["empty", "clear", "free_bytes", "MIN_POOLED_BYTES", "MAX_FREE_BYTES"]

MIN_POOLED_BYTES = 1 << 20
MAX_FREE_BYTES = 512 << 20

_lock = threading.Lock()
_free: "OrderedDict[int, np.ndarray]" = OrderedDict()  # id -> released block (uint8 array), oldest release first
_free_total = 0
# Released blocks on their way into `_free`. A release is a finalizer, and a finalizer runs wherever a garbage
# collection happens to start: also inside `empty` on a thread that holds `_lock` (an allocation there set off the
# collection of a lease in a reference cycle). So a release only appends here (deque.append is atomic) and moves
# the blocks into the pool when it can take the lock at once; whoever holds the lock moves them on.
_pending: "deque[np.ndarray]" = deque()


def empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array, like np.empty, whose memory is recycled (see the module doc)."""
    dtype = np.dtype(dtype)
    nbytes = prod(shape) * dtype.itemsize
    if nbytes < MIN_POOLED_BYTES:
        return np.empty(shape, dtype)
    global _free_total
    with _lock:
        _drain()
        key = next((k for k in reversed(_free) if _free[k].nbytes == nbytes), None)  # the newest of this size
        block = _free.pop(key) if key is not None else None
        if block is not None:
            _free_total -= nbytes
    if block is None:
        block = np.empty(nbytes, np.uint8)
    lease = _Lease(block, shape, dtype)
    weakref.finalize(lease, _release, block)
    return np.asarray(lease)


class _Lease:
    """Offers one pooled block to numpy as an array of `shape` and `dtype`; lives as long as any view."""

    __slots__ = ("block", "__array_interface__", "__weakref__")

    def __init__(self, block: np.ndarray, shape: tuple, dtype: np.dtype):
        self.block = block
        self.__array_interface__ = {
            "data": (block.ctypes.data, False),
            "shape": tuple(shape),
            "typestr": dtype.str,
            "version": 3,
        }


def _release(block: np.ndarray) -> None:
    """A lease's finalizer: never waits for `_lock` (see `_pending`)."""
    _pending.append(block)
    if _lock.acquire(blocking=False):  # else its holder (maybe this very thread, below us) drains it
        try:
            _drain()
        finally:
            _lock.release()


def _drain() -> None:
    """Move the pending releases into the pool, dropping the oldest releases over MAX_FREE_BYTES (`_lock` held); a
    block larger than that is not kept."""
    global _free_total
    while _pending:
        block = _pending.popleft()
        if block.nbytes > MAX_FREE_BYTES:
            continue
        while _free_total + block.nbytes > MAX_FREE_BYTES:
            _free_total -= _free.popitem(last=False)[1].nbytes  # the oldest release
        _free[id(block)] = block
        _free_total += block.nbytes


def free_bytes() -> int:
    """Bytes of released blocks the pool holds now."""
    with _lock:
        _drain()
        return _free_total


def clear() -> None:
    """Drop every released block (their memory goes back to the allocator)."""
    global _free_total
    with _lock:
        _pending.clear()
        _free.clear()
        _free_total = 0
