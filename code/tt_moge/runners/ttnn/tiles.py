"""Tile geometry shared by the device graph (`graph.py`), its parts (`encoder.py`, `vit_block.py`, `decoder.py`)
and the input and output sides (`pre.py`, `post.py`): ttnn's 32x32 tile, the bytes of one tile in each data
format, and a ceiling division."""

from __future__ import annotations

__all__ = ["TILE", "TILE_BYTES", "cdiv"]

TILE = 32
TILE_BYTES = {"bfloat16": 2048, "float32": 4096, "bfloat8_b": 1088}  # one 32x32 tile (bfloat8_b: with exponents)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers."""
    return -(-a // b)
