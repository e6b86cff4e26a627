"""The Tenstorrent graph (`tt_moge.runners.ttnn.graph`) against the float32 reference network, on CPU, through the
ttnn emulator (`tests/ttnn_emulator.py`): the numerics of the lowering, without a device.

* Emulated in float32 ("exact"), the graph equals the reference to float round-off: every raw map at PCC >=
  0.9999 and within 1e-5 relative, the ViT's output and class token too, for the structures the graph runs
  (with or without the normal head, with register tokens, a nearest-upsample last level).
* In the device formats (bfloat16 activations and weights, float32 residual stream; bfloat8_b ViT weights for
  "bfp8-vit") it stays within the same limits as the CPU bfloat16 graph (test_runners.py, docs/
  devices-and-precision.md), plus the depth after the full host pipeline.
* Per module, tt-metal style: one ViT block, the encoder, the decoder, each against the reference modules.
* Each check fails when the lowering breaks (`test_checks_catch_broken_lowerings`).
* ViT-L at the spec case (1920x1080, 1800 tokens) is the one `full_size` test.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tt_moge import env as environment
from tt_moge.host import CallOptions, postprocess
from tt_moge.host.canvas import plan_canvas
from tt_moge.runners.base import RawMaps
from tt_moge.runners.ttnn import Formats, Prepared, TtnnGraph, host_input, prepare_weights
from tt_moge.runners.ttnn.decoder import Conv
from tt_moge.runners.ttnn.graph import CONFIGS, GraphConfig
from tt_moge.runners.ttnn.post import DeviceOutput, widen
from tt_moge.runners.ttnn.pre import DeviceInput
from tt_moge.runners.ttnn.prepare import depth_to_space, metric_scale, phase_fold, resize_antialiased, resize_bilinear
from tt_moge.testing import add_residual_outliers, calibration_image, make_network, model_config

from .ttnn_emulator import EmulatedDevice, TtnnEmulator, round_bf16, round_bfp8, truncate_bits

SMALL, SMALL_TOKENS = (224, 126), 300  # a small 16:9 canvas: seconds on 2 cores


def _config(kind: str) -> dict:
    cfg = model_config("tiny-vits-normal")
    if kind == "registers":
        cfg["encoder"]["backbone"] = "dinov2_vits14_reg"
    elif kind == "nearest":
        for stack in ("neck", "points_head", "normal_head", "mask_head"):
            cfg[stack]["resamplers"][-1] = "nearest"
    return cfg


_NETWORKS: dict = {}
_PREPARED: dict = {}


def _network(preset: str):
    """The preset's random network; "<preset>+outliers": the same with DINOv2's massive activations planted in the
    ViT's residual stream (`testing.add_residual_outliers`; the channels in `.planted`)."""
    if preset not in _NETWORKS:
        base = preset.removesuffix("+outliers")
        net = make_network(_config(base) if base in ("registers", "nearest") else base)
        if base != preset:
            net.planted = add_residual_outliers(net)
        _NETWORKS[preset] = net
    return _NETWORKS[preset]


def _prepared(preset: str, canvas=SMALL, tokens=SMALL_TOKENS) -> Prepared:
    key = (preset, canvas, tokens)
    if key not in _PREPARED:
        _PREPARED[key] = prepare_weights(_network(preset), canvas, tokens)
    return _PREPARED[key]


def _graph(prepared: Prepared, formats="bf16", exact=False, prepare_convs=False, config="fast") -> TtnnGraph:
    """The graph on a fresh emulator. prepare_convs: run load()'s conv-preparing forward first, so that the
    forward under test reuses "device-prepared" conv weights (as on a chip); the other tests skip it."""
    emulator = TtnnEmulator(exact=exact)
    if exact:  # float32 everything: no formats, and no weights rounded to what LoFi reads (a format choice too)
        config = dataclasses.replace(CONFIGS[config] if isinstance(config, str) else config, round_lofi_weights=False)
    graph = TtnnGraph(emulator, emulator.open_device(), prepared, formats=formats, config=config)
    graph.load(prepare_convs=prepare_convs)
    return graph


# ------------------------------------------------------------------------------------------- references


def _reference(net, image: torch.Tensor, tokens: int) -> dict:
    with torch.inference_mode():
        ref = {k: v[0].numpy() for k, v in net(image, tokens).items()}
    ref["metric_scale"] = float(ref["metric_scale"])
    valid = float((ref["mask"] > 0.5).mean())
    assert 0.05 < valid < 0.95, f"valid share {valid:.3f}: the comparison would be trivial"
    return ref


def _encoder_reference(net, image: torch.Tensor, plan: dict) -> tuple[np.ndarray, np.ndarray]:
    """The neck's level-0 input (rows * cols, d0) (after its 1x1 conv over features + uv) and the class token."""
    rows, cols = plan["rows"], plan["cols"]
    with torch.inference_mode():
        features, cls_token = net.encoder(image, rows, cols)
        uv0 = net.uv_planes(rows, cols, image.shape[-1] / image.shape[-2], torch.float32, None)[0]
        level0 = net.neck.input_blocks[0](torch.cat([features, uv0], dim=1))
    return _level0_rows(level0, plan), cls_token[0].numpy()


def _level0_rows(level0: torch.Tensor, plan: dict) -> np.ndarray:
    """The neck's level-0 map (1, d0, rows, cols) as the device holds it: (rows * cols, d0), token order."""
    return level0[0].permute(1, 2, 0).reshape(plan["rows"] * plan["cols"], -1).numpy()


FLOAT32_READBACK = {"normal": "float32", "mask": "float32"}  # every map read back in float32


