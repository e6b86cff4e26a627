"""The server bounded to the last byte, on real `python -m tt_moge.server` processes on 127.0.0.1.

- Slow readers: six clients upload a 72 KB PNG that declares 4990x5000 pixels (a 574 MB npz answer) and never
  read. With --queue-size 2 two are admitted and four get 503; the two answers hold their slots and memory
  until the send timeout cuts them; a normal request is then served; a second round peaks within 0.5 GB of the
  first, and the first stays within the documented memory formula.
- Shutdown: SIGTERM with a client that does not read its answer exits 0 within --shutdown-grace + 5 s; a
  second signal exits at once. Before that, a request over --max-connections (every connection busy) gets a JSON
  503.
- Protocol errors (garbage request line, Content-Length -1, 20,000 headers, a 1 MB URL) get JSON answers the
  client can read, on the shared test server.

Three server processes of their own (the micro checkpoint, seconds to start each); about a minute in all.
Run: cd code && python -m pytest tests/test_server_limits.py -q
"""

from __future__ import annotations

import io
import json
import signal
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tt_moge.server.settings import ServerSettings  # noqa: E402

from .server_harness import (  # noqa: E402
    API_KEY,
    ServerProcess,
    auth_headers,
    encode_image,
    micro_config,
    photo,
    shared_server,
)

BOMB_SIZE = (4990, 5000)  # under the default --max-pixels (25 MP): an all-zero PNG of 72 KB, a 574 MB npz
SEND_TIMEOUT_S = 6.0  # longer than the two admitted answers take to start one after the other
GRACE_S = 3.0
GB = 1024**3


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tt_moge.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("limits-weights"), micro_config())


@pytest.fixture(scope="module")
def bomb() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((BOMB_SIZE[1], BOMB_SIZE[0], 3), np.uint8)).save(buf, "PNG", compress_level=9)
    return buf.getvalue()


