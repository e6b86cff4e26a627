"""The server's edges (issue 28), on real `python -m tt_moge.server` processes, and the photo surfaces around them.

- Idle connections: 200 sockets that send nothing, one that stalls inside its request line and a keep-alive
  connection between requests do not lock anyone out (/health answers at once) and are all closed after
  --idle-timeout.
- File descriptors: under `ulimit -n 1024`, --max-connections is lowered to fit (said in the log and /info); 1100
  idle sockets never drive accept() into EMFILE, the log stays a few lines, /health answers. An accept() that
  fails all the same is logged once per interval (in process).
- A non-ASCII API key works over real HTTP (compared as UTF-8 bytes, as sent or percent-decoded).
- Truncated JPEG/PNG data is 400 bad_image; a PNG that declares 200 MP gets a 413 that quotes --max-pixels.
- EXIF orientation: an orientation-6 JPEG comes out turned (displayed size) from the server, its web page and
  `tt-moge predict`, unturned with `exif=false` / `--no-exif`, and unturned through the plain Python API.

Two server processes of their own (the micro checkpoint), each a few seconds to start.
Run: cd code && python -m pytest tests/test_server_edges.py -q
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import resource
import socket
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tt_moge.server.settings import connections_within  # noqa: E402

from .server_harness import ServerProcess, encode_image, micro_config, photo  # noqa: E402
from .stand_in import stand_in  # noqa: E402

IDLE_S = 2.0  # --idle-timeout of the servers here
KEY = "schlüssel-ключ-7c1d"  # non-ASCII: ü is latin-1, the Cyrillic is not
FD_LIMIT = 1024
JPEG_PNG = {"JPEG": "image/jpeg", "PNG": "image/png"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tt_moge.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("edges-weights"), micro_config())


def start(weights, *flags: str, **kwargs) -> ServerProcess:
    return ServerProcess.started(weights, ["--idle-timeout", str(IDLE_S), *flags], **kwargs)


@pytest.fixture(scope="module")
def server(weights):
    server = start(weights, "--max-pixels", "2000000", env={"MOGE_API_KEY": KEY})
    yield server
    server.stop()


def auth() -> dict:
    return {"Authorization": b"Bearer " + KEY.encode("utf-8")}  # as curl and httpx send a non-ASCII header


def open_idle(port: int, count: int) -> list:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]


def closed_by_server(sock: socket.socket) -> bool:
    """The server has closed this connection (EOF or reset): nothing to read but the end."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def wait_all_closed(socks: list, seconds: float) -> list:
    """Wait up to `seconds` for the server to close every socket -> the ones it left open."""
    deadline = time.monotonic() + seconds
    left = list(socks)
    while left and time.monotonic() < deadline:
        left = [s for s in left if not closed_by_server(s)]
        time.sleep(0.1)
    return left


# ---------------------------------------------------------------------------------------- idle connections
def test_idle_connections_never_lock_clients_out_and_are_closed(server):
    idle = open_idle(server.port, 200)
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    stalled.sendall(b"GET /hea")  # a request line that never ends (slowloris)
    kept = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")  # then kept alive, between requests
    try:
        time.sleep(0.5)  # all accepted by now
        # at once: the 202 idle ones hold no slot against it (not /health: probes are answered over the limit)
        r = httpx.get(server.url + "/info", headers=auth(), timeout=5)
        assert r.status_code == 200, r.text
        left = wait_all_closed([*idle, stalled, kept], IDLE_S + 8)
        assert not left, f"{len(left)} idle connections still open {IDLE_S + 8:g} s later (--idle-timeout {IDLE_S:g})"
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        for s in (*idle, stalled, kept):
            s.close()
    assert server.proc.poll() is None


