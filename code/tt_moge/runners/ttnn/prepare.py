"""The torch side of the Tenstorrent runner: export the fixed-shape folds as numpy arrays for the ttnn graph,
and the numpy host steps around the device forward.

`prepare_weights(network, canvas_size, num_tokens)` takes the weight folds of `runners.folding.fold` (the one
source of the folds, shared with the CPU and CUDA graph and the ONNX export: normalisation in the patch
embedding, prefix / position table, LayerScale, attention scale, the taps' projections + the neck's level-0
conv, uv constant maps, the finest-level fold) and lays them out the way `graph.TtnnGraph` consumes them. The
result, `Prepared`, is a JSON-able `plan` (every shape and structural choice) plus a dict of float32 arrays, saved
as one .npz that numpy alone can read (the ttnn process has no torch).

Two layout decisions are made here, not in the graph:

* Token order. The device sequence is [patch tokens (row-major grid), class token, register tokens]: the
  prefix goes last, so the patch rows that feed the decoder are the leading rows (a slice from 0) and the
  class token is one row after them. Attention and every per-token op are indifferent to the order (the
  position embedding is added before the first block). The patch embedding is one matmul over host-unfolded
  patches; the prefix rows of the uploaded patch matrix are zero, so `patches @ W + table` gives the prefix
  tokens from `table` alone (no concat on the device).
* The finest level. MoGe-2's last resampler is a 2x bilinear (or nearest) upsample followed by a 3x3
  replicate-padded conv, which the fold has already merged with the 1x1 convs after it (7 output
  channels). Upsample-then-conv equals a 3x3 replicate-padded conv at the *coarser* level with 4x the output
  channels, one group per output phase (row parity, column parity), followed by a depth-to-space: each
  high-resolution tap is a fixed combination of the three low-resolution neighbours, and replicate padding of
  the low-resolution map reproduces both the upsample's edge clamp and the high-resolution replicate padding.
  So the device never holds a map at the finest resolution; the host interleaves the phases
  (`host_output`).

The host helpers (`host_input`, `host_output`, `resize_bilinear`, `resize_antialiased`) use numpy only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

__all__ = [
    "Prepared",
    "prepare_weights",
    "prepare_patch_embed",
    "prepare_encoder",
    "prepare_finest",
    "shapes",
    "host_input",
    "host_output",
    "depth_to_space",
    "phase_fold",
    "convt_as_matmul",
    "resize_bilinear",
    "resize_antialiased",
    "resize_taps",
    "block_arrays",
    "stack_arrays",
    "PLAN_VERSION",
]

PLAN_VERSION = 1
TILE = 32
_PLAN_KEY = "__plan__"

# Coefficients of x[i-1], x[i], x[i+1] (low resolution) in the 2x upsampled map at high-resolution position
# 2i + p, for p = -1, 0, 1, 2 (the positions a 3x3 conv at output phase 0 or 1 reads). Edge clamping is done by
# replicate-padding x by one pixel.
# ------------------------------------------------------------------------------------------- Prepared


@dataclass
class Prepared:
    """What the ttnn graph needs for one network, canvas size and token budget.

    plan: JSON-able dict of shapes and structure (see `prepare_weights`). arrays: name -> float32 array.
    """

    plan: dict
    arrays: dict

    def save(self, path: Union[str, os.PathLike]) -> None:
        """One .npz (uncompressed): the arrays, and the plan as a JSON string under `__plan__`."""
        path = os.fspath(path)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            np.savez(f, **{_PLAN_KEY: np.array(json.dumps(self.plan))}, **self.arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Prepared":
        """Read a .npz written by `save` (numpy only, no pickle)."""
        with np.load(os.fspath(path), allow_pickle=False) as data:
            if _PLAN_KEY not in data.files:
                raise ValueError(f"{path}: not a prepared ttnn graph (no {_PLAN_KEY!r} entry)")
            plan = json.loads(str(data[_PLAN_KEY]))
            arrays = {k: np.ascontiguousarray(data[k]) for k in data.files if k != _PLAN_KEY}
        if plan.get("version") != PLAN_VERSION:
            raise ValueError(f"{path}: plan version {plan.get('version')}, this code reads version {PLAN_VERSION}")
        return cls(plan, arrays)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


# ------------------------------------------------------------------------------------- prepare_weights


def phase_fold(weight: np.ndarray, mode: str = "bilinear") -> np.ndarray:
    """`folding.phase_fold` on a numpy kernel, as float32: the finest conv's kernel at the low resolution (output
    channel (2 a + b) O + o is channel o at high-resolution pixel (2 i + a, 2 j + b), see `depth_to_space`)."""
    import torch

    from .. import folding

    return folding.phase_fold(torch.from_numpy(np.asarray(weight, np.float64)), mode).numpy().astype(np.float32)


def convt_as_matmul(weight: np.ndarray, bias: np.ndarray, before: Optional[tuple] = None) -> tuple:
    """A 2x2 stride-2 conv transpose (weight (C_in, C_out, 2, 2), bias (C_out,)) as one matmul per input pixel:
    (C_in, 4 C_out) whose column (2 a + b) C_out + c gives output channel c at output pixel (2 i + a, 2 j + b),
    and its bias (4 C_out,). `before`: a 1x1 conv applied first, (w (C, C_in) in the matmul layout, b (C_in,)),
    folded in (both are per-pixel linear maps, so the composition is exact)."""
    c_in, c_out = weight.shape[:2]
    w = np.asarray(weight, np.float64).transpose(0, 2, 3, 1).reshape(c_in, 4 * c_out)
    b = np.tile(np.asarray(bias, np.float64), 4)
    if before is not None:
        w_in, b_in = (np.asarray(v, np.float64) for v in before)
        w, b = w_in @ w, b_in @ w + b
    return w.astype(np.float32), b.astype(np.float32)


def depth_to_space(phases: np.ndarray, height: int, width: int) -> np.ndarray:
    """(height * width, 4 C) phase maps at the low resolution (row-major pixels) -> (C, 2 height, 2 width)."""
    channels = phases.shape[-1] // 4
    x = np.asarray(phases, dtype=np.float32).reshape(height, width, 2, 2, channels)
    return np.ascontiguousarray(x.transpose(4, 0, 2, 1, 3).reshape(channels, 2 * height, 2 * width))


def _supported(network) -> None:
    """Refuse, with the reason, what the ttnn graph does not implement (structures the published MoGe-2
    checkpoints do not use)."""
    from .. import folding

    cfg = network.config
    if cfg.backbone.ffn != "mlp":
        raise ValueError(
            f"the ttnn graph runs DINOv2 backbones with a GELU MLP; {cfg.backbone_name} uses {cfg.backbone.ffn}"
        )
    stacks = [("neck", cfg.neck)] + [
        (h, getattr(cfg, h)) for h in ("points_head", "normal_head", "mask_head") if getattr(cfg, h) is not None
    ]
    for name, stack in stacks:
        if stack.res_block_in_norm != "none" or stack.res_block_hidden_norm != "none":
            raise ValueError(
                f"the ttnn graph runs residual blocks without norms; {name} has "
                f"{stack.res_block_in_norm}/{stack.res_block_hidden_norm}"
            )
        if stack.activation != "relu":
            raise ValueError(f"the ttnn graph runs ReLU residual blocks; {name} uses {stack.activation}")
        *inner, last = stack.resamplers
        if any(kind != "conv_transpose" for kind in inner):
            raise ValueError(
                f"the ttnn graph runs conv_transpose resamplers between the coarse levels; {name} has {inner}"
            )
        if last not in folding.PHASE_TAPS:
            raise ValueError(f"the ttnn graph folds a bilinear or nearest last resampler; {name} has {last!r}")
    if network.config.neck.num_levels < 3:
        raise ValueError("the ttnn graph needs at least 3 decoder levels")


def _t(x) -> np.ndarray:
    """A tensor as a float32 numpy array of its own (never a view of the network's weights)."""
    return x.detach().float().cpu().numpy().copy()


def _linear_into(arrays: dict, key: str, linear: tuple) -> None:
    """(weight (out, in), bias (out,)) -> `key.w` (in, out) (the ttnn.linear layout), `key.b` (out,)."""
    weight, bias = linear
    arrays[key + ".w"] = np.ascontiguousarray(_t(weight).T)
    arrays[key + ".b"] = _t(bias)


def _conv1x1_into(arrays: dict, key: str, module) -> bool:
    """A 1x1 conv as a linear layer over channels-last pixels; False (nothing stored) for nn.Identity."""
    import torch.nn as nn

    if isinstance(module, nn.Identity):
        return False
    if not (isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1)):
        raise ValueError(f"{key}: expected a 1x1 conv or identity, got {module}")
    arrays[key + ".w"] = np.ascontiguousarray(_t(module.weight)[:, :, 0, 0].T)
    arrays[key + ".b"] = _t(module.bias)
    return True


