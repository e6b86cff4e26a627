"""What a request holds while the server works for it: bytes of the memory budget, and once admitted a ticket.

The memory a request costs is known before any large allocation: its body as it arrives, and from the image
header its pixel count, which fixes the size of the result maps (`ServerSettings.request_cost`). So the budget
is checked at each of those points, and a request that does not fit gets a 503 instead of memory.

    reservation = budget.reservation()   # 0 bytes
    reservation.grow(n)                  # a body chunk arrived: False when the budget cannot hold it
    reservation.resize(cost)             # admitted: the request's whole cost (False when it does not fit)
    reservation.resize(answer_bytes)     # encoded: the answer is all it still holds
    reservation.release()                # sent, or the client is gone

A `Ticket` frees an admitted request's queue slot and its reservation once both its work (on a host thread)
and the sending of its answer (on the event loop) have ended, whichever ends last and however they end.
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["MemoryBudget", "Reservation", "Ticket"]


class MemoryBudget:
    """A byte count that reservations take from and give back, never above `limit`."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.lock = threading.Lock()

    def reservation(self) -> "Reservation":
        return Reservation(self)


class Reservation:
    """The bytes of the budget one request holds now (see the module docstring)."""

    def __init__(self, budget: MemoryBudget):
        self.budget = budget
        self.nbytes = 0

    def grow(self, nbytes: int) -> bool:
        return self.resize(self.nbytes + nbytes)

    def resize(self, nbytes: int) -> bool:
        """Hold `nbytes` from now on; False (and no change) when growing to it would go over the budget."""
        with self.budget.lock:
            delta = nbytes - self.nbytes
            if delta > 0 and self.budget.used + delta > self.budget.limit:
                return False
            self.budget.used += delta
            self.nbytes = nbytes
            return True

    def release(self) -> None:
        self.resize(0)


class Ticket:
    """An admitted request and its reservation. `done("work")` when its work has ended, `done("answer")` when
    its answer has been sent or abandoned; after both, `on_free()` runs once (it gives the queue slot and the
    memory back).
    Repeating a name does nothing, so every path that may end a part can say so."""

    PARTS = ("work", "answer")

    def __init__(self, reservation: Reservation, on_free: Callable[[], None]):
        self.reservation = reservation  # resized to the answer once it is encoded
        self._pending = set(self.PARTS)
        self._on_free = on_free
        self._lock = threading.Lock()

    def done(self, part: str) -> None:
        if part not in self.PARTS:
            raise ValueError(f"part must be one of {self.PARTS}, got {part!r}")
        with self._lock:
            if part not in self._pending:
                return
            self._pending.discard(part)
            free = not self._pending
        if free:
            self._on_free()

    @property
    def freed(self) -> bool:
        return not self._pending
