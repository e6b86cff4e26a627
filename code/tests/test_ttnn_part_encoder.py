"""`encoder.Encoder` alone (the patch embedding, the blocks, the taps' norms and projections) against
`network/moge2.py`'s `DINOv2Encoder` and the neck's level-0 conv over features + uv (`tests/ttnn_parts.py` says how
the part tests work): patch matrix -> the neck's level-0 input and the class token."""

from __future__ import annotations

import pytest

from tt_moge.runners.ttnn import host_input
from tt_moge.runners.ttnn.encoder import Encoder
from tt_moge.testing import calibration_image

from . import ttnn_parts as parts
from .test_ttnn_lowering import _encoder_reference


def build(exact: bool) -> Encoder:
    part = Encoder(parts.context(exact), parts.prepared())
    part.load()
    return part


def check(exact: bool, part: Encoder = None) -> tuple:
    part = part or build(exact)
    ctx, plan = part.ctx, parts.prepared().plan
    image = calibration_image(*parts.SMALL, seed=5)
    level0, cls_token = part.forward(parts.device(ctx, host_input(plan, image.numpy()), ctx.formats.activations))
    level0_ref, cls_ref = _encoder_reference(parts.network(), image, plan)
    bounds = parts.limits("encoder", exact)
    cls = parts.close(parts.host(ctx, cls_token, cls_ref.shape), cls_ref, bounds, "class token")
    return parts.close(parts.host(ctx, level0, level0_ref.shape), level0_ref, bounds, "level-0 map"), cls


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_encoder(exact):
    check(exact)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_the_check_catches_swapped_taps(exact):
    part = build(exact)
    part.w["tap.0.w"], part.w["tap.1.w"] = part.w["tap.1.w"], part.w["tap.0.w"]  # the first two taps' projections
    with pytest.raises(AssertionError, match="beyond"):
        check(exact, part)
