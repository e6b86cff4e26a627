"""On a device machine (a CUDA GPU, a Tenstorrent chip, or both): the API against the server's npz, bit for bit,
the captured graph / trace against an eager forward, the accuracy against the float32 reference, and the call
latencies (printed; run with -s). Each device kind is skipped, with the reason, where it is absent.

Weights: the real ones when $MOGE_WEIGHTS_DIR points at them, else a random-weight full-size ViT-L
(`tt_moge.testing`, written once per session, 1.3 GB). Canvas 1920x1080, 1800 tokens, default precision.

API == server: the npz of POST /predict must equal the npz layout of `model(bytes)` array for array.
Tenstorrent only: PCC >= 0.99 per head against the float32 reference network, and 1 vs 2 command queues
(worker dispatch) bit-identical.

    python -m pytest tests/test_api_device.py -q -s
    MOGE_DEVICE=1 python -m pytest tests/test_api_device.py -q -s    # chip (or GPU) 1 instead of 0
"""

from __future__ import annotations

import io
import os
import statistics
import time

import numpy as np
import pytest
import torch

from tt_moge.runners.ttnn.device import chips_here

CANVAS = (1920, 1080)
TOKENS = 1800
CALLS = 20
DEVICE_ID = int(os.environ.get("MOGE_DEVICE", "0"))  # the chip or GPU to test (the spec's variable)
HAVE = {"cuda": torch.cuda.is_available() and torch.cuda.device_count() > DEVICE_ID, "tt": chips_here() > DEVICE_ID}
REASON = {
    "cuda": f"needs CUDA GPU {DEVICE_ID} (torch {torch.__version__} sees {torch.cuda.device_count()} GPUs)",
    "tt": f"needs Tenstorrent chip {DEVICE_ID} (ttnn imports and sees it)",
}
needs_tt = pytest.mark.skipif(not HAVE["tt"], reason=REASON["tt"])


def _source(checkpoint):
    from tt_moge.weights import DEFAULT_REPO

    return DEFAULT_REPO if os.environ.get("MOGE_WEIGHTS_DIR") else checkpoint("vitl-normal")


@pytest.fixture(scope="module", params=["cuda", "tt"])
def gpu_model(request, checkpoint):
    """The model on each device kind present (named for the CUDA case it was written for)."""
    kind = request.param
    if not HAVE[kind]:
        pytest.skip(REASON[kind])
    from tt_moge import MoGeModel

    model = MoGeModel.from_pretrained(
        _source(checkpoint), device=kind, device_id=DEVICE_ID, resolution=CANVAS, num_tokens=TOKENS
    )
    runner = model.info()["runner"]
    if kind == "cuda":
        assert runner["runner"] == "cuda-graph" and runner["cuda_graph"]
    else:
        assert runner["runner"] == "ttnn" and runner["trace"]
    yield model
    model.close()


@pytest.fixture(scope="module")
def photo_png():
    from PIL import Image

    from tt_moge.synthetic import synthetic_photo

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
    """The captured graph (CUDA) or trace (Tenstorrent) computes what the same graph computes eagerly."""
    runner = gpu_model._runner
    canvas = torch.rand(1, 3, CANVAS[1], CANVAS[0], generator=torch.Generator().manual_seed(4))
    replayed = runner.forward(canvas)
    if runner.name == "ttnn":
        runner.trace = False
        try:
            eager = runner.forward(canvas)
        finally:
            runner.trace = True
        eager = {"points": eager.points[None], "normal": eager.normal[None], "mask": eager.mask[None]}
    else:
        with torch.no_grad(), runner._kernel_choice():
            eager = {k: v.cpu() for k, v in runner.module(canvas.to(runner.device)).items()}
    for key, value in (("points", replayed.points), ("normal", replayed.normal), ("mask", replayed.mask)):
        ref = eager[key][0]
        assert torch.allclose(value, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), key


def _pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()))


@needs_tt
def test_tenstorrent_heads_against_the_float32_reference(checkpoint):
    """PCC >= 0.99 per head of the chip's raw maps against the float32 reference network on the CPU."""
    from tt_moge import MoGeModel
    from tt_moge.synthetic import synthetic_photo

    photo = synthetic_photo(CANVAS, seed=22)
    raw = {}
    for device, precision in (("tt", "auto"), ("cpu", "fp32")):
        with MoGeModel.from_pretrained(
            _source(checkpoint),
            device=device,
            device_id=DEVICE_ID,
            precision=precision,
            resolution=CANVAS,
            num_tokens=TOKENS,
            warmup=1,
            warmup_variants="none",
        ) as model:
            raw[device] = model.forward(photo)
    valid = float((raw["cpu"]["mask"] > 0.5).float().mean())
    assert 0.05 < valid < 0.99, f"valid share {valid:.3f}: the comparison would be trivial"
    pccs = {key: _pcc(raw["tt"][key], raw["cpu"][key]) for key in ("points", "normal", "mask")}
    scale = float(raw["tt"]["metric_scale"] / raw["cpu"]["metric_scale"])
    print(f"\n[test_api_device] tt vs fp32 reference: PCC {pccs}, metric scale ratio {scale:.5f}")
    assert all(p >= 0.99 for p in pccs.values()), pccs
    assert abs(scale - 1) < 0.01


@needs_tt
def test_tenstorrent_one_and_two_command_queues_are_bit_identical(checkpoint):
    """Worker dispatch with 1 and with 2 command queues (the read-back on the second): the same maps, bit for bit."""
    from tt_moge import MoGeModel
    from tt_moge.synthetic import synthetic_photo

    photo = synthetic_photo(CANVAS, seed=23)
    outs = []
    for queues in (1, 2):
        with MoGeModel.from_pretrained(
            _source(checkpoint),
            device="tt",
            device_id=DEVICE_ID,
            dispatch="worker",
            num_command_queues=queues,
            resolution=CANVAS,
            num_tokens=TOKENS,
            warmup=1,
            warmup_variants="none",
        ) as model:
            assert model.info()["runner"]["command_queues"] == queues
            outs.append(model(photo).to_npz_bytes())
    _assert_npz_equal(_npz(outs[0]), _npz(outs[1]))


def test_predict_many_equals_single_calls(gpu_model, photo_png):
    from tt_moge.synthetic import synthetic_photo

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
    where = torch.cuda.get_device_name() if gpu_model.device.startswith("cuda") else f"Tenstorrent {gpu_model.device}"
    print(f"\n[test_api_device] {where}, {gpu_model.info()['precision']}, {CALLS} warm calls:")
    print("\n".join("  " + line for line in lines))