def _conv3x3_into(arrays: dict, key: str, conv) -> None:
    """A 3x3 replicate-padded conv: `key.w` (out, in, 3, 3) (OIHW, what ttnn.conv2d prepares), `key.b` (out,)."""
    if not (
        conv.kernel_size == (3, 3)
        and conv.padding == (1, 1)
        and conv.padding_mode == "replicate"
        and conv.stride == (1, 1)
    ):
        raise ValueError(f"{key}: expected a 3x3 replicate-padded conv, got {conv}")
    arrays[key + ".w"] = _t(conv.weight)
    arrays[key + ".b"] = _t(conv.bias)


def _stack_into(arrays: dict, key: str, stack, levels: int, with_inputs: bool) -> dict:
    """The coarse levels (0 .. levels - 2) of a conv stack: residual blocks, 1x1 input / output convs,
    conv-transpose resamplers between them. Returns the stack's plan."""
    import torch.nn as nn

    plan = {"res_blocks": [], "hidden": [], "inputs": [], "outputs": []}
    for i in range(levels - 1):
        blocks = list(stack.res_blocks[i])
        plan["res_blocks"].append(len(blocks))
        plan["hidden"].append(blocks[0].layers[2].out_channels if blocks else None)
        for j, block in enumerate(blocks):
            norm1, act1, conv1, norm2, act2, conv2 = block.layers
            if not all(isinstance(m, nn.Identity) for m in (norm1, norm2)) or not all(
                isinstance(m, nn.ReLU) for m in (act1, act2)
            ):
                raise ValueError(f"{key}.res.{i}.{j}: expected identity norms and ReLU, got {block.layers}")
            _conv3x3_into(arrays, f"{key}.res.{i}.{j}.conv1", conv1)
            _conv3x3_into(arrays, f"{key}.res.{i}.{j}.conv2", conv2)
        plan["inputs"].append(_conv1x1_into(arrays, f"{key}.in.{i}", stack.input_blocks[i]) if with_inputs else False)
        plan["outputs"].append(_conv1x1_into(arrays, f"{key}.out.{i}", stack.output_blocks[i]))
        if i < levels - 2:
            convt, conv = stack.resamplers[i]
            if not (
                isinstance(convt, nn.ConvTranspose2d)
                and convt.kernel_size == (2, 2)
                and convt.stride == (2, 2)
                and convt.padding == (0, 0)
            ):
                raise ValueError(f"{key}.up.{i}: expected a 2x2 stride-2 conv transpose, got {convt}")
            arrays[f"{key}.up.{i}.convt.w"] = _t(convt.weight)  # (in, out, 2, 2): ttnn's (and torch's) layout
            arrays[f"{key}.up.{i}.convt.b"] = _t(convt.bias)
            _conv3x3_into(arrays, f"{key}.up.{i}.conv", conv)
    return plan


