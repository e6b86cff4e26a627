"""The Tenstorrent cost model (`tt_moge.ttnn_tools.cost`) and its calibration (`tt_moge.ttnn_tools.calibration`).

The model on device operations that ttnn 0.81.1's graph capture recorded on the mock P150 (tests/data/ttnn_captures:
a 2D-multicast matmul, SDPA, a height-sharded 3x3 conv) and on synthetic ops: each cost follows the formula the
module documents (so a change to a formula, a constant or the parser shows up here). The calibration on the stored op
lists of tt-metal's demo models (`calibration.RUNS_FILE`, checked against a fresh mock capture by
tests/test_ttnn_mock.py): the committed figures are the fit's, the fit never reads a held-out point, and the
held-out errors are within the issue's goals."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from pathlib import Path

import pytest

from tt_moge.ttnn_tools import calibration, cost
from tt_moge.ttnn_tools.cost import (
    BLACKHOLE_P150,
    FITTED,
    DeviceOp,
    TensorInfo,
    call_attributes,
    device_ops_from_capture,
    estimate,
    l1_local_bytes_per_s,
    op_cost,
    ops_from_json,
    ops_to_json,
)

CAPTURES = Path(__file__).parent / "data" / "ttnn_captures"
CHIP = BLACKHOLE_P150


def _ops(name: str, call: str, attrs: dict = None) -> list:
    return device_ops_from_capture(json.loads((CAPTURES / f"{name}.json").read_text()), call, attrs or {}, "encoder")


def _ns(cycles: float) -> float:
    return cycles / CHIP.clock_hz * 1e9


def _product(passes: int) -> float:
    """Cycles of one tile product at `passes` fidelity passes (16 a pass) at the chip's FPU efficiency."""
    return 16 * passes / CHIP.fpu_efficiency


def _tensor(shape, buffer="L1", cores=0, dtype="BFLOAT16", layout=None):
    size = math.prod(shape) * (4 if dtype == "FLOAT32" else 2)
    memory = layout or ("HEIGHT_SHARDED" if cores else "INTERLEAVED")
    return TensorInfo(tuple(shape), dtype, "TILE", buffer, memory, cores, size)


# The matmul capture: (1, 1, 1825, 1024) bfloat16 in L1 @ (1024, 3072) bfloat8_b in DRAM, HiFi2, 12x10 cores of
# per_core_M 6 x per_core_N 8 tiles, in0 blocks of 4 K tiles (what context.MatmulPlanner gives qkv with whole_grid).
MATMUL_ATTRS = {"grid": [12, 10], "per_core_M": 6, "per_core_N": 8, "in0_block_w": 4}


def test_a_captured_matmul_is_parsed_into_its_tensors_and_compute_config():
    (op,) = _ops("matmul", "linear", MATMUL_ATTRS)
    assert op.name == "MatmulDeviceOperation"
    a, b = op.inputs
    assert a.shape == (1, 1, 1825, 1024) and a.dtype == "BFLOAT16" and a.buffer == "L1" and not a.sharded
    assert b.shape == (1024, 3072) and b.dtype == "BFLOAT8_B" and b.buffer == "DRAM"
    assert b.nbytes == 1024 * 3072 // 1024 * 1088  # bfloat8_b tiles: 1088 bytes
    assert op.outputs[0].shape == (1, 1, 1825, 3072) and op.outputs[0].padded_shape == (1, 1, 1856, 3072)
    assert (op.fidelity, op.fp32_acc, op.approx) == ("HiFi2", True, False)


