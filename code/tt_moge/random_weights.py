"""Random-weight MoGe-2 checkpoints in the published `model.pt` format, for tests, benchmarks and demos.

The real weights cannot be downloaded everywhere (CI has no network), so tests write their own checkpoints:
`{"model_config": ..., "model": state_dict}`, exactly what `Ruicheng/moge-2-*` ships, loadable by upstream's
`moge.model.v2.MoGeModel.from_pretrained` as well as by ours.

Random weights give degenerate geometry (negative focal, every pixel invalid). `well_posed=True` makes the
geometry known while keeping every head image-dependent:

* The neck's and the points head's finest level see the image only through their last resampler conv. That
  conv is scaled down (`image_detail`), so the raw points are, up to a small image-dependent term, a linear
  function of the view-plane uv planes. The points head's output conv is solved so that, before the `exp`
  remap, x' = k*u, y' = k*v, z' = log(depth) + tilt*u: a tilted surface seen by a pinhole camera whose focal
  length is 1/k = `focal` (relative to the canvas half diagonal), with zero z-shift.
* The mask head's output conv is rescaled and shifted so that `invalid_share` of the pixels of a calibration
  image are invalid; the normal and scale heads are rescaled to sane magnitudes.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from .network import MoGe2Config, MoGe2Network, token_grid

__all__ = [
    "PRESETS",
    "model_config",
    "make_checkpoint",
    "make_network",
    "calibration_image",
    "add_outlier_channels",
    "add_residual_outliers",
]

_RESAMPLERS = ["conv_transpose", "conv_transpose", "conv_transpose", "bilinear"]


def _stack(dim_in, dims, n_res, dim_out, **extra) -> dict:
    return {
        "dim_in": dim_in,
        "dim_out": dim_out,
        "dim_res_blocks": dims,
        "num_res_blocks": n_res,
        "res_block_in_norm": "none",
        "res_block_hidden_norm": "none",
        "resamplers": list(_RESAMPLERS),
        **extra,
    }


def _moge2(
    backbone: str,
    layers: list,
    enc_out: int,
    dims: list,
    scale: list,
    normal: bool = True,
    neck_res=(0, 2, 2, 2, 0),
    head_res=(0, 1, 1, 1, 0),
    **stack_extra,
) -> dict:
    """A MoGe-2 config with the published structure: 5 levels, uv inputs, last-level outputs only."""

    def head(out: int) -> dict:
        return _stack(list(dims), list(dims), list(head_res), [None] * 4 + [out], **stack_extra)

    cfg = {
        "encoder": {"backbone": backbone, "intermediate_layers": layers, "dim_out": enc_out},
        "neck": _stack([enc_out + 2, 2, 2, 2, 2], list(dims), list(neck_res), None, **stack_extra),
        "points_head": head(3),
        "mask_head": head(1),
        "scale_head": {"dims": scale},
        "remap_output": "exp",
        "num_tokens_range": [1200, 3600],
    }
    if normal:
        cfg["normal_head"] = head(3)
    return cfg


_FULL_DIMS = [1024, 256, 128, 64, 32]
_TINY_DIMS = [64, 32, 32, 16, 16]
PRESETS: dict[str, dict] = {
    # ViT-L: the model section of microsoft/MoGe configs/train/v2.json, the shape of moge-2-vitl(-normal).
    "vitl-normal": _moge2("dinov2_vitl14", [5, 11, 17, 23], 1024, _FULL_DIMS, [1024, 1024, 1024, 1]),
    "vitl": _moge2("dinov2_vitl14", [5, 11, 17, 23], 1024, _FULL_DIMS, [1024, 1024, 1024, 1], normal=False),
    # ViT-B / ViT-S: the same structure on the smaller backbones (published widths may differ; we read them
    # from each checkpoint's config anyway).
    "vitb-normal": _moge2("dinov2_vitb14", [2, 5, 8, 11], 768, _FULL_DIMS, [768, 768, 768, 1]),
    "vitb": _moge2("dinov2_vitb14", [2, 5, 8, 11], 768, _FULL_DIMS, [768, 768, 768, 1], normal=False),
    "vits-normal": _moge2("dinov2_vits14", [2, 5, 8, 11], 384, _FULL_DIMS, [384, 384, 384, 1]),
    "vits": _moge2("dinov2_vits14", [2, 5, 8, 11], 384, _FULL_DIMS, [384, 384, 384, 1], normal=False),
    # Tiny: real backbones, but only the first blocks feed the neck (we stop there; upstream runs them all),
    # and narrow decoders. For tests that must run in seconds on 2 cores.
    "tiny-vits-normal": _moge2("dinov2_vits14", [0, 1, 2, 3], 64, _TINY_DIMS, [384, 32, 1]),
    "tiny-vits": _moge2("dinov2_vits14", [0, 1, 2, 3], 64, _TINY_DIMS, [384, 32, 1], normal=False),
    "tiny-vitb-normal": _moge2("dinov2_vitb14", [0, 1], 64, _TINY_DIMS, [768, 32, 1]),
    "tiny-vitl-normal": _moge2("dinov2_vitl14", [0, 1], 64, _TINY_DIMS, [1024, 32, 1]),
    "tiny-vitl": _moge2("dinov2_vitl14", [0, 1], 64, _TINY_DIMS, [1024, 32, 1], normal=False),
    # Code paths the published models do not use: normalised residual blocks, other resamplers, registers.
    "tiny-norms": _moge2(
        "dinov2_vits14_reg",
        [1, 3],
        64,
        [64, 64, 32, 32, 32],
        [384, 32, 1],
        neck_res=(1, 1, 1, 1, 0),
        res_block_in_norm="layer_norm",
        res_block_hidden_norm="group_norm",
    ),
}
PRESETS["tiny-norms"]["neck"]["resamplers"] = ["pixel_shuffle", "nearest", "conv_transpose", "bilinear"]


def model_config(preset: Union[str, dict]) -> dict:
    if isinstance(preset, dict):
        return copy.deepcopy(preset)
    if preset not in PRESETS:
        raise ValueError(f"unknown checkpoint preset {preset!r}; expected one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[preset])


def calibration_image(width: int = 224, height: int = 126, seed: int = 0) -> torch.Tensor:
    """A smooth, deterministic, photo-like RGB test image (1, 3, H, W) in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    y = torch.linspace(0, 1, height)[:, None]
    x = torch.linspace(0, 1, width)[None, :]
    chans = []
    for _channel in range(3):
        fx, fy, ph = (torch.rand(3, generator=g) * torch.tensor([6.0, 4.0, 6.28])).tolist()
        chans.append(0.5 + 0.3 * torch.sin(2 * math.pi * (fx * x + fy * y) + ph) + 0.15 * (x - y))
    return torch.stack(chans).clamp(0, 1)[None]