def _run(
    graph: TtnnGraph, prepared: Prepared, image: torch.Tensor, readback: dict = None
) -> tuple[dict, np.ndarray, np.ndarray]:
    """The whole device call on one canvas, as the runner runs it (the canvas's resize and unfold on the device,
    `pre.DeviceInput`; the graph; interleave, resize to the canvas and activations on the device,
    `post.DeviceOutput`): (raw maps, level-0 map (rows * cols, d0), class token). The maps in the runner's read-back
    formats (`post.READBACK`: the normals bfloat16), or `readback`'s; in exact (float32) emulation all float32."""
    plan = prepared.plan
    if readback is None and getattr(graph.ttnn, "exact", False):
        readback = FLOAT32_READBACK
    pre = DeviceInput(graph.ttnn, graph.device, prepared, graph.formats.activations)
    post = DeviceOutput(graph.ttnn, graph.device, prepared, readback)
    pre.load()
    post.load()
    graph.finest_tiles = True
    level0, cls_token = graph.encode(pre.forward(pre.upload(image.numpy())))
    level0_np = graph.to_host(level0, (plan["grid_tokens"], plan["neck_in0_dim"]))
    maps = {k: widen(v) for k, v in post.read(post.forward(graph.decode(level0))).items()}  # bfloat16 normals
    cls = graph.to_host(cls_token, (plan["dim"],))
    raw = {k: v.transpose(1, 2, 0) for k, v in maps.items() if k != "mask"}
    if "mask" in maps:
        raw["mask"] = maps["mask"][0]
    raw["metric_scale"] = metric_scale(prepared, cls)
    return raw, level0_np, cls


# ---------------------------------------------------------------------------------------------- metrics


def _pcc(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.corrcoef(a, b)[0, 1])


