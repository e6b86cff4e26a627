"""The HTTP/1.1 connections of `tt-moge serve`: uvicorn's h11 protocol, with the answers it gives below the app
in JSON, like every other error of the server.

uvicorn answers some requests itself, before the app sees them, in plain text:

- a request it cannot parse (a garbage request line, `Content-Length: -1`, a request line and headers longer
  than h11's limit) gets a 400 and the connection is closed at once. With bytes of the request still arriving,
  the kernel then resets the connection and the client usually sees the reset, not the answer;
- at `--max-connections` it answers 503 itself.

And it never closes a connection that sends nothing, nor one that has sent part of a request head and stalls
(its keep-alive timeout starts only after a first answer), so such connections could hold every connection slot
and, under a low `ulimit -n`, drive accept() into EMFILE (logged once per attempt by asyncio: tens of MB a minute).

`JsonH11Protocol` answers the first with `{"code", "detail"}`: 400 `bad_request` naming what h11 found wrong,
or 431 `headers_too_large`, then half-closes the connection and reads and drops what the client still sends
(at most LINGER_S seconds and LINGER_BYTES bytes) so that the client gets to read the answer. The second gets a
JSON 503 `too_many_connections` with Retry-After.

Idle connections (no request in progress: nothing sent yet, an incomplete request head, a keep-alive
connection between requests) are closed after `--idle-timeout` seconds, and at `--max-connections` a new
connection first closes the connection idle the longest: only when every open connection has a request in
progress does the new one get the 503 (and beyond OVER_LIMIT_SLOTS more such, the oldest of those is closed at
once). Liveness and readiness probes (GET or HEAD of PROBE_PATHS) are answered even then: a server whose
connections are all held by uploads still tells its orchestrator that it lives. Together
with the listen backlog (ACCEPT_BACKLOG) and the limit kept below the file-descriptor limit
(`ServerSettings.within_fd_limit`), accept() never runs out of descriptors; should it fail all the same,
`log_accept_errors` logs that once per LOG_INTERVAL_S, with a count, never once per attempt.

What no server can answer (a client that closes before its request line is complete, a TLS or HTTP/2 client
on this plain HTTP/1.1 port, an answer cut after its status line was sent) is listed in docs/server-limits.md.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from http import HTTPStatus
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import OVER_LIMIT_SLOTS

__all__ = [
    "JsonH11Protocol",
    "LINGER_S",
    "LINGER_BYTES",
    "CONNECTION_LIMIT_RETRY_AFTER_S",
    "LOG_INTERVAL_S",
    "PROBE_PATHS",
    "log_accept_errors",
    "ThrottledLog",
]

log = logging.getLogger("tt_moge.server")

LINGER_S = 5.0  # after an error answer: how long the rest of a broken request is read and dropped
LINGER_BYTES = 16 * 1024 * 1024  # ... and how much of it
CONNECTION_LIMIT_RETRY_AFTER_S = 1
PROBE_PATHS = frozenset({"/health", "/ready"})  # GET / HEAD of these are answered at the connection limit too
_BODY_DRAIN_S = 2.0  # a request refused at the connection limit: how long its body is read and dropped first
_H11_DEFAULT_LIMIT = 16 * 1024  # h11's default max_incomplete_event_size (uvicorn passes None for it)
LOG_INTERVAL_S = 10.0  # events that may come by the thousand (accept errors, idle connections closed) are logged
# at most once per this many seconds, with their count


class ThrottledLog:
    """Counts events and logs them at most once per `interval_s`: the first at once, the rest as a count with the
    next line (or the next one after the interval). One per kind of event; used on the event loop only."""

    def __init__(self, level: int, interval_s: float = LOG_INTERVAL_S):
        self.level, self.interval_s = level, interval_s
        self._last = float("-inf")
        self._since = 0  # events not logged since the last line

    def __call__(self, message: str, *args: Any) -> bool:
        """Count one event; log `message % args` (plus how many were not logged) when the interval has passed.
        Returns whether a line was written."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._since += 1
            return False
        more = f" (and {self._since} more like it in the last {now - self._last:.0f} s)" if self._since else ""
        log.log(self.level, message + more, *args)
        self._last, self._since = now, 0
        return True


_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def log_accept_errors(loop: asyncio.AbstractEventLoop, interval_s: float = LOG_INTERVAL_S) -> None:
    """Make the loop log a failing accept() once per `interval_s` with a count, not once per attempt (asyncio logs
    each, with a traceback); other errors go to the handler the loop had."""
    previous = loop.get_exception_handler()
    throttled = ThrottledLog(logging.ERROR, interval_s)

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        accepting = str(context.get("message", "")).startswith("socket.accept()")
        if accepting or (isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES and "socket" in context):
            reason = f"{type(exc).__name__}: {exc}" if exc is not None else context.get("message")
            throttled(
                "accept() failed: %s; new connections wait in the listen backlog (see --max-connections, ulimit -n)",
                reason,
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


_IDLE_CLOSED = ThrottledLog(logging.DEBUG)  # routine (keep-alive connections end so); the others are overload
_REFUSED = ThrottledLog(logging.WARNING)
_EVICTED = ThrottledLog(logging.WARNING)
_CUT = ThrottledLog(logging.WARNING)


def _json_head(status: int, body: bytes, extra: tuple = ()) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def error_body(code: str, detail: str) -> bytes:
    return json.dumps({"code": code, "detail": detail}).encode()


class _RecordingConnection:
    """An h11.Connection that remembers why parsing failed (uvicorn's handler is not told)."""

    def __init__(self, conn: h11.Connection):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "error", None)

    def next_event(self) -> Any:
        try:
            return self._conn.next_event()
        except h11.RemoteProtocolError as exc:
            object.__setattr__(self, "error", exc)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)


