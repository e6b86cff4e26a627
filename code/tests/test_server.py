"""The HTTP server against a real uvicorn process on 127.0.0.1: same arrays as the Python API, clear 4xx errors.

Run: cd code && python -m pytest tests/test_server.py -q
"""

from __future__ import annotations

import io
import json
import socket
import time
import zipfile

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tt_moge.output import NPZ_LAYOUT  # noqa: E402
from tt_moge.server.settings import ServerSettings  # noqa: E402

from .server_harness import (  # noqa: E402
    API_KEY,
    CANVAS,
    TOKENS,
    TORCH_THREADS,
    ServerProcess,
    auth_headers,
    encode_image,
    photo,
    shared_server,
    shared_weights,
    timing_record,
)

PNG, JPEG = "image/png", "image/jpeg"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return shared_server(tmp_path_factory.mktemp("server-weights"))


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=auth_headers(), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(server):
    """The same checkpoint loaded in this process, with the server's torch thread count."""
    import torch

    from tt_moge import MoGeModel

    threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    model = MoGeModel.from_pretrained(
        shared_weights(), device="cpu", resolution=CANVAS, num_tokens=TOKENS, warmup=0, warmup_variants="none"
    )
    yield model
    model.close()
    torch.set_num_threads(threads)


def load_npz(content: bytes) -> dict:
    with np.load(io.BytesIO(content)) as data:
        return {k: data[k] for k in data.files}


def assert_same_arrays(served: dict, local) -> None:
    """The server's npz == the API's output written in the npz layout, bit for bit, and not trivially."""
    expected = local.npz_arrays()
    assert set(served) == set(expected) == set(NPZ_LAYOUT)
    for key, value in expected.items():
        assert served[key].dtype == value.dtype == np.dtype(NPZ_LAYOUT[key][0]), key
        assert served[key].shape == value.shape, key
        assert np.array_equal(served[key], value, equal_nan=True), f"{key} differs between the server and the API"
    valid = served["mask"].astype(bool)
    assert 0.05 < valid.mean() < 0.95, "degenerate result: the comparison would prove little"
    assert np.isfinite(served["depth"][valid]).all() and (served["depth"][valid] > 0).all()


# Inputs of several sizes and kinds: the canvas size itself (no resize), odd sizes, tall, RGBA, grayscale.
IMAGES = {
    "png-canvas-448x252": lambda: encode_image(photo(448, 252, 1), "PNG"),
    "png-rgba-333x211": lambda: encode_image(
        np.dstack([photo(333, 211, 2), np.full((211, 333), 200, np.uint8)]), "PNG"
    ),
    "png-gray-64x480": lambda: encode_image(photo(64, 480, 3)[..., 1], "PNG"),
    "jpeg-640x360": lambda: encode_image(photo(640, 360, 4), "JPEG", quality=90),
    "jpeg-97x150": lambda: encode_image(photo(97, 150, 5), "JPEG", quality=75),
}


@pytest.mark.parametrize("fit", ["pad", "stretch"])
@pytest.mark.parametrize("name", sorted(IMAGES))
def test_predict_npz_is_bit_identical_to_the_api(client, reference, name, fit):
    data = IMAGES[name]()
    kind = PNG if name.startswith("png") else JPEG
    r = client.post("/predict", content=data, headers={"Content-Type": kind}, params={"fit": fit})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-npz"
    assert_same_arrays(load_npz(r.content), reference(data, fit=fit))
    # timing_ms: every stage, device is the forward only (not the wait), and the parts fit in the total
    timing = timing_record(r)
    assert {
        "read",
        "queue",
        "decode",
        "canvas",
        "device_wait",
        "device",
        "solve",
        "finish",
        "post",
        "encode",
        "total",
    } <= set(timing)
    assert timing["device"] > 0 and timing["post"] == pytest.approx(timing["solve"] + timing["finish"], abs=0.01)
    parts = sum(timing[k] for k in ("decode", "canvas", "device_wait", "device", "solve", "finish", "encode"))
    assert parts <= timing["total"] + 0.01
    stages = [entry.split(";")[0].strip() for entry in r.headers["server-timing"].split(",")]
    assert {"decode", "device", "post", "encode"} <= set(stages)