def _angle_deg(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.degrees(2 * np.arcsin(np.minimum(np.linalg.norm(a - b, axis=-1) / 2, 1)))


def _raw_maps(d: dict) -> RawMaps:
    def t(k):
        return None if d.get(k) is None else torch.from_numpy(np.ascontiguousarray(d[k]))

    return RawMaps(t("points"), t("normal"), t("mask"), d["metric_scale"])


def _finish(raw: dict, canvas):
    return postprocess(_raw_maps(raw), plan_canvas(canvas, canvas, "stretch"), CallOptions())


def _depth_error(ours: dict, ref: dict, canvas) -> float:
    """Max relative depth error after the host pipeline (camera solve, finish) over pixels valid in both."""
    b = ref["finished"] if "finished" in ref else _finish(ref, canvas)
    a = _finish(ours, canvas)
    both = a.mask & b.mask & np.isfinite(b.depth) & (b.depth > 0)
    assert both.mean() > 0.05, "no pixel valid in both: the depth comparison would be trivial"
    return float((np.abs(a.depth[both] - b.depth[both]) / b.depth[both]).max())


def _errors(ours: dict, ref: dict, level0, level0_ref, cls_token, cls_ref, canvas=SMALL, outliers=()) -> dict:
    """The metrics of test_runners.py / perf/runners/accuracy.py, the ViT's share on its own, and PCCs. `outliers`:
    the class token's channels with planted massive activations, which would set the scale of its max-relative
    error: measured apart ("cls_token_outliers", each channel to its own largest value), the rest as usual."""
    assert sorted(k for k, v in ours.items() if v is not None) == sorted(k for k in ref if k != "finished")
    for k, v in ours.items():
        assert v is None or np.isfinite(v).all(), k
    p, q = ours["points"], ref["points"]
    err = {"points": float((np.abs(p - q) / (np.abs(q) + np.abs(q).max())).max()), "pcc_points": _pcc(p, q)}
    if "normal" in ref:
        angle = _angle_deg(ours["normal"], ref["normal"])
        err.update(
            normal_deg=float(angle.max()),
            normal_deg_p99=float(np.quantile(angle, 0.99)),
            pcc_normal=_pcc(ours["normal"], ref["normal"]),
        )
    err.update(
        mask_prob=float(np.abs(ours["mask"] - ref["mask"]).max()),
        pcc_mask=_pcc(ours["mask"], ref["mask"]),
        mask_agree=float(((ours["mask"] > 0.5) == (ref["mask"] > 0.5)).mean()),
        scale=abs(ours["metric_scale"] / ref["metric_scale"] - 1),
        encoder_rms=float(np.sqrt(((level0 - level0_ref) ** 2).mean() / (level0_ref**2).mean())),
        pcc_encoder=_pcc(level0, level0_ref),
        cls_token=_relative(np.delete(cls_token, list(outliers)), np.delete(cls_ref, list(outliers))),
        depth=_depth_error(ours, ref, canvas),
    )
    return err


# Emulated in float32: round-off only (the folds reassociate sums).
EXACT_LIMITS = {
    "points": 1e-5,
    "normal_deg": 0.01,
    "mask_prob": 1e-5,
    "scale": 1e-5,
    "encoder_rms": 1e-5,
    "cls_token": 1e-5,
    "depth": 1e-5,
}
# Device formats, bf16 weights and activations with a float32 residual stream, either graph: the CPU bf16 graph's
# documented limits (test_runners.REDUCED_LIMITS), the normal angle's p99, the depth after the host pipeline,
# and bounds on the ViT's output and class token. What the study measures: `main` below, docs/performance.md.
DEVICE_LIMITS = {
    "points": 0.008,
    "normal_deg": 1.5,
    "normal_deg_p99": 0.5,
    "mask_prob": 0.025,
    "mask_agree": 0.997,
    "scale": 0.005,
    "encoder_rms": 0.02,
    "cls_token": 0.02,
    "depth": 2e-3,
}
# bfloat8_b ViT weights: the class token moves most, the scale follows; everything else as bf16.
BFP8_VIT_LIMITS = {**DEVICE_LIMITS, "cls_token": 0.04}
LIMITS = {"bf16": DEVICE_LIMITS, "bfp8-vit": BFP8_VIT_LIMITS}


def _check(err: dict, limits: dict, min_pcc: float = 0.0) -> None:
    for key, limit in limits.items():
        if key in err:
            ok = err[key] >= limit if key == "mask_agree" else err[key] <= limit
            assert ok, f"{key}: {err[key]:.4g} beyond the limit {limit} ({err})"
    for key, value in err.items():
        if key.startswith("pcc_"):
            assert value >= min_pcc, f"{key}: {value:.7f} < {min_pcc} ({err})"


_REFERENCES: dict = {}


def _references(preset: str, seed: int, canvas, tokens) -> tuple:
    """(raw maps + their finished output, level-0 map, class token) of the reference, cached."""
    key = (preset, seed, canvas, tokens)
    if key not in _REFERENCES:
        net, plan = _network(preset), _prepared(preset, canvas, tokens).plan
        image = calibration_image(*canvas, seed=seed)
        # the level-0 map and the class token as _encoder_reference gives them, seen in the same forward (no
        # second pass through the ViT: at the spec case that is a third of the test)
        seen = {}

        def keep(name, index=None):  # a forward hook that keeps an output (and returns None: changes nothing)
            return lambda _module, _args, out: seen.update({name: out if index is None else out[index]})

        hooks = (
            net.encoder.register_forward_hook(keep("cls_token", 1)),
            net.neck.input_blocks[0].register_forward_hook(keep("level0")),
        )
        try:
            ref = _reference(net, image, tokens)
        finally:
            for hook in hooks:
                hook.remove()
        ref["finished"] = _finish(ref, canvas)
        _REFERENCES[key] = (ref, _level0_rows(seen["level0"], plan), seen["cls_token"][0].numpy())
    return _REFERENCES[key]


def _compare(
    preset: str,
    formats="bf16",
    exact=False,
    seed=6,
    canvas=SMALL,
    tokens=SMALL_TOKENS,
    graph: TtnnGraph = None,
    prepare_convs=False,
    config="fast",
    readback: dict = None,
) -> dict:
    prepared = _prepared(preset, canvas, tokens)
    graph = graph or _graph(prepared, formats, exact, prepare_convs, config)
    raw, level0, cls_token = _run(graph, prepared, calibration_image(*canvas, seed=seed), readback)
    ref, level0_ref, cls_ref = _references(preset, seed, canvas, tokens)
    outliers = getattr(_network(preset), "planted", {}).get("channels", [])
    err = _errors(raw, ref, level0, level0_ref, cls_token, cls_ref, canvas, outliers)
    if outliers:
        err["cls_token_outliers"] = max(_relative(cls_token[[c]], cls_ref[[c]]) for c in outliers)
    return err


def _relative(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _check_exact(err: dict) -> None:
    _check(err, EXACT_LIMITS, min_pcc=0.9999)
    assert err["pcc_encoder"] >= 0.99999, err


# ----------------------------------------------------------------------------------------- whole graph


@pytest.mark.parametrize("config", ["fast", "safe"])
@pytest.mark.parametrize("preset", ["tiny-vits-normal", "tiny-vits", "registers", "nearest"])
def test_exact_emulation_equals_the_reference(preset, config):
    """Every fold and layout choice (patch matmul, token order, tap matrices, phase-folded finest level,
    replicate padding, host steps; in the fast graph also the level-0 upsamples as matmul + pixel shuffle with
    the heads' input convs folded in, 1x1 convs on sharded maps, the device untilize) is exact: float32 emulation
    matches the reference to round-off. The forward compared is the second one, with the conv weights prepared
    by the first (load), as on a chip."""
    _check_exact(_compare(preset, exact=True, prepare_convs=True, config=config))


@pytest.mark.parametrize("config", ["fast", "safe"])
@pytest.mark.parametrize("formats", ["bf16", "bfp8-vit"])
def test_device_formats_are_within_documented_limits(formats, config):
    err = _compare("tiny-vits-normal", formats, config=config)
    _check(err, LIMITS[formats], min_pcc=0.999)
    assert err["encoder_rms"] > 1e-4, "no rounding at all: the formats were not emulated"


def test_the_emulator_sees_each_fidelity_choice():
    """The fidelity-aware emulator is not blind to the fast graph's choices: each lower fidelity costs accuracy
    where that op acts (so the accuracy table of docs/tenstorrent.md is not optimistic). Measured from one
    configuration with every ViT matmul at HiFi2, one change at a time (LoFi with its weights as they are, so that
    what is seen is the fidelity itself; the maps read back in float32, so that the normals' bfloat16 rounding does
    not cover the decoder's)."""
    base = _fast(  # taps as the attention's; SDPA and the coarse decoder levels at HiFi2 too
        attention_fidelity="hifi2",
        tap_fidelity="",
        mlp_fidelity="hifi2",
        sdpa_fidelity="hifi2",
        decoder_fidelity="hifi2",
        coarse_fidelity="",  # every coarse level at decoder_fidelity: the change below reaches all of them
    )
    hifi2 = _compare("tiny-vits-normal", config=base, readback=FLOAT32_READBACK)
    hifi4 = _compare("tiny-vits-normal", config=dataclasses.replace(base, attention_fidelity="hifi4"))
    assert hifi4["encoder_rms"] < 0.8 * hifi2["encoder_rms"]
    mlp_lofi = dataclasses.replace(base, mlp_fidelity="lofi", round_lofi_weights=False)
    assert _compare("tiny-vits-normal", config=mlp_lofi)["cls_token"] > 2 * hifi2["cls_token"]
    decoder_lofi = dataclasses.replace(base, decoder_fidelity="lofi", round_lofi_weights=False)
    decoder = _compare("tiny-vits-normal", config=decoder_lofi, readback=FLOAT32_READBACK)
    assert decoder["normal_deg_p99"] > 1.5 * hifi2["normal_deg_p99"]


def test_lofi_weights_are_rounded_to_what_lofi_reads():
    """A matmul at LoFi reads 5 significant bits of its weights and cuts the rest toward zero; the graph uploads
    those weights rounded to nearest at 5 bits (`GraphConfig.round_lofi_weights`), which the cut leaves as they
    are: an unbiased error half as large. Checked on the uploaded weights, and on the class token (the ViT output
    the MLP's error reaches most): at most 0.7x the error of the cut weights (observed about 0.5x)."""
    prepared = _prepared("tiny-vits-normal")
    lofi = _fast(mlp_fidelity="lofi", attention_fidelity="hifi2", round_lofi_weights=True)
    graph = _graph(prepared, config=lofi)
    ffn = graph.encoder.blocks[0].w["ffn_in.w"].data
    assert torch.equal(truncate_bits(ffn, 5), ffn), "LoFi weights not on LoFi's 5 significant bits"
    assert not torch.equal(ffn, round_bf16(torch.from_numpy(prepared.arrays["blocks.0.ffn_in.w"]).float()))
    qkv = graph.encoder.blocks[0].w["qkv.w"].data  # HiFi2: as they are (bfloat16)
    assert torch.equal(qkv, round_bf16(torch.from_numpy(prepared.arrays["blocks.0.qkv.w"]).float()))
    rounded = _compare("tiny-vits-normal", config=lofi)
    cut = _compare("tiny-vits-normal", config=dataclasses.replace(lofi, round_lofi_weights=False))
    assert rounded["cls_token"] < 0.7 * cut["cls_token"], (rounded, cut)


def test_decoder_conv_weights_are_rounded_where_their_level_runs_at_lofi():
    """The decoder's convs (3x3, conv transposes, the 1x1 convs and level-0 upsample matmuls) at LoFi get their
    weights rounded to LoFi's 5 bits like the ViT's matmuls; the finest level, at `finest_fidelity`, keeps its
    weights as they are. On the conv weights the first forward prepares, and on the outputs: rounded weights give
    a smaller error than cut ones over the whole map (the points' correlation with the reference and the normals'
    99th-percentile angle, which the decoder's error reaches). Not the largest error of one pixel: that is one
    value, and it went either way across seeds and CPUs (an AMX Xeon: points 2.09e-4 rounded, 1.96e-4 cut, at the
    seed that a Zen 3 EPYC had the other way round), while the aggregate favoured rounding at every seed tried."""
    prepared = _prepared("tiny-vits-normal")
    lofi = _fast(decoder_fidelity="lofi", finest_fidelity="hifi4", coarse_fidelity="")  # every coarse level at LoFi
    graph = _graph(prepared, config=lofi, prepare_convs=True)
    plan = prepared.plan
    coarse = graph.neck.conv["res.1.0.conv1"].weight.data
    assert torch.equal(truncate_bits(coarse, 5), coarse), "a LoFi level's conv weights not on LoFi's 5 bits"
    assert torch.equal(truncate_bits(graph.neck.w["up0.w"].data, 5), graph.neck.w["up0.w"].data)
    finest_level = next(i for i, lv in enumerate(plan["levels"]) if lv["height"] == plan["finest"]["in_height"])
    finest = graph.neck.conv[f"res.{finest_level}.0.conv1"].weight.data
    assert not torch.equal(truncate_bits(finest, 5), finest), "the finest level's weights were rounded too"
    rounded = _compare("tiny-vits-normal", config=lofi)
    cut = _compare("tiny-vits-normal", config=dataclasses.replace(lofi, round_lofi_weights=False))
    assert 1 - rounded["pcc_points"] < 1 - cut["pcc_points"], (rounded, cut)
    assert rounded["normal_deg_p99"] < cut["normal_deg_p99"], (rounded, cut)


@pytest.mark.parametrize("grid", [(13, 10), (12, 10), (11, 10)])
def test_the_graph_plans_from_the_grid_the_device_reports(grid):
    """Matmul program configs, SDPA's grid and chunks and the decoder's level sharding all come from
    `compute_with_storage_grid_size()`: on a smaller grid no config asks for a column it lacks, and the forward
    is the same."""
    prepared = _prepared("tiny-vits-normal")
    emulator = TtnnEmulator()
    graph = TtnnGraph(emulator, EmulatedDevice(grid), prepared, config="fast")
    assert graph.grid == grid and graph.num_cores == grid[0] * grid[1]
    for name, pc in graph.program_configs().items():
        size = pc.compute_with_storage_grid_size
        assert size.x <= grid[0] and size.y <= grid[1], name
    sdpa_grid = graph.encoder.blocks[0].sdpa_config.compute_with_storage_grid_size
    assert (sdpa_grid.x, sdpa_grid.y) == grid
    graph.load(prepare_convs=False)
    fin = prepared.plan["finest"]
    _, shard_rows = graph.convs.sharding(fin["in_height"], fin["in_width"])
    assert _cdiv(fin["in_height"] * fin["in_width"], shard_rows) <= graph.num_cores
    image = calibration_image(*SMALL, seed=6)
    raw, _, cls_token = _run(graph, prepared, image)
    full = _graph(prepared, config="fast")  # the emulator's default device: 13x10
    raw_full, _, cls_full = _run(full, prepared, image)
    assert np.array_equal(cls_token, cls_full)
    for key, value in raw_full.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(raw[key], value), key


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("grid,per_core,q_tiles", [((13, 10), 8, 4), ((12, 10), 9, 3), ((11, 10), 10, 5)])
def test_sdpa_chunks_leave_the_busiest_core_the_least_work(grid, per_core, q_tiles):
    """ttnn's SDPA gives each of ViT-L's 16 heads grid // 16 cores and ceil(chunks / cores) query chunks to each:
    the fast graph's chunks give the busiest core as few query tiles as that split allows (58 tiles: 8 a core at
    13x10, 9 at 12x10, 10 at 11x10; fixed 256-token chunks give 12x10 and 11x10 16), and its key chunks cover the
    58 key tiles without padding in two chunks of 29 (one rescale), in chunk pairs whose score block fits the
    kernel's buffers. With q, k, v in DRAM (a large token budget) each core reads the keys once: one query chunk a
    core, key chunks the most even split under the score block."""
    import types

    from tt_moge.runners.ttnn.graph import SDPA_SCORE_TILES
    from tt_moge.runners.ttnn.vit_block import sdpa_chunks

    cores = grid[0] * grid[1]
    fake = types.SimpleNamespace(config=CONFIGS["fast"], num_cores=cores, encoder_in_l1=True)
    q_chunk, k_chunk = sdpa_chunks(fake, 1825, 16)
    tiles, per_head = _cdiv(1825, 32), cores // 16
    assert q_chunk % 32 == 0 and k_chunk % 32 == 0
    assert (q_chunk // 32, k_chunk // 32) == (q_tiles, 29)
    assert _cdiv(_cdiv(tiles, q_tiles), per_head) * q_tiles == per_core
    assert q_tiles * 29 <= SDPA_SCORE_TILES
    dram = types.SimpleNamespace(config=CONFIGS["fast"], num_cores=cores, encoder_in_l1=False)
    q_chunk, k_chunk = sdpa_chunks(dram, 1825, 16)
    assert q_chunk // 32 == per_core and _cdiv(tiles, q_chunk // 32) <= per_head  # one pass over the keys a core
    assert (q_chunk // 32) * (k_chunk // 32) <= SDPA_SCORE_TILES and k_chunk == 480
    safe = types.SimpleNamespace(config=CONFIGS["safe"], num_cores=cores, encoder_in_l1=False)
    assert sdpa_chunks(safe, 1825, 16) == (256, 256)


# Observed (this network and ViT-L) and what a bfloat16 stream would save: docs/performance.md.
def test_float32_residual_stream_still_pays():
    """The residual-format decision (graph.py's docstring), measured where the fast graph's lower fidelities
    could have hidden it: the same graph with a bfloat16 residual stream has a larger ViT output error (the
    averaged metric; single maxima such as the class token's move either way at this size). With every op at
    HiFi4 (the safe graph) the difference is large."""
    fp32 = _compare("tiny-vits-normal", "bf16")
    bf16 = _compare("tiny-vits-normal", Formats(residual="bfloat16"))
    assert bf16["encoder_rms"] > 1.05 * fp32["encoder_rms"], (bf16, fp32)
    safe_fp32 = _compare("tiny-vits-normal", "bf16", config="safe")
    safe_bf16 = _compare("tiny-vits-normal", Formats(residual="bfloat16"), config="safe")
    assert safe_bf16["encoder_rms"] > 1.3 * safe_fp32["encoder_rms"], (safe_bf16, safe_fp32)


# ------------------------------------------------------------------------------------------- per module


def _block_input(net, plan: dict, image: torch.Tensor) -> torch.Tensor:
    """The ViT's input tokens in the device order ([patches, class token, registers]), (1, seq_len, C), on the token
    grid of `plan` (a prepared network's, or `prepare.shapes`)."""
    vit = net.encoder.backbone
    rows, cols = plan["rows"], plan["cols"]
    with torch.inference_mode():
        x = F.interpolate(image, (rows * 14, cols * 14), mode="bilinear", align_corners=False, antialias=True)
        x = (x - net.encoder.image_mean) / net.encoder.image_std
        tokens = vit.patch_embed(x) + vit.position_embedding(rows, cols)[:, 1:]
        prefix = [vit.cls_token + vit.position_embedding(rows, cols)[:, :1]]
        if vit.register_tokens is not None:
            prefix.append(vit.register_tokens)
        return torch.cat([tokens] + prefix, dim=1)


@pytest.mark.parametrize("exact,min_pcc", [(True, 0.999999), (False, 0.9995)])
def test_vit_block_pcc(exact, min_pcc):
    """One DINOv2 block (layer norms, qkv, head split, SDPA, LayerScale-folded projections, GELU MLP) against the
    reference `Block` on the same tokens (attention is indifferent to the token order). Compared: the block's
    update (output - input), which a broken block changes visibly; the output itself is mostly its input. In the
    device formats the fast graph's LoFi projections put the update's PCC at 0.99974 (0.9999 at HiFi2)."""
    net, prepared = _network("tiny-vits-normal"), _prepared("tiny-vits-normal")
    x = _block_input(net, prepared.plan, calibration_image(*SMALL, seed=3))
    graph = _graph(prepared, exact=exact)
    emulator = graph.ttnn
    for i in (0, 2):
        with torch.inference_mode():
            ref = net.encoder.backbone.blocks[i](x)[0].numpy()
        dev = emulator.Tensor(x.numpy()[None], emulator.float32, graph.device, emulator.TILE_LAYOUT)
        out = graph.to_host(graph.encoder.blocks[i].forward(dev), tuple(ref.shape))
        x0 = x[0].numpy()
        assert _pcc(out - x0, ref - x0) >= min_pcc, (i, _pcc(out - x0, ref - x0))
        if exact:
            assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref - x0).max()


@pytest.mark.parametrize("exact,min_pcc", [(True, 0.99999), (False, 0.9995)])
def test_encoder_pcc(exact, min_pcc):
    """Patch matmul + token table, the blocks, the taps' norms and projections -> the neck's level-0 input and the
    class token, against the reference encoder and level-0 conv. In the device formats the fast graph's LoFi
    projections put the class token's PCC at 0.99972 (0.9999 at HiFi2)."""
    net, prepared = _network("tiny-vits-normal"), _prepared("tiny-vits-normal")
    image = calibration_image(*SMALL, seed=4)
    graph = _graph(prepared, exact=exact)
    plan = prepared.plan
    level0, cls_token = graph.encode(graph.upload(host_input(plan, image.numpy())))
    level0_ref, cls_ref = _encoder_reference(net, image, plan)
    assert _pcc(graph.to_host(level0, level0_ref.shape), level0_ref) >= min_pcc
    assert _pcc(graph.to_host(cls_token, cls_ref.shape), cls_ref) >= min_pcc


@pytest.mark.parametrize("exact,min_pcc", [(True, 0.99999), (False, 0.9999)])
def test_decoder_pcc(exact, min_pcc):
    """The conv decoder from the reference's level-0 input to the finest maps (before the resize to the canvas
    and the activations), against the reference neck and heads."""
    net, prepared = _network("tiny-vits-normal"), _prepared("tiny-vits-normal")
    plan = prepared.plan
    image = calibration_image(*SMALL, seed=5)
    rows, cols = plan["rows"], plan["cols"]
    with torch.inference_mode():
        features, _ = net.encoder(image, rows, cols)
        uv = net.uv_planes(rows, cols, SMALL[0] / SMALL[1], torch.float32, None)
        neck_out = net.neck([torch.cat([features, uv[0]], dim=1)] + uv[1:])
        ref = torch.cat([getattr(net, h["name"] + "_head")(neck_out, last_only=True)[-1] for h in plan["heads"]], 1)[0]
    level0_ref, _ = _encoder_reference(net, image, plan)
    graph = _graph(prepared, exact=exact)
    emulator = graph.ttnn
    level0 = emulator.Tensor(level0_ref[None, None], emulator.bfloat16, graph.device, emulator.TILE_LAYOUT)
    fin = plan["finest"]
    phases = graph.to_host(graph.decode(level0), (fin["in_height"] * fin["in_width"], fin["phase_channels"]))
    ours = depth_to_space(phases, fin["in_height"], fin["in_width"]) + prepared.arrays["finest.const"]
    ref = ref.numpy()
    assert ours.shape == ref.shape
    assert _pcc(ours, ref) >= min_pcc, _pcc(ours, ref)
    for c in range(ref.shape[0]):  # every channel, not just the overall correlation
        assert _pcc(ours[c], ref[c]) >= min_pcc, (c, _pcc(ours[c], ref[c]))


# -------------------------------------------------------------------------------- the checks have teeth


def _break(graph: TtnnGraph, bug: str) -> None:
    """Inject a plausible lowering bug into a loaded graph."""
    T, plan, blocks = graph.ttnn, graph.plan, graph.encoder.blocks
    if bug == "head_split":  # qkv split into the wrong number of heads
        for block in blocks:
            block.num_heads //= 2
    elif bug == "transposed_weight":  # a square weight uploaded in torch's (out, in) layout
        a = graph.prepared.arrays["blocks.1.attn_out.w"]
        blocks[1].w["attn_out.w"] = graph.ctx.tensor(a.T, graph.formats.vit_weights)
    elif bug == "zero_padding":  # ttnn's default conv padding instead of MoGe's replicate padding
        make = graph.convs.conv_config

        def zeros(*args, **kwargs):
            config = make(*args, **kwargs)
            config.padding_mode = T.PaddingMode.Zeros
            return config

        graph.convs.conv_config = zeros
    elif bug == "phase_order":  # row and column phases swapped in the finest fold
        for name in ["neck"] + [h["name"] for h in plan["heads"]]:
            k = graph.prepared.arrays[f"finest.{name}.w"]
            n = k.shape[0] // 4
            swapped = np.concatenate([k[:n], k[2 * n : 3 * n], k[n : 2 * n], k[3 * n :]])
            graph.finest[name].conv = Conv(swapped)
    elif bug == "class_row":  # the class token read from the first row (the usual prefix-first order)
        slice_ = T.slice

        def first_row(t, starts, ends, *args, **kwargs):
            if ends[2] - starts[2] == 1:
                starts, ends = (0, 0, 0, 0), (1, 1, 1, ends[3])
            return slice_(t, starts, ends, *args, **kwargs)

        T.slice = first_row
    elif bug == "no_gelu":
        for pc in graph.program_configs().values():
            if getattr(pc, "fused_activation", None) is not None:
                pc.fused_activation = None
    elif bug == "double_scale":  # the attention scale applied again though it is folded into q
        sdpa = T.transformer.scaled_dot_product_attention
        T.transformer.scaled_dot_product_attention = lambda *a, **k: sdpa(*a, **{**k, "scale": None})
    else:
        raise ValueError(bug)


@pytest.mark.parametrize(
    "bug", ["head_split", "transposed_weight", "zero_padding", "phase_order", "class_row", "no_gelu", "double_scale"]
)
def test_checks_catch_broken_lowerings(bug):
    """Each plausible lowering bug breaks the exact comparison (so the tests above would catch it)."""
    prepared = _prepared("tiny-vits-normal")
    prepared = Prepared(copy.deepcopy(prepared.plan), prepared.arrays)  # a bug may edit the plan
    graph = _graph(prepared, exact=True)
    _break(graph, bug)
    with pytest.raises(AssertionError):
        _check_exact(_compare("tiny-vits-normal", graph=graph))


@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_persistent_input_buffer_gives_the_same_forward(dtype):
    """upload(canvas, into=allocate_input(dtype)) (the path a trace uses) feeds the forward as a fresh upload does,
    for both canvas dtypes (a photo's uint8 planes, a float canvas)."""
    prepared = _prepared("tiny-vits-normal")
    graph = _graph(prepared, exact=True)
    pre = DeviceInput(graph.ttnn, graph.device, prepared, graph.formats.activations)
    pre.load()
    canvas = calibration_image(*SMALL, seed=2).numpy()
    if dtype == "uint8":
        canvas = np.rint(canvas * 255).astype(np.uint8)
    buffer = pre.allocate_input(dtype)
    fresh = graph.read(graph.forward(pre.forward(pre.upload(canvas))))
    reused = graph.read(graph.forward(pre.forward(pre.upload(canvas, into=buffer))))
    assert pre.upload(canvas, into=buffer) is buffer
    for key in fresh:
        assert np.array_equal(fresh[key], reused[key]), key


# ------------------------------------------------------------------------------------ preparation, host


def test_prepare_refuses_structures_the_graph_does_not_run():
    with pytest.raises(ValueError, match="norms"):
        prepare_weights(make_network("tiny-norms", well_posed=False), SMALL, SMALL_TOKENS)


def test_prepared_round_trips_through_npz(tmp_path):
    prepared = _prepared("tiny-vits-normal")
    path = tmp_path / "graph.npz"
    prepared.save(path)
    loaded = Prepared.load(path)
    assert loaded.plan == prepared.plan
    assert sorted(loaded.arrays) == sorted(prepared.arrays)
    for k, v in prepared.arrays.items():
        assert loaded.arrays[k].dtype == np.float32 and np.array_equal(loaded.arrays[k], v), k


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_phase_fold_equals_upsample_then_conv(mode):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 7, 9, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 5, 3, 3, generator=gen, dtype=torch.float64)
    up = F.interpolate(x, scale_factor=2, mode=mode, **({"align_corners": False} if mode == "bilinear" else {}))
    ref = F.conv2d(F.pad(up, (1, 1, 1, 1), mode="replicate"), w)[0].numpy()
    low = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), torch.from_numpy(phase_fold(w.numpy(), mode)).double())
    ours = depth_to_space(low[0].permute(1, 2, 0).reshape(7 * 9, 16).numpy(), 7, 9)
    assert np.abs(ours - ref).max() < 1e-5 * np.abs(ref).max()


