"""MoGe-2 in plain torch: the reference network that every runner is tested against."""

from .config import BACKBONES, ConfigError, ConvStackConfig, MoGe2Config, token_grid, validate_token_budget
from .moge2 import MoGe2Network, view_plane_axes, view_plane_uv

__all__ = [
    "BACKBONES",
    "ConfigError",
    "ConvStackConfig",
    "MoGe2Config",
    "MoGe2Network",
    "token_grid",
    "validate_token_budget",
    "view_plane_axes",
    "view_plane_uv",
]
