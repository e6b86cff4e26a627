"""MoGe-2 as one torch module for one canvas size and one token budget, for the fast runners (CPU bf16, CUDA
graphs) and the ONNX export.

`FixedShapeMoGe2(network, canvas_size, num_tokens, dtype)` computes the same function as
`MoGe2Network.forward(canvas, num_tokens)` from the folds of `folding.fold(network, canvas_size, num_tokens)`
(normalisation, token tables, LayerScale, the taps' projections with the neck's level-0 conv, uv constant maps,
the finest level: see folding.py), laid out in modules for `dtype` at construction.

Matrix work runs in `dtype` (bfloat16/float16 on the fast paths), channels-last; the residual stream of the
ViT, the head outputs, the final resize to the canvas and the output activations stay float32. The ViT's blocks
are `vit_kernels.FastBlock`s: float matmuls `nn.Linear`, or with `vit_linear="onednn"` oneDNN's linear on weights
packed at construction with GELU fused into the first MLP matmul (`OnednnLinear`). With `vit_int8` (the CPU's
opt-in "int8") the ViT's linear layers are int8 (`Int8Linear`, or `OnednnInt8Linear` with `vit_int8="onednn"`),
smoothed per input channel with activation ranges calibrated at construction (one `dtype` pass over a synthetic
photo at <= 600 tokens). With `res_block="onednn"` the decoder's residual blocks run as oneDNN's fused convolutions
(`conv_kernels.OnednnResBlock`: ReLU and the residual add in the convolutions' output stages). In float32 the
result equals the reference network up to float round-off (the folds reassociate sums); the reference itself
(`TorchRunner`) is the exact float32 path.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import skip_init

from ..network import MoGe2Network, token_grid
from ..network.moge2 import remap_points
from . import folding
from .conv_kernels import RES_BLOCK_KERNELS, fuse_res_blocks
from .vit_kernels import ATTENTION_KINDS, INT8_SMOOTHING, LINEAR_KERNELS, FastBlock, HeadByHeadAttention, make_linear

__all__ = ["FixedShapeMoGe2", "finest_conv", "raw_outputs", "subpixel_kernel"]

CALIBRATION_TOKENS = 600  # token budget of the int8 calibration forward (at load)


def _to_layout(module: nn.Module, dtype: torch.dtype, channels_last: bool) -> nn.Module:
    module = copy.deepcopy(module).to(dtype).requires_grad_(False)
    return module.to(memory_format=torch.channels_last) if channels_last else module


def _const(t: torch.Tensor, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    t = t.detach().to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t.contiguous()


def _conv3x3(weight: torch.Tensor) -> nn.Conv2d:
    """A 3x3 replicate-padded conv without bias holding a copy of `weight` (out, in, 3, 3)."""
    conv = skip_init(
        nn.Conv2d,
        weight.shape[1],
        weight.shape[0],
        3,
        padding=1,
        padding_mode="replicate",
        bias=False,
        device=weight.device,
    )
    with torch.no_grad():
        conv.weight.copy_(weight)
    return conv


def subpixel_kernel(weight: torch.Tensor) -> torch.Tensor:
    """A 3x3 kernel (C, K, 3, 3) meant for a 2x bilinear upsampling of its input -> the (4C, K, 3, 3) kernel that
    gives the same outputs from the input before upsampling (`folding.phase_fold`, computed in float64), output
    channel 4c + 2a + b holding the outputs at (2i + a, 2j + b): nn.PixelShuffle(2)'s order."""
    phases = folding.phase_fold(weight, "bilinear")  # channel (2a + b) C + c
    return phases.reshape(4, *weight.shape).transpose(0, 1).reshape(4 * weight.shape[0], *weight.shape[1:])


