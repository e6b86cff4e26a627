"""Concurrent load on a real server: more clients than queue slots, every response checked against its request.

8 clients x 25 requests (MOGE_LOAD_CLIENTS / MOGE_LOAD_REQUESTS change it), each request a distinct image size; one in
ten is a truncated PNG (its header is fine, so it is admitted and fails to decode: 400, or 503 when the queue is full)
and one in ten is not an image at all (refused before admission: always 415). The server admits 2 requests at once
(--queue-size 2), so most clients meet deliberate 503s; after one, a client waits a short back-off (the Retry-After,
scaled down to keep the test short) and sends its next request. Passes when no request is lost, there is no 5xx but
503, every 2xx holds the result of its own image, every bad upload got its 4xx (or 503), the server's counts agree
with the clients', and /health answers with no request left in flight.

Run: cd code && python -m pytest tests/test_server_load.py -q -s   (-s shows the counts)
"""

from __future__ import annotations

import io
import os
import statistics
import threading
import time
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from .server_harness import auth_headers, encode_image, photo, shared_server  # noqa: E402

CLIENTS = int(os.environ.get("MOGE_LOAD_CLIENTS", "8"))
REQUESTS = int(os.environ.get("MOGE_LOAD_REQUESTS", "25"))
BACKOFF_SCALE = 0.2  # seconds slept per second of Retry-After


def image_size(client: int, index: int) -> tuple:
    """A (width, height) that no other request of the run has: width encodes the index, height the client."""
    return 40 + 6 * index, 30 + 5 * client