# ------------------------------------------------------------------------------------------ file descriptors
def test_under_ulimit_1024_1100_idle_sockets_never_exhaust_file_descriptors(weights):
    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

    cap = connections_within(FD_LIMIT)
    server = start(weights, "--max-connections", "2000", preexec_fn=low_fd_limit)
    socks: list = []
    try:
        assert f"--max-connections 2000 lowered to {cap}" in server.log()
        limits = httpx.get(server.url + "/info", timeout=10).json()["server"]["limits"]
        assert (limits["max_connections"], limits["fd_limit"], limits["idle_timeout_s"]) == (cap, FD_LIMIT, IDLE_S)
        log_before = sum(len(line) + 1 for line in server.stderr_lines)
        socks = open_idle(server.port, 1100)
        time.sleep(1.0)
        open_fds = len(list(Path(f"/proc/{server.proc.pid}/fd").iterdir()))
        answered = None
        deadline = time.monotonic() + IDLE_S + 10
        while answered is None and time.monotonic() < deadline:
            try:
                answered = httpx.get(server.url + "/info", timeout=2)  # not a probe, which passes the limit
            except httpx.TransportError:
                time.sleep(0.2)
        assert answered is not None and answered.status_code == 200, server.log()
        assert not wait_all_closed(socks, IDLE_S + 8)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.stop()
    grown = sum(len(line) + 1 for line in server.stderr_lines) - log_before
    assert open_fds < FD_LIMIT - 100, f"{open_fds} descriptors open under a limit of {FD_LIMIT}"
    assert "accept() failed" not in server.log() and "Too many open files" not in server.log()
    assert grown < 4096, f"the log grew by {grown} bytes:\n{server.log()}"


