"""On a CUDA machine: the API against the server's npz, bit for bit, the CUDA graph against eager, and the call
latencies (printed; run with -s). Skipped, with the reason, where there is no CUDA GPU.

Weights: the real ones when $MOGE_WEIGHTS_DIR points at them, else a random-weight full-size ViT-L
(`tt_moge.testing`, written once per session, 1.3 GB). Canvas 1920x1080, 1800 tokens, default precision.

API == server: the npz of POST /predict must equal the npz layout of `model(bytes)` array for array.

    python -m pytest tests/test_api_device.py -q -s
"""
from __future__ import annotations

import io
import os
import statistics
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs a CUDA GPU (torch {torch.__version__}, CUDA available: no): the CPU runners are tested in test_runners.py")

CANVAS = (1920, 1080)
TOKENS = 1800
CALLS = 20


@pytest.fixture(scope="module")
def gpu_model(checkpoint):
    from tt_moge import MoGeModel
    from tt_moge.weights import DEFAULT_REPO

    source = DEFAULT_REPO if os.environ.get("MOGE_WEIGHTS_DIR") else checkpoint("vitl-normal")
    model = MoGeModel.from_pretrained(source, device="cuda", resolution=CANVAS, num_tokens=TOKENS)
    assert model.info()["runner"]["runner"] == "cuda-graph" and model.info()["runner"]["cuda_graph"]
    yield model
    model.close()


@pytest.fixture(scope="module")
def photo_png():
    from PIL import Image

    from tt_moge.warmup import synthetic_photo

    rgb = synthetic_photo(CANVAS, seed=21)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return rgb, buf.getvalue()


def _npz(data: bytes) -> dict:
    with np.load(io.BytesIO(data)) as z:
        return {k: z[k] for k in z.files}


def _assert_npz_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert np.array_equal(a[key], b[key], equal_nan=True), f"{key} differs"


def test_api_equals_server_npz_bit_for_bit(gpu_model, photo_png):
    _, png = photo_png
    ours = gpu_model(png)
    assert 0.05 < ours.valid_fraction < 0.99 and np.isfinite(ours.depth[ours.mask]).all()
    api = _npz(ours.to_npz_bytes())
    from fastapi.testclient import TestClient

    from tt_moge.server.app import create_app

    with TestClient(create_app(gpu_model)) as client:
        r = client.post("/predict", content=png, headers={"Content-Type": "image/png"}, params={"compress": "false"})
    assert r.status_code == 200, r.text
    _assert_npz_equal(api, _npz(r.content))


def test_graph_replay_equals_eager_forward(gpu_model):
    """The captured graph computes what the same module computes eagerly (same kernels, same inputs)."""
    runner = gpu_model._runner
    canvas = torch.rand(1, 3, CANVAS[1], CANVAS[0], generator=torch.Generator().manual_seed(4))
    replayed = runner.forward(canvas)
    with torch.no_grad(), runner._kernel_choice():
        eager = {k: v.cpu() for k, v in runner.module(canvas.to(runner.device)).items()}
    for key, value in (("points", replayed.points), ("normal", replayed.normal), ("mask", replayed.mask)):
        ref = eager[key][0]
        assert torch.allclose(value, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), key


def test_predict_many_equals_single_calls(gpu_model, photo_png):
    from tt_moge.warmup import synthetic_photo

    photos = [synthetic_photo((1280, 720), seed=s) for s in range(3)] + [photo_png[0]]
    many = gpu_model.predict_many(photos)
    for photo, out in zip(photos, many):
        _assert_npz_equal(_npz(out.to_npz_bytes()), _npz(gpu_model(photo).to_npz_bytes()))


def test_call_latencies(gpu_model, photo_png, tmp_path):
    rgb, png = photo_png
    path = tmp_path / "photo.png"
    path.write_bytes(png)
    canvas = torch.from_numpy(rgb).permute(2, 0, 1)[None].float().div(255)
    calls = {
        "forward(float canvas)": lambda: gpu_model.forward(canvas),
        "model(uint8 array)": lambda: gpu_model(rgb),
        "model(png path)": lambda: gpu_model(str(path)),
    }
    lines = []
    for name, call in calls.items():
        call()
        times = []
        for _ in range(CALLS):
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1e3)
        lines.append(f"{name}: median {statistics.median(times):.2f} ms, min {min(times):.2f} ms")
    t = time.perf_counter()
    gpu_model.predict_many([rgb] * 8)
    lines.append(f"predict_many(8 arrays): {(time.perf_counter() - t) * 1e3 / 8:.2f} ms per image")
    print(f"\n[test_api_device] {torch.cuda.get_device_name()}, {gpu_model.info()['precision']}, {CALLS} warm calls:")
    print("\n".join("  " + line for line in lines))