def test_host_resizes_match_pytorch():
    gen = torch.Generator().manual_seed(1)
    image = torch.rand(1, 3, 270, 480, generator=gen)
    for size in ((112, 196), (300, 500)):
        ref = F.interpolate(image, size, mode="bilinear", align_corners=False, antialias=True)[0].numpy()
        assert np.abs(resize_antialiased(image[0].numpy(), *size) - ref).max() < 1e-5
    maps = torch.randn(1, 7, 32, 57, generator=gen)
    ref = F.interpolate(maps, (135, 240), mode="bilinear", align_corners=False)[0].numpy()
    assert np.abs(resize_bilinear(maps[0].numpy(), 135, 240) - ref).max() < 1e-4


def test_host_input_accepts_the_canvas_or_the_token_grid_image():
    plan = _prepared("tiny-vits-normal").plan
    canvas = calibration_image(*SMALL, seed=1)
    size = (plan["rows"] * plan["patch"], plan["cols"] * plan["patch"])
    resized = F.interpolate(canvas, size, mode="bilinear", align_corners=False, antialias=True)
    a = host_input(plan, canvas.numpy())
    b = host_input(plan, resized[0].permute(1, 2, 0).numpy())  # HWC at the token grid
    assert a.shape == (plan["seq_len"], plan["patch_k_padded"])
    assert np.abs(a - b).max() < 1e-5
    assert not a[plan["grid_tokens"] :].any() and not a[:, plan["patch_k"] :].any()
    with pytest.raises(ValueError, match="canvas"):
        host_input(plan, np.zeros((100, 100, 3), np.float32))