def test_matmul_cost_is_the_busiest_cores_tile_products_its_packs_and_its_first_blocks():
    (op,) = _ops("matmul", "linear", MATMUL_ATTRS)
    c = op_cost(op, CHIP)
    assert c.cores == 120  # ceil(58 / 6) rows x ceil(96 / 8) columns of output blocks
    # per core: 6 x 8 output tiles, each 32 K-tile products and one pack
    assert c.compute_ns == pytest.approx(_ns(6 * 8 * (32 * _product(2) + CHIP.pass_cycles)))
    lofi = op_cost(dataclasses.replace(op, fidelity="LoFi"), CHIP)
    assert lofi.compute_ns == pytest.approx(_ns(6 * 8 * (32 * _product(1) + CHIP.pass_cycles)))
    # the longer multicast stream: a row's in0 blocks (6 x 32 bfloat16 tiles) against a column's in1 (8 x 32 bfp8)
    assert c.data_ns >= _ns(max(6 * 32 * 2048, 8 * 32 * 1088) / CHIP.noc_bytes_per_cycle)
    # the fill: the first K block (4 tiles) of both operands before the first product; wider blocks wait longer
    assert c.fill_ns == pytest.approx(_ns((6 * 2048 + 8 * 1088) * 4 / CHIP.noc_bytes_per_cycle))
    wide = op_cost(dataclasses.replace(op, call_attrs={**MATMUL_ATTRS, "in0_block_w": 8}), CHIP)
    assert wide.fill_ns == pytest.approx(2 * c.fill_ns) and wide.compute_ns == pytest.approx(c.compute_ns)
    assert c.kernel_ns == pytest.approx(max(c.compute_ns, c.data_ns) + c.fill_ns + CHIP.kernel_ns)
    assert c.group == "encoder"


def test_fewer_cores_cost_more():
    (op,) = _ops("matmul", "linear", MATMUL_ATTRS)
    narrow = op_cost(dataclasses.replace(op, call_attrs={**MATMUL_ATTRS, "per_core_N": 12, "grid": [8, 10]}), CHIP)
    assert narrow.cores == 80 and narrow.compute_ns == pytest.approx(op_cost(op, CHIP).compute_ns * 12 / 8)


def test_a_batched_matmul_counts_each_core_its_own_batch_once():
    """ViT-Base's Q K^T: 10 images x 12 heads of 224 x 64 @ 64 x 224, one image-head (7 x 7 tiles) per core of 120.
    Its rows already count every batch: multiplying by the batch again made it 120x too slow."""
    q = _tensor((10, 12, 224, 64), cores=120)
    k = _tensor((10, 12, 64, 224), cores=120)
    out = _tensor((10, 12, 224, 224), cores=120)
    attrs = {"grid": [12, 10], "per_core_M": 7, "per_core_N": 7, "in0_block_w": 2}
    c = op_cost(DeviceOp("MatmulDeviceOperation", [q, k], [out], "matmul", "encoder", "LoFi", True, False, attrs))
    assert c.cores == 120
    assert c.compute_ns == pytest.approx(_ns(7 * 7 * (2 * _product(1) + CHIP.pass_cycles)))


SDPA_ATTRS = {"grid": [13, 10], "q_chunk_size": 256, "k_chunk_size": 512, "exp_approx_mode": True}


def test_sdpa_is_split_as_ttnns_factory_splits_it():
    """16 heads of 1825 tokens in 256-token query chunks (8 per head): on 13x10 cores every head gets 8 cores,
    one chunk each; on the 12x10 grid of tt-metal's ViT only 7, so the busiest core runs 2 chunks."""
    (op,) = _ops("sdpa", "transformer.scaled_dot_product_attention", SDPA_ATTRS)
    assert op.name == "SDPAOperation" and [t.shape for t in op.inputs] == [(1, 16, 1825, 64)] * 3
    wide = op_cost(op, CHIP)
    assert wide.cores == 128 and wide.group == "sdpa"
    narrow = op_cost(dataclasses.replace(op, call_attrs={**SDPA_ATTRS, "grid": [12, 10]}), CHIP)
    assert narrow.cores == 16 * 7 and narrow.compute_ns == pytest.approx(2 * wide.compute_ns)


def test_sdpa_costs_every_softmax_pass_and_the_exp_on_every_score_tile():
    """Per score tile QK^T and PV and four passes (pack, max, subtract, sum) besides the exp; the exact exp costs the
    difference of the two exps on every score tile and on every rescale's row tiles, nothing else."""
    (op,) = _ops("sdpa", "transformer.scaled_dot_product_attention", SDPA_ATTRS)
    approx = op_cost(op, CHIP)
    exact = op_cost(dataclasses.replace(op, call_attrs={**SDPA_ATTRS, "exp_approx_mode": False}), CHIP)
    qt, kt, k_chunks = 8, 16, 4  # 256 / 32 query tiles, 512 / 32 key tiles, 1856 keys -> 4 chunks
    score_tiles = k_chunks * qt * kt
    exps = score_tiles + (k_chunks - 1) * qt  # the rescales' exp of (old max - new max), one per row tile
    assert exact.compute_ns - approx.compute_ns == pytest.approx(_ns(exps * (CHIP.exp_cycles - CHIP.exp_cycles_approx)))
    # the approximate-exp SDPA is far more than its products and its exps: its passes are counted too
    products_and_exp = _ns(score_tiles * (2 * 2 * _product(2) + CHIP.exp_cycles_approx))
    assert approx.compute_ns >= products_and_exp + _ns(score_tiles * 4 * CHIP.pass_cycles)