def _block_into(arrays: dict, key: str, block) -> None:
    """A block's folds (`folding.BlockFolds`: LayerScale and the attention scale folded) -> its norms and matmuls
    under `key`."""
    if block.swiglu:
        raise ValueError("the ttnn graph runs GELU MLP blocks")
    for norm in ("norm1", "norm2"):
        arrays[f"{key}.{norm}.w"] = _t(getattr(block, norm).weight)
        arrays[f"{key}.{norm}.b"] = _t(getattr(block, norm).bias)
    for name in ("qkv", "attn_out", "ffn_in", "ffn_out"):
        _linear_into(arrays, f"{key}.{name}", getattr(block, name))


def block_arrays(block) -> tuple:
    """One `network/vit.py` `Block` -> (the weights of `vit_block.VitBlock` ({"norm1.w", ..., "ffn_out.b"}), folded
    as `prepare_weights` folds every block (`folding.fold_block`: one source of the folds), {"num_heads",
    "ln_eps"})."""
    from .. import folding

    folds = folding.fold_block(block)
    arrays: dict = {}
    _block_into(arrays, "b", folds)
    return {k[2:]: v for k, v in arrays.items()}, {"num_heads": folds.num_heads, "ln_eps": float(folds.norm1.eps)}


def stack_arrays(stack, levels: int, with_inputs: bool) -> tuple:
    """One `network/convstack.py` `ConvStack` (the neck's or a head's; `levels` of them) -> (its coarse levels'
    weights for `decoder.ConvStack`, without a prefix ("res.1.0.conv1.w", "in.0.w", ...), its plan), as
    `prepare_weights` lays out the neck's and the heads'. `with_inputs`: a head's (the neck's level inputs are
    folded elsewhere)."""
    arrays: dict = {}
    plan = _stack_into(arrays, "s", stack, levels, with_inputs)
    return {k[2:]: v for k, v in arrays.items()}, plan


