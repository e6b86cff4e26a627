"""Each part of the Tenstorrent device graph (`runners/ttnn/<part>.py`) against the matching `network/` module,
through the ttnn emulator (`tests/ttnn_emulator.py`), tt-metal style: one test per part, on a tiny random network
whose every weight matters (norm weights and biases, LayerScale and biases random, not DINOv2's ones and zeros).

* `patch_embed.py`: `patch_embed` against `network/vit.py`'s `PatchEmbed` + position embedding + prefix tokens.
* `vit_block.py`: `block` against `network/vit.py`'s `Block` (its update, output minus input).
* `encoder.py`: `encode` against `network/moge2.py`'s `DINOv2Encoder` and the neck's level-0 conv.
* `decoder.py`: one level of a conv stack (input 1x1 conv, residual blocks, the resampler to the next level)
  against `network/convstack.py`'s `ConvStack` modules of that level, for the neck and the heads, every level.
* `heads.py`: `head_levels` against a head's `ConvStack` levels, `finest_conv` against the last resampler and
  the finest level's 1x1 convs (the neck's through every head's input and output convs).

Each part is held to float32 round-off in the emulator's exact mode, and in the device formats (bfloat16
activations and weights, float32 residual stream, the fast graph's fidelities) to bounds a little above what
the emulator measures (observed values beside each limit); `test_part_checks_catch_broken_parts` breaks each
part on purpose (a dropped residual, two weights swapped, ...: 17 bugs) and sees its check fail.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tt_moge.runners.ttnn import Prepared, TtnnGraph, host_input, prepare_weights
from tt_moge.runners.ttnn.prepare import depth_to_space
from tt_moge.testing import calibration_image, make_network

from .test_ttnn_lowering import _block_input, _encoder_reference, _graph, _pcc

SMALL, TOKENS = (224, 126), 300

# (max |ours - ref| / max |ref|, min PCC). Exact: float32 round-off (the folds reassociate sums).
EXACT = (1e-5, 0.99999)
# Device formats, fast graph: bounds about 1.5-2x the errors the emulator measures on this network (observed
# max relative error, PCC beside each); a bfloat16 rounding is up to 2^-9 relative, LoFi reads 5 bits of a weight.
DEVICE = {
    "patch_embed": (0.02, 0.9999),  # 0.0095, 0.99995: bfloat16 patches and kernel, HiFi2
    "vit_block": (0.06, 0.9995),  # the update, worst of 4 blocks: 0.039, 0.99977 (LoFi projections, MLP, SDPA)
    "encoder": (0.04, 0.9995),  # level-0 map 0.017, 0.99993; class token 0.023, 0.99977
    "decoder": (0.045, 0.9995),  # worst level: 0.0268, 0.99979 (bfloat16 maps, LoFi convs, weights rounded to LoFi)
    "head_levels": (0.02, 0.99995),  # worst head: 0.0102, 0.99999
    "finest": (0.006, 0.99999),  # worst map: 0.0033, 0.999997 (bfloat16 input and weights, HiFi4, float32 out)
}


# ------------------------------------------------------------------------------------------ the network


@functools.lru_cache(maxsize=None)
def _network():
    """tiny-vits-normal with random weights everywhere (make_network gives the ViT's norms ones and zeros and
    LayerScale 0.1, under which a swap of two norms would go unseen)."""
    net = make_network("tiny-vits-normal", seed=11, well_posed=False)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in net.encoder.backbone.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gamma"):
                p.copy_(0.1 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return net


@functools.lru_cache(maxsize=None)
def _prepared() -> Prepared:
    return prepare_weights(_network(), SMALL, TOKENS)


_JUDGE = True  # False: main() measures without judging


def _limits(part: str, exact: bool) -> tuple:
    return EXACT if exact else DEVICE[part]


def _close(ours, ref, limits: tuple, what: str) -> tuple:
    """ours against ref within (max relative error, min PCC); both non-trivial. Returns (error, PCC)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    scale = np.abs(ref).max()
    assert scale > 0 and ref.std() > 1e-3 * scale, f"{what}: the reference is trivial"
    assert np.isfinite(ours).all() and ours.std() > 0, f"{what}: ours is constant or not finite"
    err, pcc = float(np.abs(ours - ref).max() / scale), _pcc(ours, ref)
    assert not _JUDGE or err <= limits[0] and pcc >= limits[1], (
        f"{what}: error {err:.3g}, PCC {pcc:.7f} beyond {limits}"
    )
    return err, pcc