def test_layer_norm_on_an_interleaved_tensor_runs_on_one_core_per_tile_row():
    """ttnn splits an interleaved layer norm by tile rows (a row's statistics stay on one core): 1825 rows are 58
    tile rows, so 58 cores, not the grid's 130; sharded, it runs on the shard grid. Seven passes per tile."""
    x = _tensor((1, 1, 1825, 1024), dtype="FLOAT32")
    interleaved = op_cost(DeviceOp("LayerNormDeviceOperation", [x], [x], "layer_norm", "encoder"), CHIP)
    assert interleaved.cores == 58 and interleaved.group == "norms_adds"
    assert interleaved.compute_ns == pytest.approx(_ns(32 * 7 * CHIP.pass_cycles))  # 32 tiles of a row per core
    s = _tensor((1, 1, 1825, 1024), cores=120, layout="BLOCK_SHARDED")
    sharded = op_cost(DeviceOp("LayerNormDeviceOperation", [s], [s], "layer_norm", "encoder"), CHIP)
    assert sharded.cores == 120 and sharded.compute_ns == pytest.approx(_ns(58 * 32 / 120 * 7 * CHIP.pass_cycles))


def test_a_conv_is_costed_as_its_im2col_matmul_or_its_reader():
    ops = {
        op.name: op
        for op in _ops("conv", "conv2d", {"kernel": [3, 3], "in_channels": 128, "out_channels": 128, "groups": 1})
    }
    # the input came from L1 interleaved: sharded, halo'd (its output moved), convolved
    assert sorted(ops) == [
        "Conv2dDeviceOperation",
        "HaloDeviceOperation",
        "InterleavedToShardedDeviceOperation",
        "MoveDeviceOperation",
    ]
    halo, conv = ops["HaloDeviceOperation"], ops["Conv2dDeviceOperation"]
    weight = conv.inputs[1]
    assert weight.padded_shape[-2:] == (9 * 128, 128)  # the prepared (kh kw C_in, C_out) matrix
    c = op_cost(conv, CHIP)
    pixels = 128 * 228
    assert c.cores == conv.outputs[0].cores > 100
    products = pixels / 32 * 36 * 4 / c.cores  # pixel tiles x K tiles (9 x 128 / 32) x N tiles, per core
    packs = pixels / 32 * 4 / c.cores
    assert c.compute_ns == pytest.approx(_ns(products * _product(2) + packs * CHIP.pass_cycles))
    reader = pixels / c.cores * 9 * 128 * 2 / l1_local_bytes_per_s(3 * 128 * 2) * 1e9
    assert c.data_ns >= reader
    assert op_cost(halo, CHIP).compute_ns > 0  # the halo untilizes the tiled map it gathers
    assert op_cost(halo, CHIP).group == "transfers"


def test_op_names_pick_their_cost_by_kind():
    x = _tensor((1, 1, 64, 64))
    assert op_cost(DeviceOp("SomethingNewDeviceOperation", [x], [x], "new", "encoder")).group == "transfers"
    assert op_cost(DeviceOp("UnaryDeviceOperation", [x], [x], "relu", "decoder")).group == "decoder"
    assert op_cost(DeviceOp("SoftmaxDeviceOperation", [x], [x], "softmax", "encoder")).group == "norms_adds"
    variant = DeviceOp("MatmulMultiCoreReuseDeviceOperation", [x, _tensor((64, 64))], [x], "matmul", "encoder")
    assert op_cost(variant).group == "encoder" and op_cost(variant).compute_ns > 0


def test_l1_rate_follows_tt_metals_table():
    for size, gbps in cost.L1_LOCAL_GBPS:
        assert l1_local_bytes_per_s(size) == pytest.approx(gbps * 1e9)
    rates = [l1_local_bytes_per_s(2**k) for k in range(4, 18)]
    assert rates == sorted(rates) and rates[0] == pytest.approx(1.337e9)


