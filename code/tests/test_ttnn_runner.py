"""The Tenstorrent runner (`tt_moge.runners.ttnn.runner.TtnnRunner`) and its place in the API, on the ttnn
emulator (`tests/ttnn_emulator.py`, installed as the `ttnn` module where the API imports it): device selection,
the persistent input and the trace, one or two command queues, the prepared-weights cache, close(), and the
errors a user can meet. The numerics of the graph itself are `test_ttnn_lowering.py`'s; on a chip,
`test_api_device.py` runs the same API calls for real.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

from tt_moge import MoGeModel
from tt_moge.options import LoadOptions, TtChip
from tt_moge.runners.ttnn import post as post_mod
from tt_moge.runners.ttnn import runner as runner_mod
from tt_moge.runners.ttnn.runner import TtnnRunner, prepared_weights
from tt_moge.testing import calibration_image
from tt_moge.weights import load_network

from .ttnn_emulator import EmulatedDevice, TtnnEmulator

FLOAT32_READBACK = {"points": "float32", "normal": "float32", "mask": "float32"}
CANVAS, TOKENS = (224, 126), 300  # runner tests: a small canvas (the runner takes any budget)
API_CANVAS, API_TOKENS = (448, 252), 1200  # API tests: the smallest budget from_pretrained accepts


@pytest.fixture
def ttnn(monkeypatch, tmp_path):
    """The emulator as the `ttnn` module (exact float32: results comparable with the reference to round-off),
    its devices typed as ttnn's, and a private prepared-weights cache. Exact means no formats, so the fast graph's
    weights are not rounded to what LoFi reads either (`GraphConfig.round_lofi_weights`, a format choice)."""
    import dataclasses

    from tt_moge.runners.ttnn.graph import CONFIGS

    emulator = TtnnEmulator(exact=True)
    monkeypatch.setitem(CONFIGS, "fast", dataclasses.replace(CONFIGS["fast"], round_lofi_weights=False))
    monkeypatch.setitem(sys.modules, "ttnn", emulator)
    monkeypatch.setattr(EmulatedDevice, "__module__", "ttnn._ttnn.multi_device")
    monkeypatch.setenv(runner_mod.CACHE_ENV, str(tmp_path / "ttnn-cache"))
    return emulator


@pytest.fixture(scope="module")
def network_path(tmp_path_factory):
    from tt_moge.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ttnn-runner"), "tiny-vits-normal", well_posed=True)


def _network(path):
    return load_network(path, None)[0]


def _reference(path, image):
    net = _network(path)
    with torch.inference_mode():
        out = {k: v[0] for k, v in net(image, TOKENS).items()}
    valid = float((out["mask"] > 0.5).float().mean())
    assert 0.05 < valid < 0.95, f"valid share {valid:.3f}: the comparison would be trivial"
    return out


def _runner(path, ttnn, **kwargs) -> TtnnRunner:
    chip = kwargs.pop("chip", TtChip(0))
    return TtnnRunner(_network(path), CANVAS, TOKENS, chip, ttnn=ttnn, **kwargs)


BF16_HALF_ULP = 2.0**-8  # bfloat16's rounding, relative, at most: the normals' read-back format


def _assert_close(raw, ref, tol=2e-5):
    """The runner's raw maps against the reference's: to `tol`, plus the bfloat16 read-back's rounding for the
    normals (post.READBACK: the runner hands them on as bfloat16, the points and the mask as float32)."""
    assert raw.points.dtype == raw.mask.dtype == torch.float32 and raw.normal.dtype == torch.bfloat16
    for key in ("points", "normal", "mask"):
        got, want = getattr(raw, key), ref[key]
        assert got.shape == want.shape, key
        bound = tol + (BF16_HALF_ULP if got.dtype == torch.bfloat16 else 0.0)
        assert float((got.float() - want).abs().max() / want.abs().max()) < bound, key
    assert abs(raw.metric_scale / float(ref["metric_scale"]) - 1) < tol


def test_runner_equals_the_reference_and_the_trace_replays_each_new_canvas(network_path, ttnn):
    """The traces (one per slot of the double-buffered pipeline) are captured on the first call and replayed
    after: each call's result is its own canvas's (a replay that kept reading the first input, or a fresh input
    tensor outside the trace, would fail here)."""
    runner = _runner(network_path, ttnn)
    images = [calibration_image(*CANVAS, seed=s) for s in (1, 2, 3)]
    for image in images:
        _assert_close(runner.forward(image), _reference(network_path, image))
    assert len(ttnn.traces) == 2 and ttnn.op_counts["execute_trace"] == 3
    runner.close()
    assert ttnn.traces == {} and len(ttnn.closed) == 1, "close() releases the trace and closes the chip it opened"


def test_maps_are_read_into_recycled_host_tensors_that_no_live_result_sees(network_path, ttnn):
    """The maps come back as views of recycled read-back host tensors (no copy, no fresh pages per call). A set is
    reused only once nothing made from its last read is alive: results kept across calls (all of them, or one
    view of one) stay their own canvas's (a set reused too early would hold a later canvas's maps), and a loop
    that drops each result reads into the sets it already has."""
    runner = _runner(network_path, ttnn)
    images = [calibration_image(*CANVAS, seed=s) for s in (5, 6, 7)]
    refs = [_reference(network_path, image) for image in images]
    kept = [runner.forward(image) for image in images]
    assert runner.post.zero_copy and runner.post.sets_made == 3, "three live results: three sets"
    for raw, ref in zip(kept, refs):
        _assert_close(raw, ref)
    normal = kept[0].normal[10:20]  # a view of the first result's maps outlives the result
    del kept, raw
    for _ in range(2):
        for image, ref in zip(images[1:], refs[1:]):
            _assert_close(runner.forward(image), ref)
    assert runner.post.sets_made == 3, "the dropped results' sets were reused"
    assert float((normal.float() - refs[0]["normal"][10:20]).abs().max()) < 2e-5 + BF16_HALF_ULP, (
        "the view still holds the first canvas's"
    )
    runner.close()


def test_two_command_queues_give_bit_identical_maps_and_read_on_queue_1(network_path, ttnn):
    image = calibration_image(*CANVAS, seed=4)
    one = _runner(network_path, ttnn, num_command_queues=1, dispatch="worker")
    first = one.forward(image)
    one.close()
    assert ("wait", 1) not in ttnn.events
    two = _runner(network_path, ttnn, num_command_queues=2, dispatch="worker")
    second = two.forward(image)
    two.close()
    assert ttnn.events[-3:] == [("record", 0), ("wait", 1), ("record", 1)], (
        "the read waits on queue 1 for the forward on queue 0, and an event marks its end"
    )
    assert ttnn.reads == [0] * 4 + [1] * 4, "three maps and the class token read on queue 0, then on queue 1"
    assert ttnn.opened[-1]["num_command_queues"] == 2 and ttnn.opened[-1]["dispatch_core_config"] == "worker"
    for key in ("points", "normal", "mask"):
        assert torch.equal(getattr(first, key), getattr(second, key)), key
    assert first.metric_scale == second.metric_scale


def _conflicts(log: list, pipeline) -> tuple:
    """The emulator's queue log (`TtnnEmulator.queue_log`) as ordering facts. -> (before(i, j): step i is ordered
    before step j by its queue's order, the events waited for or the host's waits; the pairs of steps that touch the
    same device buffer, at least one of them writing it, in log order). A trace reads its slot's input and writes
    its slot's outputs and class token (`pipeline.DevicePipeline`)."""
    trace_of = {trace_id: key for key, trace_id in pipeline.traces.items()}

    def access(step) -> tuple:  # (written, read) buffer ids
        what, _, detail = step
        if what == "write":
            return {id(detail)}, set()
        if what == "read":
            return set(), {id(detail)}
        if what == "trace":
            kind, slot = trace_of[detail]
            outs = {id(t) for t in pipeline.outputs[slot].values()} | {id(pipeline.cls[slot])}
            return outs, {id(pipeline.inputs[kind, slot])}
        return set(), set()

    preds = {i: set() for i in range(len(log))}
    last_on, records, host = {}, {}, set()  # host: steps every later step follows (the host waited for them)
    for i, (what, cq, detail) in enumerate(log):
        if what == "sync":
            host.add(records[detail])
            continue
        if what == "sync_all":
            host.update(last_on.values())
            continue
        preds[i].update(host)
        if cq in last_on:
            preds[i].add(last_on[cq])  # in order on its queue (an event fires when all before it are done)
        if what == "wait":
            preds[i].add(records[detail])
        if what == "record":
            records[detail] = i
        last_on[cq] = i

    def before(a: int, b: int) -> bool:
        seen, todo = set(), [b]
        while todo:
            for p in preds[todo.pop()]:
                if p == a:
                    return True
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return False

    pairs = []
    for j in range(len(log)):
        wj, rj = access(log[j])
        for i in range(j):
            wi, ri = access(log[i])
            if wi & (wj | rj) or wj & ri:
                pairs.append((i, j))
    return before, pairs