def _init_backbone(net: MoGe2Network) -> None:
    """DINOv2-like random ViT weights (the decoder keeps PyTorch's fan-in scaled default initialisation)."""
    with torch.no_grad():
        for name, p in net.encoder.backbone.named_parameters():
            if name.endswith("gamma"):
                p.fill_(0.1)  # LayerScale: trained DINOv2 values are of this order
            elif name == "mask_token":
                p.zero_()
            elif p.ndim >= 2 or name in ("pos_embed", "cls_token", "register_tokens"):
                p.copy_(torch.randn(p.shape).clamp_(-2, 2) * 0.02)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def _finest_head_input(head, neck_out) -> torch.Tensor:
    """The features that a head's last 1x1 output conv reads, (C, pixels)."""
    out_conv = head.output_blocks[-1]
    head.output_blocks[-1] = nn.Identity()
    try:
        h = head(neck_out, last_only=True)[-1]
    finally:
        head.output_blocks[-1] = out_conv
    return h[0].flatten(1)


def _require_linear_finest_level(stack, name: str) -> None:
    if len(stack.res_blocks[-1]) != 0:
        raise ValueError(f"well_posed needs a config whose {name} has no residual blocks at its finest level")


@torch.no_grad()
def _make_well_posed(
    net: MoGe2Network,
    focal: float,
    depth: float,
    tilt: float,
    image_detail: float,
    invalid_share: float,
    metric_scale: float,
) -> None:
    neck, points = net.neck, net.points_head
    _require_linear_finest_level(neck, "neck")
    _require_linear_finest_level(points, "points_head")
    image = calibration_image(448, 252)
    num_tokens = 300
    aspect = image.shape[-1] / image.shape[-2]

    # 1. The neck's finest output becomes exactly linear in uv: W_n uv + b_n.
    last = neck.resamplers[-1][-1]
    last.weight.zero_()
    last.bias.zero_()
    w_n = neck.input_blocks[-1].weight[:, :, 0, 0]
    b_n = neck.input_blocks[-1].bias
    if isinstance(neck.output_blocks[-1], nn.Conv2d):
        o = neck.output_blocks[-1]
        w_n, b_n = o.weight[:, :, 0, 0] @ w_n, o.weight[:, :, 0, 0] @ b_n + o.bias

    # 2. Points head: features h = R(image) + P uv + q at the finest level; solve the output conv.
    a_p = points.input_blocks[-1]
    p_mat = a_p.weight[:, :, 0, 0] @ w_n
    q_vec = a_p.weight[:, :, 0, 0] @ b_n + a_p.bias
    k = 1.0 / focal
    target_m = torch.tensor([[k, 0.0], [0.0, k], [tilt, 0.0]])
    target_n = torch.tensor([0.0, 0.0, math.log(depth)])
    out_w = target_m @ torch.linalg.pinv(p_mat)
    out_b = target_n - out_w @ q_vec
    points.output_blocks[-1].weight.copy_(out_w[:, :, None, None])
    points.output_blocks[-1].bias.copy_(out_b)

    neck_out, cls_token = net.neck_features(image, num_tokens)
    rows, cols = token_grid(num_tokens, aspect)
    uv = net.uv_planes(rows, cols, aspect, torch.float32, None)[-1][0].flatten(1)  # (2, pixels)
    # Scale the image-dependent term so that it moves log-depth, and x/z, y/z relative to k, by about
    # `image_detail` (the largest std over pixels of the three).
    h_p = _finest_head_input(points, neck_out)
    image_term = out_w @ (h_p - (p_mat @ uv + q_vec[:, None]))
    spread = max(float(image_term[0].std()) / k, float(image_term[1].std()) / k, float(image_term[2].std()))
    conv = points.resamplers[-1][-1]
    factor = image_detail / spread if spread > 0 else 0.0
    conv.weight.mul_(factor)
    conv.bias.mul_(factor)

    # 3. Mask head: logits with a spread of ~3 and `invalid_share` of the calibration pixels below 0.
    if hasattr(net, "mask_head"):
        mask_conv = net.mask_head.output_blocks[-1]
        logits = mask_conv.weight[:, :, 0, 0] @ _finest_head_input(net.mask_head, neck_out) + mask_conv.bias[:, None]
        scale = 3.0 / float(logits.std().clamp_min(1e-12))
        mask_conv.weight.mul_(scale)
        mask_conv.bias.mul_(scale)
        shift = torch.quantile(logits[0] * scale, invalid_share)
        mask_conv.bias.sub_(shift)

    # 4. Normal head: unit-order raw vectors, so normalisation is well conditioned.
    if hasattr(net, "normal_head"):
        n_conv = net.normal_head.output_blocks[-1]
        raw = n_conv.weight[:, :, 0, 0] @ _finest_head_input(net.normal_head, neck_out) + n_conv.bias[:, None]
        s = 1.0 / float(raw.norm(dim=0).median().clamp_min(1e-12))
        n_conv.weight.mul_(s)
        n_conv.bias.mul_(s)

    # 5. Scale head: exp(output) near `metric_scale`, varying a little with the image.
    if hasattr(net, "scale_head"):
        lin = net.scale_head[-1]
        lin.weight.mul_(0.1)
        lin.bias.mul_(0.1)
        current = float(net.scale_head(cls_token)[0, 0])
        lin.bias.add_(math.log(metric_scale) - current)


