"""MoGe-2 rearranged for one canvas size and one token budget, for the fast runners (CPU bf16, CUDA graphs).

`FixedShapeMoGe2(network, canvas_size, num_tokens, dtype)` computes the same function as
`MoGe2Network.forward(canvas, num_tokens)`, with everything that depends only on the weights and the fixed
shape done once at construction:

* the ImageNet normalisation is folded into the patch-embedding conv;
* the class token, register tokens and the position embedding (resized for the token grid) are one
  precomputed prefix / additive table;
* LayerScale is folded into the attention and MLP output projections;
* the encoder's per-layer 1x1 output projections and the neck's first 1x1 input conv are one matrix over the
  four normed intermediate layers (no non-linearity between them); the uv half of that conv and the neck's
  uv input convs of the other levels are constant maps;
* the finest level (no residual blocks there in MoGe-2: last resampler conv, the neck's and each head's 1x1
  convs) is linear, so every head's output there is `conv3x3(head upsample) + conv3x3(neck upsample) +
  constant map`, with the 1x1 convs multiplied into the 3x3 kernels: 7 output channels instead of 4 x 32.

Matrix work runs in `dtype` (bfloat16/float16 on the fast paths), channels-last; the residual stream of the
ViT, the head outputs, the final resize to the canvas and the output activations stay float32. The ViT's float
matmuls are `nn.Linear`, or with `vit_linear="onednn"` oneDNN's linear on weights packed at construction with
GELU fused into the first MLP matmul (`OnednnLinear`). With
`vit_int8` (the CPU's opt-in "int8") the ViT's linear layers are int8 (`Int8Linear`, or `OnednnInt8Linear` with
`vit_int8="onednn"`), smoothed per input channel with
activation ranges calibrated at construction (one `dtype` pass over a synthetic photo at <= 600 tokens). In float32
the result equals the reference network up to float round-off (the folds reassociate sums); the reference
itself (`TorchRunner`) is the exact float32 path. The ViT's kernels (`FastBlock`, the linear layers, the
attentions) are in vit_kernels.py.
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
from .vit_kernels import ATTENTION_KINDS, INT8_SMOOTHING, LINEAR_KERNELS, FastBlock, HeadByHeadAttention, make_linear

__all__ = ["FixedShapeMoGe2", "raw_outputs", "HEADS"]

HEADS = ("points", "normal", "mask")
CALIBRATION_TOKENS = 600  # token budget of the int8 calibration forward (at load)


def _to_layout(module: nn.Module, dtype: torch.dtype, channels_last: bool) -> nn.Module:
    module = copy.deepcopy(module).to(dtype).requires_grad_(False)
    return module.to(memory_format=torch.channels_last) if channels_last else module


def _const(t: torch.Tensor, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    t = t.detach().to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t.contiguous()


def _matrix(conv: nn.Module, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (out, in), bias (out,)) of a 1x1 conv, or the identity for nn.Identity (float32, on `device`:
    the network's, so that the folds also build on a GPU)."""
    if isinstance(conv, nn.Identity):
        return torch.eye(channels, device=device), torch.zeros(channels, device=device)
    if not (isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1)):
        raise ValueError(f"expected a 1x1 conv or identity, got {conv}")
    return conv.weight.detach().float()[:, :, 0, 0], conv.bias.detach().float()


def _split_resampler(resampler: nn.Sequential) -> tuple[nn.Module, nn.Conv2d]:
    """A resampler = (upsampling part, final 3x3 replicate-padded conv)."""
    last = resampler[-1]
    if not (isinstance(last, nn.Conv2d) and last.kernel_size == (3, 3) and last.padding_mode == "replicate"):
        raise ValueError(f"the finest-level fold expects a resampler ending in a 3x3 replicate conv, got {resampler}")
    return nn.Sequential(*list(resampler)[:-1]), last