def _steps(log: list, what: str) -> list:
    return [i for i, step in enumerate(log) if step[0] == what]


@pytest.mark.parametrize("queues", [2, 1])
def test_back_to_back_calls_overlap_and_every_buffer_access_is_ordered(network_path, ttnn, queues):
    """Three canvases submitted before any result is asked for (`submit` returns before the forward ends): each
    result is its own canvas's, every pair of queue steps that touch one device buffer (a slot's input, outputs,
    class token) with a write is ordered by queue order, events or host waits, and with two queues the chip's next
    trace overlaps the read-back of the last maps and the upload of the next canvas (tt-metal's ops on CQ0,
    uploads and reads on CQ1); with one, every step runs in order."""
    runner = _runner(network_path, ttnn, num_command_queues=queues, dispatch="worker")
    images = [calibration_image(*CANVAS, seed=s) for s in (11, 12, 13)]
    pending = [runner.submit(image) for image in images]
    assert not pending[-1].ready, "the last call's maps are not waited for before its result is asked for"
    for p, image in zip(pending, images):
        _assert_close(p.result(), _reference(network_path, image))
    log = [step for step in ttnn.queue_log if step[0] != "sync_all"][-60:]  # the three calls (capture before)
    before, pairs = _conflicts(log, runner.pipeline)
    assert pairs and all(before(i, j) for i, j in pairs), "every access to a shared buffer is ordered"
    traces, writes = _steps(log, "trace"), _steps(log, "write")
    reads = _steps(log, "read")[::4]  # each call reads three maps and its class token, in order
    assert len(traces) == len(writes) == len(reads) == 3
    for i in range(2):
        if queues == 2:
            assert not before(reads[i], traces[i + 1]) and not before(traces[i + 1], reads[i]), (
                f"call {i}'s read-back runs while call {i + 1}'s trace runs"
            )
            if i + 2 < 3:
                assert not before(writes[i + 2], traces[i + 1]), f"call {i + 2}'s upload runs during trace {i + 1}"
        else:
            assert before(reads[i], traces[i + 1]), "one queue: the next trace waits for the read-back"
    runner.close()


