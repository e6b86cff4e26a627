"""The convolutional parts of MoGe-2: the multi-level conv stack (neck and heads) and the scale MLP.

Module and parameter names match the MoGe checkpoints (`input_blocks.N`, `res_blocks.N.M.layers.K`,
`resamplers.N.K`, `output_blocks.N`), so the state dict loads strictly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .config import ConvStackConfig

_ACTIVATIONS = {
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.2),
    "silu": nn.SiLU,
    "elu": nn.ELU,
}


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "group_norm":
        return nn.GroupNorm(channels // 32, channels)
    if kind == "layer_norm":
        return nn.GroupNorm(1, channels)
    if kind == "instance_norm":
        return nn.InstanceNorm2d(channels)
    return nn.Identity()


def _conv3x3(c_in: int, c_out: int) -> nn.Conv2d:
    # MoGe pads by edge replication everywhere in the decoder.
    return nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, padding_mode="replicate")


class ResidualConvBlock(nn.Module):
    """norm -> act -> conv3x3 -> norm -> act -> conv3x3, plus the input (pre-activation residual block)."""

    def __init__(self, channels: int, hidden: int, activation: str, in_norm: str, hidden_norm: str):
        super().__init__()
        act = _ACTIVATIONS[activation]
        self.layers = nn.Sequential(
            _norm(in_norm, channels),
            act(),
            _conv3x3(channels, hidden),
            _norm(hidden_norm, hidden),
            act(),
            _conv3x3(hidden, channels),
        )
        self.skip_connection = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + x


def _resampler(kind: str, c_in: int, c_out: int) -> nn.Sequential:
    """2x upsampling between levels, then a 3x3 conv."""
    if kind == "conv_transpose":
        return nn.Sequential(nn.ConvTranspose2d(c_in, c_out, kernel_size=2, stride=2), _conv3x3(c_out, c_out))
    if kind in ("bilinear", "nearest"):
        up = nn.Upsample(scale_factor=2, mode=kind, align_corners=False if kind == "bilinear" else None)
        return nn.Sequential(up, _conv3x3(c_in, c_out))
    if kind == "pixel_shuffle":
        return nn.Sequential(_conv3x3(c_in, c_out * 4), nn.PixelShuffle(2), _conv3x3(c_out, c_out))
    raise ValueError(f"unsupported resampler {kind!r}")


class ConvStack(nn.Module):
    """Coarse-to-fine conv stack: at each level add the projected input, refine, emit, upsample 2x."""

    def __init__(self, cfg: ConvStackConfig):
        super().__init__()
        dims = cfg.dim_res_blocks
        self.input_blocks = nn.ModuleList(
            nn.Conv2d(d_in, d, kernel_size=1) if d_in is not None else nn.Identity()
            for d_in, d in zip(cfg.dim_in, dims)
        )
        self.resamplers = nn.ModuleList(
            _resampler(kind, a, b) for kind, a, b in zip(cfg.resamplers, dims[:-1], dims[1:])
        )
        self.res_blocks = nn.ModuleList(
            nn.Sequential(
                *(
                    ResidualConvBlock(
                        d,
                        d * cfg.dim_times_res_block_hidden,
                        cfg.activation,
                        cfg.res_block_in_norm,
                        cfg.res_block_hidden_norm,
                    )
                    for _ in range(n)
                )
            )
            for d, n in zip(dims, cfg.num_res_blocks)
        )
        self.output_blocks = nn.ModuleList(
            nn.Conv2d(d, d_out, kernel_size=1) if d_out is not None else nn.Identity()
            for d_out, d in zip(cfg.dim_out, dims)
        )

    def forward(self, inputs: list[Optional[torch.Tensor]], last_only: bool = False) -> list[torch.Tensor]:
        """`inputs[i]` feeds level i (coarse to fine). Returns every level's output, or only the finest."""
        outputs = []
        x = None
        last = len(self.res_blocks) - 1
        for i in range(last + 1):
            if inputs[i] is not None:
                feature = self.input_blocks[i](inputs[i])
                x = feature if x is None else x + feature
            x = self.res_blocks[i](x)
            if not last_only or i == last:
                outputs.append(self.output_blocks[i](x))
            if i < last:
                x = self.resamplers[i](x)
        return outputs


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (the metric-scale head on the class token)."""

    def __init__(self, dims: list[int]):
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)