def test_emulator_formats_match_ttnn_host_conversions():
    """bfloat16: round to nearest even. bfloat8_b: values ttnn 0.81.1's own host conversion produced (blocks of
    16 along the last dim, shared exponent, 7-bit magnitudes, ties to even, clipped at 127)."""
    x = torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8])
    assert round_bf16(x).tolist() == [1.0, 1.0, 1.0 + 2**-6, -1.0]
    cases = [
        ([100, 0.5, 2.5, 1.5, 3.5, -0.5, -2.5, 0.49], [100, 0, 2, 2, 4, 0, -2, 0]),
        ([127.6, 1.0, 0.5, 127.4], [127, 1, 0, 127]),
        ([127.5, 126.5, 125.5, 3.0], [127, 126, 126, 3]),
        ([3.0, 1.0 + 3 * 2**-8, -1.99, 0.02, 0.01], [3.0, 1.0, -2.0, 0.03125, 0.0]),
    ]
    for values, expected in cases:
        row = torch.zeros(32)
        row[: len(values)] = torch.tensor(values)
        row[16 : 16 + len(values)] = torch.tensor(values) / 64  # the second block has its own exponent
        out = round_bfp8(row[None])[0]
        assert out[: len(values)].tolist() == expected, (values, out[: len(values)].tolist())
        assert (out[16 : 16 + len(values)] * 64).tolist() == expected