@pytest.mark.parametrize("broken", ["no event waits", "one slot, no host wait"])
def test_the_order_check_sees_a_race_when_the_pipeline_is_broken(network_path, ttnn, monkeypatch, broken):
    """The check above, broken on purpose with two queues: without the event waits (queue 0 would run a trace
    before its canvas is up, queue 1 read maps before the trace wrote them), or with one slot and no host wait for
    the call that used it (the next canvas's upload on queue 1 would overwrite the input a trace on queue 0 still
    reads). The emulator still computes every map right (it runs each step at once); on a chip these are races."""
    from tt_moge.runners.ttnn import pipeline as pipeline_mod

    if broken == "no event waits":
        monkeypatch.setattr(ttnn, "wait_for_event", lambda cq_id, event: None)
        expected = {("write", "trace"), ("trace", "read")}
    else:
        monkeypatch.setattr(pipeline_mod, "SLOTS", 1)
        monkeypatch.setattr(pipeline_mod.DevicePipeline, "_make_room", lambda self: None)
        expected = {("trace", "write")}
    runner = _runner(network_path, ttnn, num_command_queues=2, dispatch="worker")
    pending = [runner.submit(calibration_image(*CANVAS, seed=s)) for s in (14, 15)]
    for p in pending:
        p.result()
    log = [step for step in ttnn.queue_log if step[0] != "sync_all"][-40:]
    before, pairs = _conflicts(log, runner.pipeline)
    races = {(log[i][0], log[j][0]) for i, j in pairs if not before(i, j)}
    assert expected <= races, races
    runner.close()