def _fold_kernel(matrix: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """The 3x3 kernel of `matrix @ conv` (a 1x1 conv after a 3x3 conv, without the bias), float32."""
    return torch.einsum("om,mikl->oikl", matrix, conv.weight.detach().float())


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
    ):
        super().__init__()
        cfg = network.config
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
        self.remap = cfg.remap_output
        self.aspect = aspect = width / height
        self.rows, self.cols = rows, cols = token_grid(num_tokens, aspect)
        device = next(network.parameters()).device
        with torch.no_grad():
            self._build_encoder(network, rows, cols)
            uv = network.uv_planes(rows, cols, aspect, torch.float32, device)
            self._build_decoder(network, uv)
            self.scale_head = (
                copy.deepcopy(network.scale_head).float().requires_grad_(False)
                if hasattr(network, "scale_head")
                else None
            )

    # ----------------------------------------------------------------------------------------- build
    def _build_encoder(self, network: MoGe2Network, rows: int, cols: int) -> None:
        enc, vit = network.encoder, network.encoder.backbone
        spec = vit.spec
        self.patch = spec.patch_size
        self.layers = list(enc.layers)
        self.num_prefix = 1 + spec.num_register_tokens
        # (x - mean) / std -> patch conv  ==  conv with weight W / std and bias b - sum(W * mean / std)
        proj = vit.patch_embed.proj
        mean, std = enc.image_mean.detach().float().view(-1), enc.image_std.detach().float().view(-1)
        w = proj.weight.detach().float() / std[None, :, None, None]
        b = proj.bias.detach().float() - (w * mean[None, :, None, None]).sum(dim=(1, 2, 3))
        self.patch_embed = skip_init(nn.Conv2d, 3, w.shape[0], spec.patch_size, stride=spec.patch_size, device=w.device)
        self.patch_embed.weight.copy_(w)
        self.patch_embed.bias.copy_(b)
        self.patch_embed = _to_layout(self.patch_embed, self.dtype, self.channels_last)
        pos = vit.position_embedding(rows, cols).detach().float()
        self.register_buffer("token_prefix", self._token_prefix(vit, pos))  # (1, P, C)
        self.register_buffer("patch_pos", pos[:, 1:].to(self.residual_dtype))  # (1, rows*cols, C)
        workspace = HeadByHeadAttention() if self.attention == "heads" else None  # one workspace for all blocks
        blocks = vit.blocks[: max(self.layers) + 1]
        act_max, alpha = [None] * len(blocks), 0.5
        if self.vit_int8 and self.int8_smoothing is not None:
            act_max, alpha = self._activation_maxima(vit, blocks), self.int8_smoothing
        tokens = self.num_prefix + rows * cols
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
            for blk, a in zip(blocks, act_max)
        )
        self.final_norm = copy.deepcopy(vit.norm).float().requires_grad_(False)

    def _token_prefix(self, vit, pos: torch.Tensor) -> torch.Tensor:
        """The class token (+ its position embedding) and the register tokens, (1, P, C) in the residual dtype."""
        prefix = [vit.cls_token.detach().float() + pos[:, :1]]
        if vit.register_tokens is not None:
            prefix.append(vit.register_tokens.detach().float())
        return torch.cat(prefix, dim=1).to(self.residual_dtype)

    def _embed(self, image: torch.Tensor, prefix: torch.Tensor, patch_pos: torch.Tensor) -> torch.Tensor:
        """image (1, 3, rows * patch, cols * patch) in [0, 1] -> the ViT's input tokens (1, P + rows * cols, C)."""
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        patches = self.patch_embed(image.to(self.dtype)).flatten(2).transpose(1, 2)  # (1, rows*cols, C)
        return torch.cat([prefix, patches.to(self.residual_dtype) + patch_pos], dim=1)

    def _activation_maxima(self, vit, blocks) -> list:
        """Calibration of the int8 smoothing: per block, {linear name: per input channel max |x|} of the
        `dtype` graph on a synthetic photo at a reduced token budget (at most CALIBRATION_TOKENS; the channels
        with outliers are the same at every size)."""
        from ..synthetic import synthetic_photo

        rows, cols = token_grid(min(CALIBRATION_TOKENS, self.rows * self.cols), self.aspect)
        pos = vit.position_embedding(rows, cols).detach().float()
        device = self.patch_pos.device
        photo = torch.from_numpy(synthetic_photo((cols * self.patch, rows * self.patch), seed=0))
        tokens = self._embed(
            photo.permute(2, 0, 1)[None].to(device, torch.float32).div(255),
            self._token_prefix(vit, pos),
            pos[:, 1:].to(self.residual_dtype),
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

    def _build_decoder(self, network: MoGe2Network, uv: list) -> None:
        neck = network.neck
        levels = self.num_levels = len(neck.res_blocks)
        last = levels - 1
        # Level 0 of the neck: conv1x1(cat(sum_i P_i LN_i + p, uv0)) == [LN_5 | LN_11 | ...] @ W^T + const map.
        in0 = neck.input_blocks[0]
        if not isinstance(in0, nn.Conv2d):
            raise ValueError("the neck's level-0 input must be a 1x1 conv over (features, uv)")
        w_in = in0.weight.detach().float()[:, :, 0, 0]
        feat_dim = w_in.shape[1] - 2
        w_feat, w_uv = w_in[:, :feat_dim], w_in[:, feat_dim:]
        mats, bias = [], in0.bias.detach().float().clone()
        for proj in network.encoder.output_projections:
            p_w, p_b = _matrix(proj, 0, proj.weight.device)
            mats.append(w_feat @ p_w)
            bias += w_feat @ p_b
        self.neck_in0 = make_linear(torch.cat(mats, dim=1), torch.zeros_like(bias), self.dtype)
        uv0 = uv[0][0].flatten(1)  # (2, rows*cols)
        self.register_buffer("neck_in0_const", (w_uv @ uv0 + bias[:, None]).t().contiguous())  # (rows*cols, d0) float32
        # The neck's uv inputs of levels 1..last are constant maps (the last one goes into the finest fold).
        for i in range(1, last):
            self.register_buffer(f"neck_const{i}", _const(neck.input_blocks[i](uv[i]), self.dtype, self.channels_last))
        self.neck = _to_layout(neck, self.dtype, self.channels_last)
        heads = [h for h in HEADS if getattr(network, h + "_head", None) is not None]
        self.head_names = heads
        self.heads = nn.ModuleDict(
            {h: _to_layout(getattr(network, h + "_head"), self.dtype, self.channels_last) for h in heads}
        )
        self._build_finest_fold(network, heads, neck.input_blocks[last](uv[last]).float(), levels)

    def _build_finest_fold(self, network: MoGe2Network, heads: list, neck_const: torch.Tensor, levels: int) -> None:
        last = levels - 1
        neck = network.neck
        for name, stack in [("neck", neck)] + [(h, getattr(network, h + "_head")) for h in heads]:
            if len(stack.res_blocks[last]) != 0:
                raise ValueError(
                    f"the finest-level fold needs no residual blocks at the finest level ({name} has some)"
                )
        n_up, n_conv = _split_resampler(neck.resamplers[last - 1])
        self.neck_up = _to_layout(n_up, self.dtype, self.channels_last)
        on_w, _ = _matrix(neck.output_blocks[last], n_conv.out_channels, n_conv.weight.device)
        kernels_neck, consts = [], []
        self.head_ups = nn.ModuleList()
        self.head_convs = nn.ModuleList()
        zero_neck = torch.zeros(1, n_conv.in_channels, *neck_const.shape[-2:], device=neck_const.device)
        neck_const_out = neck.output_blocks[last](n_conv(zero_neck) + neck_const)  # the neck's finest output at u = 0
        for h in heads:
            stack = getattr(network, h + "_head")
            h_up, h_conv = _split_resampler(stack.resamplers[last - 1])
            ih_w, _ = _matrix(stack.input_blocks[last], h_conv.out_channels, h_conv.weight.device)
            oh_w, _ = _matrix(stack.output_blocks[last], h_conv.out_channels, h_conv.weight.device)
            kernels_neck.append(_fold_kernel(oh_w @ ih_w @ on_w, n_conv))
            conv = skip_init(
                nn.Conv2d,
                h_conv.in_channels,
                oh_w.shape[0],
                3,
                padding=1,
                padding_mode="replicate",
                bias=False,
                device=oh_w.device,
            )
            conv.weight.copy_(_fold_kernel(oh_w, h_conv))
            self.head_ups.append(_to_layout(h_up, self.dtype, self.channels_last))
            self.head_convs.append(_to_layout(conv, self.dtype, self.channels_last))
            zero_head = torch.zeros(1, h_conv.in_channels, *neck_const.shape[-2:], device=neck_const.device)
            consts.append(stack.output_blocks[last](h_conv(zero_head) + stack.input_blocks[last](neck_const_out)))
        self.head_channels = [k.shape[0] for k in kernels_neck]
        conv = skip_init(
            nn.Conv2d,
            n_conv.in_channels,
            sum(self.head_channels),
            3,
            padding=1,
            padding_mode="replicate",
            bias=False,
            device=n_conv.weight.device,
        )
        conv.weight.copy_(torch.cat(kernels_neck))
        self.neck_fold_conv = _to_layout(conv, self.dtype, self.channels_last)
        const = torch.cat(consts, dim=1).float()  # (1, sum out, H_L, W_L)
        self.register_buffer(
            "finest_const", const.contiguous(memory_format=torch.channels_last) if self.channels_last else const
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
        y = self.finest_const + self.neck_fold_conv(self.neck_up(x)).float()
        parts = []
        for name, up, conv in zip(self.head_names, self.head_ups, self.head_convs):
            head = self.heads[name]
            h = None
            for i in range(last):
                feature = head.input_blocks[i](neck_out[i])
                h = feature if h is None else h + feature
                h = head.res_blocks[i](h)
                if i < last - 1:
                    h = head.resamplers[i](h)
            parts.append(conv(up(h)).float())
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
