"""The device runner interface: a canvas goes in, the raw maps come out. Nothing else knows the device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RawMaps:
    """The raw forward outputs for one canvas, on the host, at the canvas resolution (float32, CPU).

    points (H, W, 3) affine point map (after MoGe's output remap, before focal/shift recovery);
    normal (H, W, 3) unit normals or None; mask (H, W) validity probability or None; metric_scale or None.
    """

    points: torch.Tensor
    normal: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    metric_scale: Optional[float]


class Runner:
    """Runs the fixed-shape MoGe-2 forward for one canvas size and token budget on one device."""

    name = "base"
    device = "none"

    def forward(self, canvas: torch.Tensor) -> RawMaps:
        """canvas (1, 3, H, W) float32 in [0, 1], on the host -> RawMaps on the host."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"runner": self.name, "device": str(self.device)}

    def close(self) -> None:
        pass
