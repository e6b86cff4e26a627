"""The Tenstorrent cost model (`tt_moge.ttnn_tools.cost`) on device operations that ttnn 0.81.1's graph capture
recorded on the mock P150 (tests/data/ttnn_captures: a 2D-multicast matmul, SDPA, a height-sharded 3x3 conv), and
on synthetic op lists: the capture is parsed into what each op moves and computes, and each cost follows the
formula the module documents (so a change to a formula, a constant or the parser shows up here). The whole
forward's estimate and its calibration run on the mock itself (tests/test_ttnn_mock.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tt_moge.ttnn_tools import cost
from tt_moge.ttnn_tools.cost import (
    BLACKHOLE_P150,
    DeviceOp,
    TensorInfo,
    call_attributes,
    device_ops_from_capture,
    estimate,
    fit_calibration,
    l1_local_bytes_per_s,
    op_cost,
)

CAPTURES = Path(__file__).parent / "data" / "ttnn_captures"
CHIP = BLACKHOLE_P150


def _ops(name: str, call: str, attrs: dict = None) -> list:
    return device_ops_from_capture(json.loads((CAPTURES / f"{name}.json").read_text()), call, attrs or {}, "encoder")


def _cycles_ns(cycles: float) -> float:
    return cycles / CHIP.clock_hz * 1e9


# The matmul capture: (1, 1, 1825, 1024) bfloat16 in L1 @ (1024, 3072) bfloat8_b in DRAM, HiFi2, 12x10 cores of
# per_core_M 6 x per_core_N 8 tiles (what graph._MatmulPlanner gives qkv with whole_grid).
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


def test_matmul_cost_is_the_busiest_cores_tile_products_at_its_fidelity():
    (op,) = _ops("matmul", "linear", MATMUL_ATTRS)
    c = op_cost(op, CHIP)
    assert c.cores == 120  # ceil(58 / 6) rows x ceil(96 / 8) columns of output blocks
    products = 6 * 8 * 32  # per-core block x K tiles
    assert c.compute_ns == pytest.approx(_cycles_ns(products * 16 * 2 / CHIP.fpu_efficiency))  # 16 cycles a pass
    lofi = op_cost(dataclasses.replace(op, fidelity="LoFi"), CHIP)
    hifi4 = op_cost(dataclasses.replace(op, fidelity="HiFi4"), CHIP)
    assert lofi.compute_ns == pytest.approx(c.compute_ns / 2) and hifi4.compute_ns == pytest.approx(2 * c.compute_ns)
    # the longer multicast stream: a row's in0 blocks (6 x 32 bfloat16 tiles) against a column's in1 (8 x 32 bfp8)
    stream = max(6 * 32 * 2048, 8 * 32 * 1088)
    assert c.data_ns >= _cycles_ns(stream / CHIP.noc_bytes_per_cycle)
    assert c.total_ns == pytest.approx(max(c.compute_ns, c.data_ns) + CHIP.op_overhead_ns)
    assert c.group == "encoder"


def test_fewer_cores_cost_more():
    (op,) = _ops("matmul", "linear", MATMUL_ATTRS)
    narrow = op_cost(dataclasses.replace(op, call_attrs={**MATMUL_ATTRS, "per_core_N": 12, "grid": [8, 10]}), CHIP)
    assert narrow.cores == 80 and narrow.compute_ns == pytest.approx(op_cost(op, CHIP).compute_ns * 12 / 8)


def test_sdpa_is_split_as_ttnns_factory_splits_it():
    """16 heads of 1825 tokens in 256-token query chunks (8 per head): on 13x10 cores every head gets 8 cores,
    one chunk each; on the 12x10 grid of tt-metal's ViT only 7, so the busiest core runs 2 chunks."""
    attrs = {"grid": [13, 10], "q_chunk_size": 256, "k_chunk_size": 512, "exp_approx_mode": True}
    (op,) = _ops("sdpa", "transformer.scaled_dot_product_attention", attrs)
    assert op.name == "SDPAOperation" and [t.shape for t in op.inputs] == [(1, 16, 1825, 64)] * 3
    wide = op_cost(op, CHIP)
    assert wide.cores == 128 and wide.group == "sdpa"
    score_tiles = 1 * 8 * 4 * 16  # 1 chunk x 8 query tiles x 4 key chunks x 16 key tiles (padded to 2048)
    per_tile = (
        2 * 2 * 32**3 * 2 / CHIP.flop_per_cycle_lofi * 2 / CHIP.fpu_efficiency + CHIP.softmax_cycles_per_tile_approx
    )
    assert wide.compute_ns >= _cycles_ns(score_tiles * per_tile)
    narrow = op_cost(dataclasses.replace(op, call_attrs={**attrs, "grid": [12, 10]}), CHIP)
    assert narrow.cores == 16 * 7 and narrow.compute_ns == pytest.approx(2 * wide.compute_ns, rel=0.01)
    exact = op_cost(dataclasses.replace(op, call_attrs={**attrs, "exp_approx_mode": False}), CHIP)
    assert exact.compute_ns > 2 * wide.compute_ns  # the exact exp is the SDPA's costliest part


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
    flops = 2 * pixels * 9 * 128 * 128
    assert c.compute_ns == pytest.approx(_cycles_ns(flops / (c.cores * 4096) * 2) / CHIP.conv_efficiency)
    reader = pixels / c.cores * 9 * 128 * 2 / l1_local_bytes_per_s(3 * 128 * 2) * 1e9
    assert c.data_ns >= reader
    assert op_cost(halo, CHIP).compute_ns > 0  # the halo untilizes the tiled map it gathers
    assert op_cost(halo, CHIP).group == "transfers"


