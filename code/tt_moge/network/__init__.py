"""MoGe-2 in plain torch: the reference network that every runner is tested against. The configuration
(`config.py`) imports without torch; the network's names are imported on first use."""

from __future__ import annotations

from typing import Any

from .config import BACKBONES, ConfigError, ConvStackConfig, MoGe2Config, token_grid, validate_token_budget

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

_LAZY = {"MoGe2Network": "moge2", "view_plane_axes": "moge2", "view_plane_uv": "moge2"}  # torch: on first use


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
