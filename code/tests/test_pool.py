"""ModelPool (issue 46, item 1): one replica per device behind one model's calls, on two CPU replicas.

- The answers are the bytes of a MoGeModel loaded on that device with that thread count (`cpu,cpu` on 2 threads:
  two replicas of 1 thread each), for one image, `predict_many` (spread in chunks over both replicas: both run)
  and a clip; the call options are parsed once per call (per clip), not again in each chunk on its replica.
- A replica whose device fails is taken out of service and its call runs again on the other (same answer);
  with none left the call raises NoReplicaError; a bad image is the caller's error, and takes no replica out.
- The server takes a pool: /predict answers the pool's bytes, /info lists the replicas; under 16 concurrent
  requests a replica that fails loses none (each answered 200), and when every replica has failed /ready and the
  routes answer 503 (`device_failed`, `not_ready`), never 500.
- `--devices` on `tt-moge serve` and `parse_devices`: bad lists get errors naming the argument.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tt_moge import MoGeModel
from tt_moge.host import CallOptions, InputError
from tt_moge.pool import CHUNK, ModelPool, NoReplicaError, parse_devices
from tt_moge.scene import camera_path, render_path

from .conftest import TEST_CANVAS, TEST_TOKENS
from .server_harness import encode_image, micro_config, photo

LOAD = dict(resolution=TEST_CANVAS, num_tokens=TEST_TOKENS, warmup=1, warmup_variants="none", precision="fp32")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The server tests' micro checkpoint: what is checked here does not depend on the network's size."""
    from tt_moge.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("pool-weights"), micro_config())