def _device(graph: TtnnGraph, array, dtype: str = "bfloat16"):
    """(rows, C) numpy -> a (1, 1, rows, C) device tensor in tiles."""
    T = graph.ttnn
    return T.Tensor(np.asarray(array, np.float32)[None, None], getattr(T, dtype), graph.device, T.TILE_LAYOUT)


def _rows(t: torch.Tensor) -> np.ndarray:
    """(1, C, H, W) -> (H * W, C), the device's channels-last pixel rows."""
    return t[0].permute(1, 2, 0).reshape(-1, t.shape[1]).numpy()


def _map(shape: tuple, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ the checks


def _check_patch_embed(graph: TtnnGraph, exact: bool) -> tuple:
    """patch_embed.py: the patch matrix (the host reference of pre.py) -> the residual stream's first value,
    class and register rows after the patch rows, against PatchEmbed + position embedding + prefix tokens."""
    net, plan = _network(), graph.plan
    image = calibration_image(*SMALL, seed=3)
    out = graph.patch_embed(graph.upload(host_input(plan, image.numpy())))
    ref = _block_input(net, graph.prepared, image)[0].numpy()
    return _close(graph.to_host(out, ref.shape), ref, _limits("patch_embed", exact), "patch_embed")


def _check_vit_block(graph: TtnnGraph, exact: bool, i: int = 1) -> tuple:
    """vit_block.py: block i on the ViT's input tokens (device order) against `Block`; compared: the update
    (output - input), which is small beside the input."""
    net = _network()
    x = _block_input(net, graph.prepared, calibration_image(*SMALL, seed=4))
    with torch.inference_mode():
        ref = net.encoder.backbone.blocks[i](x)[0].numpy()
    x0 = x[0].numpy()
    out = graph.to_host(graph.block(_device(graph, x0, graph.formats.residual), i), ref.shape)
    return _close(out - x0, ref - x0, _limits("vit_block", exact), f"block {i}")


def _check_encoder(graph: TtnnGraph, exact: bool) -> tuple:
    """encoder.py: patch matrix -> the neck's level-0 input and the class token, against `DINOv2Encoder` and the
    neck's level-0 conv over features + uv."""
    net, plan = _network(), graph.plan
    image = calibration_image(*SMALL, seed=5)
    level0, cls_token = graph.encode(graph.upload(host_input(plan, image.numpy())))
    level0_ref, cls_ref = _encoder_reference(net, image, plan)
    limits = _limits("encoder", exact)
    cls = _close(graph.to_host(cls_token, cls_ref.shape), cls_ref, limits, "class token")
    return _close(graph.to_host(level0, level0_ref.shape), level0_ref, limits, "level-0 map"), cls


def _stack(key: str):
    return _network().neck if key == "neck" else getattr(_network(), key.split(".")[1] + "_head")


def _stack_plan(graph: TtnnGraph, key: str) -> dict:
    if key == "neck":
        return graph.plan["neck"]
    return next(h for h in graph.plan["heads"] if f"head.{h['name']}" == key)


def _check_decoder_level(graph: TtnnGraph, exact: bool, key: str, i: int) -> tuple:
    """decoder.py: level i of a conv stack, as `ConvStack.forward` runs it: the running map plus the input 1x1
    conv of the level's input (a head's levels from 1 on; level 0 of a head is its folded input conv + upsample),
    the residual blocks, then the resampler to level i + 1 (none at the finest fold's input level), against the
    stack's modules of that level, on random maps."""
    plan, stack = graph.plan, _stack(key)
    last = len(plan["levels"]) - 1
    level = plan["levels"][i]
    h, w = level["height"], level["width"]
    sp = _stack_plan(graph, key)
    dim = sp["dims"][i] if "dims" in sp else level["dim"]  # the stack's width at this level
    x = _map((1, dim, h, w), 20 + i)  # the running map (a head's level 0 has none: its input conv's output)
    inp = _map((1, level["dim"], h, w), 30 + i)  # the neck's output at this level, a head's input
    limits = _limits("decoder", exact)
    fold = i == 0 and graph.level0_folds.get(key)
    with torch.inference_mode():
        ref_in = x
        if sp["inputs"][i]:
            ref_in = stack.input_blocks[i](inp) if i == 0 else x + stack.input_blocks[i](inp)
        ref_y = stack.res_blocks[i](ref_in)
        ref_up = stack.resamplers[i](ref_y) if i < last - 1 else None
    if fold:  # the level-0 input conv inside the upsample's matmul
        up = graph._upsample0(_device(graph, _rows(inp)), key)
        return _close(graph.to_host(up, (up.shape[-2], up.shape[-1])), _rows(ref_up), limits, f"{key} up 0")
    y = _device(graph, _rows(x))
    if sp["inputs"][i]:
        feature = graph._one_by_one(_device(graph, _rows(inp)), f"{key}.in.{i}", i)
        y = feature if i == 0 else graph._add(y, feature)
    y, _ = graph._stack_level(y, key, sp, i, owned=False)
    result = None
    if len(stack.res_blocks[i]):
        result = _close(graph.to_host(y, (h * w, dim)), _rows(ref_y), limits, f"{key} level {i}")
    if ref_up is not None:
        up = graph._level_up(y, key, i)
        result = _close(graph.to_host(up, (4 * h * w, ref_up.shape[1])), _rows(ref_up), limits, f"{key} up {i}")
    assert result is not None, "nothing compared"
    return result


def _neck_outputs(seed: int) -> list:
    """The reference neck's outputs on an image: what the heads read."""
    net, plan = _network(), _prepared().plan
    rows, cols = plan["rows"], plan["cols"]
    image = calibration_image(*SMALL, seed=seed)
    with torch.inference_mode():
        features, _ = net.encoder(image, rows, cols)
        uv = net.uv_planes(rows, cols, SMALL[0] / SMALL[1], torch.float32, None)
        return net.neck([torch.cat([features, uv[0]], dim=1)] + uv[1:])


def _check_head_levels(graph: TtnnGraph, exact: bool, name: str) -> tuple:
    """heads.py `head_levels`: the neck's level outputs -> the head's map at the finest fold's input level,
    against the head's `ConvStack` levels 0 .. finest - 1 (input convs, residual blocks, resamplers)."""
    plan, stack = graph.plan, getattr(_network(), name + "_head")
    last = len(plan["levels"]) - 1
    neck_out = _neck_outputs(6)
    with torch.inference_mode():
        ref = None
        for i in range(last):
            feature = stack.input_blocks[i](neck_out[i])
            ref = feature if ref is None else ref + feature
            ref = stack.res_blocks[i](ref)
            if i < last - 1:
                ref = stack.resamplers[i](ref)
    head = next(h for h in plan["heads"] if h["name"] == name)
    out = graph.head_levels([_device(graph, _rows(t)) for t in neck_out[:last]], head)
    ref = _rows(ref)
    return _close(graph.to_host(out, ref.shape), ref, _limits("head_levels", exact), f"{name} head levels")


def _check_finest(graph: TtnnGraph, exact: bool, name: str) -> tuple:
    """heads.py `finest_conv`: the phase-folded conv of feature map `name` at the level before the finest,
    interleaved (depth_to_space), against what the network computes from that map at the finest level: the
    last resampler (2x upsample, 3x3 conv) and the 1x1 convs after it (for the neck: its output conv and every
    head's input and output convs), less the same at a zero map (the constant map, which post.py adds)."""
    net, plan = _network(), graph.plan
    fin, last = plan["finest"], len(plan["levels"]) - 1
    heads = [h["name"] for h in plan["heads"]]
    stack = net.neck if name == "neck" else getattr(net, name + "_head")
    x = _map((1, stack.resamplers[last - 1][-1].in_channels, fin["in_height"], fin["in_width"]), 40)

    def finest(t: torch.Tensor) -> torch.Tensor:
        parts = []
        for head in heads:
            hs = getattr(net, head + "_head")
            c = hs.output_blocks[last].out_channels
            if name == "neck":
                n = net.neck.output_blocks[last](net.neck.resamplers[last - 1](t))
                parts.append(hs.output_blocks[last](hs.input_blocks[last](n)))
            elif head == name:
                parts.append(hs.output_blocks[last](hs.resamplers[last - 1](t)))
            else:
                parts.append(torch.zeros(1, c, 2 * t.shape[2], 2 * t.shape[3]))
        return torch.cat(parts, dim=1)

    with torch.inference_mode():
        ref = (finest(x) - finest(torch.zeros_like(x)))[0].numpy()
    out = graph.finest_conv(_device(graph, _rows(x)), name)
    assert out.dtype == getattr(graph.ttnn, graph.formats.finest), f"{name}: finest maps in {out.dtype}"
    phases = graph.to_host(out, (x.shape[2] * x.shape[3], -1))
    ours = depth_to_space(phases, fin["in_height"], fin["in_width"])
    if name != "neck":  # a head's kernel is zero outside its own channels: compare those, and the zeros apart
        own = [h["name"] == name for h in plan["heads"] for _ in range(h["channels"])]
        assert not ours[[not o for o in own]].any(), f"{name}: output outside its own channels"
        ours, ref = ours[own], ref[own]
    return _close(ours, ref, _limits("finest", exact), f"{name} finest conv")


# ------------------------------------------------------------------------------------------ the tests

_HEADS = ["points", "normal", "mask"]
_LEVELS = [("neck", 0), ("neck", 1), ("neck", 2), ("neck", 3), ("head.points", 0), ("head.normal", 1)]
_LEVELS += [("head.mask", 2), ("head.points", 3)]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_patch_embed(exact):
    _check_patch_embed(_graph(_prepared(), exact=exact), exact)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_vit_block(exact):
    graph = _graph(_prepared(), exact=exact)
    for i in range(graph.plan["blocks"]):
        _check_vit_block(graph, exact, i)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_encoder(exact):
    _check_encoder(_graph(_prepared(), exact=exact), exact)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("key,level", _LEVELS)
def test_decoder_level(key, level, exact):
    _check_decoder_level(_graph(_prepared(), exact=exact), exact, key, level)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_head_levels(exact):
    graph = _graph(_prepared(), exact=exact)
    for name in _HEADS:
        _check_head_levels(graph, exact, name)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("name", ["neck"] + _HEADS)
def test_finest_conv(name, exact):
    _check_finest(_graph(_prepared(), exact=exact), exact, name)


def test_parts_in_the_safe_graph():
    """The safe graph's placements (DRAM, 1x1 convs as matmuls everywhere, conv_transpose2d at level 0) run the
    same parts: each exact."""
    graph = _graph(_prepared(), exact=True, config="safe")
    _check_patch_embed(graph, True)
    _check_vit_block(graph, True)
    for key, level in [("neck", 0), ("neck", 1), ("head.normal", 1)]:
        _check_decoder_level(graph, True, key, level)
    _check_head_levels(graph, True, "points")
    _check_finest(graph, True, "neck")


# ------------------------------------------------------------------------------------- the checks have teeth


def _replace_conv(graph: TtnnGraph, key: str, weight: np.ndarray, bias=None) -> None:
    T = graph.ttnn
    as_host = functools.partial(graph._tensor, device=False, layout=T.ROW_MAJOR_LAYOUT)
    graph.convs[key] = (as_host(weight, "float32"), None if bias is None else as_host(bias, "float32", (1, 1, 1, -1)))


def _drop_residual(graph: TtnnGraph) -> None:
    """Every add returns its second operand (0 + b): the residual of a block or a level dropped."""
    T = graph.ttnn
    add = T.add
    T.add = lambda a, b, **kw: add(T.subtract(a, a), b, **kw)


def _break(graph: TtnnGraph, bug: str) -> None:
    a, w, T = graph.prepared.arrays, graph.w, graph.ttnn
    if bug == "no_table":  # the position embedding and prefix tokens left out
        w["token_table"] = graph._tensor(0 * a["token_table"], "float32", (1, 1) + a["token_table"].shape)
    elif bug == "swapped_colours":  # the patch kernel's red and blue rows swapped
        k = a["patch.w"].copy()
        pp = graph.plan["patch"] ** 2
        k[:pp], k[2 * pp : 3 * pp] = a["patch.w"][2 * pp : 3 * pp], a["patch.w"][:pp]
        w["patch.w"] = graph._tensor(k, graph.formats.decoder_weights)
    elif bug == "no_residual":
        _drop_residual(graph)
    elif bug == "swapped_norms":  # norm1's weight where norm2's goes, and back
        w["blocks.1.norm1.w"], w["blocks.1.norm2.w"] = w["blocks.1.norm2.w"], w["blocks.1.norm1.w"]
    elif bug == "transposed_attn_out":
        w["blocks.1.attn_out.w"] = graph._tensor(a["blocks.1.attn_out.w"].T, graph.formats.vit_weights)
    elif bug == "swapped_taps":  # the first two taps' projections swapped
        w["neck_in0.0.w"], w["neck_in0.1.w"] = w["neck_in0.1.w"], w["neck_in0.0.w"]
    elif bug == "swapped_convs":  # a residual block's two convs swapped (square in this network)
        graph.convs["neck.res.1.0.conv1"], graph.convs["neck.res.1.0.conv2"] = (
            graph.convs["neck.res.1.0.conv2"],
            graph.convs["neck.res.1.0.conv1"],
        )
    elif bug == "shuffled_phases":  # the level-0 upsample's output phases (a, b) as (b, a)
        c = w["neck.up0.w"].shape[-1] // 4
        order = np.r_[0:c, 2 * c : 3 * c, c : 2 * c, 3 * c : 4 * c]
        weight = a["neck.up.0.convt.w"].transpose(0, 2, 3, 1).reshape(-1, 4 * c)[:, order]
        w["neck.up0.w"] = graph._tensor(weight, graph.formats.decoder_weights)
    elif bug == "zero_padding":  # ttnn's default conv padding instead of MoGe's replicate padding
        make = graph._conv_config

        def zeros(*args, **kwargs):
            config = make(*args, **kwargs)
            config.padding_mode = T.PaddingMode.Zeros
            return config

        graph._conv_config = zeros
    elif bug == "transposed_input_conv":  # a head's level-1 input 1x1 conv (square here) transposed
        key = "head.normal.in.1"
        _replace_conv(graph, key, a[key + ".w"][:, :, None, None], a[key + ".b"])
    elif bug == "flipped_convt":  # a conv transpose's 2x2 kernel flipped
        key = "head.mask.up.2.convt"
        _replace_conv(graph, key, a[key + ".w"][:, :, ::-1, ::-1], a[key + ".b"])
    elif bug == "bfloat16_finest":  # the finest conv's output stored in bfloat16, not the finest format
        conv = graph._conv

        def narrow(x, key, *args, **kwargs):
            if key.startswith("finest."):
                kwargs["out_dtype"] = "bfloat16"
            return conv(x, key, *args, **kwargs)

        graph._conv = narrow
    elif bug == "phase_order":  # row and column phases swapped in the finest fold
        for name in ["neck"] + _HEADS:
            k = a[f"finest.{name}.w"]
            n = k.shape[0] // 4
            _replace_conv(graph, f"finest.{name}", np.concatenate([k[:n], k[2 * n : 3 * n], k[n : 2 * n], k[3 * n :]]))
    else:
        raise ValueError(bug)


_BROKEN = [
    ("patch_embed", "no_table", lambda g, e: _check_patch_embed(g, e)),
    ("patch_embed", "swapped_colours", lambda g, e: _check_patch_embed(g, e)),
    ("vit_block", "no_residual", lambda g, e: _check_vit_block(g, e)),
    ("vit_block", "swapped_norms", lambda g, e: _check_vit_block(g, e)),
    ("vit_block", "transposed_attn_out", lambda g, e: _check_vit_block(g, e)),
    ("encoder", "swapped_taps", lambda g, e: _check_encoder(g, e)),
    ("decoder", "no_residual", lambda g, e: _check_decoder_level(g, e, "neck", 1)),
    ("decoder", "swapped_convs", lambda g, e: _check_decoder_level(g, e, "neck", 1)),
    ("decoder", "shuffled_phases", lambda g, e: _check_decoder_level(g, e, "neck", 0)),
    ("decoder", "zero_padding", lambda g, e: _check_decoder_level(g, e, "neck", 2)),
    ("decoder", "transposed_input_conv", lambda g, e: _check_decoder_level(g, e, "head.normal", 1)),
    ("decoder", "flipped_convt", lambda g, e: _check_decoder_level(g, e, "head.mask", 2)),
    ("head_levels", "no_residual", lambda g, e: _check_head_levels(g, e, "points")),
    ("head_levels", "transposed_input_conv", lambda g, e: _check_head_levels(g, e, "normal")),
    ("finest", "phase_order", lambda g, e: _check_finest(g, e, "neck")),
    ("finest", "zero_padding", lambda g, e: _check_finest(g, e, "mask")),
    ("finest", "bfloat16_finest", lambda g, e: _check_finest(g, e, "normal")),
]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("part,bug,check", _BROKEN, ids=[f"{p}-{b}" for p, b, _ in _BROKEN])
def test_part_checks_catch_broken_parts(part, bug, check, exact):
    """Each part's check, which passes on the graph as it is (the tests above), fails on that part broken, in
    float32 emulation and within the device formats' looser bounds."""
    graph = _graph(_prepared(), exact=exact)
    _break(graph, bug)
    with pytest.raises(AssertionError, match="beyond|finest maps in"):
        check(graph, exact)


def main() -> None:
    """Each part's error and PCC against its reference, in float32 emulation and in the device formats (the
    observed values behind `DEVICE`): cd code && python -m tests.test_ttnn_parts"""
    global _JUDGE
    _JUDGE = False
    for exact in (True, False):
        mode, fresh = "exact" if exact else "device", lambda: _graph(_prepared(), exact=exact)
        rows = [("patch_embed", _check_patch_embed(fresh(), exact))]
        graph = fresh()
        rows += [(f"block {i}", _check_vit_block(graph, exact, i)) for i in range(graph.plan["blocks"])]
        level0, cls = _check_encoder(fresh(), exact)
        rows += [("encoder level 0", level0), ("encoder class token", cls)]
        rows += [(f"{key} level {i}", _check_decoder_level(fresh(), exact, key, i)) for key, i in _LEVELS]
        graph = fresh()
        rows += [(f"{name} head levels", _check_head_levels(graph, exact, name)) for name in _HEADS]
        rows += [(f"{name} finest conv", _check_finest(fresh(), exact, name)) for name in ["neck"] + _HEADS]
        for what, (err, pcc) in rows:
            print(f"{mode:6s} {what:24s} max rel error {err:.3g}  PCC {pcc:.7f}")


if __name__ == "__main__":
    main()
