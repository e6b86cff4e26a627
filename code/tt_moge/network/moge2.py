"""The MoGe-2 network: DINOv2 encoder, conv neck with view-plane uv inputs, points/normal/mask heads, scale MLP.

`MoGe2Network.forward(image, num_tokens)` returns the raw maps at the input resolution, as MoGe-2 defines
them: affine points (after the output remap), unit normals, mask probability and the metric scale.
Everything before that (canvas fit) and after it (focal/shift recovery, finish) is host code in
`tt_moge.host`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import MoGe2Config, token_grid
from .convstack import MLP, ConvStack
from .vit import DinoVisionTransformer

# ImageNet statistics; stored in the checkpoint as encoder.image_mean / image_std as well.
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)


def view_plane_axes(
    width: int, height: int, aspect_ratio: float, dtype=torch.float32, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel-centre coordinates (u (width,), v (height,)) on the view plane, normalised by the half diagonal.

    u spans [-a, a] and v [-b, b] with a = aspect / sqrt(1 + aspect^2), b = 1 / sqrt(1 + aspect^2), sampled at
    pixel centres. MoGe feeds these planes to the neck and solves focal/shift against them.
    """
    span_x = aspect_ratio / (1 + aspect_ratio**2) ** 0.5
    span_y = 1 / (1 + aspect_ratio**2) ** 0.5
    u = torch.linspace(-span_x * (width - 1) / width, span_x * (width - 1) / width, width, dtype=dtype, device=device)
    v = torch.linspace(
        -span_y * (height - 1) / height, span_y * (height - 1) / height, height, dtype=dtype, device=device
    )
    return u, v


def view_plane_uv(width: int, height: int, aspect_ratio: float, dtype=torch.float32, device=None) -> torch.Tensor:
    """(height, width, 2) view-plane uv map (see `view_plane_axes`)."""
    u, v = view_plane_axes(width, height, aspect_ratio, dtype, device)
    return torch.stack(torch.meshgrid(u, v, indexing="xy"), dim=-1)


def remap_points(points: torch.Tensor, kind: str) -> torch.Tensor:
    """MoGe-2's output remap of the raw (..., 3) point channels: "linear", "exp" (xy * e^z, e^z), "sinh",
    "sinh_exp"."""
    if kind == "exp":
        xy, z = points.split([2, 1], dim=-1)
        z = torch.exp(z)
        return torch.cat([xy * z, z], dim=-1)
    if kind == "sinh":
        return torch.sinh(points)
    if kind == "sinh_exp":
        xy, z = points.split([2, 1], dim=-1)
        return torch.cat([torch.sinh(xy), torch.exp(z)], dim=-1)
    return points


class DINOv2Encoder(nn.Module):
    """Resize to the token grid, normalise, run the ViT, project and sum the intermediate layers."""

    def __init__(self, cfg: MoGe2Config):
        super().__init__()
        self.layers = list(cfg.intermediate_layers)
        self.patch_size = cfg.backbone.patch_size
        self.backbone = DinoVisionTransformer(cfg.backbone)
        self.output_projections = nn.ModuleList(
            nn.Conv2d(cfg.backbone.embed_dim, cfg.encoder_dim_out, kernel_size=1) for _ in self.layers
        )
        self.register_buffer("image_mean", torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1))
        self.register_buffer("image_std", torch.tensor(IMAGE_STD).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """image (B, 3, H, W) RGB in [0, 1] -> features (B, dim_out, rows, cols), class token (B, embed_dim)."""
        size = (rows * self.patch_size, cols * self.patch_size)
        x = F.interpolate(image, size, mode="bilinear", align_corners=False, antialias=True)
        x = (x - self.image_mean) / self.image_std
        layers = self.backbone.intermediate_layers(x, self.layers)
        b = image.shape[0]
        features = None
        for proj, (tokens, _) in zip(self.output_projections, layers):
            grid = tokens.transpose(1, 2).reshape(b, -1, rows, cols)
            y = proj(grid)
            features = y if features is None else features + y
        return features, layers[-1][1]


class MoGe2Network(nn.Module):
    """MoGe-2 as an `nn.Module` whose state dict is the `model` entry of a MoGe-2 `model.pt`."""

    def __init__(self, cfg: MoGe2Config):
        super().__init__()
        self.config = cfg
        self.encoder = DINOv2Encoder(cfg)
        self.neck = ConvStack(cfg.neck)
        self.points_head = ConvStack(cfg.points_head)
        if cfg.normal_head is not None:
            self.normal_head = ConvStack(cfg.normal_head)
        if cfg.mask_head is not None:
            self.mask_head = ConvStack(cfg.mask_head)
        if cfg.scale_head_dims is not None:
            self.scale_head = MLP(cfg.scale_head_dims)
        self._uv_cache: dict = {}

    def uv_planes(self, rows: int, cols: int, aspect_ratio: float, dtype, device) -> list[torch.Tensor]:
        """The (1, 2, rows*2^l, cols*2^l) view-plane uv inputs of the neck, one per level; cached."""
        key = (rows, cols, aspect_ratio, dtype, device)
        planes = self._uv_cache.get(key)
        if planes is None:
            planes = [
                view_plane_uv(cols * 2**level, rows * 2**level, aspect_ratio, dtype, device).permute(2, 0, 1)[None]
                for level in range(self.config.neck.num_levels)
            ]
            self._uv_cache = {key: planes}
        return planes

    def neck_features(self, image: torch.Tensor, num_tokens: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Encoder + neck: the per-level features every head reads, and the class token."""
        b, _, h, w = image.shape
        aspect = w / h
        rows, cols = token_grid(num_tokens, aspect)
        features, cls_token = self.encoder(image, rows, cols)
        uv = [p.expand(b, -1, -1, -1) for p in self.uv_planes(rows, cols, aspect, image.dtype, image.device)]
        return self.neck([torch.cat([features, uv[0]], dim=1)] + uv[1:]), cls_token

    def forward(self, image: torch.Tensor, num_tokens: int) -> dict[str, torch.Tensor]:
        """Raw MoGe-2 outputs for a batch of RGB images (B, 3, H, W) in [0, 1].

        Returns `points` (B, H, W, 3) affine point map, `normal` (B, H, W, 3) unit normals, `mask` (B, H, W)
        validity probability, `metric_scale` (B,); heads missing from the checkpoint are left out.
        """
        h, w = image.shape[-2:]
        neck_out, cls_token = self.neck_features(image, num_tokens)
        out: dict[str, torch.Tensor] = {}
        for name in ("points", "normal", "mask"):
            head = getattr(self, name + "_head", None)
            if head is None:
                continue
            y = head(neck_out, last_only=True)[-1]
            out[name] = F.interpolate(y, (h, w), mode="bilinear", align_corners=False)
        out["points"] = remap_points(out["points"].permute(0, 2, 3, 1), self.config.remap_output)
        if "normal" in out:
            out["normal"] = F.normalize(out["normal"].permute(0, 2, 3, 1), dim=-1)
        if "mask" in out:
            out["mask"] = out["mask"].squeeze(1).sigmoid()
        if hasattr(self, "scale_head"):
            out["metric_scale"] = self.scale_head(cls_token).squeeze(1).exp()
        return out
