"""`heads.FinestConv` alone: the phase-folded conv of one feature map at the level before the finest, interleaved
(depth_to_space), against what the network computes from that map at the finest level: the last resampler (2x
upsample, 3x3 conv) and the 1x1 convs after it (for the neck: its output conv and every head's input and output
convs), less the same at a zero map (the constant map, which post.py adds) (`tests/ttnn_parts.py` says how the part
tests work)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tt_moge.runners.ttnn.decoder import Conv, Convs
from tt_moge.runners.ttnn.heads import FinestConv
from tt_moge.runners.ttnn.prepare import depth_to_space

from . import ttnn_parts as parts


def build(exact: bool, name: str) -> FinestConv:
    prepared = parts.prepared_part("finest")
    ctx = parts.context(exact, plan=prepared.plan)
    fin = prepared.plan["finest"]
    convs = Convs(ctx, fin["in_height"])
    return FinestConv(ctx, convs, prepared.arrays[f"finest.{name}.w"], fin["in_height"], fin["in_width"])


def check(exact: bool, name: str, part: FinestConv = None) -> tuple:
    part = part or build(exact, name)
    net, plan, ctx = parts.network(), parts.prepared_part("finest").plan, part.ctx
    fin, last = plan["finest"], len(plan["levels"]) - 1
    stack = net.neck if name == "neck" else getattr(net, name + "_head")
    x = parts.random_map((1, stack.resamplers[last - 1][-1].in_channels, fin["in_height"], fin["in_width"]), 40)

    def finest(t: torch.Tensor) -> torch.Tensor:
        out = []
        for head in parts.HEADS:
            hs = getattr(net, head + "_head")
            c = hs.output_blocks[last].out_channels
            if name == "neck":
                n = net.neck.output_blocks[last](net.neck.resamplers[last - 1](t))
                out.append(hs.output_blocks[last](hs.input_blocks[last](n)))
            elif head == name:
                out.append(hs.output_blocks[last](hs.resamplers[last - 1](t)))
            else:
                out.append(torch.zeros(1, c, 2 * t.shape[2], 2 * t.shape[3]))
        return torch.cat(out, dim=1)

    with torch.inference_mode():
        ref = (finest(x) - finest(torch.zeros_like(x)))[0].numpy()
    out = part.forward(parts.device(ctx, parts.rows(x)))
    assert out.dtype == ctx.dt(ctx.formats.finest), f"{name}: finest maps in {out.dtype}"
    ours = depth_to_space(parts.host(ctx, out, (x.shape[2] * x.shape[3], -1)), fin["in_height"], fin["in_width"])
    if name != "neck":  # a head's kernel is zero outside its own channels: compare those, and the zeros apart
        own = [h["name"] == name for h in plan["heads"] for _ in range(h["channels"])]
        assert not ours[[not o for o in own]].any(), f"{name}: output outside its own channels"
        ours, ref = ours[own], ref[own]
    return parts.close(ours, ref, parts.limits("finest", exact), f"{name} finest conv")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("name", ["neck"] + parts.HEADS)
def test_finest_conv(name, exact):
    check(exact, name)


def _break(part: FinestConv, bug: str) -> None:
    T = part.ctx.ttnn
    if bug == "phase_order":  # row and column phases swapped in the finest fold
        k = part.conv.weight
        n = k.shape[0] // 4
        part.conv = Conv(np.concatenate([k[:n], k[2 * n : 3 * n], k[n : 2 * n], k[3 * n :]]))
    elif bug == "zero_padding":  # ttnn's default conv padding instead of MoGe's replicate padding
        make = part.convs.conv_config

        def zeros(*args, **kwargs):
            config = make(*args, **kwargs)
            config.padding_mode = T.PaddingMode.Zeros
            return config

        part.convs.conv_config = zeros
    elif bug == "bfloat16_finest":  # the finest conv's output stored in bfloat16, not the finest format
        conv = part.convs.conv
        part.convs.conv = lambda x, c, h, w, relu=False, out_dtype=None: conv(x, c, h, w, relu, "bfloat16")
    else:
        raise ValueError(bug)


BROKEN = [("neck", "phase_order"), ("mask", "zero_padding"), ("normal", "bfloat16_finest")]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("name,bug", BROKEN, ids=[f"{n}-{b}" for n, b in BROKEN])
def test_the_check_catches_a_broken_finest_conv(name, bug, exact):
    part = build(exact, name)
    _break(part, bug)
    with pytest.raises(AssertionError, match="beyond|finest maps in"):
        check(exact, name, part)
