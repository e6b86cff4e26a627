"""What the part tests of the Tenstorrent device graph share (`tests/test_ttnn_part_*.py`, one file per part, tt-metal
style): the tiny network whose every weight matters, a context on a fresh emulator, the bounds, the comparison.

Each part test builds only its part, from its own weights, on a `context.Context` of the emulator
(`tests/ttnn_emulator.py`), and checks it against the matching `network/` module:

* `patch_embed.PatchEmbed`, `encoder.Encoder`, `heads.FinestConv`: their weights are folds across modules (the
  image normalisation into the patch kernel, the position embedding and prefix tokens into the table, the taps'
  projections into the neck's level-0 conv; the last resampler and the 1x1 convs after it into the phase-folded
  conv), each part's from only the modules it folds (`prepare.prepare_patch_embed`, `prepare_encoder`,
  `prepare_finest`, over `folding.fold_patch_embed`, `fold_encoder`, `fold_finest`: `prepared_part`), laid out
  as `prepare.prepare_weights` lays out the whole network's, with the plan's shapes (`prepare.shapes`);
* `vit_block.VitBlock`: from one `network/vit.py` `Block` (`prepare.block_arrays`);
* `decoder.ConvStack` (a level of the neck or of a head) and `heads.Head` (a head's levels): from one
  `network/convstack.py` `ConvStack` (`prepare.stack_arrays`);
  these two with the network's plan of shapes alone (`prepare.shapes`: `network_plan`). No part test prepares the
  whole network.

Each part is held to float32 round-off in the emulator's exact mode, and in the device formats (bfloat16
activations and weights, float32 residual stream, the fast graph's fidelities) to bounds a little above what the
emulator measures (observed values beside each limit); each file also breaks its part on purpose and sees the check
fail. `cd code && python -m tests.ttnn_parts` prints every part's error and PCC (the observed values).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import torch

from tt_moge.runners.ttnn import Prepared
from tt_moge.runners.ttnn.context import FORMATS, Context, to_host
from tt_moge.runners.ttnn.graph import CONFIGS
from tt_moge.runners.ttnn.prepare import prepare_encoder, prepare_finest, prepare_patch_embed, shapes
from tt_moge.testing import add_residual_outliers, make_network

from .test_ttnn_lowering import _pcc
from .ttnn_emulator import TtnnEmulator

SMALL, TOKENS = (224, 126), 300

# (max |ours - ref| / max |ref|, min PCC). Exact: float32 round-off (the folds reassociate sums).
EXACT = (1e-5, 0.99999)
# Device formats, fast graph: bounds about 1.5-2x the errors the emulator measures on this network (observed
# max relative error, PCC beside each); a bfloat16 rounding is up to 2^-9 relative, LoFi reads 5 bits of a weight.
DEVICE = {
    "patch_embed": (0.02, 0.9999),  # 0.0095, 0.99995: bfloat16 patches and kernel, HiFi2
    "vit_block": (0.06, 0.9995),  # the update, worst of 4 blocks: 0.039, 0.99977 (planted: the same)
    "encoder": (0.04, 0.9995),  # level-0 map 0.017, 0.99993 (planted: 0.0125)
    # the class token and a decoder level: 0.02, the bounds they had before figures were seen (issue 47: the class
    # token's had gone to 0.06 at full size, a decoder level's to 0.045 in these tests, once measured). Observed:
    # class token 0.0218 (planted: 0.0035), a strict known failure (test_ttnn_part_encoder.CLASS_TOKEN_GAP); worst
    # decoder level 0.0105, 0.99996 with the two coarsest levels at HiFi2 (0.0268 with them at LoFi)
    "class_token": (0.02, 0.9995),
    "decoder": (0.02, 0.9995),
    "head_levels": (0.02, 0.99995),  # worst head: 0.0097, 0.99998
    "finest": (0.006, 0.99999),  # worst map: 0.0033, 0.999997 (bfloat16 input and weights, HiFi4, float32 out)
}

JUDGE = [True]  # [False]: `main` measures without judging


WEIGHTS = ["random", "outliers"]  # the ViT's weights: random, or with DINOv2's massive activations planted


@functools.lru_cache(maxsize=None)
def network(weights: str = "random"):
    """tiny-vits-normal with random weights everywhere (make_network gives the ViT's norms ones and zeros and
    LayerScale 0.1, under which a swap of two norms would go unseen); "outliers": the same with DINOv2's massive
    activations planted in the residual stream (`testing.add_residual_outliers`: 4 channels, from about 50 to 300
    times the stream's median magnitude over the blocks)."""
    if weights == "outliers":
        net = copy.deepcopy(network())
        net.planted = add_residual_outliers(net)  # {"channels": [...], "ratios": [...]}
        return net
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
def network_plan(weights: str = "random") -> dict:
    """The network's plan without weights (`prepare.shapes`: the token grid, the blocks, the levels), for the parts
    that need its shapes and none of the other parts' weights (a ViT block)."""
    return shapes(network(weights), SMALL, TOKENS)


@functools.lru_cache(maxsize=None)
def prepared_part(part: str, weights: str = "random") -> Prepared:
    """One part's weights alone, folded from its own modules (`prepare.prepare_patch_embed`, `prepare_encoder`,
    `prepare_finest`: "patch_embed", "encoder", "finest"), with the plan's shapes (`prepare.shapes`)."""
    make = {"patch_embed": prepare_patch_embed, "encoder": prepare_encoder, "finest": prepare_finest}[part]
    return make(network(weights), SMALL, TOKENS)


def forbid_whole_network(monkeypatch) -> None:
    """Make preparing the whole network (`prepare.prepare_weights`, as the package exports it too) fail the test."""
    import tt_moge.runners.ttnn as package
    import tt_moge.runners.ttnn.prepare as prepare

    def whole(*args, **kwargs):
        raise AssertionError("a part test prepared the whole network")

    monkeypatch.setattr(prepare, "prepare_weights", whole)
    monkeypatch.setattr(package, "prepare_weights", whole)
    monkeypatch.setitem(globals(), "prepare_weights", whole)  # a name this module may have imported


def context(exact: bool, config: str = "fast", plan: dict = None) -> Context:
    """A context on a fresh emulator (exact: float32 everything, and no weights rounded to what LoFi reads, a
    format choice too), placed as the graph of the network's plan is (`network_plan`; `plan`, a part's, when given:
    the same shapes)."""
    emulator = TtnnEmulator(exact=exact)
    cfg = CONFIGS[config]
    if exact:
        cfg = dataclasses.replace(cfg, round_lofi_weights=False)
    plan = network_plan() if plan is None else plan
    return Context.for_plan(emulator, emulator.open_device(), plan, FORMATS["bf16"], cfg)


def limits(part: str, exact: bool) -> tuple:
    return EXACT if exact else DEVICE[part]


def outlier_channels(weights: str) -> list:
    """The residual-stream channels planted with massive activations in `network(weights)` (none for "random")."""
    return list(getattr(network(weights), "planted", {}).get("channels", []))


def close(ours, ref, bounds: tuple, what: str, outliers: list = ()) -> tuple:
    """ours against ref within (max relative error, min PCC); both non-trivial. Returns (error, PCC). `outliers`:
    channels (last axis) with planted massive activations, which would set the scale of a max-relative error and of
    the PCC and hide the other channels' errors: those are compared apart, each channel to its own largest value
    (the bound's relative error), and the rest as usual."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if len(outliers):
        picked = ref[..., list(outliers)]
        err = np.abs(ours[..., list(outliers)] - picked).max(axis=tuple(range(picked.ndim - 1)))
        worst = float((err / np.abs(picked).max(axis=tuple(range(picked.ndim - 1)))).max())
        assert not JUDGE[0] or worst <= bounds[0], f"{what}, outlier channels: error {worst:.3g} beyond {bounds}"
        keep = np.ones(ref.shape[-1], bool)
        keep[list(outliers)] = False
        ours, ref = ours[..., keep], ref[..., keep]
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    scale = np.abs(ref).max()
    assert scale > 0 and ref.std() > 1e-3 * scale, f"{what}: the reference is trivial"
    assert np.isfinite(ours).all() and ours.std() > 0, f"{what}: ours is constant or not finite"
    err, pcc = float(np.abs(ours - ref).max() / scale), _pcc(ours, ref)
    assert not JUDGE[0] or err <= bounds[0] and pcc >= bounds[1], (
        f"{what}: error {err:.3g}, PCC {pcc:.7f} beyond {bounds}"
    )
    return err, pcc


def device(ctx: Context, array, dtype: str = "bfloat16"):
    """(rows, C) numpy -> a (1, 1, rows, C) device tensor in tiles."""
    return ctx.tensor(np.asarray(array, np.float32), dtype, (1, 1) + np.shape(array))


def host(ctx: Context, t, shape: tuple) -> np.ndarray:
    return to_host(ctx.ttnn, t, shape)


def rows(t: torch.Tensor) -> np.ndarray:
    """(1, C, H, W) -> (H * W, C), the device's channels-last pixel rows."""
    return t[0].permute(1, 2, 0).reshape(-1, t.shape[1]).numpy()


def random_map(shape: tuple, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def drop_residual(ctx: Context) -> None:
    """Every add returns its second operand (0 + b): the residual of a block or a level dropped."""
    T = ctx.ttnn
    add = T.add
    T.add = lambda a, b, **kw: add(T.subtract(a, a), b, **kw)


def main() -> None:
    """Each part's error and PCC against its reference, in float32 emulation and in the device formats (the
    observed values behind `DEVICE`): cd code && python -m tests.ttnn_parts"""
    from . import (
        test_ttnn_part_decoder,
        test_ttnn_part_encoder,
        test_ttnn_part_finest,
        test_ttnn_part_patch_embed,
        test_ttnn_part_vit_block,
    )
    from . import ttnn_parts as shared  # the module the tests import (this file runs as __main__)

    shared.JUDGE[0] = False
    for exact in (True, False):
        mode = "exact" if exact else "device"
        rows_ = [("patch_embed", test_ttnn_part_patch_embed.check(exact))]
        for weights in WEIGHTS:
            blocks = range(network_plan()["blocks"])
            rows_ += [
                (f"block {i} ({weights})", test_ttnn_part_vit_block.check(exact, i, weights=weights)) for i in blocks
            ]
            level0, cls = test_ttnn_part_encoder.check(exact, weights=weights)
            rows_ += [(f"encoder level 0 ({weights})", level0), (f"encoder class token ({weights})", cls)]
        rows_ += [
            (f"{key} level {i}", test_ttnn_part_decoder.check_level(exact, key, i))
            for key, i in test_ttnn_part_decoder.LEVELS
        ]
        rows_ += [(f"{n} head levels", test_ttnn_part_decoder.check_head(exact, n)) for n in HEADS]
        rows_ += [(f"{n} finest conv", test_ttnn_part_finest.check(exact, n)) for n in ["neck"] + HEADS]
        for what, (err, pcc) in rows_:
            print(f"{mode:6s} {what:34s} max rel error {err:.3g}  PCC {pcc:.7f}")


HEADS = ["points", "normal", "mask"]


if __name__ == "__main__":
    main()