def test_options_multipart_and_stored_npz_match_the_api(client, reference):
    data = encode_image(photo(300, 200, 6), "JPEG", quality=85)
    options = {"fov_x": 55.0, "apply_mask": False, "force_projection": False, "fit": "stretch"}
    local = reference(data, **options)
    query = {"fov_x": "55", "apply_mask": "false", "force_projection": "false", "fit": "stretch"}
    stored = client.post("/predict", content=data, headers={"Content-Type": JPEG}, params=query)  # auto: loopback
    deflated = client.post(
        "/predict", content=data, headers={"Content-Type": JPEG}, params={**query, "compress": "true"}
    )
    multipart = client.post("/predict", files={"image": ("photo.jpg", data, JPEG)}, params=query)
    for r in (deflated, stored, multipart):
        assert r.status_code == 200, r.text
        assert_same_arrays(load_npz(r.content), local)
    assert float(load_npz(deflated.content)["fov_x"]) == pytest.approx(55.0, abs=1e-4)
    assert not np.isinf(load_npz(deflated.content)["depth"]).any()  # apply_mask=False reached the model
    assert len(deflated.content) < 0.9 * len(stored.content)  # the maps were deflated
    with zipfile.ZipFile(io.BytesIO(stored.content)) as npz:  # auto on loopback: stored
        assert {m.compress_type for m in npz.infolist()} == {zipfile.ZIP_STORED}


def test_summary_json_matches_the_api(client, reference):
    data = encode_image(photo(320, 180, 7), "PNG")
    r = client.post("/predict/summary", content=data, headers={"Content-Type": PNG}, params={"fov_x": 70})
    assert r.status_code == 200, r.text
    body = r.json()
    local = reference(data, fov_x=70)
    assert (body["width"], body["height"]) == local.size == (320, 180)
    assert body["valid_fraction"] == local.valid_fraction and 0.05 < body["valid_fraction"] < 0.95
    assert body["median_depth_m"] == pytest.approx(local.median_depth, rel=1e-6)
    assert body["fov_x_deg"] == pytest.approx(70.0, abs=1e-4) and body["fov_y_deg"] == pytest.approx(local.fov_y)
    assert np.array_equal(np.array(body["intrinsics"], np.float32), local.intrinsics)
    assert np.array_equal(np.array(body["intrinsics_pixels"], np.float32), local.intrinsics_pixels)
    assert body["metric_scale"] == pytest.approx(local.metric_scale) and body["has_normal"] is True
    assert body["timing_ms"]["device"] > 0 and body["timing_ms"]["encode"] >= 0
    assert "device;dur=" in r.headers["server-timing"]