@pytest.fixture(scope="module")
def pool(weights):
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # two CPU replicas of one thread each
    try:
        pool = ModelPool.from_pretrained(weights, devices="cpu,cpu", **LOAD)
    finally:
        torch.set_num_threads(previous)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def single(weights):
    """The same checkpoint on the CPU with one thread: what each replica is."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = MoGeModel.from_pretrained(weights, device="cpu", **LOAD)
    finally:
        torch.set_num_threads(previous)
    yield model
    model.close()


def images(count: int) -> list:
    return [photo(160, 120, seed=i) for i in range(count)]


def assert_same(a, b) -> None:
    assert 0.05 < b.valid_fraction < 0.999 and np.isfinite(b.depth[b.mask]).all()  # not vacuous
    for name in ("depth", "points", "normal", "mask", "intrinsics"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def one_thread(call):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return call()
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def healthy(pool):
    """Every replica back in service after a test that broke one (the runners are put back by monkeypatch)."""
    yield pool
    for replica in pool.replicas:
        replica.out_of_service = None


def break_replica(monkeypatch, replica) -> None:
    runner = replica.model.service.runner

    def lost(canvas):
        raise RuntimeError("the device stopped answering")

    monkeypatch.setattr(runner, "submit", lost)


def parses(monkeypatch) -> list:
    """The options given to `CallOptions.of_arguments` from now on in this test: one entry per parse."""
    parse, parsed = CallOptions.of_arguments.__func__, []
    monkeypatch.setattr(CallOptions, "of_arguments", classmethod(lambda cls, g: parsed.append(g) or parse(cls, g)))
    return parsed


def test_a_pool_gives_each_devices_bytes_and_spreads_predict_many(pool, single, monkeypatch):
    assert [r.device for r in pool.replicas] == ["cpu", "cpu"]
    assert all(r.model.service.runner.threads.fixed == 1 for r in pool.replicas)  # the threads split
    batch = images(3 * CHUNK)
    before = [r.done for r in pool.replicas]
    parsed = parses(monkeypatch)
    outs = pool.predict_many(batch)
    assert all(r.done > b for r, b in zip(pool.replicas, before)), "predict_many ran on one replica only"
    assert len(parsed) == 1  # the options parsed once, not again for each chunk on its replica
    reference = one_thread(lambda: single.predict_many(batch))
    for a, b in zip(outs, reference):
        assert_same(a, b)
    assert_same(pool(batch[0]), reference[0])
    info = pool.info()
    assert [r["device"] for r in info["replicas"]] == ["cpu", "cpu"] and info["device"] == "cpu,cpu"


def test_a_clip_runs_on_a_pool_as_on_one_model(pool, single, monkeypatch):
    frames = np.stack([r.image for r in render_path(camera_path(12)[::3], 160, 120)])
    parsed = parses(monkeypatch)
    got = pool.predict_video(frames, calibration_frames=2)
    assert len(parsed) == 1  # the clip's options, once: its calls take them parsed (the pool's service)
    want = one_thread(lambda: single.predict_video(frames, calibration_frames=2))
    np.testing.assert_array_equal(got.poses, want.poses)
    for a, b in zip(got.frames, want.frames):
        np.testing.assert_array_equal(a.depth, b.depth)


def test_a_failed_device_is_taken_out_and_its_call_runs_on_another(healthy, single, monkeypatch):
    pool = healthy
    image = photo(160, 120, seed=7)
    want = one_thread(lambda: single.predict(image))
    break_replica(monkeypatch, pool.replicas[0])
    for replica in pool.replicas:  # the broken one is the least busy and has done fewest: it is tried first
        replica.busy = 0
    pool.replicas[0].done, pool.replicas[1].done = 0, 10**6
    assert_same(pool.predict(image), want)
    first, second = pool.replicas
    assert first.out_of_service and "stopped answering" in first.out_of_service and first.failures == 1
    assert second.out_of_service is None
    outs = pool.predict_many(images(2 * CHUNK))  # the rest runs on the replica in service
    assert len(outs) == 2 * CHUNK and first.failures == 1
    with pytest.raises(InputError):  # the caller's error: no replica is taken out for it
        pool.predict(b"not an image")
    assert second.out_of_service is None
    break_replica(monkeypatch, second)
    with pytest.raises(NoReplicaError, match="stopped answering"):
        pool.predict(image)
    with pytest.raises(NoReplicaError, match="no replica of the pool can run this call"):
        pool.predict(image)


def test_devices_are_parsed_with_errors_that_name_them():
    assert parse_devices("cpu, CPU") == ["cpu", "cpu"] and parse_devices(["tt:0", "tt:1"]) == ["tt:0", "tt:1"]
    assert parse_devices("all") == ["cpu"]  # no chip, no GPU here
    for bad, message in (
        ("tt:0,tt:0", "named twice"),
        ("cpu,cuda:0", "one kind of device"),
        ("", "device names separated by commas"),
        ("cpu,,cpu", "device names separated by commas"),
        ("all,cpu", "device names separated by commas"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_devices(bad)
    with pytest.raises(TypeError, match="devices="):
        ModelPool.from_pretrained(devices="cpu", device="cpu")


# ------------------------------------------------------------------------------------------------ the server
def test_the_server_serves_a_pool_and_loses_no_request_when_a_device_fails(healthy, monkeypatch):
    from fastapi.testclient import TestClient

    from tt_moge.server.app import create_app

    pool = healthy
    body = encode_image(photo(160, 120, seed=3), "PNG")
    want = pool.predict(body)
    with TestClient(create_app(pool)) as client:
        r = client.post("/predict?compress=false", content=body, headers={"Content-Type": "image/png"})
        assert r.status_code == 200
        npz = np.load(io.BytesIO(r.content))
        np.testing.assert_array_equal(npz["depth"], want.depth)
        replicas = client.get("/info").json()["replicas"]
        assert [(r["device"], r["in_service"]) for r in replicas] == [("cpu", True), ("cpu", True)]

        def post(_):
            return client.post("/predict/summary", content=body, headers={"Content-Type": "image/png"}).status_code

        with ThreadPoolExecutor(8) as threads:
            first = [threads.submit(post, i) for i in range(8)]
            break_replica(monkeypatch, pool.replicas[0])  # fails under load
            rest = [threads.submit(post, i) for i in range(8)]
            statuses = [f.result() for f in first + rest]
        assert statuses == [200] * 16, statuses
        replicas = client.get("/info").json()["replicas"]
        assert [r["in_service"] for r in replicas] == [False, True] and replicas[0]["failures"] >= 1
        assert client.get("/ready").status_code == 200

        break_replica(monkeypatch, pool.replicas[1])
        r = client.post("/predict/summary", content=body, headers={"Content-Type": "image/png"})
        assert r.status_code == 503 and r.json()["code"] == "device_failed", r.text
        assert r.headers["retry-after"] == "1"
        ready = client.get("/ready")
        assert ready.status_code == 503 and "no replica of the pool is in service" in ready.json()["detail"]
        r = client.post("/predict/summary", content=body, headers={"Content-Type": "image/png"})
        assert r.status_code == 503 and r.json()["code"] == "not_ready", r.text
        assert client.get("/health").json()["status"] == "failed"
