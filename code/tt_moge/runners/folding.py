"""The weight folds of MoGe-2 for one canvas and one token budget: `fold(network, canvas_size, num_tokens)`.

Everything that depends only on the weights and the fixed shape, computed once, as plain float32 tensors (on the
network's device) in a `Folds`. No module is built: the fixed-shape torch graph (`fixed_graph.FixedShapeMoGe2`:
the CPU and CUDA runners, the ONNX export) lays these tensors out in its modules, and the Tenstorrent runner
(`ttnn/prepare.py`) turns them into numpy arrays. The folds:

* the ImageNet normalisation is folded into the patch-embedding conv;
* the class token, register tokens and the position embedding (resized for the token grid) are one
  precomputed prefix / additive table;
* LayerScale is folded into the attention and MLP output projections, the attention scale into the q rows of
  the qkv projection (`fold_block`);
* the encoder's per-layer 1x1 output projections and the neck's first 1x1 input conv are one matrix over the
  four normed intermediate layers (no non-linearity between them); the uv half of that conv and the neck's
  uv input convs of the other levels are constant maps;
* the finest level (no residual blocks there in MoGe-2: last resampler conv, the neck's and each head's 1x1
  convs) is linear, so every head's output there is `conv3x3(head upsample) + conv3x3(neck upsample) +
  constant map`, with the 1x1 convs multiplied into the 3x3 kernels: 7 output channels instead of 4 x 32.

What is not folded (the norms, the coarse levels of the neck and heads, the upsampling before the finest conv,
the scale head) is handed on as the network's own modules, not copies: read only. The upsampling before the
finest conv is folded by each fast path when it lays the folds out, with one function (`phase_fold`: the finest
conv at the coarse level, four phases of output channels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..network import MoGe2Network, token_grid

__all__ = [
    "HEADS",
    "BlockFolds",
    "Folds",
    "fold",
    "fold_block",
    "fold_encoder",
    "fold_finest",
    "fold_patch_embed",
    "grid",
    "phase_fold",
    "token_tables",
    "upsample_mode",
]

HEADS = ("points", "normal", "mask")  # the dense heads, in the order their channels are stacked

# A 2x upsampling (align_corners=False) seen from the upsampled signal: the fine sample at position p = -1 .. 2
# around the coarse pixel i's pair (2i, 2i + 1) as weights of the coarse samples i - 1, i, i + 1 (replicate-padded,
# which also replicate-pads the fine signal).
PHASE_TAPS = {
    "bilinear": ((0.75, 0.25, 0.0), (0.25, 0.75, 0.0), (0.0, 0.75, 0.25), (0.0, 0.25, 0.75)),
    "nearest": ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)),
}


@dataclass(frozen=True)
class BlockFolds:
    """One DINOv2 block (`network/vit.py` `Block`) with LayerScale folded into `attn_out` and `ffn_out`, and the
    attention scale 1/sqrt(head_dim) into the q rows of `qkv`. Each linear is (weight (out, in), bias (out,))
    float32; `ffn_in` is the MLP's first matmul (`fc1`, or SwiGLU's `w12` when `swiglu`). `norm1`, `norm2`: the
    block's LayerNorms."""

    norm1: nn.Module
    norm2: nn.Module
    num_heads: int
    swiglu: bool
    qkv: tuple
    attn_out: tuple
    ffn_in: tuple
    ffn_out: tuple


@dataclass(frozen=True)
class Folds:
    """The folded weights of one network for one canvas (width, height) and token budget (see the module's
    docstring). Tensors are float32 on the network's device; modules are the network's own."""

    canvas_size: tuple  # (width, height)
    num_tokens: int
    rows: int  # the token grid
    cols: int
    patch: int  # the ViT's patch size
    num_prefix: int  # class token + register tokens
    layers: list  # the ViT blocks whose (normed) outputs feed the neck
    remap: str  # the points' output remap (`network.moge2.remap_points`)
    # encoder
    patch_weight: torch.Tensor  # (C, 3, patch, patch): the patch conv with the normalisation folded in
    patch_bias: torch.Tensor  # (C,)
    token_prefix: torch.Tensor  # (1, P, C): class token (+ its position) and register tokens
    patch_pos: torch.Tensor  # (1, rows * cols, C): the patch tokens' position embedding
    blocks: list  # BlockFolds of the blocks up to the last tapped one
    final_norm: nn.Module  # the ViT's final LayerNorm, applied to every tap
    neck_in0: torch.Tensor  # (d0, taps * C): the taps' projections times the neck's level-0 conv
    neck_in0_const: torch.Tensor  # (rows * cols, d0): its uv half and every bias, a constant map
    # decoder
    neck: nn.Module  # the neck (`ConvStack`): its coarse levels run as they are
    neck_consts: dict  # {level: (1, d, H, W)} the neck's uv inputs of levels 1 .. levels - 2, constant maps
    heads: dict  # {name: the head's ConvStack}, in HEADS order, the heads the network has
    neck_up: tuple  # the modules of the neck's last resampler before its 3x3 conv (the 2x upsample)
    neck_fold: torch.Tensor  # (sum of head channels, C_neck, 3, 3): the neck's finest conv into every head's output
    head_ups: list  # per head, as `neck_up`
    head_folds: list  # per head (channels, C_head, 3, 3): its finest conv times its 1x1 output conv
    head_channels: list  # per head, its output channels (points 3, normal 3, mask 1)
    finest_const: torch.Tensor  # (1, sum of head channels, H_L, W_L): the finest level's constant part
    scale_head: Optional[nn.Module]  # the metric scale MLP on the class token, or None

    @property
    def num_levels(self) -> int:
        return len(self.neck.res_blocks)