# ------------------------------------------------------------------------------------------- full size


# The CPU bfloat16 graph's limits with the depth bound after the full pipeline (1e-3) and the full-size mask
# probability limit of the CPU graph (0.06); the class token's is DEVICE_LIMITS' 0.02, the bound it had before the
# fast graph's LoFi MLP took ViT-L's to 0.0495 and the limit was moved to 0.06 after that was seen (issue 47 puts it
# back: `test_full_size_vitl_class_token`, not met). Observed: docs/performance.md.
FULL_SIZE_LIMITS = {**DEVICE_LIMITS, "mask_prob": 0.06, "depth": 1e-3}
# The spec case on weights with DINOv2's massive activations planted (`testing.add_residual_outliers`) runs when this
# is "1": another full-size emulation, which the suite's time budget does not take (its figures: docs/performance.md).
OUTLIERS_FULL_SIZE = environment.get("MOGE_TEST_OUTLIERS_FULL_SIZE") == "1"


_FULL_SIZE_WEIGHTS = [
    "random",
    pytest.param(
        "outliers",
        marks=pytest.mark.skipif(not OUTLIERS_FULL_SIZE, reason="set MOGE_TEST_OUTLIERS_FULL_SIZE=1 to run it"),
    ),
]
_FULL_SIZE: dict = {}