def test_panorama_npz_and_summary_are_the_api_panorama(client, reference):
    """POST /predict/panorama gives `model.predict_panorama` of the same bytes, array for array, and its
    summary route the same summary; apply_mask=false keeps the fitted distance everywhere."""
    from tt_moge.panorama.predict import PANORAMA_NPZ_LAYOUT
    from tt_moge.testing.room import render_panorama

    data = encode_image(render_panorama(256, 128).image, "PNG")
    local = reference.predict_panorama(data)
    assert 0.05 < local.valid_fraction < 0.999 and local.view_errors.count(None) >= 6  # not vacuous
    r = client.post("/predict/panorama", content=data, headers={"Content-Type": PNG}, params={"compress": "false"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-npz" and "decode;dur=" in r.headers["server-timing"]
    served, expected = load_npz(r.content), local.npz_arrays()
    assert set(served) == set(expected) == set(PANORAMA_NPZ_LAYOUT)
    for key, value in expected.items():
        assert served[key].dtype == value.dtype and np.array_equal(served[key], value), key
    assert np.isinf(served["distance"][served["mask"] == 0]).all()

    r = client.post("/predict/panorama/summary", content=data, headers={"Content-Type": PNG})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = local.summary()
    assert body["merge_residual"] == pytest.approx(expected["merge_residual"], rel=1e-9)  # a sum: last-ulp order
    assert {k: v for k, v in body.items() if k not in ("seconds", "timing_ms", "merge_residual")} == {
        k: v for k, v in expected.items() if k not in ("seconds", "merge_residual")
    }
    assert body["kind"] == "panorama" and body["timing_ms"]["panorama"] > 0

    r = client.post("/predict/panorama", content=data, headers={"Content-Type": PNG}, params={"apply_mask": "false"})
    unmasked = load_npz(r.content)
    assert np.isfinite(unmasked["distance"]).all()
    assert np.array_equal(unmasked["distance"], reference.predict_panorama(data, apply_mask=False).distance)


def test_panorama_errors_name_what_was_expected(client, reference):
    from fastapi.testclient import TestClient

    from tt_moge.server.app import create_app

    wide = client.post("/predict/panorama", content=_GOOD_PNG, headers={"Content-Type": PNG})
    assert wide.status_code == 422 and wide.json()["code"] == "not_a_panorama", wide.text
    assert wide.json()["detail"].startswith("image: a panorama must be") and "twice as wide" in wide.json()["detail"]
    r = client.post("/predict/panorama/summary", content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"fov_x": 60})
    assert r.status_code == 422 and "fov_x" in r.json()["detail"]  # not an option of a panorama
    r = client.post("/predict/panorama", content=b"not an image", headers={"Content-Type": PNG})
    assert r.status_code == 415 and r.json()["code"] == "unsupported_image"
    assert client.get("/health").json()["status"] == "ok"

    small = ServerSettings(max_pixels=100_000, max_body_bytes=1_000_000, memory_budget_bytes=64 * 2**20)
    with TestClient(create_app(reference, small)) as local:
        pano = encode_image(photo(256, 128, 3), "PNG")
        r = local.post("/predict/panorama", content=pano, headers={"Content-Type": PNG})
        assert r.status_code == 413 and r.json()["code"] == "panorama_too_large", r.text
        assert "--memory-budget-mb" in r.json()["detail"]
        assert local.post("/predict", content=pano, headers={"Content-Type": PNG}).status_code == 200  # a photo fits


def test_health_ready_info(client, server):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["ready"] is True and health["queue_size"] == 2
    assert client.get("/ready").json() == {"ready": True}
    info = client.get("/info").json()
    assert info["canvas"] == list(CANVAS) and info["num_tokens"] == TOKENS and info["device"] == "cpu"
    assert info["server"]["limits"]["max_pixels"] == 2_000_000 and info["server"]["limits"]["auth"] is True
    assert info["server"]["limits"]["max_connections"] == ServerSettings().max_connections
    # Before the model had loaded, /ready answered 503 (with Retry-After) while /health already answered.
    early = [s for s in server.ready_statuses if s[0] == 503]
    assert early and early[0][1]["code"] == "not_ready" and early[0][2] == "1", server.ready_statuses
    assert server.ready_statuses[-1][0] == 200
    schema = client.get("/openapi.json").json()
    assert {"/predict", "/predict/summary", "/health", "/ready", "/info"} <= set(schema["paths"])


# ----------------------------------------------------------------------------------------------- bad input
def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_declaring(width: int, height: int) -> bytes:
    """A small PNG file whose header declares width x height (a decompression bomb when large)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(b"\0" * 4096))
        + _png_chunk(b"IEND", b"")
    )


_GOOD_PNG = encode_image(photo(64, 48, 8), "PNG")
_GOOD_JPEG = encode_image(photo(64, 48, 8), "JPEG", quality=90)
BAD_REQUESTS = {
    # name: (request kwargs, expected status, expected error code)
    "no-content-type": (dict(content=_GOOD_PNG), 415, "unsupported_media_type"),
    "text-plain": (dict(content=b"hello", headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type"),
    "empty-body": (dict(content=b"", headers={"Content-Type": PNG}), 400, "empty_body"),
    "not-an-image": (dict(content=b"GIF89a" + bytes(200), headers={"Content-Type": PNG}), 415, "unsupported_image"),
    "png-labelled-jpeg": (dict(content=_GOOD_PNG, headers={"Content-Type": JPEG}), 415, "unsupported_image"),
    "truncated-png": (dict(content=_GOOD_PNG[: len(_GOOD_PNG) // 2], headers={"Content-Type": PNG}), 400, "bad_image"),
    "truncated-jpeg": (
        dict(content=_GOOD_JPEG[: len(_GOOD_JPEG) // 3], headers={"Content-Type": JPEG}),
        400,
        "bad_image",
    ),
    "png-magic-only": (dict(content=b"\x89PNG\r\n\x1a\n" + bytes(40), headers={"Content-Type": PNG}), 400, "bad_image"),
    "png-bad-ihdr-crc": (
        dict(content=_GOOD_PNG[:29] + bytes(4) + _GOOD_PNG[33:], headers={"Content-Type": PNG}),
        400,
        "bad_image",
    ),
    "jpeg-garbage": (
        dict(content=b"\xff\xd8\xff" + bytes(range(256)) * 4, headers={"Content-Type": JPEG}),
        400,
        "bad_image",
    ),
    "below-8x8": (
        dict(content=encode_image(photo(7, 30), "PNG"), headers={"Content-Type": PNG}),
        422,
        "image_too_small",
    ),
    "bomb-60000x60000": (
        dict(content=png_declaring(60000, 60000), headers={"Content-Type": PNG}),
        413,
        "too_many_pixels",
    ),
    "over-max-pixels": (dict(content=png_declaring(2000, 1001), headers={"Content-Type": PNG}), 413, "too_many_pixels"),
    "body-too-large": (dict(content=bytes(3 * 1024 * 1024), headers={"Content-Type": PNG}), 413, "body_too_large"),
    "bad-fit": (dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"fit": "zoom"}), 422, "invalid_option"),
    "fov-too-large": (
        dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"fov_x": "180"}),
        422,
        "invalid_option",
    ),
    "fov-zero": (dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"fov_x": "0"}), 422, "invalid_option"),
    "fov-nan": (dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"fov_x": "nan"}), 422, "invalid_option"),
    "fov-text": (
        dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"fov_x": "wide"}),
        422,
        "invalid_option",
    ),
    "bad-compress": (
        dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"compress": "yes"}),
        422,
        "invalid_option",
    ),
    "bad-bool": (
        dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"apply_mask": "maybe"}),
        422,
        "invalid_option",
    ),
    "path-option": (
        dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"path": "/etc/passwd"}),
        422,
        "invalid_option",
    ),
    "image-as-path": (dict(content=b"/etc/passwd", headers={"Content-Type": PNG}), 415, "unsupported_image"),
    "repeated-option": (
        dict(content=_GOOD_PNG, headers={"Content-Type": PNG}, params=[("fit", "pad"), ("fit", "stretch")]),
        422,
        "invalid_option",
    ),
    "multipart-wrong-field": (dict(files={"file": ("a.png", _GOOD_PNG, PNG)}), 400, "missing_field"),
    "multipart-text-field": (
        dict(data={"image": "/etc/passwd"}, files={"other": ("a.png", _GOOD_PNG, PNG)}),
        400,
        "missing_field",
    ),
    "multipart-two-files": (
        dict(files=[("image", ("a.png", _GOOD_PNG, PNG)), ("image", ("b.png", _GOOD_PNG, PNG))]),
        400,
        "bad_request",
    ),
    "multipart-bad-image": (dict(files={"image": ("a.png", b"not an image", PNG)}), 415, "unsupported_image"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_input_gets_a_clear_4xx_and_the_server_stays_up(client, name):
    kwargs, status, code = BAD_REQUESTS[name]
    r = client.post("/predict", **kwargs)
    assert r.status_code == status, (name, r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["code"] == code and len(body["detail"]) > 10, body
    assert " object at 0x" not in body["detail"], body  # says what is wrong, not which Python object failed
    assert client.get("/health").json()["status"] == "ok"


def test_option_errors_name_the_option(client):
    r = client.post("/predict", content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"fov_x": "200"})
    assert "fov_x" in r.json()["detail"]
    r = client.post("/predict/summary", content=_GOOD_PNG, headers={"Content-Type": PNG}, params={"compress": "true"})
    assert r.status_code == 422 and "compress" in r.json()["detail"]  # an npz-only option


def test_streamed_body_over_the_limit_is_refused(client):
    def chunks():
        for _ in range(48):
            yield bytes(64 * 1024)  # 3 MiB in total, no Content-Length

    r = client.post("/predict", content=chunks(), headers={"Content-Type": PNG})
    assert r.status_code == 413 and r.json()["code"] == "body_too_large"
    assert client.get("/health").status_code == 200


def test_stalled_upload_times_out_with_408(server, client):
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 5000\r\n"
            + f"Authorization: Bearer {API_KEY}\r\n\r\n".encode()
            + _GOOD_PNG[:100]
        )
        t = time.monotonic()
        reply = sock.recv(65536).decode("latin-1")
        waited = time.monotonic() - t
        while not reply.endswith("}"):  # the JSON body may come in a later segment
            more = sock.recv(65536).decode("latin-1")
            if not more:
                break
            reply += more
    assert reply.startswith("HTTP/1.1 408"), reply
    assert '"code":"timeout"' in reply and 2.0 < waited < 15.0
    assert client.get("/health").status_code == 200


def test_wrong_method_and_path_are_json(client):
    r = client.get("/predict")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"
    r = client.get("/no/such/path")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {API_KEY}", f"Bearer {API_KEY}x"])
def test_api_key_is_required_when_configured(server, authorization):
    headers = {"Content-Type": PNG} | ({"Authorization": authorization} if authorization else {})
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        for method, path in (("POST", "/predict"), ("POST", "/predict/summary"), ("GET", "/info")):
            r = anonymous.request(method, path, content=_GOOD_PNG if method == "POST" else None, headers=headers)
            assert r.status_code == 401 and r.json()["code"] == "unauthorized", (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
        assert anonymous.get("/health").status_code == 200  # probes need no key
        assert anonymous.get("/ready").status_code == 200


# ------------------------------------------------------------------------------------------------ start-up
def test_missing_weights_stop_the_server_with_exit_code_1(tmp_path):
    proc = ServerProcess(tmp_path / "no-such-dir" / "model.pt", [])
    try:
        code = proc.proc.wait(120)
    finally:
        proc.stop()
    assert code == 1, proc.log()
    assert "weights not found" in proc.log()


def test_bad_flags_exit_with_code_2(capsys):
    """Bad model or server flags stop `python -m tt_moge.server` with code 2 before it binds a port or reads
    weights (the weights below do not exist: reaching the load would exit with 1)."""
    from tt_moge.server.__main__ import main

    def exit_code(*flags):
        try:
            return main(["--weights", "/nonexistent/model.pt", "--port", "0", *flags])
        except SystemExit as exc:  # argparse usage errors
            return exc.code

    for flags, word in [
        (("--resolution", "10x10"), "resolution"),
        (("--resolution", "wide"), "resolution"),
        (("--num-tokens", "99"), "num_tokens"),
        (("--queue-size", "0"), "--queue-size"),
        (("--num-command-queues", "2"), "num_command_queues"),
        (("--precision", "fp64"), "precision"),
        (("--warmup-variants", "fast"), "preset"),
        (("--device", "tpu"), "device"),
        (("--max-pixels", "100000000"), "--memory-budget-mb"),
        (("--send-timeout", "0"), "--send-timeout"),
        (("--port", "99999"), "--port"),
        (("--max-body-mb", "inf"), "--max-body-mb"),
        (("--memory-budget-mb", "inf"), "--memory-budget-mb"),
    ]:
        assert exit_code(*flags) == 2, flags
        assert word in capsys.readouterr().err, flags


def test_openapi_error_bodies_are_documented(client):
    ops = client.get("/openapi.json").json()["paths"]["/predict"]["post"]
    assert {"400", "401", "413", "415", "422", "503"} <= set(ops["responses"])
    assert set(ops["requestBody"]["content"]) == {PNG, JPEG, "multipart/form-data"}
    assert json.dumps(ops).count("application/x-npz") == 1


def test_auto_compression_deflates_only_for_remote_clients():
    from starlette.requests import Request

    from tt_moge.server.app import client_is_loopback

    def request_from(host):
        return Request({"type": "http", "method": "POST", "path": "/predict", "headers": [], "client": (host, 5000)})

    assert client_is_loopback(request_from("127.0.0.1")) and client_is_loopback(request_from("::1"))
    assert not client_is_loopback(request_from("10.1.2.3")) and not client_is_loopback(request_from("testclient"))