def add_outlier_channels(net: MoGe2Network, seed: int = 1) -> MoGe2Network:
    """Give the ViT of `net` (in place) the activation outliers of trained ViTs (DINOv2 among them): in every
    block 4 LayerNorm channels 40x larger before attention and before the MLP (the inputs of qkv and fc1), and 8
    MLP hidden channels 20x larger (the input of fc2). The test case of the int8 smoothing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in net.encoder.backbone.blocks:
            for norm in (block.norm1, block.norm2):
                idx = torch.randperm(norm.weight.numel(), generator=gen)[:4]
                norm.weight[idx] *= 40
                norm.bias[idx] *= 40
            fc1 = block.mlp.fc1 if hasattr(block.mlp, "fc1") else block.mlp.w12
            idx = torch.randperm(fc1.out_features, generator=gen)[:8]
            fc1.weight[idx] *= 20
            fc1.bias[idx] *= 20
    return net


def add_residual_outliers(
    net: MoGe2Network,
    channels: int = 4,
    low: float = 50.0,
    high: float = 300.0,
    seed: int = 2,
    image: Optional[torch.Tensor] = None,
    num_tokens: int = 300,
) -> dict:
    """Plant DINOv2's massive activations in the ViT of `net` (in place): `channels` channels of the residual stream
    (the same in every block) whose magnitude grows with depth from `low` to `high` times the stream's median
    magnitude after the first and the last block the encoder runs, by an update per block in those channels (the output
    projection of the MLP zeroed there, its bias set, LayerScale 1). As in trained DINOv2, the channels are a
    handful and dwarf the rest; the graph's layer norms then subtract means and divide by deviations they dominate.
    The medians are measured on `image` (a calibration image, default 224x126) at `num_tokens`. Returns
    {"channels": [...], "ratios": [the planted magnitude / the median after each block]}."""
    blocks = net.encoder.backbone.blocks
    image = calibration_image(224, 126, seed=1) if image is None else image
    gen = torch.Generator().manual_seed(seed)
    dim = blocks[0].norm1.weight.numel()
    picked = torch.randperm(dim, generator=gen)[:channels]
    signs = torch.where(torch.rand(channels, generator=gen) < 0.5, -1.0, 1.0)

    def after_each_block(keep) -> list:  # keep(residual stream) after each block the encoder runs, in order
        seen = []
        hooks = [b.register_forward_hook(lambda m, i, o: seen.append(keep(o.detach()))) for b in blocks]
        try:
            with torch.inference_mode():
                net.encoder(image, *token_grid(num_tokens, image.shape[-1] / image.shape[-2]))
        finally:
            for h in hooks:
                h.remove()
        return seen

    def medians() -> list:  # the residual stream's median |x| after each block
        return after_each_block(lambda x: x.abs().median().item())

    before = medians()  # the blocks the encoder runs (up to its last tap)
    last = max(1, len(before) - 1)
    previous = torch.zeros(channels)
    with torch.no_grad():
        for i, block in enumerate(blocks[: len(before)]):
            target = before[i] * (low + (high - low) * i / last) * signs
            fc2 = block.mlp.fc2 if hasattr(block.mlp, "fc2") else block.mlp.w3
            fc2.weight[picked] = 0.0
            fc2.bias[picked] = target - previous
            block.ls2.gamma[picked] = 1.0
            previous = target
    after = medians()
    stream = after_each_block(lambda x: x)
    ratios = [float(x[..., picked].abs().min() / m) for x, m in zip(stream, after)]
    return {"channels": picked.tolist(), "ratios": ratios}


def make_network(
    preset: Union[str, dict] = "tiny-vits-normal",
    seed: int = 0,
    well_posed: bool = True,
    focal: float = 1.2,
    depth: float = 3.0,
    tilt: float = 0.5,
    image_detail: float = 0.01,
    invalid_share: float = 0.25,
    metric_scale: float = 2.0,
) -> MoGe2Network:
    """A random-weight MoGe2Network (see the module docstring for `well_posed`)."""
    cfg = model_config(preset)
    with torch.random.fork_rng():  # deterministic per seed, and the caller's RNG state is left alone
        torch.manual_seed(seed)
        net = MoGe2Network(MoGe2Config.parse(cfg)).eval()
        _init_backbone(net)
    if well_posed:
        _make_well_posed(net, focal, depth, tilt, image_detail, invalid_share, metric_scale)
    return net


def make_checkpoint(
    path: Union[str, os.PathLike],
    preset: Union[str, dict] = "tiny-vits-normal",
    seed: int = 0,
    **well_posed_kwargs: Any,
) -> Path:
    """Write a random-weight MoGe-2 `model.pt` (upstream format) and return its path.

    `path` may be a directory (then `model.pt` is written inside it). Keyword arguments go to `make_network`.
    """
    path = Path(path)
    if path.suffix != ".pt":
        path = path / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    net = make_network(preset, seed=seed, **well_posed_kwargs)
    tmp = path.with_suffix(".tmp")
    torch.save({"model_config": model_config(preset), "model": net.state_dict()}, tmp)
    os.replace(tmp, path)
    return path
