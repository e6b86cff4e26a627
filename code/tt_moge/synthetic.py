"""A synthetic photo-like image, for the work that needs a photo before any is given: the warm-up forwards
(`warmup`), the int8 smoothing's calibration (`runners.fixed_graph`), the ONNX export's check and the benchmarks'
default image. Not a test fixture: the analytic scene with exact ground truth is `tt_moge.scene`."""

from __future__ import annotations

import numpy as np

__all__ = ["synthetic_photo"]


def synthetic_photo(size: tuple, seed: int = 0) -> np.ndarray:
    """A photo-like (H, W, 3) uint8 image: smooth gradients, a horizon and mild noise (compresses like a photo)."""
    w, h = size
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :]
    sky = np.stack([0.45 + 0.2 * y + 0 * x, 0.6 + 0.15 * y + 0 * x, 0.85 - 0.1 * y + 0 * x], axis=-1)
    ground = np.stack(
        [0.35 + 0.25 * np.sin(8 * x + 3 * y), 0.4 + 0.2 * y + 0 * x, 0.2 + 0.1 * np.cos(5 * x) + 0 * y], axis=-1
    )
    img = np.where((y > 0.45 + 0.05 * np.sin(6 * x))[..., None], ground, sky)
    img = img + rng.normal(0.0, 0.02, img.shape).astype(np.float32)
    return np.rint(np.clip(img, 0, 1) * 255).astype(np.uint8)