def test_eth_dispatch_failure_falls_back_to_worker_with_a_warning(network_path, ttnn, monkeypatch):
    real_open = ttnn.open_device

    def open_device(**kwargs):
        if kwargs.get("dispatch_core_config") == "eth":
            raise RuntimeError("No core coordinate found at location: (0, 12, ETH, LOGICAL)")
        return real_open(**kwargs)

    monkeypatch.setattr(ttnn, "open_device", open_device)
    with pytest.warns(RuntimeWarning, match="ETH dispatch failed"):
        runner = _runner(network_path, ttnn)
    assert runner.describe()["dispatch"] == "worker"
    runner.close()


def test_a_callers_device_is_used_and_never_closed(network_path, ttnn):
    handle = ttnn.open_device(device_id=0)
    runner = _runner(network_path, ttnn, chip=TtChip(0, handle=handle))
    runner.forward(calibration_image(*CANVAS, seed=5))
    runner.close()
    assert ttnn.closed == [] and len(ttnn.opened) == 1


def test_prepared_weights_are_cached_per_checkpoint_canvas_and_tokens(network_path, ttnn, tmp_path, monkeypatch):
    calls = []
    real = runner_mod.prepare_weights
    monkeypatch.setattr(runner_mod, "prepare_weights", lambda *a: calls.append(a[1:]) or real(*a))
    net = _network(network_path)
    first, path = prepared_weights(net, CANVAS, TOKENS, tmp_path)
    again, same = prepared_weights(_network(network_path), CANVAS, TOKENS, tmp_path)
    assert path == same and path.is_file() and len(calls) == 1, "the second load reads the cache"
    assert all(np.array_equal(first.arrays[k], again.arrays[k]) for k in first.arrays)
    prepared_weights(net, CANVAS, 320, tmp_path)
    with torch.no_grad():
        net.encoder.backbone.blocks[0].attn.qkv.weight.add_(1e-3)
    _, changed = prepared_weights(net, CANVAS, TOKENS, tmp_path)
    assert len(calls) == 3 and changed != path, "another token budget or other weights prepare again"


def test_graph_that_does_not_fit_is_a_clear_error(network_path, ttnn, monkeypatch):
    def overflow(self, prepare_convs=True):
        raise RuntimeError(
            "TT_THROW @ program.cpp:1: Statically allocated circular buffers on core range [(x=0,y=0)] "
            "grow to 17323136 B which is beyond max L1 size of 1572864 B\n --- backtrace"
        )

    monkeypatch.setattr(runner_mod.TtnnGraph, "load", overflow)
    with pytest.raises(ValueError, match=r"canvas 224x126 with 300 tokens does not run on this chip.*beyond max L1"):
        _runner(network_path, ttnn)
    assert len(ttnn.closed) == 1, "the chip opened for the failed load is closed again"