def make_request(client: int, index: int) -> dict:
    w, h = image_size(client, index)
    rgb = photo(w, h, seed=1000 * client + index)
    if index % 10 == 4:  # decodable header, truncated pixel data: 400 once admitted
        data = encode_image(rgb, "PNG")
        return {"data": data[: len(data) // 2], "type": "image/png", "path": "/predict", "bad": 400, "size": (w, h)}
    if index % 10 == 9:  # not PNG data at all: refused before admission, so never a 503
        return {
            "data": b"P6\n8 8\n255\n" + bytes(192),
            "type": "image/png",
            "path": "/predict",
            "bad": 415,
            "size": (w, h),
        }
    fmt, kind = ("PNG", "image/png") if (client + index) % 2 else ("JPEG", "image/jpeg")
    path = "/predict" if index % 2 == 0 else "/predict/summary"
    return {"data": encode_image(rgb, fmt), "type": kind, "path": path, "bad": 0, "size": (w, h)}


def check_result(request: dict, response) -> str:
    """'' when the 2xx response holds the result of this request's image, else what is wrong."""
    w, h = request["size"]
    if request["path"] == "/predict/summary":
        body = response.json()
        got, valid = (body["width"], body["height"]), body["valid_fraction"]
        cx = body["intrinsics_pixels"][0][2]
    else:
        with np.load(io.BytesIO(response.content)) as npz:
            depth, mask, points, kp = npz["depth"], npz["mask"], npz["points"], npz["intrinsics_pixels"]
        if points.shape != (h, w, 3) or mask.shape != (h, w):
            return f"maps of shape {points.shape}, {mask.shape} for a {w}x{h} image"
        got, valid, cx = (depth.shape[1], depth.shape[0]), float(mask.mean()), float(kp[0, 2])
    if got != (w, h):
        return f"result for a {got} image, sent {w}x{h}"
    # the principal point sits near the image centre (within the rounding of the letterbox on the canvas)
    if not 0.0 < valid < 1.0 or abs(cx - w / 2) > 0.01 * w + 0.5:
        return f"implausible result (valid {valid}, cx {cx} for width {w})"
    return ""


def test_bounded_concurrent_load_loses_nothing(tmp_path_factory, capsys):
    server = shared_server(tmp_path_factory.mktemp("server-weights"))
    with httpx.Client(base_url=server.url, headers=auth_headers(), timeout=60) as probe:
        before = probe.get("/health").json()["responses"]

    outcomes: Counter = Counter()
    problems: list = []
    latencies: list = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def run_client(client: int) -> None:
        with httpx.Client(base_url=server.url, headers=auth_headers(), timeout=120) as http:
            start.wait()
            for index in range(REQUESTS):
                request = make_request(client, index)
                t = time.perf_counter()
                try:
                    r = http.post(request["path"], content=request["data"], headers={"Content-Type": request["type"]})
                except httpx.HTTPError as exc:  # no HTTP answer at all: a lost request
                    with lock:
                        outcomes["lost"] += 1
                        problems.append(f"client {client} request {index}: {type(exc).__name__}: {exc}")
                    continue
                seconds = time.perf_counter() - t
                problem = ""
                if r.status_code == 200:
                    kind = "2xx"
                    problem = "a bad upload was accepted" if request["bad"] else check_result(request, r)
                elif r.status_code == 503:
                    kind = "503"
                    if r.json().get("code") != "queue_full" or r.headers.get("retry-after") != "1":
                        problem = f"503 without queue_full / Retry-After: {r.headers} {r.text}"
                    elif request["bad"] == 415:
                        problem = "a non-image took a queue slot"
                elif 400 <= r.status_code < 500:
                    kind = "4xx"
                    if r.status_code != request["bad"]:
                        problem = f"unexpected {r.status_code}: {r.text}"
                else:
                    kind = "other"
                    problem = f"status {r.status_code}: {r.text[:300]}"
                with lock:
                    outcomes[kind] += 1
                    if kind == "2xx":
                        latencies.append(seconds)
                    if problem:
                        problems.append(
                            f"client {client} request {index} ({request['path']}, {request['size']}): {problem}"
                        )
                if kind == "503":
                    time.sleep(int(r.headers.get("retry-after", "1")) * BACKOFF_SCALE)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run_client, args=(c,), name=f"load-client-{c}") for c in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    seconds = time.perf_counter() - t0
    assert not any(thread.is_alive() for thread in threads), "a client did not finish within 600 s"

    with httpx.Client(base_url=server.url, headers=auth_headers(), timeout=60) as probe:
        health = probe.get("/health").json()
    sent = CLIENTS * REQUESTS
    kinds = Counter(make_request(c, i)["bad"] for c in range(CLIENTS) for i in range(REQUESTS))
    answered = sum(outcomes[k] for k in ("2xx", "4xx", "503", "other"))
    p50 = statistics.median(latencies) if latencies else float("nan")
    p95 = sorted(latencies)[int(0.95 * (len(latencies) - 1))] if latencies else float("nan")
    with capsys.disabled():  # the counts show in every run, CI included (pytest captures prints otherwise)
        print(
            f"\n[load] {CLIENTS} clients x {REQUESTS} requests in {seconds:.1f} s: sent {sent}, 2xx {outcomes['2xx']}, "
            f"4xx {outcomes['4xx']} (bad uploads sent: {kinds[400]} truncated, "
            f"{kinds[415]} not images), 503 {outcomes['503']}, other {outcomes['other']}, "
            f"lost {sent - answered}; 2xx latency p50 {p50:.2f} s, p95 {p95:.2f} s; server health: {health}"
        )

    assert not problems, "\n".join(problems[:20])
    assert answered == sent and outcomes["lost"] == 0 and outcomes["other"] == 0
    assert kinds[415] <= outcomes["4xx"] <= kinds[415] + kinds[400]
    assert outcomes["503"] > 0, "the load never filled the queue: the test did not exercise admission"
    assert outcomes["2xx"] >= CLIENTS
    # The server counted the same responses (its first /health call above is one more 2xx).
    delta = {k: health["responses"][k] - before[k] for k in before}
    assert delta == {"2xx": outcomes["2xx"] + 1, "4xx": outcomes["4xx"], "503": outcomes["503"], "5xx": 0}, delta
    assert health["status"] == "ok" and health["in_flight"] == 0  # every queue slot came back
