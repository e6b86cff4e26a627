"""The HTTP/1.1 connections of `tt-moge serve`: uvicorn's h11 protocol, with the answers it gives below the app
in JSON, like every other error of the server.

uvicorn answers some requests itself, before the app sees them, in plain text:

- a request it cannot parse (a garbage request line, `Content-Length: -1`, a request line and headers longer
  than h11's limit) gets a 400 and the connection is closed at once. With bytes of the request still arriving,
  the kernel then resets the connection and the client usually sees the reset, not the answer;
- at `--max-connections` it answers 503 itself.

`JsonH11Protocol` answers the first with `{"code", "detail"}`: 400 `bad_request` naming what h11 found wrong,
or 431 `headers_too_large`, then half-closes the connection and reads and drops what the client still sends
(at most LINGER_S seconds and LINGER_BYTES bytes) so that the client gets to read the answer. The second gets a
JSON 503 `too_many_connections` with Retry-After, by the same rule as uvicorn's.

What no server can answer (a client that closes before its request line is complete, a TLS or HTTP/2 client
on this plain HTTP/1.1 port, an answer cut after its status line was sent) is listed in docs/server-limits.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["JsonH11Protocol", "LINGER_S", "LINGER_BYTES", "CONNECTION_LIMIT_RETRY_AFTER_S"]

log = logging.getLogger("tt_moge.server")

LINGER_S = 5.0  # after an error answer: how long the rest of a broken request is read and dropped
LINGER_BYTES = 16 * 1024 * 1024  # ... and how much of it
CONNECTION_LIMIT_RETRY_AFTER_S = 1
_BODY_DRAIN_S = 2.0  # a request refused at the connection limit: how long its body is read and dropped first
_H11_DEFAULT_LIMIT = 16 * 1024  # h11's default max_incomplete_event_size (uvicorn passes None for it)


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
        # uvicorn counts open connections (this one included) and running requests (this one not yet added)
        busy = len(self.protocol.connections) >= self.limit or len(self.protocol.tasks) - 1 >= self.limit
        if scope["type"] != "http" or not busy:
            return await self.app(scope, receive, send)
        log.warning(
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
    """uvicorn's H11Protocol with JSON answers to unparsable requests and at the connection limit (see the
    module docstring). Pass it as `uvicorn.Config(http=JsonH11Protocol, ...)`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = _RecordingConnection(self.conn)
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        self._dropped = 0
        if self.limit_concurrency is not None:  # our wrapper checks it (in JSON); uvicorn's own check is off
            self.app = _ConnectionLimit(self.app, self, self.limit_concurrency)
            self.limit_concurrency = None

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
        super().connection_lost(exc)