def test_l1_rate_follows_tt_metals_table():
    for size, gbps in cost._L1_LOCAL_GBPS:
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


def _tensor(shape, buffer="L1", cores=0, dtype="BFLOAT16"):
    size = 1
    for v in shape:
        size *= v
    return TensorInfo(
        tuple(shape), dtype, "TILE", buffer, "HEIGHT_SHARDED" if cores else "INTERLEAVED", cores, size * 2
    )


def test_estimate_groups_sum_to_the_total_and_every_op_pays_its_dispatch():
    ops = _ops("matmul", "linear", MATMUL_ATTRS) + _ops(
        "sdpa", "transformer.scaled_dot_product_attention", {"grid": [13, 10], "q_chunk_size": 256, "k_chunk_size": 512}
    )
    ops.append(
        DeviceOp(
            "BinaryNgDeviceOperation",
            [_tensor((1, 1, 1856, 1024))] * 2,
            [_tensor((1, 1, 1856, 1024))],
            "add",
            "encoder",
        )
    )
    ops.append(
        DeviceOp(
            "InterleavedToShardedDeviceOperation",
            [_tensor((1, 1, 1856, 1024), "DRAM")],
            [_tensor((1, 1, 1856, 1024), cores=58)],
            "to_memory_config",
            "decoder",
        )
    )
    est = estimate(ops, CHIP)
    assert est.total_ms == pytest.approx(sum(est.groups_ms.values()))
    assert {g for g, v in est.groups_ms.items() if v} == {"encoder", "sdpa", "norms_adds", "transfers"}
    assert est.total_ms >= len(ops) * CHIP.op_overhead_ns / 1e6
    top = est.summary(top=2)["top"]
    assert len(top) == 2 and top[0]["ms"] >= top[1]["ms"]


def test_the_calibration_fit_recovers_the_figures_that_made_the_times():
    """fit_calibration on times made by a chip with other dispatch and softmax figures finds those figures."""
    lists = {
        tokens: _ops("matmul", "linear", MATMUL_ATTRS) * (tokens // 1024)
        + _ops(
            "sdpa",
            "transformer.scaled_dot_product_attention",
            {"grid": [12, 10], "q_chunk_size": 256, "k_chunk_size": 256, "exp_approx_mode": False},
        )
        * (tokens // 1024) ** 2
        for tokens in (1024, 2048, 3072)
    }
    truth = dataclasses.replace(CHIP, op_overhead_ns=3000.0, softmax_cycles_per_tile=200.0)
    made = {t: 12 * estimate(ops, truth).total_ms for t, ops in lists.items()}
    fit = fit_calibration(lists, CHIP, published_ms=made)
    assert fit["op_overhead_ns"] == pytest.approx(3000.0, rel=1e-3)
    assert fit["softmax_cycles_per_tile"] == pytest.approx(200.0, rel=1e-3)
    assert all(row["ratio"] == pytest.approx(1.0, abs=1e-3) for row in fit["table"].values())