def test_call_attributes_keep_program_configs_and_conv_geometry_only():
    class Grid:
        x, y = 11, 10

    class Config:
        compute_with_storage_grid_size = Grid()
        per_core_M, per_core_N, in0_block_w = 6, 3, 8

    attrs = call_attributes("linear", {"program_config": Config()})
    assert attrs["grid"] == [11, 10] and attrs["per_core_N"] == 3
    conv = call_attributes(
        "conv2d", {"kernel_size": (3, 3), "in_channels": 64, "out_channels": 32, "input_height": 8, "input_width": 9}
    )
    assert conv["kernel"] == [3, 3] and conv["in_channels"] == 64 and not conv["transposed"]
    assert "kernel" not in call_attributes("max_pool2d", {"kernel_size": (2, 2)})  # a pool is not a conv


def test_an_op_list_survives_its_json_form():
    ops = _ops("matmul", "linear", MATMUL_ATTRS) + _ops("conv", "conv2d", {"kernel": [3, 3], "in_channels": 128})
    back = ops_from_json(json.loads(json.dumps(ops_to_json(ops))))
    assert back == ops


def test_the_dispatch_gap_adds_to_end_to_end_times_only():
    """A kernel figure (summed kernel durations) does not move with the gap between ops; an end-to-end figure moves
    by the gap times the ops."""
    runs = {"vit_base": calibration.load_runs()["vit_base"]}
    kernel, e2e = [p for p in calibration.POINTS if p.run == "vit_base"]
    assert (kernel.measure, e2e.measure) == ("kernel", "e2e")
    slower = dataclasses.replace(CHIP, dispatch_ns=CHIP.dispatch_ns + 1000.0)
    assert calibration.point_ms(kernel, runs, slower) == pytest.approx(calibration.point_ms(kernel, runs, CHIP))
    gained = calibration.point_ms(e2e, runs, slower) - calibration.point_ms(e2e, runs, CHIP)
    assert gained == pytest.approx(len(runs["vit_base"]) * 1000.0 / 1e6)
    est = estimate(runs["vit_base"], CHIP)
    assert all(c.dispatch_ns == CHIP.dispatch_ns and c.startup_ns == CHIP.kernel_ns for c in est.ops)
    top = est.summary(top=2)["top"]
    assert len(top) == 2 and top[0]["ms"] >= top[1]["ms"]


# ---------------------------------------------------------------------------------------------- calibration


@pytest.fixture(scope="module")
def runs() -> dict:
    return calibration.load_runs()


BLIND_RUNS = ("sentence_bert", "ufld_v2", "vgg_unet", "resnet50 b16", "resnet50 b32")


def test_the_published_figures_are_the_sources_rates_per_run():
    by = {(p.model, p.config, p.measure): p for p in calibration.POINTS}
    assert len(calibration.POINTS) == 21 and len(by) == 21
    hires = [p for p in calibration.POINTS if p.model == "hires_vit"]
    assert len(hires) == 12 and {p.measure for p in hires} == {"e2e"}
    assert by[("hires_vit", "hidden 2304, 3072 tokens, 12 layers, batch 1", "e2e")].published_ms == pytest.approx(
        1000 / 31
    )
    assert by[("vit_base", "batch 10, 224x224, device kernel", "kernel")].published_ms == pytest.approx(10 / 4300 * 1e3)
    unet = [p for p in calibration.POINTS if p.model == "unet_shallow"]
    assert sorted(round(p.published_ms, 3) for p in unet) == [1.391, 1.58]
    # the blind points: device-kernel figures (batch / samples per second), held out, never seen before the model
    # was frozen
    run = {p.run: p for p in calibration.POINTS}
    expected = {
        "sentence_bert": 8 / 980,
        "ufld_v2": 1 / 495,
        "vgg_unet": 1 / 488,
        "resnet50 b16": 16 / 10610,
        "resnet50 b32": 32 / 15480,
    }
    for key, seconds in expected.items():
        p = run[key]
        assert p.published_ms == pytest.approx(seconds * 1e3) and p.measure == "kernel", key
        assert p.blind and not p.fitted, key
    assert {p.run for p in calibration.POINTS if p.blind} == set(BLIND_RUNS)


