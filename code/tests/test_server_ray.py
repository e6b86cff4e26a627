"""`tt-moge serve --ray` (issue 46, items 3 and 4), a real process on a local Ray with two CPU replicas of one thread.

- /predict answers the bytes of `model.predict` on a one-thread CPU model of the same checkpoint, and /info is a
  replica's (the same app as `tt-moge serve`).
- A replica's process killed (SIGKILL) under load loses no request: each of them is answered 200 (or 503), never
  500 or a broken connection; Ray Serve starts a replica in its place.
- SIGTERM stops it: exit 0, and no Ray process of the run is left.

One Ray start (about 20-40 s on 2 cores); needs `ray[serve]` (the `ray` extra).
Run: cd code && python -m pytest tests/test_server_ray.py -q
"""

from __future__ import annotations

import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from .server_harness import CANVAS, TOKENS, ServerProcess, encode_image, micro_config, photo  # noqa: E402

PNG = {"Content-Type": "image/png"}


def replica_pids() -> list:
    """Processes of the model's Serve replicas (Ray names them ray::ServeReplica:moge:MoGeReplica)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"ServeReplica:moge:MoGeReplica" in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def ray_processes() -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if line.startswith(b"ray::") or b"gcs_server" in line or b"raylet" in line:
                found.append((int(entry), line[:60]))
    return found


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tt_moge.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ray-weights"), micro_config())


@pytest.fixture(scope="module")
def server(weights):
    before = {pid for pid, _ in ray_processes()}
    server = ServerProcess.started(weights, ["--ray", "--replicas", "2", "--threads-per-replica", "1"])
    server.ray_before = before
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(weights):
    import torch

    from tt_moge import MoGeModel

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = MoGeModel.from_pretrained(
            weights, device="cpu", resolution=CANVAS, num_tokens=TOKENS, warmup=1, warmup_variants="none"
        )
    finally:
        torch.set_num_threads(previous)
    yield model
    model.close()


def test_ray_serve_answers_the_bytes_of_the_python_api(server, reference):
    import torch

    body = encode_image(photo(320, 240, seed=5), "PNG")
    r = httpx.post(server.url + "/predict?compress=true", content=body, headers=PNG, timeout=120)
    assert r.status_code == 200, r.text[:300]
    npz = np.load(io.BytesIO(r.content))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = reference.predict(body)
    finally:
        torch.set_num_threads(previous)
    assert 0.05 < want.valid_fraction < 0.999  # not vacuous
    np.testing.assert_array_equal(npz["depth"], want.depth)
    np.testing.assert_array_equal(npz["mask"], want.mask.astype(np.uint8))
    info = httpx.get(server.url + "/info", timeout=30).json()
    assert info["device"] == "cpu" and info["canvas"] == list(CANVAS)
    bad = httpx.post(server.url + "/predict", content=b"not a png", headers=PNG, timeout=30)
    assert bad.status_code == 415 and bad.json()["code"] == "unsupported_image"  # the server's own JSON errors


def test_a_replica_killed_under_load_loses_no_request(server):
    body = encode_image(photo(160, 120, seed=2), "PNG")
    pids = replica_pids()
    assert len(pids) == 2, pids

    def post(_):
        try:
            return httpx.post(server.url + "/predict/summary", content=body, headers=PNG, timeout=120).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(8) as threads:
        futures = [threads.submit(post, i) for i in range(32)]
        time.sleep(1.5)  # requests are in flight on both replicas
        os.kill(pids[0], signal.SIGKILL)
        statuses = [f.result() for f in futures]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 24, statuses
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (len(replica_pids()) == 2 and pids[0] not in replica_pids()):
        time.sleep(1)
    assert len(replica_pids()) == 2 and pids[0] not in replica_pids(), "Ray Serve did not start a new replica"
    assert httpx.post(server.url + "/predict/summary", content=body, headers=PNG, timeout=120).status_code == 200


def test_sigterm_stops_it_and_leaves_no_ray_process(server):
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(60)
    assert code == 0, server.log()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and [p for p, _ in ray_processes() if p not in server.ray_before]:
        time.sleep(0.5)
    left = [(p, c) for p, c in ray_processes() if p not in server.ray_before]
    assert not left, left


def test_each_replica_asks_ray_for_its_own_device():
    """A replica asks Ray for one chip (TTNPU) or one GPU and opens the one Ray made visible; a CPU replica asks
    for its threads. Batch replicas ask for a chip the same way (one chip each, not all on chip 0)."""
    from tt_moge.batch.session import chip_request
    from tt_moge.server.ray_serve import replica_device, replica_resources

    assert replica_resources("tt", 1) == {"resources": {"TTNPU": 1}, "num_cpus": 1} and replica_device("tt:2") == "tt:0"
    assert replica_resources("cuda:1", 1) == {"num_gpus": 1, "num_cpus": 1} and replica_device("cuda:1") == "cuda"
    assert replica_resources("cpu", 3) == {"num_cpus": 3} and replica_device("cpu") == "cpu"
    assert chip_request("tt:1") == ("tt:0", {"resources": {"TTNPU": 1}}) and chip_request("cpu") == ("cpu", {})
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'tt'"):
        replica_resources("mps", 1)
