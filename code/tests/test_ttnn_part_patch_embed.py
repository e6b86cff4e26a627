"""`patch_embed.PatchEmbed` alone against `network/vit.py`'s `PatchEmbed` + position embedding + prefix tokens
(`tests/ttnn_parts.py` says how the part tests work): the patch matrix (the host reference of `pre.py`) -> the
residual stream's first value, class and register rows after the patch rows."""

from __future__ import annotations

import pytest

from tt_moge.runners.ttnn import host_input
from tt_moge.runners.ttnn.patch_embed import PatchEmbed
from tt_moge.testing import calibration_image

from . import ttnn_parts as parts
from .test_ttnn_lowering import _block_input


def build(exact: bool) -> PatchEmbed:
    prepared = parts.prepared_part("patch_embed")
    part = PatchEmbed.from_prepared(parts.context(exact, plan=prepared.plan), prepared)
    part.load()
    return part


def check(exact: bool, part: PatchEmbed = None) -> tuple:
    part = part or build(exact)
    prepared = parts.prepared_part("patch_embed")
    ctx, plan = part.ctx, prepared.plan
    image = calibration_image(*parts.SMALL, seed=3)
    patches = parts.device(ctx, host_input(plan, image.numpy()), ctx.formats.activations)
    ref = _block_input(parts.network(), plan, image)[0].numpy()
    out = parts.host(ctx, part.forward(patches), ref.shape)
    return parts.close(out, ref, parts.limits("patch_embed", exact), "patch_embed")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_patch_embed(exact):
    check(exact)


def _break(part: PatchEmbed, bug: str) -> None:
    ctx, a = part.ctx, part.arrays
    if bug == "no_table":  # the position embedding and prefix tokens left out
        part.w["table"] = ctx.tensor(0 * a["table"], ctx.formats.residual, (1, 1) + a["table"].shape)
    elif bug == "swapped_colours":  # the patch kernel's red and blue rows swapped
        k = a["weight"].copy()
        pp = parts.prepared_part("patch_embed").plan["patch"] ** 2
        k[:pp], k[2 * pp : 3 * pp] = a["weight"][2 * pp : 3 * pp], a["weight"][:pp]
        part.w["weight"] = ctx.tensor(k, ctx.formats.decoder_weights)
    else:
        raise ValueError(bug)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("bug", ["no_table", "swapped_colours"])
def test_the_check_catches_a_broken_patch_embed(bug, exact):
    part = build(exact)
    _break(part, bug)
    with pytest.raises(AssertionError, match="beyond"):
        check(exact, part)
