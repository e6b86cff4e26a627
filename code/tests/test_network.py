"""Our MoGe-2 network against upstream's (PyPI dlr-moge = microsoft/MoGe): same state dict, same raw outputs."""

from __future__ import annotations

import moge.model.v2 as upstream_v2  # the oracle: pip install --no-deps dlr-moge==2.0.0 dlr-utils3d==1.3
import pytest
import torch

from tt_moge.network import MoGe2Config, MoGe2Network
from tt_moge.testing import PRESETS, calibration_image, model_config
from tt_moge.weights import build_network, read_checkpoint

TINY = [p for p in PRESETS if p.startswith("tiny")]
FULL = [p for p in PRESETS if not p.startswith("tiny")]


@pytest.mark.parametrize("preset", FULL + TINY)
def test_state_dict_layout_matches_upstream(preset):
    """Every key and shape of upstream's network exists in ours and vice versa, for every variant."""
    cfg = model_config(preset)
    with torch.device("meta"):
        ours = MoGe2Network(MoGe2Config.parse(cfg)).state_dict()
    theirs = upstream_v2.MoGeModel(**cfg).state_dict()  # upstream cannot be built on the meta device
    assert sorted(ours) == sorted(theirs)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}


def _assert_raw_close(ours: dict, theirs: dict, atol: float = 2e-5) -> None:
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        a, b = ours[key], theirs[key]
        assert a.shape == b.shape, key
        assert torch.isfinite(b).all(), key
        scale = float(b.abs().max())
        assert scale > 1e-3, f"{key} is trivially small"
        err = float((a - b).abs().max())
        assert err <= atol * max(1.0, scale), f"{key}: max abs diff {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("preset", TINY)
def test_raw_forward_matches_upstream(checkpoint, upstream, preset):
    path = checkpoint(preset)
    config, state = read_checkpoint(path)
    ours = build_network(config, state)
    theirs = upstream(path)
    image = calibration_image(336, 189, seed=1)
    tokens = 300 if "vits" in preset else 100  # upstream runs every block of ViT-B/L: keep them cheap
    with torch.inference_mode():
        a = ours(image, tokens)
        b = theirs.forward(image, num_tokens=tokens)
    _assert_raw_close(a, b)
    if "normal_head" not in config:
        assert "normal" not in a
    # the mask is informative: neither all valid nor all invalid
    valid = float((b["mask"] > 0.5).float().mean())
    assert 0.05 < valid < 0.95


def test_raw_forward_parity_detects_a_broken_weight(checkpoint, upstream):
    """The comparison above is not vacuous: one perturbed weight in one block makes it fail."""
    path = checkpoint("tiny-vits-normal")
    config, state = read_checkpoint(path)
    ours = build_network(config, state)
    theirs = upstream(path)
    with torch.no_grad():
        ours.encoder.backbone.blocks[1].mlp.fc2.weight[0, 0] += 0.5
    image = calibration_image(336, 189, seed=1)
    with torch.inference_mode():
        a, b = ours(image, 300), theirs.forward(image, num_tokens=300)
    with pytest.raises(AssertionError):
        _assert_raw_close(a, b)


def test_token_grid_and_blocks_run(checkpoint, upstream):
    """We stop after the last block the neck reads; upstream runs them all; outputs are still equal."""
    path = checkpoint("tiny-vitl-normal")  # reads blocks 0 and 1 of 24
    config, state = read_checkpoint(path)
    ours = build_network(config, state)
    calls = []
    hooks = [
        blk.register_forward_hook(lambda *a, i=i: calls.append(i)) for i, blk in enumerate(ours.encoder.backbone.blocks)
    ]
    theirs = upstream(path)
    image = calibration_image(224, 126, seed=2)
    with torch.inference_mode():
        a, b = ours(image, 100), theirs.forward(image, num_tokens=100)
    for h in hooks:
        h.remove()
    assert calls == [0, 1]
    _assert_raw_close(a, b)
