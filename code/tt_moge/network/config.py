"""The MoGe-2 architecture as data: parse and check the `model_config` stored in `model.pt`.

Every size of the network (backbone, feature levels, channel widths, heads) comes from the
checkpoint's own config; nothing here assumes ViT-L.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

__all__ = ["BackboneSpec", "BACKBONES", "ConvStackConfig", "MoGe2Config", "ConfigError"]


class ConfigError(ValueError):
    """The checkpoint's `model_config` does not describe a MoGe-2 network we can build."""


@dataclass(frozen=True)
class BackboneSpec:
    """One DINOv2 ViT variant (as published by facebookresearch/dinov2 and named by MoGe configs)."""

    embed_dim: int
    depth: int
    num_heads: int
    ffn: str = "mlp"  # "mlp" (GELU MLP) or "swiglu" (ViT-g)
    num_register_tokens: int = 0
    mlp_ratio: float = 4.0
    patch_size: int = 14
    img_size: int = 518  # the position embedding grid is img_size // patch_size squared
    interpolate_offset: float = 0.1
    interpolate_antialias: bool = False

    @property
    def pos_grid(self) -> int:
        return self.img_size // self.patch_size


def _with_registers(spec: BackboneSpec) -> BackboneSpec:
    # DINOv2's "_reg" models: 4 register tokens and a plain size-based position-embedding resize.
    return BackboneSpec(
        spec.embed_dim,
        spec.depth,
        spec.num_heads,
        spec.ffn,
        num_register_tokens=4,
        interpolate_offset=0.0,
        interpolate_antialias=True,
    )


_PLAIN = {
    "dinov2_vits14": BackboneSpec(384, 12, 6),
    "dinov2_vitb14": BackboneSpec(768, 12, 12),
    "dinov2_vitl14": BackboneSpec(1024, 24, 16),
    "dinov2_vitg14": BackboneSpec(1536, 40, 24, ffn="swiglu"),
}
BACKBONES: dict[str, BackboneSpec] = {**_PLAIN, **{k + "_reg": _with_registers(v) for k, v in _PLAIN.items()}}

_RESAMPLERS = {"conv_transpose", "bilinear", "nearest", "pixel_shuffle"}
_NORMS = {"none", "layer_norm", "group_norm", "instance_norm"}
_ACTIVATIONS = {"relu", "leaky_relu", "silu", "elu"}
_REMAPS = {"linear", "sinh", "exp", "sinh_exp"}