def finest_conv(up: tuple, weight: torch.Tensor) -> nn.Module:
    """`conv3x3(up(x))` with `weight` (replicate padding) as a module. Where `up` is a 2x bilinear upsampling it runs
    as a 3x3 conv at the coarse level into 4x the channels, then a pixel shuffle: the same function (see
    subpixel_kernel) on a quarter of the pixels, without the upsampled map or its padding in memory (on the CPU
    those two took most of the finest level's time). Any other upsampling runs as written."""
    if folding.upsample_mode(up) == "bilinear":
        return nn.Sequential(_conv3x3(subpixel_kernel(weight)), nn.PixelShuffle(2))
    return nn.Sequential(*up, _conv3x3(weight))


class FixedShapeMoGe2(nn.Module):
    """MoGe-2 for one canvas (width, height) and token budget. `forward(canvas)` -> the reference's raw dict.

    canvas: (1, 3, H, W) float32 in [0, 1] on the module's device. Returns float32 `points` (1, H, W, 3),
    `normal` (1, H, W, 3), `mask` (1, H, W) probability, `metric_scale` (1,), as `MoGe2Network.forward`.
    """

    def __init__(
        self,
        network: MoGe2Network,
        canvas_size: tuple,
        num_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        residual_dtype: torch.dtype = torch.float32,
        channels_last: bool = True,
        attention: str = "sdpa",
        vit_int8=False,
        native=None,
        int8_smoothing: Optional[float] = INT8_SMOOTHING,
        vit_linear: str = "aten",
        res_block: str = "aten",
    ):
        super().__init__()
        width, height = (int(v) for v in canvas_size)
        self.canvas_size = (width, height)
        self.dtype = dtype
        self.residual_dtype = residual_dtype
        self.channels_last = channels_last
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        self.attention = attention
        self.vit_int8 = "int8" if vit_int8 is True else vit_int8  # False, or the int8 kernel: INT8_KERNELS
        self.native = native  # the native host library (`cpu_kernels`: fused attention, int8 glue), or None: torch
        self.int8_smoothing = int8_smoothing  # SmoothQuant's alpha for the int8 ViT (None: no smoothing)
        if vit_linear not in LINEAR_KERNELS:
            raise ValueError(f"vit_linear must be one of {LINEAR_KERNELS}, got {vit_linear!r}")
        self.vit_linear = vit_linear  # the ViT's float matmuls: nn.Linear ("aten") or OnednnLinear ("onednn")
        if res_block not in RES_BLOCK_KERNELS:
            raise ValueError(f"res_block must be one of {RES_BLOCK_KERNELS}, got {res_block!r}")
        self.res_block = res_block  # the decoder's residual blocks: torch.nn ("aten") or OnednnResBlock ("onednn")
        self.aspect = width / height
        folds = folding.fold(network, self.canvas_size, num_tokens)
        self.remap = folds.remap
        self.rows, self.cols = folds.rows, folds.cols
        with torch.no_grad():
            self._build_encoder(folds, network.encoder.backbone)
            self._build_decoder(folds)
            self.scale_head = (
                copy.deepcopy(folds.scale_head).float().requires_grad_(False) if folds.scale_head is not None else None
            )

    # ----------------------------------------------------------------------------------------- build
    def _build_encoder(self, folds: folding.Folds, vit) -> None:
        self.patch = folds.patch
        self.layers = list(folds.layers)
        self.num_prefix = folds.num_prefix
        w = folds.patch_weight
        self.patch_embed = skip_init(nn.Conv2d, 3, w.shape[0], self.patch, stride=self.patch, device=w.device)
        self.patch_embed.weight.copy_(w)
        self.patch_embed.bias.copy_(folds.patch_bias)
        self.patch_embed = _to_layout(self.patch_embed, self.dtype, self.channels_last)
        self.register_buffer("token_prefix", folds.token_prefix.to(self.residual_dtype))  # (1, P, C)
        self.register_buffer("patch_pos", folds.patch_pos.to(self.residual_dtype))  # (1, rows*cols, C)
        workspace = HeadByHeadAttention() if self.attention == "heads" else None  # one workspace for all blocks
        act_max, alpha = [None] * len(folds.blocks), 0.5
        if self.vit_int8 and self.int8_smoothing is not None:
            act_max, alpha = self._activation_maxima(vit, folds.blocks), self.int8_smoothing
        tokens = self.num_prefix + self.rows * self.cols
        self.blocks = nn.ModuleList(
            FastBlock(
                blk,
                self.dtype,
                self.attention,
                workspace,
                self.vit_int8,
                self.native,
                a,
                alpha,
                self.num_prefix,
                linear=self.vit_linear,
                tokens=tokens,
            )
            for blk, a in zip(folds.blocks, act_max)
        )
        self.final_norm = copy.deepcopy(folds.final_norm).float().requires_grad_(False)

    def _embed(self, image: torch.Tensor, prefix: torch.Tensor, patch_pos: torch.Tensor) -> torch.Tensor:
        """image (1, 3, rows * patch, cols * patch) in [0, 1] -> the ViT's input tokens (1, P + rows * cols, C)."""
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        patches = self.patch_embed(image.to(self.dtype)).flatten(2).transpose(1, 2)  # (1, rows*cols, C)
        return torch.cat([prefix, patches.to(self.residual_dtype) + patch_pos], dim=1)

    def _activation_maxima(self, vit, blocks: list) -> list:
        """Calibration of the int8 smoothing: per block (`folding.BlockFolds`), {linear name: per input channel
        max |x|} of the `dtype` graph on a synthetic photo at a reduced token budget (at most CALIBRATION_TOKENS;
        the channels with outliers are the same at every size)."""
        from ..synthetic import synthetic_photo

        rows, cols = token_grid(min(CALIBRATION_TOKENS, self.rows * self.cols), self.aspect)
        prefix, pos = folding.token_tables(vit, rows, cols)
        device = self.patch_pos.device
        photo = torch.from_numpy(synthetic_photo((cols * self.patch, rows * self.patch), seed=0))
        tokens = self._embed(
            photo.permute(2, 0, 1)[None].to(device, torch.float32).div(255),
            prefix.to(self.residual_dtype),
            pos.to(self.residual_dtype),
        )
        maxima = []
        for block in blocks:
            fast = FastBlock(block, self.dtype)  # SDPA attention: every linear is called as a module
            seen: dict = {}
            hooks = [
                getattr(fast, name).register_forward_pre_hook(
                    lambda module, args, name=name: seen.__setitem__(
                        name, args[0].abs().flatten(0, -2).amax(dim=0).float()
                    )
                )
                for name in FastBlock.LINEARS
            ]
            tokens = fast(tokens)
            for hook in hooks:
                hook.remove()
            maxima.append(seen)
        return maxima

    def _build_decoder(self, folds: folding.Folds) -> None:
        dtype, channels_last = self.dtype, self.channels_last
        self.num_levels = folds.num_levels
        self.neck_in0 = make_linear(folds.neck_in0, folds.neck_in0.new_zeros(folds.neck_in0.shape[0]), dtype)
        self.register_buffer("neck_in0_const", folds.neck_in0_const)  # (rows*cols, d0) float32
        for i, const in folds.neck_consts.items():
            self.register_buffer(f"neck_const{i}", _const(const, dtype, channels_last))
        self.neck = _to_layout(folds.neck, dtype, channels_last)
        self.head_names = list(folds.heads)
        self.heads = nn.ModuleDict({h: _to_layout(stack, dtype, channels_last) for h, stack in folds.heads.items()})
        if self.res_block == "onednn":
            for stack in (self.neck, *self.heads.values()):
                fuse_res_blocks(stack.res_blocks)
        # the finest level: conv3x3(head upsample) + conv3x3(neck upsample) + constant map (folding.py), each
        # "conv3x3(upsample)" run at the coarser level where the upsampling allows it (finest_conv)
        self.neck_finest = _to_layout(finest_conv(folds.neck_up, folds.neck_fold), dtype, channels_last)
        self.head_finest = nn.ModuleList(
            _to_layout(finest_conv(up, w), dtype, channels_last) for up, w in zip(folds.head_ups, folds.head_folds)
        )
        self.head_channels = list(folds.head_channels)
        const = folds.finest_const
        self.register_buffer(
            "finest_const", const.contiguous(memory_format=torch.channels_last) if channels_last else const
        )

    # --------------------------------------------------------------------------------------- forward
    def _nchw(self, tokens: torch.Tensor, channels: int) -> torch.Tensor:
        """(rows*cols, C) row-major tokens -> (1, C, rows, cols) (a channels-last view, or a contiguous copy)."""
        x = tokens.view(1, self.rows, self.cols, channels).permute(0, 3, 1, 2)
        return x if self.channels_last else x.contiguous()

    def encode(self, canvas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """canvas (1, 3, H, W) float32 -> neck level-0 input (1, d0, rows, cols) in `dtype`, class token (1, C)
        float32."""
        size = (self.rows * self.patch, self.cols * self.patch)
        x = F.interpolate(canvas, size, mode="bilinear", align_corners=False, antialias=True)
        tokens = self._embed(x, self.token_prefix, self.patch_pos)
        taps = {}
        wanted = set(self.layers)
        for i, block in enumerate(self.blocks):
            tokens = block(tokens)
            if i in wanted:
                taps[i] = self.final_norm(tokens)
        cls_token = taps[self.layers[-1]][:, 0].float()
        stacked = torch.cat([taps[i][0, self.num_prefix :].to(self.dtype) for i in self.layers], dim=1)
        level0 = (self.neck_in0(stacked).float() + self.neck_in0_const).to(self.dtype)
        return self._nchw(level0, level0.shape[1]), cls_token

    def decode(self, level0: torch.Tensor) -> torch.Tensor:
        """Neck + heads -> (1, sum of head channels, H_L, W_L) float32 maps at the finest level."""
        last = self.num_levels - 1
        neck = self.neck
        x = level0
        neck_out = []
        for i in range(last):
            if i > 0:
                x = x + getattr(self, f"neck_const{i}")
            x = neck.res_blocks[i](x)
            neck_out.append(neck.output_blocks[i](x))
            if i < last - 1:
                x = neck.resamplers[i](x)
        y = self.finest_const + self.neck_finest(x).float()
        parts = []
        for name, finest in zip(self.head_names, self.head_finest):
            head = self.heads[name]
            h = None
            for i in range(last):
                feature = head.input_blocks[i](neck_out[i])
                h = feature if h is None else h + feature
                h = head.res_blocks[i](h)
                if i < last - 1:
                    h = head.resamplers[i](h)
            parts.append(finest(h).float())
        return y + torch.cat(parts, dim=1)

    def forward(self, canvas: torch.Tensor) -> dict:
        height, width = canvas.shape[-2:]
        if (width, height) != self.canvas_size:
            raise ValueError(
                f"canvas: this graph runs {self.canvas_size[0]}x{self.canvas_size[1]}, got {width}x{height}"
            )
        level0, cls_token = self.encode(canvas)
        maps = F.interpolate(self.decode(level0), (height, width), mode="bilinear", align_corners=False)
        out = raw_outputs(maps, self.head_names, self.head_channels, self.remap)
        if self.scale_head is not None:
            out["metric_scale"] = self.scale_head(cls_token).squeeze(1).exp()
        return out


def raw_outputs(maps: torch.Tensor, head_names: list, head_channels: list, remap: str) -> dict:
    """The heads' stacked maps at the canvas (1, sum of channels, H, W) -> the reference's raw dict: `points`
    (1, H, W, 3) after the output remap, `normal` (1, H, W, 3) unit, `mask` (1, H, W) probability."""
    out: dict = {}
    start = 0
    for name, channels in zip(head_names, head_channels):
        out[name] = maps[:, start : start + channels]
        start += channels
    out["points"] = remap_points(out["points"].permute(0, 2, 3, 1), remap).contiguous()
    if "normal" in out:
        # channels-last first: normalising the permuted view takes a slow strided reduction (several times the
        # whole remap); the result differs from it only in float round-off
        out["normal"] = F.normalize(out["normal"].permute(0, 2, 3, 1).contiguous(), dim=-1)
    if "mask" in out:
        out["mask"] = out["mask"][:, 0].sigmoid()
    return out