def test_the_blind_transcriptions_ran_whole_models_on_the_mock(runs):
    """The stored op lists of the blind points are the models the sources describe: every conv of ResNet-34 (36:
    the stem, 32 3x3, 3 strided downsamples) and of VGG-UNet (24 3x3, 4 transposed, and the 1x1 output one run as a
    matmul), ResNet-50's 53 convs (the 1x1 stride-1 ones run as matmuls) and its classifier; batch 32 does the same
    work on twice the pixels."""
    counts = {key: collections.Counter(op.name for op in runs[key]) for key in BLIND_RUNS}
    assert counts["ufld_v2"]["Conv2dDeviceOperation"] == 36
    assert counts["ufld_v2"]["MatmulDeviceOperation"] == 3  # the pool conv (1x1) and the head's two linears
    assert counts["vgg_unet"]["Conv2dDeviceOperation"] == 28 and counts["vgg_unet"]["MatmulDeviceOperation"] == 1
    for batch in (16, 32):
        got = counts[f"resnet50 b{batch}"]
        assert got["Conv2dDeviceOperation"] + got["MatmulDeviceOperation"] == 53 + 1
    resnet = ("resnet50 b16", "resnet50 b32")
    rows = {key: max(op.outputs[0].rows for op in runs[key] if op.name == "Conv2dDeviceOperation") for key in resnet}
    assert rows["resnet50 b32"] == 2 * rows["resnet50 b16"]


def test_the_fit_never_reads_a_blind_point(runs):
    """With the blind points' op lists swapped for another model's and their published times tripled, the fit finds
    the same figures (it reads neither), while those points' reported errors change."""
    moved = tuple(dataclasses.replace(p, published_ms=3 * p.published_ms) if p.blind else p for p in calibration.POINTS)
    swapped = {**runs, **{key: runs["vit_base"] for key in BLIND_RUNS}}
    a = calibration.fit(runs, iterations=3)
    b = calibration.fit(swapped, points=moved, iterations=3)
    assert a["chip"] == b["chip"]
    assert b["calibration"]["blind"]["mean_error"] < a["calibration"]["blind"]["mean_error"] - 0.5


def test_the_held_out_errors_are_reported_all_blind_and_seen(runs):
    """`calibration` reports the held-out errors three ways: all held-out points, the blind ones alone and the ones
    seen under an earlier split, each with its signed mean; the groups partition the held-out points."""
    report = calibration.calibration(runs)
    rows = report["points"]
    blind = [r["error"] for r in rows if r["blind"]]
    seen = [r["error"] for r in rows if not r["fitted"] and not r["blind"]]
    held = [r["error"] for r in rows if not r["fitted"]]
    assert len(blind) == len(BLIND_RUNS) and len(seen) == 8 and len(blind) + len(seen) == len(held)
    assert not any(r["blind"] and r["fitted"] for r in rows)
    for group, errors in (("blind", blind), ("seen_held_out", seen)):
        got = report[group]
        assert got["points"] == len(errors)
        assert got["mean_abs_error"] == pytest.approx(sum(map(abs, errors)) / len(errors), abs=1e-3)
        assert got["max_abs_error"] == pytest.approx(max(map(abs, errors)), abs=1e-3)
        assert got["mean_error"] == pytest.approx(sum(errors) / len(errors), abs=1e-3)
        assert got["mean_error"] != pytest.approx(got["mean_abs_error"])  # errors of both signs: the sign is kept
    assert report["held_out_mean_error"] == pytest.approx(sum(held) / len(held), abs=1e-3)


def test_the_committed_figures_are_what_the_fit_finds_on_the_fitted_points(runs):
    """Started from figures 30 % off, the fit on the fitted points converges to `BLACKHOLE_P150`'s own: the committed
    constants are the fit's, not tuned by hand."""
    start = dataclasses.replace(CHIP, **{n: getattr(CHIP, n) * 1.3 for n in FITTED})
    result = calibration.fit(runs, start)
    for name in FITTED:
        assert result["chip"][name] == pytest.approx(getattr(CHIP, name), rel=0.01), name


def test_the_fit_never_reads_a_held_out_point(runs):
    """Doubling every held-out published time changes nothing the fit returns but those points' errors."""
    moved = tuple(
        p if p.fitted else dataclasses.replace(p, published_ms=2 * p.published_ms) for p in calibration.POINTS
    )
    a, b = calibration.fit(runs, iterations=3), calibration.fit(runs, points=moved, iterations=3)
    assert a["chip"] == b["chip"]
    assert b["calibration"]["held_out_mean_abs_error"] > a["calibration"]["held_out_mean_abs_error"]