# --------------------------------------------------------------------------------------------- the API
def test_api_on_a_tenstorrent_device(network_path, ttnn, monkeypatch):
    """MoGeModel with an open ttnn device, with "tt", and with device=None when a chip is present: the same
    outputs as the reference runner's (float32 emulation, every map read back in float32: the default's bfloat16
    normals are `test_api_reads_normals_back_in_bfloat16`'s), the device named, nothing closed that the caller
    owns."""
    monkeypatch.setattr(post_mod, "READBACK", FLOAT32_READBACK)
    image = (calibration_image(*API_CANVAS, seed=7)[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    common = dict(resolution=API_CANVAS, num_tokens=API_TOKENS, warmup=1, warmup_variants="minimal")
    with MoGeModel.from_pretrained(network_path, device="cpu", precision="fp32", **common) as cpu:
        want = cpu(image)
    handle = ttnn.open_device(device_id=0)
    with MoGeModel.from_pretrained(network_path, device=handle, **common) as model:
        got = model(image)
        info = model.info()
    assert info["device"] == "tt:0" and info["runner"]["runner"] == "ttnn" and info["precision"] == "bf16"
    assert ttnn.closed == []
    assert 0.05 < got.mask.mean() < 0.95 and np.array_equal(got.mask, want.mask)
    valid = got.mask
    assert np.allclose(got.depth[valid], want.depth[valid], rtol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a chip is present: no "running on the CPU" warning
        with MoGeModel.from_pretrained(network_path, device=None, **common) as model:
            assert model.device == "tt:0"
        with MoGeModel.from_pretrained(network_path, device="tt:0", precision="bfp8", **common) as model:
            assert model.info()["runner"]["formats"] == "bfp8-vit"
    assert len(ttnn.closed) == 2, "the chips the models opened are closed"


def test_a_photo_goes_up_as_8_bit_planes_and_a_float_canvas_as_float32(network_path, ttnn, monkeypatch):
    """A uint8 photo's canvas is uploaded as uint8 planes (a quarter of float32's bytes; the device divides by 255)
    and the device warm-up captures that trace, so a call only replays it; a float image of the canvas size (it
    has no 8-bit form) goes up as float32, through a trace of its own. Both give the reference runner's outputs
    (every map read back in float32, to compare masks exactly)."""
    monkeypatch.setattr(post_mod, "READBACK", FLOAT32_READBACK)
    photo = (calibration_image(*API_CANVAS, seed=8)[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    float_image = calibration_image(*API_CANVAS, seed=9)[0].permute(1, 2, 0).numpy()
    common = dict(resolution=API_CANVAS, num_tokens=API_TOKENS, warmup=1, warmup_variants="minimal")
    with MoGeModel.from_pretrained(network_path, device="cpu", precision="fp32", **common) as cpu:
        want = [cpu(photo), cpu(float_image)]
    with MoGeModel.from_pretrained(network_path, device=ttnn.open_device(device_id=0), **common) as model:
        runner, uploads = model.service.runner, []
        upload = runner.pre.upload
        runner.pre.upload = lambda canvas, **kw: (uploads.append(canvas.dtype), upload(canvas, **kw))[1]
        assert len(ttnn.traces) == 2, "the warm-up captured the 8-bit traces (one per slot)"
        got = [model(photo)]
        assert uploads == [np.uint8] and len(ttnn.traces) == 2
        got.append(model(float_image))
        assert uploads == [np.uint8, np.float32] and len(ttnn.traces) == 4
        got.append(model(photo))  # the first trace again, with the second one captured since
        assert uploads[-1] == np.uint8 and len(ttnn.traces) == 4
        # read-back sets: one holds the warm-up's raw maps (the model keeps them for later warm-ups), one serves
        # the single calls; predict_many reads image i+1 while image i's finish holds its maps: one more, and
        # every result its own image's (a set reused under a finish would give image i image i+1's maps)
        assert runner.post.sets_made == 2
        many = model.predict_many([photo, float_image, photo, float_image])
        assert runner.post.sets_made == 3
    for g, w in zip(many, got[:2] * 2):
        assert np.array_equal(g.depth, w.depth) and np.array_equal(g.normal, w.normal)
    for g, w in zip(got, want + want[:1]):
        assert 0.05 < g.mask.mean() < 0.95 and np.array_equal(g.mask, w.mask)
        assert np.allclose(g.depth[g.mask], w.depth[w.mask], rtol=1e-4)


def test_api_reads_normals_back_in_bfloat16(network_path, ttnn, monkeypatch):
    """The default read-back (post.READBACK): the raw maps' normals are bfloat16 (the points and the mask
    float32), `model.forward` hands them on widened to float32, and the finished outputs are those of every map
    read back in float32 but for bfloat16's rounding of the normals: the mask, the camera and the depth the same
    to the bit, the normals within a fraction of a degree."""
    image = (calibration_image(*API_CANVAS, seed=7)[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    common = dict(resolution=API_CANVAS, num_tokens=API_TOKENS, warmup=0, warmup_variants=())
    with MoGeModel.from_pretrained(network_path, device=ttnn.open_device(device_id=0), **common) as model:
        got = model(image)
        raw = model.service.forward(image)
        assert raw.points.dtype == raw.mask.dtype == torch.float32 and raw.normal.dtype == torch.bfloat16
        forward = model.forward(image)
        assert all(forward[k].dtype == torch.float32 for k in ("points", "normal", "mask"))
        assert torch.equal(forward["normal"][0], raw.normal.float())
    monkeypatch.setattr(post_mod, "READBACK", FLOAT32_READBACK)
    with MoGeModel.from_pretrained(network_path, device=ttnn.open_device(device_id=0), **common) as model:
        want = model(image)
        assert model.service.forward(image).normal.dtype == torch.float32
    assert 0.05 < got.mask.mean() < 0.95 and np.array_equal(got.mask, want.mask)
    assert np.array_equal(got.depth, want.depth) and got.fov_x == want.fov_x
    valid = got.mask
    g, w = got.normal[valid].astype(np.float64), want.normal[valid].astype(np.float64)
    angle = np.degrees(np.arctan2(np.linalg.norm(np.cross(g, w), axis=-1), (g * w).sum(-1)))  # lengths aside
    assert 0 < angle.max() <= 0.5 and angle.mean() <= 0.1
    assert np.abs(np.linalg.norm(g, axis=-1) - 1).max() <= BF16_HALF_ULP  # unit to bfloat16's rounding


def test_tenstorrent_option_errors(network_path, ttnn):
    with pytest.raises(ValueError, match="no Tenstorrent chip 3"):
        LoadOptions.resolve(network_path, device="tt:3")
    with pytest.raises(ValueError, match="'tt' or 'tt:N'"):
        LoadOptions.resolve(network_path, device="tt:x")
    with pytest.raises(ValueError, match="num_command_queues=2 needs dispatch='worker'"):
        LoadOptions.resolve(network_path, device="tt", num_command_queues=2)
    with pytest.raises(ValueError, match="precision='int8' is not available on a Tenstorrent chip"):
        LoadOptions.resolve(network_path, device="tt", precision="int8")
    with pytest.raises(ValueError, match="bfp8.*Tenstorrent option"):
        LoadOptions.resolve(network_path, device="cpu", precision="bfp8")
    ttnn.device_count = 0
    with pytest.raises(ValueError, match=r"no Tenstorrent chip 0 here \(0 found"):
        LoadOptions.resolve(network_path, device="tt")
    assert _resolved_without_a_chip(network_path) in ("cpu", "cuda")


def test_device_id_names_a_chip_and_is_never_silently_another_device(network_path, ttnn):
    """device=None with a device_id: that chip, or an error when chips are here but not that one (never the
    CPU or a GPU instead)."""
    ttnn.device_count = 2
    assert str(LoadOptions.resolve(network_path, device_id=1).device) == "tt:1"
    with pytest.raises(ValueError, match=r"device_id=3: no Tenstorrent chip 3 here \(2 found"):
        LoadOptions.resolve(network_path, device_id=3)


def test_two_command_queues_on_a_callers_device_need_no_dispatch_argument(network_path, ttnn):
    """A device the caller opened with two command queues: num_command_queues=2 alone is enough (the dispatch
    was the caller's choice), and the read-back goes to queue 1."""
    handle = ttnn.open_device(device_id=0, num_command_queues=2)
    options = LoadOptions.resolve(network_path, device=handle, num_command_queues=2)
    assert options.device.handle is handle and options.num_command_queues == 2
    runner = TtnnRunner(_network(network_path), CANVAS, TOKENS, options.device, ttnn=ttnn, num_command_queues=2)
    runner.forward(calibration_image(*CANVAS, seed=3))
    runner.close()
    assert ("wait", 1) in ttnn.events and ttnn.closed == []


def test_tt_visible_devices_none_hides_every_chip(network_path, ttnn, monkeypatch):
    """TT_VISIBLE_DEVICES=none (a host-only run): device=None takes CUDA or the CPU even though a chip is here,
    and device="tt" says why it cannot."""
    monkeypatch.setenv("TT_VISIBLE_DEVICES", "none")
    assert _resolved_without_a_chip(network_path) in ("cpu", "cuda")
    with pytest.raises(ValueError, match="TT_VISIBLE_DEVICES=none hides every Tenstorrent chip"):
        LoadOptions.resolve(network_path, device="tt")
    monkeypatch.setenv("TT_VISIBLE_DEVICES", "0")
    assert str(LoadOptions.resolve(network_path).device) == "tt:0"


def test_without_ttnn_a_tenstorrent_device_is_a_clear_error(network_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ttnn", None)  # `import ttnn` raises ImportError
    with pytest.raises(ValueError, match="ttnn .* does not import here"):
        LoadOptions.resolve(network_path, device="tt")
    assert _resolved_without_a_chip(network_path) in ("cpu", "cuda")


def _resolved_without_a_chip(path) -> str:
    """device=None where no chip is seen: CUDA or the CPU (a CUDA build of torch that sees no GPU warns)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kind = LoadOptions.resolve(path, device=None, warmup_variants="none").device.type
    if kind == "cpu" and torch.backends.cuda.is_built():
        assert any("no Tenstorrent chip" in str(w.message) for w in caught)
    return kind
