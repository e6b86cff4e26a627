"""Sending an answer with bounded memory and a deadline on progress.

A finished answer waits in the server until the client reads it. Written to the connection in one piece, all of
it would sit in the transport's buffer (a copy) for as long as the client does not read, with nothing to stop
it. `StreamedAnswer` instead hands the answer to the connection in chunks of `CHUNK_BYTES`, each only after the
previous one has drained (the server's flow control), so a connection buffers at most about one chunk. The
answer's parts are views of the result's arrays where possible (`npzio.npz_parts`): no npz copy is made.

A client that reads nothing for `send_timeout_s` is cut: its connection is aborted (not closed, which would
wait for the unsent bytes forever) and its queue slot and memory are given back. The same happens when the
sending is cancelled (the shutdown grace period ran out) or the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import weakref
from typing import Any, Callable, Optional, Sequence

from starlette.responses import Response

from ..npzio import parts_nbytes

__all__ = ["StreamedAnswer", "CHUNK_BYTES", "ABORT_KEY", "connection_aborter"]

log = logging.getLogger("tt_moge.server")

CHUNK_BYTES = 1 << 20  # what one send hands to the connection; the most a connection buffers beyond the socket
ABORT_KEY = "tt_moge.abort_connection"  # scope key: a callable that drops the request's connection at once


def connection_aborter(send: Any) -> Optional[Callable[[], None]]:
    """The callable that drops the connection behind an ASGI `send` at once, when the server exposes it.

    uvicorn's `send` is a method of the request's cycle object, which holds the connection's asyncio transport.
    `transport.abort()` drops the transport's unsent bytes, but the kernel would still hold the socket's own
    (megabytes) and keep the connection open to deliver them; a zero linger time makes the close a reset that
    discards them too. Other servers: None (a cut client then stops getting bytes and frees its slot and
    memory, but its connection stays until it goes away).
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if not callable(getattr(transport, "abort", None)):
        return None

    def abort() -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:  # already closed, or not a TCP socket
                pass
        transport.abort()

    return abort


class StreamedAnswer(Response):
    """A 200 answer made of `parts` (bytes or 1-D uint8 arrays), sent in chunks under a progress deadline.

    on_end() runs exactly once when the answer has been sent, abandoned (client gone, cut, cancelled), or never
    sent at all (the object was dropped): the caller frees the request's slot and memory there.
    """

    def __init__(
        self, parts: Sequence[Any], media_type: str, headers: dict, send_timeout_s: float, on_end: Callable[[], None]
    ):
        self.parts = list(parts)
        self.nbytes = parts_nbytes(self.parts)
        self.send_timeout_s = send_timeout_s
        super().__init__(None, 200, {**headers, "content-length": str(self.nbytes)}, media_type)
        self._end = weakref.finalize(self, on_end)  # runs once: at the end of __call__, or when dropped unsent

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        gone = asyncio.Event()
        listener = asyncio.ensure_future(self._watch(receive, gone))
        sent = 0
        try:
            await self._send(
                send, {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            for part in self.parts:
                view = memoryview(part).cast("B")
                for start in range(0, len(view), CHUNK_BYTES):
                    if gone.is_set():
                        return
                    chunk = bytes(view[start : start + CHUNK_BYTES])
                    await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
                    sent += len(chunk)
            # the last message waits until the connection has taken all but the last few KiB
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.TimeoutError:
            client = scope.get("client") or ("?", 0)
            log.warning(
                "cut %s:%s: it read nothing for %g s (--send-timeout); %d of %d bytes sent",
                client[0],
                client[1],
                self.send_timeout_s,
                sent,
                self.nbytes,
            )
            await self._abort(scope)
        except asyncio.CancelledError:
            # Only the server cancels a request's task: its shutdown grace period ran out. The connection is cut
            # and the task ends normally (re-raising would only make the server log a traceback for it).
            client = scope.get("client") or ("?", 0)
            log.warning(
                "cut %s:%s at shutdown (the grace period ran out); %d of %d bytes sent",
                client[0],
                client[1],
                sent,
                self.nbytes,
            )
            await self._abort(scope)
        finally:
            listener.cancel()
            self.parts = []
            self._end()

    async def _send(self, send: Any, message: dict) -> None:
        await asyncio.wait_for(send(message), self.send_timeout_s)

    @staticmethod
    async def _watch(receive: Any, gone: asyncio.Event) -> None:
        """Set `gone` when the client disconnects (the request body has been read already)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return

    @staticmethod
    async def _abort(scope: dict) -> None:
        abort = scope.get(ABORT_KEY)
        if abort is not None:
            abort()
            await asyncio.sleep(0)  # let the server see the connection lost before the app returns