def start(weights, *flags: str) -> ServerProcess:
    return ServerProcess.started(weights, list(flags))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class RssPeak:
    """The highest RSS of a process, sampled every 20 ms while in the `with` block."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> "RssPeak":
        self.peak = rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def request_bytes(body: bytes, content_type: str = "image/png", path: str = "/predict", auth: bool = False) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n" + (f"Authorization: Bearer {API_KEY}\r\n" if auth else "") + "\r\n"
    )
    return head.encode() + body


def non_reading_client(port: int, data: bytes) -> socket.socket:
    """A connection that sends a request and then reads nothing (a small receive buffer: it fills at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def peek_head(sock: socket.socket, timeout_s: float) -> str:
    """The start of what the server sent, left unread in the socket (MSG_PEEK): once the whole head has arrived
    and, for an answer other than 200, its body too (up to 2048 bytes in all). The head and the body can come
    in separate segments (seen in CI: a 503 head peeked before its JSON body)."""
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        data = sock.recv(2048, socket.MSG_PEEK)
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            text = head.decode("latin-1").lower()
            if data.startswith(b"HTTP/1.1 200") or "content-length: " not in text:
                break
            if len(body) >= min(content_length(text), 2048 - len(head) - len(sep)):
                break
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return data.decode("latin-1")


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of a connected socket (Linux TCP_INFO): 1 established, 7 closed (reset)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def wait_cut(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """True once the server has dropped the connection, seen without reading what it holds."""
    deadline = time.monotonic() + timeout_s
    while tcp_state(sock) == 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def content_length(head: str) -> int:
    return int(head.lower().split("content-length: ", 1)[1].split("\r\n", 1)[0])


def read_all(sock: socket.socket) -> int:
    """Read until the server closes or resets the connection -> bytes received."""
    sock.settimeout(30)
    total = 0
    try:
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            total += len(chunk)
    except (ConnectionResetError, socket.timeout):
        pass
    return total


def wait_health(client, predicate, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = client.get("/health").json()
        if predicate(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------- slow readers
def test_slow_readers_hold_their_slot_until_cut_and_memory_stays_bounded(weights, bomb):
    server = start(
        weights, "--queue-size", "2", "--host-threads", "2", "--max-body-mb", "2", "--send-timeout", str(SEND_TIMEOUT_S)
    )
    pixels = BOMB_SIZE[0] * BOMB_SIZE[1]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert (
                client.post(
                    "/predict", content=encode_image(photo(96, 64), "PNG"), headers={"Content-Type": "image/png"}
                ).status_code
                == 200
            )
            rounds = []
            for round_ in range(2):
                base = rss_bytes(server.proc.pid)
                with RssPeak(server.proc.pid) as peak:
                    clients = [non_reading_client(server.port, request_bytes(bomb)) for _ in range(6)]
                    heads = [peek_head(sock, 60) for sock in clients]
                    statuses = sorted(head.split(" ", 2)[1] for head in heads)
                    assert statuses == ["200"] * 2 + ["503"] * 4, heads
                    assert all('"code":"queue_full"' in h for h in heads if h.startswith("HTTP/1.1 503")), heads
                    # the two answers are stuck in their connections: they still hold their slots and memory
                    stuck = client.get("/health").json()
                    assert stuck["in_flight"] == 2 and stuck["memory_reserved_bytes"] > 0, stuck
                    late = client.post("/predict/summary", content=bomb, headers={"Content-Type": "image/png"})
                    assert late.status_code == 503 and late.json()["code"] == "queue_full", late.text
                    t = time.monotonic()
                    health = wait_health(client, lambda h: h["in_flight"] == 0, SEND_TIMEOUT_S + 30)
                    cut_after = time.monotonic() - t
                    assert health["in_flight"] == 0 and health["memory_reserved_bytes"] == 0, health
                    admitted = [sock for sock, head in zip(clients, heads) if head.startswith("HTTP/1.1 200")]
                    assert all(wait_cut(sock) for sock in admitted), "the server did not drop the slow connections"
                    length = content_length(next(h for h in heads if h.startswith("HTTP/1.1 200")))
                    received = [read_all(sock) for sock in admitted]
                    assert all(n < length for n in received), f"a slow client was not cut: {received} of {length} bytes"
                    for sock in clients:
                        sock.close()
                    normal = client.post(
                        "/predict/summary",
                        content=encode_image(photo(96, 64, round_), "PNG"),
                        headers={"Content-Type": "image/png"},
                    )
                    assert normal.status_code == 200, normal.text
                rounds.append((base, peak.peak, cut_after))
    finally:
        server.stop()
    (base1, peak1, _), (base2, peak2, _) = rounds
    formula = 2 * ServerSettings.request_cost(pixels, len(bomb))  # two admitted requests, as documented
    print(
        f"\n[slow readers] rounds (base, peak, cut after): {[(b / GB, p / GB, round(c, 1)) for b, p, c in rounds]} GB; "
        f"formula for 2 admitted: {formula / GB:.2f} GB; npz of one answer {length / 1e6:.0f} MB"
    )
    assert peak2 - peak1 < 0.5 * GB, f"the second round peaked {(peak2 - peak1) / GB:.2f} GB above the first"
    assert peak1 - base1 <= formula, f"round 1 took {(peak1 - base1) / GB:.2f} GB over {formula / GB:.2f} GB"


# ------------------------------------------------------------------------------------------------- shutdown
def stuck_answer(server: ServerProcess, client) -> socket.socket:
    """A client whose answer (a 3 MP npz, far more than the socket buffers) is being sent and not read."""
    sock = non_reading_client(server.port, request_bytes(encode_image(np.zeros((1500, 2000, 3), np.uint8), "PNG")))
    assert peek_head(sock, 60).startswith("HTTP/1.1 200")
    assert client.get("/health").json()["in_flight"] == 1
    return sock


def test_sigterm_with_a_client_that_does_not_read_exits_0_within_the_grace_period(weights):
    server = start(weights, "--shutdown-grace", str(GRACE_S), "--send-timeout", "600", "--max-connections", "3")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            sock = stuck_answer(server, client)
            # the stuck client and two requests whose bodies are still arriving: every connection of the limit (3)
            # has a request in progress (an idle one would be closed to make room), so a fourth gets a JSON 503
            receiving = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
            for other in receiving:
                other.sendall(
                    b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 99\r\n\r\n"
                )
            time.sleep(0.5)
            with httpx.Client(base_url=server.url, timeout=60) as fourth:
                refused = fourth.get("/info")  # not a probe: /health and /ready are answered even now
            for other in receiving:
                other.close()
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
            assert (
                refused.json()["code"] == "too_many_connections" and "--max-connections 3" in refused.json()["detail"]
            )
        t = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(GRACE_S + 30)
        seconds = time.monotonic() - t
        sock.close()
    finally:
        server.stop()
    assert code == 0, server.log()
    assert GRACE_S - 0.5 < seconds <= GRACE_S + 5, f"exited {seconds:.1f} s after SIGTERM (grace {GRACE_S} s)"
    assert "SIGTERM: stopping" in server.log()


def test_a_second_signal_exits_at_once(weights):
    server = start(weights, "--shutdown-grace", "600", "--send-timeout", "600")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            sock = stuck_answer(server, client)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert server.proc.poll() is None, "the first signal waits for the client (grace 600 s)"
        t = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        seconds = time.monotonic() - t
        sock.close()
    finally:
        server.stop()
    assert code == 128 + signal.SIGTERM and seconds < 5, (code, seconds, server.log())
    assert "SIGTERM again: exiting now" in server.log()


# ------------------------------------------------------------------------------------------ protocol errors
def raw_exchange(port: int, data: bytes) -> tuple:
    """Send `data` on a new connection, read until the server closes -> (status, headers text, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        reply = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, head.decode("latin-1").lower(), json.loads(body)


PROTOCOL_ERRORS = {
    "garbage-request-line": (b"HELLO THERE\r\n\r\n", 400, "bad_request"),
    "negative-content-length": (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: -1\r\n\r\n",
        400,
        "bad_request",
    ),
    "20000-headers": (
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(20000)) + b"\r\n",
        431,
        "headers_too_large",
    ),
    "1MB-url": (b"GET /health?q=" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431, "headers_too_large"),
}


@pytest.mark.parametrize("name", sorted(PROTOCOL_ERRORS))
def test_protocol_errors_are_json_the_client_can_read(tmp_path_factory, name):
    server = shared_server(tmp_path_factory.mktemp("server-weights"))
    data, status, code = PROTOCOL_ERRORS[name]
    got, head, body = raw_exchange(server.port, data)
    assert (got, body["code"]) == (status, code), (name, head, body)
    assert "content-type: application/json" in head and "connection: close" in head and len(body["detail"]) > 20
    with httpx.Client(base_url=server.url, headers=auth_headers(), timeout=60) as client:
        assert client.get("/health").json()["status"] == "ok"


# ------------------------------------------------------------------------------------------ the answer itself
def test_streamed_answer_sends_bounded_chunks_and_cuts_a_stalled_client():
    """In process, no server: the answer goes out in chunks of at most CHUNK_BYTES whose concatenation is the
    npz (no single large write that the connection would have to buffer whole); a send that never completes is
    cut after the send timeout (the connection aborted) and the request's slot is freed exactly once."""
    import asyncio

    from tt_moge.npzio import npz_bytes, npz_parts
    from tt_moge.server.sending import ABORT_KEY, CHUNK_BYTES, StreamedAnswer

    arrays = {"points": np.arange(3 * CHUNK_BYTES // 4, dtype=np.float32), "mask": np.ones(1000, np.uint8)}
    freed, aborted, messages = [], [], []

    async def disconnect_never() -> dict:
        await asyncio.sleep(3600)

    async def recording_send(message: dict) -> None:
        messages.append(message)

    async def stalled_send(message: dict) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)  # the client stopped reading

    async def main() -> None:
        scope = {"type": "http", "client": ("127.0.0.1", 1), ABORT_KEY: lambda: aborted.append(True)}
        answer = StreamedAnswer(
            npz_parts(arrays, compress=False), "application/x-npz", {}, 5.0, lambda: freed.append(1)
        )
        await answer(scope, disconnect_never, recording_send)
        stalled = StreamedAnswer(
            npz_parts(arrays, compress=False), "application/x-npz", {}, 0.3, lambda: freed.append(2)
        )
        t = time.monotonic()
        await stalled(scope, disconnect_never, stalled_send)
        assert 0.25 < time.monotonic() - t < 3

    asyncio.run(main())
    bodies = [m["body"] for m in messages if m["type"] == "http.response.body"]
    assert b"".join(bodies) == npz_bytes(arrays, compress=False) and len(bodies) > 3
    assert max(len(b) for b in bodies) <= CHUNK_BYTES <= 1 << 20 and not messages[-1]["more_body"]
    assert dict(messages[0]["headers"])[b"content-length"] == str(len(b"".join(bodies))).encode()
    assert aborted == [True] and freed == [1, 2]
