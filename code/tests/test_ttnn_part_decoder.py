"""`decoder.ConvStack` (one level of the neck or of a head) and `heads.Head` (a head's levels) alone, each built from
one `network/convstack.py` `ConvStack` (`prepare.stack_arrays`), against that module on random maps
(`tests/ttnn_parts.py` says how the part tests work).

A level, as `ConvStack.forward` runs it: the running map plus the input 1x1 conv of the level's input (a head's
levels from 1 on; level 0 of a head is its folded input conv + upsample), the residual blocks, then the resampler to
level i + 1 (none at the finest fold's input level)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tt_moge.runners.ttnn.decoder import Conv, Convs, ConvStack
from tt_moge.runners.ttnn.graph import LOFI_WEIGHT_BITS, level0_folds, round_significant
from tt_moge.runners.ttnn.heads import Head
from tt_moge.runners.ttnn.prepare import stack_arrays
from tt_moge.testing import calibration_image

from . import ttnn_parts as parts
from .ttnn_parts import forbid_whole_network

LEVELS = [("neck", 0), ("neck", 1), ("neck", 2), ("neck", 3), ("head.points", 0), ("head.normal", 1)]
LEVELS += [("head.mask", 2), ("head.points", 3)]


def _module(key: str):
    net = parts.network()
    return net.neck if key == "neck" else getattr(net, key.split(".")[1] + "_head")


def build(exact: bool, key: str, cls=ConvStack) -> ConvStack:
    """The stack `key` ("neck", "head.points", ...) from its own module, on a fresh context."""
    plan = parts.network_plan()  # shapes only: no other part's weights are prepared
    ctx = parts.context(exact, plan=plan)
    levels = plan["levels"]
    weights, stack_plan = stack_arrays(_module(key), len(levels), with_inputs=key != "neck")
    fold = None
    if ctx.chained:
        fold = level0_folds({"heads": [{"name": key.split(".")[-1], **stack_plan}] if key != "neck" else []})[key]
    convs = Convs(ctx, plan["finest"]["in_height"])
    part = cls(ctx, convs, key, weights, stack_plan, levels, grid_tokens=plan["grid_tokens"], level0_fold=fold)
    part.load()
    return part


def check_level(exact: bool, key: str, i: int, part: ConvStack = None) -> tuple:
    part = part or build(exact, key)
    ctx, plan, stack = part.ctx, parts.network_plan(), _module(key)
    last = len(plan["levels"]) - 1
    level = plan["levels"][i]
    h, w = level["height"], level["width"]
    sp = next((s for s in plan["heads"] if f"head.{s['name']}" == key), {})  # the neck: its level's width
    dim = sp["dims"][i] if "dims" in sp else level["dim"]  # the stack's width at this level
    x = parts.random_map((1, dim, h, w), 20 + i)  # the running map (a head's level 0 has none)
    inp = parts.random_map((1, level["dim"], h, w), 30 + i)  # the neck's output at this level, a head's input
    bounds = parts.limits("decoder", exact)
    with torch.inference_mode():
        ref_in = x
        if part.plan["inputs"][i]:
            ref_in = stack.input_blocks[i](inp) if i == 0 else x + stack.input_blocks[i](inp)
        ref_y = stack.res_blocks[i](ref_in)
        ref_up = stack.resamplers[i](ref_y) if i < last - 1 else None
    if i == 0 and part.level0_fold:  # the level-0 input conv inside the upsample's matmul
        up = part.upsample0(parts.device(ctx, parts.rows(inp)))
        return parts.close(parts.host(ctx, up, tuple(up.shape[-2:])), parts.rows(ref_up), bounds, f"{key} up 0")
    y = parts.device(ctx, parts.rows(x))
    if part.plan["inputs"][i]:
        feature = part.one_by_one(parts.device(ctx, parts.rows(inp)), f"in.{i}", i)
        y = feature if i == 0 else part.convs.add(y, feature)
    y, _ = part.level(y, i, owned=False)
    result = None
    if len(stack.res_blocks[i]):
        result = parts.close(parts.host(ctx, y, (h * w, dim)), parts.rows(ref_y), bounds, f"{key} level {i}")
    if ref_up is not None:
        up = part.level_up(y, i)
        ref = parts.rows(ref_up)
        result = parts.close(parts.host(ctx, up, ref.shape), ref, bounds, f"{key} up {i}")
    assert result is not None, "nothing compared"
    return result


@functools.lru_cache(maxsize=None)
def _neck_outputs(seed: int) -> list:
    """The reference neck's outputs on an image: what the heads read (computed once: the reference network's
    encoder and neck)."""
    net, plan = parts.network(), parts.network_plan()
    image = calibration_image(*parts.SMALL, seed=seed)
    with torch.inference_mode():
        features, _ = net.encoder(image, plan["rows"], plan["cols"])
        uv = net.uv_planes(plan["rows"], plan["cols"], parts.SMALL[0] / parts.SMALL[1], torch.float32, None)
        return net.neck([torch.cat([features, uv[0]], dim=1)] + uv[1:])


def check_head(exact: bool, name: str, part: Head = None) -> tuple:
    """`Head.forward`: the neck's level outputs -> the head's map at the finest fold's input level, against the
    head's `ConvStack` levels 0 .. finest - 1 (input convs, residual blocks, resamplers)."""
    part = part or build(exact, f"head.{name}", Head)
    ctx, stack = part.ctx, _module(f"head.{name}")
    last = len(part.levels) - 1
    neck_out = _neck_outputs(6)
    with torch.inference_mode():
        ref = None
        for i in range(last):
            feature = stack.input_blocks[i](neck_out[i])
            ref = feature if ref is None else ref + feature
            ref = stack.res_blocks[i](ref)
            if i < last - 1:
                ref = stack.resamplers[i](ref)
    out = part.forward([parts.device(ctx, parts.rows(t)) for t in neck_out[:last]])
    ref = parts.rows(ref)
    return parts.close(parts.host(ctx, out, ref.shape), ref, parts.limits("head_levels", exact), f"{name} head")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("key,level", LEVELS)