def test_a_failing_accept_is_logged_once_per_interval(caplog):
    from tt_moge.server.protocol import log_accept_errors

    loop = asyncio.new_event_loop()
    try:
        log_accept_errors(loop, interval_s=60)
        with caplog.at_level(logging.INFO):
            for _ in range(1000):  # what asyncio reports for each failed attempt
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(errno.EMFILE, "Too many open files"),
                        "socket": None,
                    }
                )
            loop.call_exception_handler({"message": "something else broke"})  # not an accept error: as before
    finally:
        loop.close()
    accept = [r for r in caplog.records if "accept() failed" in r.getMessage()]
    assert len(accept) == 1 and "Too many open files" in accept[0].getMessage()
    assert any("something else broke" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------------- API key
def test_a_non_ascii_api_key_works_over_http(server):
    """As UTF-8 bytes (curl), and percent-encoded UTF-8 (the web page: a browser cannot send a header beyond
    Latin-1, and sends Latin-1 as single bytes, which are another key)."""
    from urllib.parse import quote

    assert httpx.get(server.url + "/info", headers=auth(), timeout=10).status_code == 200
    encoded = {"Authorization": f"Bearer {quote(KEY, safe='')}"}  # what encodeURIComponent(key) makes
    assert httpx.get(server.url + "/info", headers=encoded, timeout=10).status_code == 200
    for wrong in (
        b"Bearer " + KEY.replace("-7c1d", "").encode("utf-8"),
        b"Bearer " + "schlüssel".encode("latin-1"),  # the same text in another encoding is another key
        f"Bearer {quote(KEY.replace('-7c1d', ''), safe='')}".encode(),
        None,
    ):
        r = httpx.get(server.url + "/info", headers={"Authorization": wrong} if wrong else {}, timeout=10)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"


# ------------------------------------------------------------------------------------------- bad image data
def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def cut_jpeg() -> bytes:
    """A 1200x800 photo JPEG cut to a third, with its end-of-image marker put back: libjpeg would fill gray."""
    data = encode_image(photo(1200, 800, seed=3), "JPEG", quality=90)
    return data[: len(data) // 3] + b"\xff\xd9"


def cut_png() -> bytes:
    """A 600x400 PNG whose IDAT holds a third of its data, then IEND: every chunk sound, the pixels short."""
    data = encode_image(photo(600, 400, seed=4), "PNG")
    i = data.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", data[i : i + 4])
    return data[:i] + _chunk(b"IDAT", data[i + 8 : i + 8 + length // 3]) + _chunk(b"IEND", b"")


@pytest.mark.parametrize("route", ["/predict", "/predict/summary", "/ui/api/predict"])
def test_truncated_images_are_bad_image(server, route):
    for data, kind in ((cut_jpeg(), "image/jpeg"), (cut_png(), "image/png")):
        r = httpx.post(server.url + route, content=data, headers={**auth(), "Content-Type": kind}, timeout=60)
        assert r.status_code == 400 and r.json()["code"] == "bad_image", r.text
        assert "truncated" in r.json()["detail"]


def test_a_huge_png_gets_a_413_that_quotes_max_pixels(server):
    header = struct.pack(">IIBBBBB", 20000, 10000, 8, 2, 0, 0, 0)  # 200 MP: over twice Pillow's own limit
    data = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
    data += _chunk(b"IEND", b"")
    r = httpx.post(server.url + "/predict", content=data, headers={**auth(), "Content-Type": "image/png"}, timeout=30)
    assert r.status_code == 413 and r.json()["code"] == "too_many_pixels", r.text
    detail = r.json()["detail"]
    assert "20000x10000" in detail and "2000000 (--max-pixels)" in detail and "decompression bomb" not in detail


# ---------------------------------------------------------------------------------------- EXIF orientation
STORED = (320, 240)  # (width, height) as stored; orientation 6 shows it 240 wide and 320 high


@pytest.fixture(scope="module")
def sideways(tmp_path_factory) -> Path:
    exif = Image.Exif()
    exif[0x0112] = 6  # "turn 90 degrees clockwise to show": a phone held upright
    path = tmp_path_factory.mktemp("exif") / "upright.jpg"
    Image.fromarray(photo(*STORED, seed=5)).save(path, format="JPEG", quality=92, exif=exif.tobytes())
    return path


@pytest.mark.parametrize("route", ["/predict/summary", "/ui/api/predict"])
def test_the_server_and_its_page_apply_exif_orientation(server, sideways, route):
    def size(**params) -> tuple:
        r = httpx.post(
            server.url + route,
            content=sideways.read_bytes(),
            params=params,
            headers={**auth(), "Content-Type": "image/jpeg"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        summary = r.json() if route == "/predict/summary" else r.json()["summary"]
        return summary["width"], summary["height"]

    assert size() == (240, 320)  # by default: as shown
    assert size(exif="false") == STORED
    r = httpx.post(
        server.url + "/predict",
        content=sideways.read_bytes(),
        headers={**auth(), "Content-Type": "image/jpeg"},
        timeout=60,
    )
    with np.load(io.BytesIO(r.content)) as npz:
        assert npz["depth"].shape == (320, 240)


def test_the_cli_applies_exif_orientation_and_the_api_does_not_unless_asked(sideways, tmp_path, monkeypatch):
    import tt_moge
    from tt_moge.cli import main

    def cli_size(*flags: str) -> tuple:
        out = tmp_path / f"out{len(flags)}"
        with stand_in(monkeypatch):
            code = main(["predict", str(sideways), "-o", str(out), "-q", *flags])
        assert code == 0
        run = json.loads((out / "run.json").read_text())
        result = json.loads((out / run["images"][0]["output"] / "result.json").read_text())
        assert run["options"]["exif"] == ("--no-exif" not in flags)
        return result["width"], result["height"]

    assert cli_size() == (240, 320)
    assert cli_size("--no-exif") == STORED
    assert tt_moge.load_image(str(sideways)).shape == (240, 320, 3)  # the spec: no rotation
    assert tt_moge.load_image(str(sideways), exif=True).shape == (320, 240, 3)


def test_the_cli_reports_a_truncated_jpeg(tmp_path, monkeypatch):
    from tt_moge.cli import main

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "cut.jpg").write_bytes(cut_jpeg())
    (tmp_path / "in" / "good.jpg").write_bytes(encode_image(photo(64, 48), "JPEG"))
    with stand_in(monkeypatch):
        code = main(["predict", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "-q"])
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    status = {Path(i["input"]).name: (i["status"], i["error"]) for i in run["images"]}
    assert code != 0 and status["good.jpg"] == ("done", None)
    assert status["cut.jpg"][0] == "failed" and "truncated" in status["cut.jpg"][1]