def fold_block(block) -> BlockFolds:
    """A `network/vit.py` `Block` -> its `BlockFolds`."""
    with torch.no_grad():
        g1, g2 = block.ls1.gamma.detach().float(), block.ls2.gamma.detach().float()
        num_heads = block.attn.num_heads
        dim = block.attn.qkv.in_features
        q_scale = torch.ones(3 * dim, device=g1.device)
        q_scale[:dim] = (dim // num_heads) ** -0.5
        mlp = block.mlp
        swiglu = hasattr(mlp, "w12")
        ffn_in, out = (mlp.w12, mlp.w3) if swiglu else (mlp.fc1, mlp.fc2)
        return BlockFolds(
            norm1=block.norm1,
            norm2=block.norm2,
            num_heads=num_heads,
            swiglu=swiglu,
            qkv=(q_scale[:, None] * block.attn.qkv.weight.float(), q_scale * block.attn.qkv.bias.float()),
            attn_out=(g1[:, None] * block.attn.proj.weight.float(), g1 * block.attn.proj.bias.float()),
            ffn_in=(ffn_in.weight.float(), ffn_in.bias.float()),
            ffn_out=(g2[:, None] * out.weight.float(), g2 * out.bias.float()),
        )


def upsample_mode(modules: tuple) -> Optional[str]:
    """ "bilinear" or "nearest" when `modules` (a resampler's modules before its conv) are one plain 2x upsampling
    that `phase_fold` folds (align_corners=False), else None."""
    if len(modules) != 1 or not isinstance(modules[0], nn.Upsample):
        return None
    up = modules[0]
    if up.scale_factor not in (2, 2.0, (2, 2), (2.0, 2.0)) or up.mode not in PHASE_TAPS:
        return None
    return None if up.mode == "bilinear" and up.align_corners else up.mode


def phase_fold(weight: torch.Tensor, mode: str = "bilinear") -> torch.Tensor:
    """(O, C, 3, 3) kernel of a replicate-padded 3x3 conv applied after a 2x `mode` upsampling -> the (4 O, C, 3, 3)
    kernel of the equivalent replicate-padded 3x3 conv at the low resolution; output channel (2 a + b) O + o is
    output channel o at high-resolution pixel (2 i + a, 2 j + b). The same function on a quarter of the pixels,
    without the upsampled map. Computed in float64, returned in `weight`'s dtype."""
    if mode not in PHASE_TAPS:
        raise ValueError(f"phase_fold: mode must be one of {sorted(PHASE_TAPS)}, got {mode!r}")
    taps = torch.tensor(PHASE_TAPS[mode], dtype=torch.float64, device=weight.device)  # (4 positions, 3 taps)
    w = weight.to(torch.float64)
    phases = [torch.einsum("ocyx,yt,xs->octs", w, taps[a : a + 3], taps[b : b + 3]) for a in (0, 1) for b in (0, 1)]
    return torch.cat(phases).to(weight.dtype)


def token_tables(vit, rows: int, cols: int) -> tuple:
    """The ViT's token tables for a rows x cols grid, float32: (prefix (1, P, C): the class token plus its position
    embedding, then the register tokens; the patch tokens' position embedding (1, rows * cols, C))."""
    with torch.no_grad():
        pos = vit.position_embedding(rows, cols).detach().float()
        prefix = [vit.cls_token.detach().float() + pos[:, :1]]
        if vit.register_tokens is not None:
            prefix.append(vit.register_tokens.detach().float())
        return torch.cat(prefix, dim=1), pos[:, 1:]


def grid(canvas_size: tuple, num_tokens: int) -> tuple:
    """(width, height, aspect, rows, cols): the canvas and the token grid of a token budget on it."""
    width, height = (int(v) for v in canvas_size)
    aspect = width / height
    rows, cols = token_grid(num_tokens, aspect)
    return width, height, aspect, rows, cols


def fold_patch_embed(network: MoGe2Network, rows: int, cols: int) -> dict:
    """The patch embedding's folds for a rows x cols grid (the encoder's normalisation and the ViT's patch conv and
    token tables only): the `Folds` fields patch_weight, patch_bias, token_prefix, patch_pos."""
    enc, vit = network.encoder, network.encoder.backbone
    with torch.no_grad():
        # (x - mean) / std -> patch conv  ==  conv with weight W / std and bias b - sum(W * mean / std)
        proj = vit.patch_embed.proj
        mean, std = enc.image_mean.detach().float().view(-1), enc.image_std.detach().float().view(-1)
        w = proj.weight.detach().float() / std[None, :, None, None]
        b = proj.bias.detach().float() - (w * mean[None, :, None, None]).sum(dim=(1, 2, 3))
        token_prefix, patch_pos = token_tables(vit, rows, cols)
    return {"patch_weight": w, "patch_bias": b, "token_prefix": token_prefix, "patch_pos": patch_pos}


def fold_neck_in0(network: MoGe2Network, rows: int, cols: int, aspect: float) -> dict:
    """The taps' projections times the neck's level-0 conv (its input blocks and the encoder's output projections
    only): the `Folds` fields neck_in0, neck_in0_const."""
    enc, neck = network.encoder, network.neck
    device = next(network.parameters()).device
    with torch.no_grad():
        uv0 = network.uv_planes(rows, cols, aspect, torch.float32, device)[0][0].flatten(1)  # (2, rows*cols)
        # Level 0 of the neck: conv1x1(cat(sum_i P_i LN_i + p, uv0)) == [LN_5 | LN_11 | ...] @ W^T + const map.
        in0 = neck.input_blocks[0]
        if not isinstance(in0, nn.Conv2d):
            raise ValueError("the neck's level-0 input must be a 1x1 conv over (features, uv)")
        w_in = in0.weight.detach().float()[:, :, 0, 0]
        feat_dim = w_in.shape[1] - 2
        w_feat, w_uv = w_in[:, :feat_dim], w_in[:, feat_dim:]
        mats, bias = [], in0.bias.detach().float().clone()
        for conv in enc.output_projections:
            p_w, p_b = _matrix(conv, 0, conv.weight.device)
            mats.append(w_feat @ p_w)
            bias += w_feat @ p_b
        return {
            "neck_in0": torch.cat(mats, dim=1),
            "neck_in0_const": (w_uv @ uv0 + bias[:, None]).t().contiguous(),  # (rows*cols, d0)
        }


def fold_encoder(network: MoGe2Network, rows: int, cols: int, aspect: float) -> dict:
    """The encoder's folds (the patch embedding's, the blocks' up to the last tap, the level-0 fold): the `Folds`
    fields patch_weight .. neck_in0_const, and layers."""
    layers = list(network.encoder.layers)
    vit = network.encoder.backbone
    return {
        "layers": layers,
        **fold_patch_embed(network, rows, cols),
        "blocks": [fold_block(blk) for blk in list(vit.blocks)[: max(layers) + 1]],
        "final_norm": vit.norm,
        **fold_neck_in0(network, rows, cols, aspect),
    }


def fold_finest(network: MoGe2Network, rows: int, cols: int, aspect: float) -> dict:
    """The finest level's fold (the neck's and the heads' last resamplers and 1x1 convs, the neck's last uv input
    only): the `Folds` fields heads, neck_up, neck_fold, head_ups, head_folds, head_channels, finest_const."""
    neck = network.neck
    last = len(neck.res_blocks) - 1
    device = next(network.parameters()).device
    with torch.no_grad():
        uv = network.uv_planes(rows, cols, aspect, torch.float32, device)
        heads = {h: getattr(network, h + "_head") for h in HEADS if getattr(network, h + "_head", None) is not None}
        return {"heads": heads, **_fold_finest(neck, heads, neck.input_blocks[last](uv[last]).float(), last)}


def fold(network: MoGe2Network, canvas_size: tuple, num_tokens: int) -> Folds:
    """The folds of `network` for a canvas (width, height) and a token budget. Raises ValueError for a structure
    the finest-level fold does not cover (residual blocks at the finest level, a neck whose level-0 input is not
    a 1x1 conv, a last resampler that does not end in a 3x3 replicate-padded conv). The parts' folds alone:
    `fold_patch_embed`, `fold_encoder`, `fold_finest`."""
    width, height, aspect, rows, cols = grid(canvas_size, num_tokens)
    vit = network.encoder.backbone
    device = next(network.parameters()).device
    neck = network.neck
    last = len(neck.res_blocks) - 1
    with torch.no_grad():
        uv = network.uv_planes(rows, cols, aspect, torch.float32, device)
        return Folds(
            canvas_size=(width, height),
            num_tokens=int(num_tokens),
            rows=rows,
            cols=cols,
            patch=vit.spec.patch_size,
            num_prefix=1 + vit.spec.num_register_tokens,
            remap=network.config.remap_output,
            **fold_encoder(network, rows, cols, aspect),
            neck=neck,
            # the neck's uv inputs of levels 1..last are constant maps (the last one goes into the finest fold)
            neck_consts={i: neck.input_blocks[i](uv[i]).detach() for i in range(1, last)},
            scale_head=getattr(network, "scale_head", None),
            **fold_finest(network, rows, cols, aspect),
        )


def _fold_finest(neck: nn.Module, heads: dict, neck_const: torch.Tensor, last: int) -> dict:
    """The finest level as `conv3x3(head upsample) + conv3x3(neck upsample) + constant map` per head: the `Folds`
    fields neck_up, neck_fold, head_ups, head_folds, head_channels, finest_const."""
    for name, stack in [("neck", neck)] + list(heads.items()):
        if len(stack.res_blocks[last]) != 0:
            raise ValueError(f"the finest-level fold needs no residual blocks at the finest level ({name} has some)")
    n_up, n_conv = _split_resampler(neck.resamplers[last - 1])
    on_w, _ = _matrix(neck.output_blocks[last], n_conv.out_channels, n_conv.weight.device)
    kernels_neck, head_ups, head_folds, consts = [], [], [], []
    zero_neck = torch.zeros(1, n_conv.in_channels, *neck_const.shape[-2:], device=neck_const.device)
    neck_const_out = neck.output_blocks[last](n_conv(zero_neck) + neck_const)  # the neck's finest output at u = 0
    for stack in heads.values():
        h_up, h_conv = _split_resampler(stack.resamplers[last - 1])
        ih_w, _ = _matrix(stack.input_blocks[last], h_conv.out_channels, h_conv.weight.device)
        oh_w, _ = _matrix(stack.output_blocks[last], h_conv.out_channels, h_conv.weight.device)
        kernels_neck.append(_fold_kernel(oh_w @ ih_w @ on_w, n_conv))
        head_ups.append(h_up)
        head_folds.append(_fold_kernel(oh_w, h_conv))
        zero_head = torch.zeros(1, h_conv.in_channels, *neck_const.shape[-2:], device=neck_const.device)
        consts.append(stack.output_blocks[last](h_conv(zero_head) + stack.input_blocks[last](neck_const_out)))
    return {
        "neck_up": n_up,
        "neck_fold": torch.cat(kernels_neck),
        "head_ups": head_ups,
        "head_folds": head_folds,
        "head_channels": [k.shape[0] for k in kernels_neck],
        "finest_const": torch.cat(consts, dim=1).float(),  # (1, sum out, H_L, W_L)
    }


def _matrix(conv: nn.Module, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (out, in), bias (out,)) of a 1x1 conv, or the identity for nn.Identity (float32, on `device`:
    the network's, so that the folds also build on a GPU)."""
    if isinstance(conv, nn.Identity):
        return torch.eye(channels, device=device), torch.zeros(channels, device=device)
    if not (isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1)):
        raise ValueError(f"expected a 1x1 conv or identity, got {conv}")
    return conv.weight.detach().float()[:, :, 0, 0], conv.bias.detach().float()


def _split_resampler(resampler: nn.Sequential) -> tuple[tuple, nn.Conv2d]:
    """A resampler = (its upsampling modules, final 3x3 replicate-padded conv)."""
    last = resampler[-1]
    if not (isinstance(last, nn.Conv2d) and last.kernel_size == (3, 3) and last.padding_mode == "replicate"):
        raise ValueError(f"the finest-level fold expects a resampler ending in a 3x3 replicate conv, got {resampler}")
    return tuple(resampler)[:-1], last


def _fold_kernel(matrix: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """The 3x3 kernel of `matrix @ conv` (a 1x1 conv after a 3x3 conv, without the bias), float32."""
    return torch.einsum("om,mikl->oikl", matrix, conv.weight.detach().float())
