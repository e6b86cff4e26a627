"""`vit_block.VitBlock` alone, built from one `network/vit.py` `Block` (`prepare.block_arrays`), against that block
on the ViT's input tokens in the device order (`tests/ttnn_parts.py` says how the part tests work), on random weights
and with DINOv2's massive activations planted. Compared: the update (output - input), which is small beside the
input."""

from __future__ import annotations

import pytest
import torch

from tt_moge.runners.ttnn.prepare import block_arrays
from tt_moge.runners.ttnn.vit_block import VitBlock
from tt_moge.testing import calibration_image

from . import ttnn_parts as parts
from .test_ttnn_lowering import _block_input
from .ttnn_parts import forbid_whole_network


def build(exact: bool, i: int = 1, weights: str = "random") -> VitBlock:
    arrays, info = block_arrays(parts.network(weights).encoder.backbone.blocks[i])
    plan = parts.network_plan(weights)  # shapes only: no other part's weights are prepared
    part = VitBlock(parts.context(exact, plan=plan), arrays, seq_len=plan["seq_len"], **info)
    part.load()
    return part


def check(exact: bool, i: int = 1, part: VitBlock = None, weights: str = "random") -> tuple:
    part = part or build(exact, i, weights)
    ctx, net = part.ctx, parts.network(weights)
    x = _block_input(net, parts.network_plan(weights), calibration_image(*parts.SMALL, seed=4))
    with torch.inference_mode():
        ref = net.encoder.backbone.blocks[i](x)[0].numpy()
    x0 = x[0].numpy()
    out = parts.host(ctx, part.forward(parts.device(ctx, x0, ctx.formats.residual)), ref.shape)
    bounds, outliers = parts.limits("vit_block", exact), parts.outlier_channels(weights)
    return parts.close(out - x0, ref - x0, bounds, f"block {i} ({weights})", outliers)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("weights", parts.WEIGHTS)
def test_vit_block(weights, exact):
    """Every block the graph runs (up to the last tap), on random weights and with DINOv2's massive activations
    planted in the residual stream (which every block's layer norms then see)."""
    for i in range(parts.network_plan()["blocks"]):
        check(exact, i, weights=weights)


def _break(part: VitBlock, bug: str) -> None:
    ctx, w = part.ctx, part.w
    if bug == "no_residual":
        parts.drop_residual(ctx)
    elif bug == "swapped_norms":  # norm1's weight where norm2's goes, and back
        w["norm1.w"], w["norm2.w"] = w["norm2.w"], w["norm1.w"]
    elif bug == "transposed_attn_out":
        w["attn_out.w"] = ctx.tensor(part.arrays["attn_out.w"].T, ctx.formats.vit_weights)
    else:
        raise ValueError(bug)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("bug", ["no_residual", "swapped_norms", "transposed_attn_out"])
def test_the_check_catches_a_broken_block(bug, exact):
    part = build(exact)
    _break(part, bug)
    with pytest.raises(AssertionError, match="beyond"):
        check(exact, 1, part)


def test_a_block_is_built_and_checked_without_the_whole_network(monkeypatch):
    """The block's part test prepares nothing but its own block: the plan's shapes come from `prepare.shapes`
    (`ttnn_parts.network_plan`), not from the whole network prepared (issue 47, item 1: one part, one object,
    tested alone)."""
    parts.network_plan.cache_clear()
    forbid_whole_network(monkeypatch)
    check(True, 0)