def _full_size(weights: str) -> dict:
    """The errors of ViT-L at the spec case (1920x1080, 1800 tokens: 32x57 grid, 1825 tokens, 24 blocks, 512x912
    finest level), the fast graph in bf16, on random weights or with DINOv2's massive activations planted; one
    emulation per weights for the tests below."""
    if weights not in _FULL_SIZE:
        preset = "vitl-normal" + ("+outliers" if weights == "outliers" else "")
        _FULL_SIZE[weights] = _compare(preset, "bf16", canvas=(1920, 1080), tokens=1800)
    return _FULL_SIZE[weights]


@pytest.mark.full_size
@pytest.mark.parametrize("weights", _FULL_SIZE_WEIGHTS)
def test_full_size_vitl_in_device_formats(weights):
    """ViT-L at the spec case within the limits (the class token's below)."""
    limits = {k: v for k, v in FULL_SIZE_LIMITS.items() if k != "cls_token"}
    _check(_full_size(weights), limits, min_pcc=0.999)


@pytest.mark.full_size
@pytest.mark.parametrize("weights", _FULL_SIZE_WEIGHTS)
def test_full_size_vitl_class_token(weights, request):
    """ViT-L's class token within 0.02 (its outlier channels, if planted, held to it apart). Not met by the fast graph:
    0.0503 on random weights (0.036 with the MLP at HiFi2, +1.74 ms), 0.0372 on planted ones (their planted channels
    0.0016): a known failure, strict (it fails the day it passes), not traded against issue 27's 15 ms forward and
    issue 46's 60 images/s here (docs/tenstorrent.md)."""
    request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 47, item 2"))
    err = _full_size(weights)
    _check(err, {"cls_token": FULL_SIZE_LIMITS["cls_token"]})
    assert err.get("cls_token_outliers", 0.0) <= FULL_SIZE_LIMITS["cls_token"], err