def _upsample_mode(modules: tuple, key: str) -> str:
    """The mode of the upsampling before a finest-level conv (`modules`: the resampler's modules before it)."""
    from .. import folding

    mode = folding.upsample_mode(modules)
    if mode is None:
        raise ValueError(
            f"{key}: the finest-level fold needs a plain 2x bilinear (align_corners=False) or nearest upsample, "
            f"got {modules}"
        )
    return mode


def shapes(network, canvas_size: tuple, num_tokens: int) -> dict:
    """The plan of `prepare_weights` without the conv stacks' structure ("neck", a head's "res_blocks" ..) and the
    scale head's: every shape, from the network's modules, no weight read (the part tests' contexts and parts,
    `prepare_patch_embed`, `prepare_encoder`, `prepare_finest`). Raises ValueError as `prepare_weights` does."""
    import torch.nn as nn

    from .. import folding

    _supported(network)
    width, height, _, rows, cols = folding.grid(canvas_size, num_tokens)
    cfg, vit, neck = network.config, network.encoder.backbone, network.neck
    patch, dim = vit.spec.patch_size, vit.patch_embed.proj.out_channels
    patch_k = vit.patch_embed.proj.in_channels * patch * patch
    num_prefix = 1 + vit.spec.num_register_tokens
    taps = list(network.encoder.layers)
    block = vit.blocks[0]
    levels = len(neck.res_blocks)
    level_shapes = [(rows * 2**i, cols * 2**i) for i in range(levels)]
    heads = [h for h in folding.HEADS if getattr(network, h + "_head", None) is not None]
    channels = []
    for name in heads:
        stack = getattr(network, name + "_head")
        out = stack.output_blocks[levels - 1]
        channels.append(
            out.out_channels if isinstance(out, nn.Conv2d) else stack.resamplers[levels - 2][-1].out_channels
        )
    total = sum(channels)
    return {
        "version": PLAN_VERSION,
        "backbone": cfg.backbone_name,
        "canvas": [width, height],
        "num_tokens": int(num_tokens),
        "rows": rows,
        "cols": cols,
        "patch": patch,
        "patch_k": patch_k,
        "patch_k_padded": -(-patch_k // TILE) * TILE,
        "grid_tokens": rows * cols,
        "num_prefix": num_prefix,
        "seq_len": rows * cols + num_prefix,
        "dim": dim,
        "num_heads": block.attn.num_heads,
        "head_dim": dim // block.attn.num_heads,
        "ffn_dim": block.mlp.fc1.out_features,
        "blocks": max(taps) + 1,
        "taps": taps,
        "ln_eps": float(block.norm1.eps),
        "final_ln_eps": float(vit.norm.eps),
        "neck_in0_dim": neck.input_blocks[0].out_channels,
        "levels": [{"height": h, "width": w, "dim": d} for (h, w), d in zip(level_shapes, cfg.neck.dim_res_blocks)],
        "heads": [
            {"name": name, "channels": c, "dims": list(getattr(cfg, name + "_head").dim_res_blocks)}
            for name, c in zip(heads, channels)
        ],
        "finest": {
            "mode": _upsample_mode(tuple(neck.resamplers[levels - 2])[:-1], "neck"),
            "channels": total,
            "phase_channels": 4 * total,
            "in_height": level_shapes[-2][0],
            "in_width": level_shapes[-2][1],
            "height": level_shapes[-1][0],
            "width": level_shapes[-1][1],
        },
        "remap": cfg.remap_output,
    }


def _patch_embed_into(arrays: dict, folds) -> None:
    """The patch embedding's folds (`folding.fold_patch_embed`'s fields) -> "patch.w" (the patch matmul, the
    normalisation folded, padded to whole tiles) and "token_table" (patch rows, then the prefix rows)."""
    dim = folds.patch_weight.shape[0]
    w = _t(folds.patch_weight).reshape(dim, -1)  # (C, 3 * p * p), (channel, ky, kx) order
    patch_k = w.shape[1]
    arrays["patch.w"] = np.zeros((-(-patch_k // TILE) * TILE, dim), np.float32)
    arrays["patch.w"][:patch_k] = w.T
    grid_tokens = folds.patch_pos.shape[1]
    table = np.empty((grid_tokens + folds.token_prefix.shape[1], dim), np.float32)
    table[:grid_tokens] = _t(folds.patch_pos)[0] + _t(folds.patch_bias)[None]
    table[grid_tokens:] = _t(folds.token_prefix)[0]
    arrays["token_table"] = table


def _encoder_into(arrays: dict, folds) -> None:
    """The encoder's folds (`folding.fold_encoder`'s fields) -> the patch matmul, token table, blocks, final norm
    and tap projections ("neck_in0.<k>.w", "neck_in0.const")."""
    _patch_embed_into(arrays, folds)
    dim = folds.patch_weight.shape[0]
    for i, block in enumerate(folds.blocks):
        _block_into(arrays, f"blocks.{i}", block)
    arrays["final_norm.w"] = _t(folds.final_norm.weight)
    arrays["final_norm.b"] = _t(folds.final_norm.bias)
    neck_in0 = _t(folds.neck_in0)  # (d0, taps * C) over the concatenated normed taps
    for k in range(len(folds.layers)):
        arrays[f"neck_in0.{k}.w"] = np.ascontiguousarray(neck_in0[:, k * dim : (k + 1) * dim].T)  # (C, d0)
    arrays["neck_in0.const"] = _t(folds.neck_in0_const)  # (rows * cols, d0)


def _finest_into(arrays: dict, folds) -> None:
    """The finest level's fold (`folding.fold_finest`'s fields) -> the phase-folded kernels "finest.neck.w",
    "finest.<head>.w" (zero outside the head's channels) and the constant map "finest.const"."""
    total = sum(folds.head_channels)
    mode = _upsample_mode(folds.neck_up, "neck")
    arrays["finest.neck.w"] = phase_fold(_t(folds.neck_fold), mode)
    start = 0
    for name, up, weight, c in zip(folds.heads, folds.head_ups, folds.head_folds, folds.head_channels):
        if _upsample_mode(up, name) != mode:
            raise ValueError("the finest-level fold needs the same upsample mode in the neck and every head")
        kernel = np.zeros((total,) + tuple(weight.shape[1:]), np.float32)
        kernel[start : start + c] = _t(weight)
        arrays[f"finest.{name}.w"] = phase_fold(kernel, mode)
        start += c
    arrays["finest.const"] = _t(folds.finest_const)[0]  # (sum channels, H_L, W_L)


def _prepare_part(network, canvas_size: tuple, num_tokens: int, fold_part: Callable, into: Callable) -> Prepared:
    """One part alone: `shapes`' plan and the arrays `into` lays out from `fold_part(rows, cols, aspect)` (the
    part's folds, a dict of `folding.Folds` fields)."""
    from types import SimpleNamespace

    from .. import folding

    plan = shapes(network, canvas_size, num_tokens)  # first: a structure the graph lacks is refused by name
    _, _, aspect, rows, cols = folding.grid(canvas_size, num_tokens)
    arrays: dict = {}
    into(arrays, SimpleNamespace(**fold_part(rows, cols, aspect)))
    return Prepared(plan, arrays)


def prepare_patch_embed(network, canvas_size: tuple, num_tokens: int) -> Prepared:
    """The patch embedding alone (`patch_embed.PatchEmbed`): `shapes`' plan and the arrays "patch.w",
    "token_table", from `folding.fold_patch_embed` (the encoder's normalisation and the ViT's patch conv and token
    tables), as `prepare_weights` lays them out."""
    from .. import folding

    def fold_part(rows: int, cols: int, aspect: float) -> dict:
        return folding.fold_patch_embed(network, rows, cols)  # the token tables need no aspect

    return _prepare_part(network, canvas_size, num_tokens, fold_part, _patch_embed_into)


def prepare_encoder(network, canvas_size: tuple, num_tokens: int) -> Prepared:
    """The encoder alone (`encoder.Encoder`): `shapes`' plan and the arrays of the patch embedding, the blocks, the
    final norm and the taps' projections into the neck's level-0 conv, from `folding.fold_encoder`, as
    `prepare_weights` lays them out."""
    from functools import partial

    from .. import folding

    return _prepare_part(network, canvas_size, num_tokens, partial(folding.fold_encoder, network), _encoder_into)


def prepare_finest(network, canvas_size: tuple, num_tokens: int) -> Prepared:
    """The finest conv alone (`heads.FinestConv`): `shapes`' plan and the arrays "finest.neck.w",
    "finest.<head>.w", "finest.const", from `folding.fold_finest` (the last resamplers and 1x1 convs of the neck
    and the heads), as `prepare_weights` lays them out."""
    from functools import partial

    from .. import folding

    return _prepare_part(network, canvas_size, num_tokens, partial(folding.fold_finest, network), _finest_into)


def prepare_weights(network, canvas_size: tuple, num_tokens: int) -> Prepared:
    """Lay out the folds of `folding.fold(network, canvas_size, num_tokens)` for `graph.TtnnGraph` (the encoder's,
    the finest level's as `prepare_encoder` and `prepare_finest` do; the plan: `shapes`' and the conv stacks').

    network: a `MoGe2Network` (any device; read only). canvas_size: (width, height) of the canvas the runner is
    given. Raises ValueError for structures the ttnn graph does not implement (see `_supported`).
    """
    import torch

    from .. import folding

    shape_plan = shapes(network, canvas_size, num_tokens)
    folds = folding.fold(network, canvas_size, num_tokens)
    arrays: dict = {}

    # Encoder: patch matmul (folded normalisation), token table, blocks, final norm, tap projections.
    _encoder_into(arrays, folds)

    # Decoder: coarse levels of the neck and heads, constant uv maps, the phase-folded finest conv.
    levels = folds.num_levels
    for i in range(1, levels - 1):
        const = _t(folds.neck_consts[i])[0]  # (d_i, H_i, W_i)
        arrays[f"neck.const.{i}"] = np.ascontiguousarray(const.reshape(const.shape[0], -1).T)  # (H_i W_i, d_i)
    neck_plan = _stack_into(arrays, "neck", folds.neck, levels, with_inputs=False)
    head_plans = {}
    for name in folds.heads:
        head_plans[name] = _stack_into(arrays, f"head.{name}", folds.heads[name], levels, with_inputs=True)
    _finest_into(arrays, folds)
    scale_dims = None
    if folds.scale_head is not None:
        linears = [m for m in folds.scale_head if isinstance(m, torch.nn.Linear)]
        scale_dims = [linears[0].in_features] + [m.out_features for m in linears]
        for k, lin in enumerate(linears):
            arrays[f"scale.{k}.w"] = _t(lin.weight)  # (out, in): host numpy, y = x @ w.T + b
            arrays[f"scale.{k}.b"] = _t(lin.bias)

    heads = [{**h, **head_plans[h["name"]]} for h in shape_plan["heads"]]
    return Prepared({**shape_plan, "neck": neck_plan, "heads": heads, "scale_head": scale_dims}, arrays)


# ----------------------------------------------------------------------------------------- host helpers


def _aa_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and weights (out_size, taps) of PyTorch's antialiased bilinear resize along one axis
    (`F.interpolate(..., mode="bilinear", align_corners=False, antialias=True)`: a triangle filter widened by
    the downscale factor), computed in float32 as PyTorch's CPU kernel does."""
    f32 = np.float32
    scale = f32(in_size) / f32(out_size)
    support = scale if scale >= 1.0 else f32(1.0)
    invscale = f32(1.0) / scale if scale >= 1.0 else f32(1.0)
    taps = int(math.ceil(support)) * 2 + 1
    index = np.zeros((out_size, taps), np.int64)
    weight = np.zeros((out_size, taps), np.float32)
    for i in range(out_size):
        center = scale * (f32(i) + f32(0.5))
        lo = max(int(center - support + f32(0.5)), 0)
        hi = min(int(center + support + f32(0.5)), in_size)
        j = np.arange(lo, hi).astype(np.float32)
        w = np.maximum(f32(0.0), f32(1.0) - np.abs((j - center + f32(0.5)) * invscale)).astype(np.float32)
        total = w.sum(dtype=np.float32)
        w = w / total if total > 0 else w
        index[i, : len(j)] = np.arange(lo, hi)
        index[i, len(j) :] = lo
        weight[i, : len(j)] = w
    return index, weight


def _bilinear_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and weights (out_size, 2) of PyTorch's bilinear resize (align_corners=False, no antialias),
    in float32 as PyTorch computes them."""
    f32 = np.float32
    scale = f32(in_size) / f32(out_size)
    src = np.maximum((np.arange(out_size, dtype=np.float32) + f32(0.5)) * scale - f32(0.5), f32(0.0))
    i0 = np.minimum(src.astype(np.int64), in_size - 1)
    i1 = np.minimum(i0 + 1, in_size - 1)
    lam = (src - i0.astype(np.float32)).astype(np.float32)
    return np.stack([i0, i1], axis=1), np.stack([f32(1.0) - lam, lam], axis=1)


def resize_taps(in_size: int, out_size: int, kind: str = "antialiased") -> tuple[np.ndarray, np.ndarray]:
    """Indices and weights (out_size, taps) of PyTorch's resize along one axis: "antialiased" (bilinear with
    antialias=True, `resize_antialiased`) or "bilinear" (align_corners=False, `resize_bilinear`)."""
    if kind not in ("antialiased", "bilinear"):
        raise ValueError(f"resize_taps: kind must be 'antialiased' or 'bilinear', got {kind!r}")
    return (_aa_taps if kind == "antialiased" else _bilinear_taps)(in_size, out_size)


def _apply_taps(x: np.ndarray, axis: int, index: np.ndarray, weight: np.ndarray) -> np.ndarray:
    out = None
    for t in range(index.shape[1]):
        shape = [1] * x.ndim
        shape[axis] = -1
        term = np.take(x, index[:, t], axis=axis) * weight[:, t].reshape(shape)
        out = term if out is None else out + term
    return out


def _resize(x: np.ndarray, height: int, width: int, taps: Callable) -> np.ndarray:
    """(C, H, W) -> (C, height, width), separably: rows, then columns, with `taps(in_size, out_size)`."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-2:] != (height, width):
        x = _apply_taps(x, x.ndim - 2, *taps(x.shape[-2], height))
        x = _apply_taps(x, x.ndim - 1, *taps(x.shape[-1], width))
    return x.astype(np.float32, copy=False)


def resize_antialiased(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, H, W) float32 -> (C, height, width), as PyTorch's antialiased bilinear `F.interpolate`."""
    return _resize(image, height, width, _aa_taps)


def resize_bilinear(maps: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, H, W) float32 -> (C, height, width), as PyTorch's bilinear `F.interpolate` (align_corners=False)."""
    return _resize(maps, height, width, _bilinear_taps)


def _chw(image: np.ndarray) -> np.ndarray:
    x = np.asarray(image, dtype=np.float32)
    if x.ndim == 4 and x.shape[:2] == (1, 3):
        return x[0]
    if x.ndim == 3 and x.shape[-1] == 3:
        return x.transpose(2, 0, 1)
    raise ValueError(f"image: expected (H, W, 3) or (1, 3, H, W) float32 in [0, 1], got shape {x.shape}")


def host_input(plan: dict, image: np.ndarray) -> np.ndarray:
    """What the device graph takes: the patch matrix (seq_len, patch_k_padded) float32.

    image: the canvas (H, W, 3) or (1, 3, H, W) float32 in [0, 1] at the plan's canvas size (it is resized here,
    antialiased bilinear, to the token grid (rows * patch, cols * patch)), or an image already at the token
    grid size (used as is). Row r * cols + c holds patch (r, c) flattened as (channel, y, x); the prefix rows
    and the padding columns are zero.
    """
    x = _chw(image)
    rows, cols, patch = plan["rows"], plan["cols"], plan["patch"]
    size = (rows * patch, cols * patch)
    width, height = plan["canvas"]
    if x.shape[-2:] == (height, width):
        x = resize_antialiased(x, *size)
    elif x.shape[-2:] != size:
        raise ValueError(
            f"image: expected the canvas ({height}x{width}) or the token-grid size {size[0]}x{size[1]}, "
            f"got {x.shape[-2]}x{x.shape[-1]}"
        )
    patches = x.reshape(3, rows, patch, cols, patch).transpose(1, 3, 0, 2, 4).reshape(rows * cols, -1)
    out = np.zeros((plan["seq_len"], plan["patch_k_padded"]), np.float32)
    out[: rows * cols, : patches.shape[1]] = patches
    return out


def _remap_points(points: np.ndarray, kind: str) -> np.ndarray:
    """MoGe-2's output remap of (..., 3) raw points (as `network.moge2.remap_points`)."""
    if kind == "exp":
        z = np.exp(points[..., 2:3])
        return np.concatenate([points[..., :2] * z, z], axis=-1)
    if kind == "sinh":
        return np.sinh(points)
    if kind == "sinh_exp":
        return np.concatenate([np.sinh(points[..., :2]), np.exp(points[..., 2:3])], axis=-1)
    return points


def metric_scale(prepared: Prepared, cls_token: np.ndarray) -> Optional[float]:
    """The scale MLP on the class token (C,), float32 on the host; None without a scale head."""
    dims = prepared.plan["scale_head"]
    if dims is None:
        return None
    x = np.asarray(cls_token, dtype=np.float32).reshape(-1)
    n = len(dims) - 1
    for k in range(n):
        x = x @ prepared.arrays[f"scale.{k}.w"].T + prepared.arrays[f"scale.{k}.b"]
        if k < n - 1:
            x = np.maximum(x, 0)
    return float(np.exp(x[0]))


def host_output(
    prepared: Prepared, readback: dict, resize: Optional[Callable[[np.ndarray, int, int], np.ndarray]] = None
) -> dict:
    """The device's read-back arrays -> the raw maps, as `MoGe2Network.forward` returns them (batch dim dropped).

    readback: {"finest": (in_height * in_width, phase_channels) float32, "cls_token": (C,) float32} (what
    `TtnnGraph.read` returns). resize(maps (C, h, w), height, width) -> (C, height, width): the bilinear resize
    to the canvas (default `resize_bilinear`; the runner may pass a faster one).
    Returns float32 numpy: points (H, W, 3), normal (H, W, 3) unit, mask (H, W) probability (heads the
    checkpoint has), and metric_scale (float or None).
    """
    plan = prepared.plan
    fin = plan["finest"]
    maps = depth_to_space(
        np.asarray(readback["finest"], np.float32).reshape(-1, fin["phase_channels"]), fin["in_height"], fin["in_width"]
    )
    maps += prepared.arrays["finest.const"]
    width, height = plan["canvas"]
    maps = (resize or resize_bilinear)(maps, height, width)
    out: dict = {}
    start = 0
    for head in plan["heads"]:
        out[head["name"]] = maps[start : start + head["channels"]]
        start += head["channels"]
    out["points"] = _remap_points(out["points"].transpose(1, 2, 0), plan["remap"]).astype(np.float32)
    if "normal" in out:
        n = out["normal"].transpose(1, 2, 0)
        out["normal"] = (n / np.maximum(np.linalg.norm(n, axis=-1, keepdims=True), 1e-12)).astype(np.float32)
    if "mask" in out:
        out["mask"] = (1.0 / (1.0 + np.exp(-out["mask"][0]))).astype(np.float32)
    out["metric_scale"] = metric_scale(prepared, readback["cls_token"])
    return out