class _ConnectionLimit:
    """ASGI wrapper: uvicorn's --max-connections rule (`limit_concurrency`), answered in JSON."""

    def __init__(self, app: Any, protocol: "JsonH11Protocol", limit: int):
        self.app, self.protocol, self.limit = app, protocol, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        # over the limit when it was accepted (no idle connection to close), or running requests (this one
        # included) over the limit
        busy = self.protocol.over_limit or len(self.protocol.tasks) - 1 >= self.limit
        if scope["type"] != "http" or not busy:
            return await self.app(scope, receive, send)
        if scope["method"] in ("GET", "HEAD") and scope["path"] in PROBE_PATHS:
            self.protocol.probing = True  # answered even now, and not closed to make room for others
            return await self.app(scope, receive, send)
        _REFUSED(
            "refused a request: %d connections open (--max-connections %d)", len(self.protocol.connections), self.limit
        )
        try:  # read the body first: closing with unread bytes would reset the connection before the answer
            await asyncio.wait_for(self._drain(receive), _BODY_DRAIN_S)
        except asyncio.TimeoutError:
            pass
        body = error_body(
            "too_many_connections",
            f"the server has {len(self.protocol.connections)} connections open, its limit "
            f"(--max-connections {self.limit}); retry after {CONNECTION_LIMIT_RETRY_AFTER_S} s",
        )
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(CONNECTION_LIMIT_RETRY_AFTER_S).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    @staticmethod
    async def _drain(receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


class JsonH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with JSON answers to unparsable requests and at the connection limit, and idle
    connections bounded (see the module docstring). Pass it as `uvicorn.Config(http=JsonH11Protocol, ...)`: the
    config's `timeout_keep_alive` is the idle timeout, its `limit_concurrency` the connection limit."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = _RecordingConnection(self.conn)
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        self._dropped = 0
        self.limit = self.limit_concurrency
        self.over_limit = False  # accepted over the limit with no idle connection to close: its request gets 503
        self.probing = False  # its request is a liveness or readiness probe (PROBE_PATHS), answered over the limit
        self.accepted_at = time.monotonic()
        self.idle_since: Optional[float] = None  # loop time since when no request is in progress; None while one is
        self._idle_timer: Optional[asyncio.TimerHandle] = None
        if self.limit is not None:  # our wrapper checks it (in JSON); uvicorn's own check is off
            self.app = _ConnectionLimit(self.app, self, self.limit)
            self.limit_concurrency = None

    # ------------------------------------------------------------------------------------- idle connections
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._became_idle()
        if self.limit is None:
            return
        open_now = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_now) <= self.limit:
            return
        idle = [c for c in open_now if c is not self and getattr(c, "idle_since", None) is not None]
        if idle:
            min(idle, key=lambda c: c.idle_since).close_idle()
            _EVICTED(
                "%d connections open (--max-connections %d): closed the one idle the longest to make room",
                len(open_now),
                self.limit,
            )
            return
        self.over_limit = True
        if len(open_now) > self.limit + OVER_LIMIT_SLOTS:
            # the over-limit slots are full: close the oldest of them that is not a probe (its request would get the
            # 503 anyway), so that a new connection, which may be a liveness probe, gets a slot
            doomed = [c for c in open_now if c is not self and getattr(c, "over_limit", False) and not c.probing]
            oldest = min(doomed, key=lambda c: c.accepted_at) if doomed else self
            _CUT(
                "%d connections open, each with a request in progress (--max-connections %d): closed one over the "
                "limit at once",
                len(open_now),
                self.limit,
            )
            oldest.transport.abort()

    def _became_idle(self) -> None:
        """No request in progress from now: close the connection if that lasts the idle timeout."""
        self.idle_since = self.loop.time()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self._idle_timer = None
        if self.idle_since is not None and not self.transport.is_closing():
            _IDLE_CLOSED("closed a connection idle for %g s (--idle-timeout)", self.timeout_keep_alive)
            self.close_idle()

    def close_idle(self) -> None:
        """Close this connection, which has no request in progress (as uvicorn's keep-alive timeout does)."""
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # a request head half received: nothing to tell the peer
            pass
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self.idle_since = None  # a request head arrived: its body has --read-timeout, its answer --send-timeout

    def on_response_complete(self) -> None:
        self._became_idle()  # before uvicorn's, which may start a pipelined request (handle_events)
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        error = self.conn.error
        status = getattr(error, "error_status_hint", 400) if error is not None else 400
        reason = str(error) if error is not None and str(error) else msg
        if status == 431:
            limit = self.config.h11_max_incomplete_event_size or _H11_DEFAULT_LIMIT
            body = error_body(
                "headers_too_large",
                f"the request line and headers are longer than {limit} bytes "
                f"({reason}); send a shorter URL and fewer or shorter headers",
            )
        else:
            status = status if 400 <= status < 500 else 400
            body = error_body(
                "bad_request",
                f"not a valid HTTP/1.1 request: {reason}; expected a request line such as "
                "'POST /predict HTTP/1.1', then headers (a Content-Length is a byte count)",
            )
        log.warning("answered %d to an unparsable request: %s", status, reason)
        self.transport.write(_json_head(status, body) + body)
        self._linger()

    def _linger(self) -> None:
        """Half-close after the answer and drop what still arrives, so the client reads the answer, not a reset."""
        if self._linger_timer is not None:
            return
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.abort)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:  # pragma: no cover - TLS transports cannot half-close
            self.transport.close()
        self.flow.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.abort()
            return
        super().data_received(data)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        super().connection_lost(exc)
