"""The server against clients that lie or crawl (issue 48, items 1 and 2), on a real `python -m tt_moge.server`.

- A video's header is not its size: an AVI whose header says 2 frames but holds 40 is stopped at
  --max-video-frames (413) while it is decoded, never run to its end; one that holds 8 (under the limit) gets the
  same answer as the honest file; its memory is counted by the frames really read (in process: a budget that
  holds the header's count but not the frames' refuses it).
- Slow uploads cannot lock the server: a body that arrives slower than --min-body-rate is cut with 408 once its
  grace is over, long before --read-timeout; while every connection is held by such uploads (and the over-limit
  slots too), liveness and readiness probes on new connections are answered.

Run: cd code && python -m pytest tests/test_server_hostile.py -q
"""

from __future__ import annotations

import io
import json
import socket
import struct
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tt_moge.scene import camera_path, render_path  # noqa: E402
from tt_moge.server.settings import BODY_RATE_GRACE_S, OVER_LIMIT_SLOTS  # noqa: E402

from .server_harness import ServerProcess, micro_config  # noqa: E402

MAX_FRAMES = 10  # --max-video-frames of the server here
CONNECTIONS = 6  # --max-connections
RATE = 4000  # --min-body-rate, bytes/s
READ_TIMEOUT_S = 40.0  # --read-timeout: far beyond the rate floor's cut, so a cut before it is the floor's
SIZE = (160, 120)
VIDEO = {"Content-Type": "video/x-msvideo"}


# ------------------------------------------------------------------------------------------- clips that lie
def avi(frames: int, header_frames: int | None = None) -> bytes:
    """An MJPEG AVI of `frames` frames of the analytic walk; with `header_frames`, its header (the main header's
    total frames and the stream header's length) says that many instead."""
    import tempfile
    from pathlib import Path

    import cv2

    renders = render_path(camera_path(3 * frames)[::3], *SIZE)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.avi"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, SIZE)
        for r in renders:
            writer.write(np.ascontiguousarray(r.image[..., ::-1]))
        writer.release()
        data = bytearray(path.read_bytes())
    if header_frames is not None:
        main, stream = data.find(b"avih"), data.find(b"strh")
        assert struct.unpack_from("<I", data, main + 8 + 16)[0] == frames  # dwTotalFrames
        assert struct.unpack_from("<I", data, stream + 8 + 32)[0] == frames  # dwLength
        struct.pack_into("<I", data, main + 8 + 16, header_frames)
        struct.pack_into("<I", data, stream + 8 + 32, header_frames)
    return bytes(data)


def header_count(data: bytes) -> tuple:
    """(frames the header gives, frames decoded) by OpenCV, as the server's reader sees the file."""
    import tempfile
    from pathlib import Path

    import cv2

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.avi"
        path.write_bytes(data)
        capture = cv2.VideoCapture(str(path))
        said, read = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), 0
        while capture.grab():
            read += 1
        capture.release()
    return said, read


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tt_moge.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("hostile-weights"), micro_config())


@pytest.fixture(scope="module")
def server(weights):
    flags = ["--max-video-frames", str(MAX_FRAMES), "--max-connections", str(CONNECTIONS)]
    flags += ["--min-body-rate", str(RATE), "--read-timeout", str(READ_TIMEOUT_S), "--idle-timeout", "3"]
    server = ServerProcess.started(weights, flags)
    yield server
    server.stop()


def settled(server: ServerProcess) -> dict:
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["in_flight"] == 0 and health["memory_reserved_bytes"] == 0, health
    return health


