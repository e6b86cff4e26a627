"""DINOv2 vision transformer (patch 14), inference only, state-dict compatible with DINOv2 / MoGe.

Parameter names follow the published checkpoints (`patch_embed.proj`, `blocks.N.attn.qkv`, `ls1.gamma`, ...)
so a MoGe `model.pt` loads strictly. Attention is PyTorch SDPA. The position embedding is resized once per
token grid and cached (the grid is fixed for a loaded model).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import BackboneSpec


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, rows*cols, C)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)  # (B, heads, N, head_dim)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    """The ViT-g feed-forward: silu(x W1) * (x W2), then W3; W1 and W2 are stored stacked as `w12`."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        hidden = (int(hidden * 2 / 3) + 7) // 8 * 8  # DINOv2's rounding of the SwiGLU width
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    def __init__(self, spec: BackboneSpec):
        super().__init__()
        dim = spec.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, spec.num_heads)
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        ffn = SwiGLU if spec.ffn == "swiglu" else Mlp
        self.mlp = ffn(dim, int(dim * spec.mlp_ratio))
        self.ls2 = LayerScale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class DinoVisionTransformer(nn.Module):
    """The DINOv2 ViT without its classification head; returns normed intermediate layers."""

    def __init__(self, spec: BackboneSpec):
        super().__init__()
        self.spec = spec
        dim = spec.embed_dim
        self.patch_embed = PatchEmbed(spec.patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, spec.pos_grid**2 + 1, dim))
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, spec.num_register_tokens, dim)) if spec.num_register_tokens else None
        )
        self.mask_token = nn.Parameter(torch.zeros(1, dim))  # unused at inference; kept for strict loading
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self._pos_cache: dict = {}

    def position_embedding(self, rows: int, cols: int) -> torch.Tensor:
        """(1, 1 + rows*cols, C) position embedding for a token grid: the 37x37 table resized bicubically.

        DINOv2 resizes with a scale factor of (n + offset) / 37 (its historical offset of 0.1), which moves the
        sample positions slightly; we keep that so the numbers match the trained model. Cached per grid and dtype.
        """
        key = (rows, cols, self.pos_embed.dtype, self.pos_embed.device, self.pos_embed._version)
        cached = self._pos_cache.get(key)
        if cached is not None:
            return cached
        spec = self.spec
        table = self.pos_embed.detach().float()
        grid = spec.pos_grid
        cls_pos, patch_pos = table[:, :1], table[:, 1:]
        patch_pos = patch_pos.reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
        if spec.interpolate_offset > 0:
            scale = ((rows + spec.interpolate_offset) / grid, (cols + spec.interpolate_offset) / grid)
            patch_pos = F.interpolate(
                patch_pos, scale_factor=scale, mode="bicubic", antialias=spec.interpolate_antialias
            )
        else:
            patch_pos = F.interpolate(
                patch_pos, size=(rows, cols), mode="bicubic", antialias=spec.interpolate_antialias
            )
        if patch_pos.shape[-2:] != (rows, cols):
            raise RuntimeError(f"position embedding resized to {tuple(patch_pos.shape[-2:])}, expected {(rows, cols)}")
        patch_pos = patch_pos.flatten(2).transpose(1, 2)
        out = torch.cat([cls_pos, patch_pos], dim=1).to(self.pos_embed.dtype)
        self._pos_cache = {key: out}  # one grid per model: keep only the latest
        return out

    def intermediate_layers(self, x: torch.Tensor, layers: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the blocks on a (B, 3, rows*14, cols*14) normalised image.

        Returns, for each requested block index, (patch tokens (B, rows*cols, C), class token (B, C)), both
        after the final LayerNorm. Blocks after the last requested one are not run.
        """
        rows, cols = x.shape[-2] // self.spec.patch_size, x.shape[-1] // self.spec.patch_size
        tokens = self.patch_embed(x)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1).to(tokens.dtype), tokens], dim=1)
        tokens = tokens + self.position_embedding(rows, cols).to(tokens.dtype)
        n_reg = self.spec.num_register_tokens
        if n_reg:
            reg = self.register_tokens.expand(tokens.shape[0], -1, -1).to(tokens.dtype)
            tokens = torch.cat([tokens[:, :1], reg, tokens[:, 1:]], dim=1)
        wanted = set(layers)
        outputs = {}
        for i, block in enumerate(self.blocks[: max(layers) + 1]):
            tokens = block(tokens)
            if i in wanted:
                normed = self.norm(tokens)
                outputs[i] = (normed[:, 1 + n_reg :], normed[:, 0])
        return [outputs[i] for i in layers]