# ------------------------------------------------------------------------------------------ the study


def _fast(**change) -> GraphConfig:
    return dataclasses.replace(CONFIGS["fast"], **change)


# name -> (formats, config) of the accuracy study (docs/tenstorrent.md)
_STUDY = {
    "safe": ("bf16", "safe"),
    "safe-bfp8-vit": ("bfp8-vit", "safe"),
    "fast": ("bf16", "fast"),
    "fast-bfp8-vit": ("bfp8-vit", "fast"),
    "fast-res16": (Formats(residual="bfloat16"), "fast"),
    "fast-exact-exp": ("bf16", _fast(sdpa_exp_approx=False)),
    "fast-sdpa-hifi4": ("bf16", _fast(sdpa_fidelity="hifi4")),
    "fast-attention-hifi4": ("bf16", _fast(attention_fidelity="hifi4")),
    "fast-decoder-hifi4": ("bf16", _fast(decoder_fidelity="hifi4")),
    "fast-decoder-hifi2": ("bf16", _fast(decoder_fidelity="hifi2")),
    "fast-sdpa-hifi2": ("bf16", _fast(sdpa_fidelity="hifi2")),
    "fast-decoder-sdpa-hifi2": ("bf16", _fast(decoder_fidelity="hifi2", sdpa_fidelity="hifi2")),
    "fast-finest-hifi2": ("bf16", _fast(finest_fidelity="hifi2")),
    "fast-norm-hifi2": ("bf16", _fast(norm_fidelity="hifi2")),
    "fast-mlp-lofi": ("bf16", _fast(mlp_fidelity="lofi")),
    "fast-mlp-lofi-cut": ("bf16", _fast(mlp_fidelity="lofi", round_lofi_weights=False)),
    "fast-lofi": ("bf16", _fast(mlp_fidelity="lofi", attention_fidelity="lofi")),
    "fast-lofi-taps-hifi2": ("bf16", _fast(mlp_fidelity="lofi", attention_fidelity="lofi", tap_fidelity="hifi2")),
    "fast-lofi-cut": ("bf16", _fast(mlp_fidelity="lofi", attention_fidelity="lofi", round_lofi_weights=False)),
    "fast-bfp8-all-hifi2": ("bfp8-vit", _fast(sdpa_exp_approx=False, sdpa_fidelity="hifi2")),
    "fast-bfp8-decoder": ("bfp8-decoder", "fast"),
    "fast-bfp8-decoder-maps": (Formats(decoder_weights="bfloat8_b", decoder_activations="bfloat8_b"), "fast"),
    "fast-bfp8-all": ("bfp8", "fast"),
    "fast-bfp8-all-maps": (
        Formats(vit_weights="bfloat8_b", decoder_weights="bfloat8_b", decoder_activations="bfloat8_b"),
        "fast",
    ),
    "fast-bfp8-decoder-hifi4": ("bfp8-decoder", _fast(decoder_fidelity="hifi4")),
    "fast-bfp8-decoder-maps-hifi4": (
        Formats(decoder_weights="bfloat8_b", decoder_activations="bfloat8_b"),
        _fast(decoder_fidelity="hifi4"),
    ),
}


def main(argv=None) -> None:
    """The accuracy study behind the limits above: every metric, per variant (formats + graph config), on one
    network and canvas, in the fidelity-aware emulator.

        cd code && python -m tests.test_ttnn_lowering --preset vitl-normal --size 1920 1080 --tokens 1800
    """
    import argparse
    import time

    ap = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-vits-normal")
    ap.add_argument("--size", type=int, nargs=2, default=SMALL, metavar=("W", "H"))
    ap.add_argument("--tokens", type=int, default=SMALL_TOKENS)
    ap.add_argument(
        "--variants", default="exact,safe,fast", help=f"comma-separated: exact (float32 emulation) or {sorted(_STUDY)}"
    )
    ap.add_argument("--seed", type=int, default=6)
    args = ap.parse_args(argv)
    canvas = tuple(args.size)
    for name in args.variants.split(","):
        t = time.perf_counter()
        exact = name == "exact"
        formats, config = ("bf16", "safe") if exact else _STUDY[name]
        err = _compare(
            args.preset, formats, exact=exact, seed=args.seed, canvas=canvas, tokens=args.tokens, config=config
        )
        cells = ", ".join(f"{k} {v:.4g}" for k, v in err.items() if not k.startswith("pcc"))
        took = time.perf_counter() - t
        print(
            f"{args.preset} {canvas[0]}x{canvas[1]} {args.tokens} tokens, {name} ({took:.0f} s): {cells}",
            flush=True,
        )


if __name__ == "__main__":
    main()
