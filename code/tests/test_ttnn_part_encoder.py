"""`encoder.Encoder` alone (the patch embedding, the blocks, the taps' norms and projections) against
`network/moge2.py`'s `DINOv2Encoder` and the neck's level-0 conv over features + uv (`tests/ttnn_parts.py` says how
the part tests work): patch matrix -> the neck's level-0 input and the class token, on random weights and with
DINOv2's massive activations planted in the residual stream."""

from __future__ import annotations

import functools

import pytest

from tt_moge.runners.ttnn import host_input
from tt_moge.runners.ttnn.encoder import Encoder
from tt_moge.testing import calibration_image

from . import ttnn_parts as parts
from .test_ttnn_lowering import _encoder_reference

# The class token's bound (0.02) is not met by the fast graph in the device formats on random weights: its LoFi MLP
# and attention give 0.0218 here (0.0495 on ViT-L at the spec case); the MLP at HiFi2 gives 0.0149 here but 0.036 on
# ViT-L (+1.74 ms of forward), and meeting 0.02 on ViT-L takes more than that, which would break issue 27's 15 ms
# forward and issue 46's 60 images/s. Recorded as a known failure (strict: it fails the day it passes), not traded
# against those goals here (docs/tenstorrent.md, "Accuracy on real-like weights").
CLASS_TOKEN_GAP = "the fast graph's LoFi MLP and attention: the class token beyond 0.02 (issue 47, item 2)"


def build(exact: bool, weights: str = "random") -> Encoder:
    prepared = parts.prepared_part("encoder", weights)
    part = Encoder(parts.context(exact, plan=prepared.plan), prepared)
    part.load()
    return part


def run(exact: bool, part: Encoder = None, weights: str = "random") -> dict:
    """The encoder's level-0 map and class token against the reference's, on the host."""
    part = part or build(exact, weights)
    ctx, plan = part.ctx, parts.prepared_part("encoder", weights).plan
    image = calibration_image(*parts.SMALL, seed=5)
    level0, cls_token = part.forward(parts.device(ctx, host_input(plan, image.numpy()), ctx.formats.activations))
    level0_ref, cls_ref = _encoder_reference(parts.network(weights), image, plan)
    return {
        "level0": (parts.host(ctx, level0, level0_ref.shape), level0_ref),
        "cls": (parts.host(ctx, cls_token, cls_ref.shape), cls_ref),
    }


@functools.lru_cache(maxsize=None)
def _run(exact: bool, weights: str) -> dict:
    return run(exact, weights=weights)


def judge(out: dict, exact: bool, weights: str = "random", what: str = "both") -> tuple:
    """(level-0 map's (error, PCC), class token's), each held to its bound (`what`: "level0", "cls" or "both")."""
    level0 = cls = None
    if what in ("level0", "both"):
        ours, ref = out["level0"]
        level0 = parts.close(ours, ref, parts.limits("encoder", exact), f"level-0 map ({weights})")
    if what in ("cls", "both"):
        ours, ref = out["cls"]
        bounds, outliers = parts.limits("class_token", exact), parts.outlier_channels(weights)
        cls = parts.close(ours, ref, bounds, f"class token ({weights})", outliers)
    return level0, cls


def check(exact: bool, part: Encoder = None, weights: str = "random") -> tuple:
    out = run(exact, part, weights) if part is not None else _run(exact, weights)
    return judge(out, exact, weights)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("weights", parts.WEIGHTS)
def test_encoder_level0(weights, exact):
    judge(_run(exact, weights), exact, weights, "level0")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
@pytest.mark.parametrize("weights", parts.WEIGHTS)
def test_encoder_class_token(weights, exact, request):
    if weights == "random" and not exact:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=CLASS_TOKEN_GAP))
    judge(_run(exact, weights), exact, weights, "cls")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "device"])
def test_the_check_catches_swapped_taps(exact):
    part = build(exact)
    part.w["tap.0.w"], part.w["tap.1.w"] = part.w["tap.1.w"], part.w["tap.0.w"]  # the first two taps' projections
    with pytest.raises(AssertionError, match="beyond"):
        judge(run(exact, part), exact, what="level0")