def test_decoder_level(key, level, exact):
    check_level(exact, key, level)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("name", parts.HEADS)
def test_head_levels(name, exact):
    check_head(exact, name)


def test_the_safe_graphs_placements_run_the_same_parts():
    """The safe graph's placements (DRAM, 1x1 convs as matmuls everywhere, conv_transpose2d at level 0): exact."""
    safe = parts.context(True, "safe", parts.network_plan())
    assert not safe.chained
    for key, level in [("neck", 0), ("neck", 1), ("head.normal", 1)]:
        plan = parts.network_plan()
        weights, stack_plan = stack_arrays(_module(key), len(plan["levels"]), with_inputs=key != "neck")
        convs = Convs(safe, plan["finest"]["in_height"])
        part = ConvStack(safe, convs, key, weights, stack_plan, plan["levels"], grid_tokens=plan["grid_tokens"])
        part.load()
        check_level(True, key, level, part)
        safe = parts.context(True, "safe", parts.network_plan())


def _break(part: ConvStack, bug: str) -> None:
    a, T = part.arrays, part.ctx.ttnn
    if bug == "no_residual":
        parts.drop_residual(part.ctx)
    elif bug == "swapped_convs":  # a residual block's two convs swapped (square in this network)
        c = part.conv
        c["res.1.0.conv1"], c["res.1.0.conv2"] = c["res.1.0.conv2"], c["res.1.0.conv1"]
    elif bug == "shuffled_phases":  # the level-0 upsample's output phases (a, b) as (b, a)
        w, b = part.up0
        c = w.shape[-1] // 4
        order = np.r_[0:c, 2 * c : 3 * c, c : 2 * c, 3 * c : 4 * c]
        part.w["up0.w"] = part.ctx.tensor(w[:, order], part.ctx.formats.decoder_weights)
    elif bug == "zero_padding":  # ttnn's default conv padding instead of MoGe's replicate padding
        make = part.convs.conv_config

        def zeros(*args, **kwargs):
            config = make(*args, **kwargs)
            config.padding_mode = T.PaddingMode.Zeros
            return config

        part.convs.conv_config = zeros
    elif bug == "transposed_input_conv":  # a level-1 input 1x1 conv (square here) transposed
        part.conv["in.1"] = Conv(a["in.1.w"][:, :, None, None], a["in.1.b"])
    elif bug == "flipped_convt":  # a conv transpose's 2x2 kernel flipped
        part.conv["up.2.convt"] = Conv(a["up.2.convt.w"][:, :, ::-1, ::-1], a["up.2.convt.b"])
    else:
        raise ValueError(bug)


BROKEN = [
    ("neck", 1, "no_residual"),
    ("neck", 1, "swapped_convs"),
    ("neck", 0, "shuffled_phases"),
    ("neck", 2, "zero_padding"),
    ("head.normal", 1, "transposed_input_conv"),
    ("head.mask", 2, "flipped_convt"),
]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("key,level,bug", BROKEN, ids=[f"{k}-{b}" for k, _, b in BROKEN])
def test_the_level_check_catches_a_broken_level(key, level, bug, exact):
    part = build(exact, key)
    _break(part, bug)
    with pytest.raises(AssertionError, match="beyond"):
        check_level(exact, key, level, part)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("name,bug", [("points", "no_residual"), ("normal", "transposed_input_conv")])
def test_the_head_check_catches_a_broken_head(name, bug, exact):
    part = build(exact, f"head.{name}", Head)
    _break(part, bug)
    with pytest.raises(AssertionError, match="beyond"):
        check_head(exact, name, part)


def test_the_coarse_levels_and_their_resamplers_run_at_their_own_fidelity():
    """The fast graph's decoder fidelity by step (issue 47): its two coarsest levels and the resamplers out of them
    at HiFi2 (a level's 0.02 needs it: `DEVICE["decoder"]`), the rest at LoFi but the level the finest fold reads
    (HiFi4); and their weights rounded to what LoFi reads only where LoFi runs."""
    part = build(False, "neck")
    convs, heights = part.convs, [level["height"] for level in part.levels]
    assert [convs.fidelity(heights[i], i) for i in (0, 1)] == ["hifi2", "hifi2"]
    assert convs.fidelity(heights[2], 1) == "hifi2", "the resampler from level 1 into level 2"
    assert convs.fidelity(heights[2], 2) == "lofi" and convs.fidelity(heights[-2], 2) == "hifi4"
    assert "res.2.0.conv1" in part.conv, "a residual block at level 2 (LoFi) to look at"
    for name, level, height, rounded in [("up.1.conv", 1, heights[2], False), ("res.2.0.conv1", 2, heights[2], True)]:
        conv = part.conv[name]
        uploaded = conv.inputs(part.ctx, convs.fidelity(height, level))[0].data.numpy()
        want = round_significant(conv.weight, LOFI_WEIGHT_BITS) if rounded else conv.weight
        assert np.array_equal(uploaded, want) and rounded != np.array_equal(uploaded, conv.weight), name


def test_a_level_and_a_head_are_built_and_checked_without_the_whole_network(monkeypatch):
    """The decoder's part tests prepare only their stack (`prepare.stack_arrays`) with the plan's shapes
    (`prepare.shapes`), not the whole network (issue 47, item 1)."""
    parts.network_plan.cache_clear()
    _neck_outputs.cache_clear()
    forbid_whole_network(monkeypatch)
    check_level(True, "neck", 1)
    check_head(True, "normal")