def test_a_header_that_undercounts_is_stopped_at_the_limit_as_frames_are_decoded(server):
    lying = avi(40, header_frames=2)
    assert header_count(lying) == (2, 40)  # what the server is told, and what the file holds
    started = time.monotonic()
    r = httpx.post(server.url + "/predict/video/summary", content=lying, headers=VIDEO, timeout=120)
    assert r.status_code == 413, r.text[:300]
    assert r.json()["code"] == "too_many_frames" and "as decoded" in r.json()["detail"], r.json()
    assert f"the limit is {MAX_FRAMES}" in r.json()["detail"]
    took = time.monotonic() - started
    settled(server)
    honest = httpx.post(server.url + "/predict/video/summary", content=avi(40), headers=VIDEO, timeout=120)
    assert honest.status_code == 413 and honest.json()["code"] == "too_many_frames"  # refused from its header
    assert took < 60, f"{took:.0f} s: the lying clip ran far past the limit"


def test_a_header_that_undercounts_within_the_limit_gets_the_honest_files_answer(server):
    honest, lying = avi(8), avi(8, header_frames=2)
    assert header_count(lying) == (2, 8)
    answers = []
    for body in (honest, lying):
        r = httpx.post(server.url + "/predict/video?calibration_frames=2", content=body, headers=VIDEO, timeout=120)
        assert r.status_code == 200, r.text[:300]
        answers.append(np.load(io.BytesIO(r.content)))
    truth, got = answers
    assert truth["depth"].shape == (8, SIZE[1], SIZE[0]) and np.isfinite(truth["depth"]).any()
    for name in truth.files:
        np.testing.assert_array_equal(got[name], truth[name], err_msg=name)
    settled(server)