def test_the_fit_recovers_the_figures_that_made_the_times(runs):
    """Published times made by a chip with other figures: the fit finds those figures from the usual start."""
    truth = dataclasses.replace(CHIP, fpu_efficiency=0.6, exp_cycles=150.0, kernel_ns=4000.0, dispatch_ns=2500.0)
    made = tuple(dataclasses.replace(p, published_ms=calibration.point_ms(p, runs, truth)) for p in calibration.POINTS)
    result = calibration.fit(runs, points=made)
    for name in FITTED:
        assert result["chip"][name] == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert result["calibration"]["held_out_max_abs_error"] < 1e-3


def test_the_calibration_holds_half_its_points_out_and_meets_the_goals_on_them(runs):
    """The issue's goal: at least half of the published figures held out, their mean error <= 8 % and max <= 15 %."""
    report = calibration.calibration(runs)
    points = report["points"]
    assert len(points) == len(calibration.POINTS)
    assert report["held_out_points"] >= len(points) / 2
    assert report["fitted_points"] + report["held_out_points"] == len(calibration.POINTS)
    for row in points:
        assert row["estimate_ms"] > 0 and row["error"] == pytest.approx(
            row["estimate_ms"] / row["published_ms"] - 1, abs=2e-3
        )
    held = [abs(r["error"]) for r in points if not r["fitted"]]
    assert report["held_out_mean_abs_error"] == pytest.approx(sum(held) / len(held), abs=1e-3)
    assert report["held_out_mean_abs_error"] <= 0.08, report
    assert report["held_out_max_abs_error"] <= 0.15, report


def test_the_gemm_cross_check_runs_the_microbenchmarks_matmuls():
    """tt-metal's P150 matmul microbenchmark, not fitted: the model is pessimistic there (its efficiency is that of the
    models' own small per-core blocks), and the check says by how much."""
    (op, ns), *_ = calibration.gemm_ops()
    assert op.call_attrs["per_core_M"] == 2 and op.call_attrs["per_core_N"] == 2  # 640 x 832 on 10 x 13 cores
    assert ns == pytest.approx(640 * 832 * 832 / 32**3 * 16 / 130 / 1.35 / 0.1117)
    check = calibration.gemm_check()
    assert check["points"] == len(calibration.GEMM_UTILIZATION) and check["mean_error"] > 0


def test_cross_validation_predicts_each_model_from_a_fit_that_never_saw_it(monkeypatch):
    """Leave one model out: each model's figures are predicted by a fit on every other model's figures and none of
    its own, and all 21 figures are predicted once; a fitted figure that no other model moves (the exact exp, which
    only the hiRes ViT runs) is not fitted in that fold but takes its documented stand-in (the fast exp's cycles).
    On stand-ins for the fit and the estimate (the real ones: `python -m tt_moge.ttnn_tools.calibration
    --cross-validate`, docs/tenstorrent.md)."""
    folds = []

    def fake_fit(runs, chip, points, names=calibration.FITTED, iterations=50):
        folds.append(({p.model for p in points if p.fitted}, {p.model for p in points if not p.fitted}, names, chip))
        return {"chip": {n: getattr(chip, n) for n in names}, "iterations": 0}

    def fake_point_ms(point, runs, chip):  # every figure moves with the efficiency, only the hiRes ViT's with the exp
        exp = chip.exp_cycles if point.model == "hires_vit" else 1.0
        return point.published_ms * chip.fpu_efficiency * exp * (chip.kernel_ns + chip.dispatch_ns) * 1e-3

    monkeypatch.setattr(calibration, "fit", fake_fit)
    monkeypatch.setattr(calibration, "point_ms", fake_point_ms)
    result = calibration.cross_validation({})
    models = {p.model for p in calibration.POINTS}
    assert len(folds) == len(models) == 7 and result["all"]["points"] == len(calibration.POINTS)
    for fitted, held, names, chip in folds:
        assert len(held) == 1 and fitted == models - held, (fitted, held)
        if held == {"hires_vit"}:
            assert "exp_cycles" not in names and chip.exp_cycles == chip.exp_cycles_approx
        else:
            assert set(names) == set(calibration.FITTED) and chip.exp_cycles == calibration.CV_START["exp_cycles"]