def _per_level(value: Any, n: int, name: str) -> list:
    """Expand a scalar-or-list config entry to one value per level."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"{name} has {len(value)} entries; expected {n} (one per feature level)")
        return list(value)
    return [value] * n


@dataclass(frozen=True)
class ConvStackConfig:
    """A multi-level conv stack (the neck or a head): one entry per resolution level, coarse to fine."""

    dim_in: list  # per level: input channels of the 1x1 input conv, or None for no input at that level
    dim_res_blocks: list
    dim_out: list  # per level: output channels of the 1x1 output conv, or None (identity)
    resamplers: list  # between levels: len(levels) - 1 entries
    num_res_blocks: list
    dim_times_res_block_hidden: int = 1
    res_block_in_norm: str = "layer_norm"
    res_block_hidden_norm: str = "group_norm"
    activation: str = "relu"

    @property
    def num_levels(self) -> int:
        return len(self.dim_res_blocks)

    @classmethod
    def parse(cls, raw: Mapping[str, Any], name: str) -> "ConvStackConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{name} must be a dict, got {type(raw).__name__}")
        try:
            dims = list(raw["dim_res_blocks"])
        except KeyError:
            raise ConfigError(f"{name} has no 'dim_res_blocks'") from None
        n = len(dims)
        if n < 1:
            raise ConfigError(f"{name}.dim_res_blocks is empty")
        cfg = cls(
            dim_in=_per_level(raw.get("dim_in"), n, f"{name}.dim_in"),
            dim_res_blocks=dims,
            dim_out=_per_level(raw.get("dim_out"), n, f"{name}.dim_out"),
            resamplers=_per_level(raw.get("resamplers", "bilinear"), n - 1, f"{name}.resamplers"),
            num_res_blocks=_per_level(raw.get("num_res_blocks", 1), n, f"{name}.num_res_blocks"),
            dim_times_res_block_hidden=int(raw.get("dim_times_res_block_hidden", 1)),
            res_block_in_norm=raw.get("res_block_in_norm", "layer_norm"),
            res_block_hidden_norm=raw.get("res_block_hidden_norm", "group_norm"),
            activation=raw.get("activation", "relu"),
        )
        for r in cfg.resamplers:
            if r not in _RESAMPLERS:
                raise ConfigError(
                    f"{name}.resamplers: unsupported resampler {r!r}; expected one of {sorted(_RESAMPLERS)}"
                )
        for key in ("res_block_in_norm", "res_block_hidden_norm"):
            if getattr(cfg, key) not in _NORMS:
                raise ConfigError(
                    f"{name}.{key}: unsupported norm {getattr(cfg, key)!r}; expected one of {sorted(_NORMS)}"
                )
        if cfg.activation not in _ACTIVATIONS:
            raise ConfigError(
                f"{name}.activation: unsupported {cfg.activation!r}; expected one of {sorted(_ACTIVATIONS)}"
            )
        return cfg


@dataclass(frozen=True)
class MoGe2Config:
    """The whole network: encoder, neck, heads and output remap, read from a checkpoint's `model_config`."""

    backbone_name: str
    backbone: BackboneSpec
    intermediate_layers: list  # block indices whose (normed) outputs feed the neck
    encoder_dim_out: int
    neck: ConvStackConfig
    points_head: Optional[ConvStackConfig]
    normal_head: Optional[ConvStackConfig]
    mask_head: Optional[ConvStackConfig]
    scale_head_dims: Optional[list]
    remap_output: str = "linear"
    num_tokens_range: tuple = (1200, 3600)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> "MoGe2Config":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"model_config must be a dict, got {type(raw).__name__}")
        enc = raw.get("encoder")
        if not isinstance(enc, Mapping) or "backbone" not in enc:
            raise ConfigError("model_config.encoder must be a dict with a 'backbone' name (e.g. 'dinov2_vitl14')")
        name = enc["backbone"]
        if name not in BACKBONES:
            raise ConfigError(
                f"model_config.encoder.backbone {name!r} is not a DINOv2 "
                f"backbone we know; expected one of {sorted(BACKBONES)}"
            )
        spec = BACKBONES[name]
        layers = enc.get("intermediate_layers", 4)
        if isinstance(layers, int):
            layers = list(range(spec.depth - layers, spec.depth))
        layers = [int(i) for i in layers]
        if not layers or min(layers) < 0 or max(layers) >= spec.depth:
            raise ConfigError(
                f"model_config.encoder.intermediate_layers {layers} out of range for {name} ({spec.depth} blocks)"
            )
        if "neck" not in raw:
            raise ConfigError(
                "model_config has no 'neck'; this is not a MoGe-2 checkpoint (MoGe-1 checkpoints are not supported)"
            )
        neck = ConvStackConfig.parse(raw["neck"], "neck")
        heads = {}
        for head in ("points_head", "normal_head", "mask_head"):
            heads[head] = ConvStackConfig.parse(raw[head], head) if raw.get(head) is not None else None
            if heads[head] is not None and heads[head].num_levels != neck.num_levels:
                raise ConfigError(f"{head} has {heads[head].num_levels} levels but the neck has {neck.num_levels}")
        if heads["points_head"] is None:
            raise ConfigError("model_config has no points_head; MoGe-2 needs one")
        scale = raw.get("scale_head")
        scale_dims = list(scale["dims"]) if scale is not None else None
        remap = raw.get("remap_output", "linear")
        if remap not in _REMAPS:
            raise ConfigError(f"model_config.remap_output {remap!r}; expected one of {sorted(_REMAPS)}")
        token_range = tuple(int(t) for t in raw.get("num_tokens_range", (1200, 3600)))
        return cls(
            backbone_name=name,
            backbone=spec,
            intermediate_layers=layers,
            encoder_dim_out=int(enc["dim_out"]),
            neck=neck,
            points_head=heads["points_head"],
            normal_head=heads["normal_head"],
            mask_head=heads["mask_head"],
            scale_head_dims=scale_dims,
            remap_output=remap,
            num_tokens_range=token_range,
            raw=dict(raw),
        )

    @property
    def has_normal(self) -> bool:
        return self.normal_head is not None

    def describe(self) -> str:
        heads = [h for h in ("points", "normal", "mask") if getattr(self, h + "_head") is not None]
        scale = "+scale" if self.scale_head_dims else ""
        return f"{self.backbone_name}, heads {'/'.join(heads)}{scale}, remap {self.remap_output}"


def token_grid(num_tokens: int, aspect_ratio: float) -> tuple[int, int]:
    """(rows, cols) of ViT patch tokens for a budget and an image aspect (width / height).

    rows * cols is close to `num_tokens` and cols / rows close to the aspect, as MoGe-2 chooses them.
    """
    rows = round((num_tokens / aspect_ratio) ** 0.5)
    cols = round((num_tokens * aspect_ratio) ** 0.5)
    return rows, cols


def validate_token_budget(num_tokens: Any, allowed: Sequence[int] = (1200, 3600)) -> int:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    lo, hi = allowed
    if not lo <= num_tokens <= hi:
        raise ValueError(f"num_tokens must be in [{lo}, {hi}] (the MoGe-2 token budget), got {num_tokens}")
    return num_tokens