# ---------------------------------------------------------------------------------------------- slow uploads
def slow_upload(port: int, path: str = "/predict/summary", declared: int = 200_000) -> socket.socket:
    """A connection whose request head has arrived and whose body then trickles: a few bytes now, none after."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: {declared}\r\n\r\n"
    sock.sendall(head.encode() + b"\x89PNG")
    return sock


def answer_of(sock: socket.socket, timeout_s: float) -> tuple:
    """(status, JSON body, seconds waited) of the answer the server sends on `sock` (status None: closed without)."""
    sock.settimeout(timeout_s)
    started, data = time.monotonic(), b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    waited = time.monotonic() - started
    if not data.startswith(b"HTTP/1.1 "):
        return None, None, waited
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        record = json.loads(body)
    except ValueError:
        record = None
    return int(head.split()[1]), record, waited


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 0


def probe(url: str) -> list:
    """GET /health and /ready on new connections -> their status codes."""
    return [httpx.get(url + route, timeout=10).status_code for route in ("/health", "/ready")]


def test_probes_are_answered_while_slow_uploads_hold_every_connection_and_the_uploads_are_cut(server):
    held = [slow_upload(server.port) for _ in range(CONNECTIONS)]
    try:
        time.sleep(0.5)  # every connection slot is held by a request in progress
        other = httpx.post(server.url + "/predict/summary", content=b"x", headers={"Content-Type": "image/png"})
        assert other.status_code == 503 and other.json()["code"] == "too_many_connections", other.text
        statuses = [s for _ in range(10) for s in probe(server.url)]
        assert statuses == [200] * 20, statuses
        # the uploads crawl (4 bytes in 5 s): cut by the floor once the grace is over, not at --read-timeout
        answers = [answer_of(sock, READ_TIMEOUT_S) for sock in held]
    finally:
        for sock in held:
            sock.close()
    for status, record, waited in answers:
        assert status == 408 and record["code"] == "too_slow", (status, record)
        assert "--min-body-rate" in record["detail"]
        assert waited < BODY_RATE_GRACE_S + 5, f"cut after {waited:.1f} s"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    settled(server)


def test_probes_get_a_slot_when_the_over_limit_slots_are_full_too(server):
    """Past --max-connections, OVER_LIMIT_SLOTS more connections are kept to read their 503; once those are full
    too, the oldest of them is closed for a new one, which may be a probe (before: the new one was)."""
    total = CONNECTIONS + OVER_LIMIT_SLOTS
    held = []
    try:
        for _ in range(total):
            held.append(slow_upload(server.port))
        time.sleep(0.3)
        assert probe(server.url) == [200, 200]
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    settled(server)


def test_a_body_that_keeps_above_the_floor_is_not_cut(server):
    """An upload at twice the floor takes longer than the grace and is served: the floor cuts crawling bodies,
    not slow honest ones."""
    from .server_harness import encode_image, photo

    body = encode_image(photo(320, 240), "PNG")
    pad = max(0, int(2 * RATE * (BODY_RATE_GRACE_S + 2)) - len(body))
    body += b"\0" * pad  # bytes after the PNG's end are ignored by its decoder
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        head = f"POST /predict/summary HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: {len(body)}"
        sock.sendall(head.encode() + b"\r\n\r\n")
        step = 2 * RATE // 10  # 2x the floor, in tenths of a second
        started = time.monotonic()
        for i in range(0, len(body), step):
            sock.sendall(body[i : i + step])
            time.sleep(max(0.0, started + (i + step) / (2 * RATE) - time.monotonic()))
        status, record, _ = answer_of(sock, 60)
    finally:
        sock.close()
    assert time.monotonic() - started > BODY_RATE_GRACE_S
    assert status == 200, record


def test_a_clips_memory_is_counted_by_the_frames_decoded_not_its_header(tiny_model):
    """In process: a budget that holds the clip at its header's 2 frames but not at its 8 real ones refuses it
    (413 clip_too_large) as the frames are decoded; the same budget with room for the 8 serves it, and the
    reservation it grows to is the 8 frames' cost (the 6 past the header counted twice: their answer is copied once
    at the end); either way the budget comes back."""
    from fastapi.testclient import TestClient

    from tt_moge.server.app import create_app
    from tt_moge.server.settings import CLIP_BYTES_PER_PIXEL, ServerSettings

    lying = avi(8, header_frames=2)
    w, h = tiny_model.resolution
    pixels = SIZE[0] * SIZE[1]

    def cost(frames: int, copied: int = 0) -> int:
        return ServerSettings.clip_cost(frames, pixels, len(lying), 2, w * h) + copied * CLIP_BYTES_PER_PIXEL * pixels

    held = cost(8, copied=6)
    assert cost(2) < held - CLIP_BYTES_PER_PIXEL * pixels  # not vacuous: the two budgets below differ
    for budget, status in ((held - 1, 413), (held, 200)):
        settings = ServerSettings(max_pixels=pixels, max_body_bytes=1 << 20, memory_budget_bytes=budget)
        with TestClient(create_app(tiny_model, settings)) as c:
            r = c.post("/predict/video/summary?calibration_frames=2", content=lying, headers=VIDEO)
            assert r.status_code == status, (budget, held, r.text[:300])
            assert r.json()["code"] == "clip_too_large" if status == 413 else r.json()["frames"] == 8
            assert c.get("/health").json()["memory_reserved_bytes"] == 0


def test_a_raw_mjpeg_stream_whose_count_is_unknown_is_counted(server):
    """A raw MJPEG stream (JPEGs one after the other) states no frame count: OpenCV reports -2^63, which was taken
    for a count ("gives -9223372036854775796 frame(s)", 422). Its frames are counted instead."""
    import cv2

    renders = render_path(camera_path(18)[::3], *SIZE)
    stream = b"".join(cv2.imencode(".jpg", np.ascontiguousarray(r.image[..., ::-1]))[1].tobytes() for r in renders)
    r = httpx.post(server.url + "/predict/video/summary", content=stream, headers=VIDEO, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["frames"] == len(renders) == 6
    too_many = stream * 2  # 12 frames: over the limit of 10, found by counting
    r = httpx.post(server.url + "/predict/video/summary", content=too_many, headers=VIDEO, timeout=120)
    assert r.status_code == 413 and r.json()["code"] == "too_many_frames", r.text[:300]
    settled(server)
