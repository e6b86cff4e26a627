"""The torch runner: the reference network on a torch device (CPU for now)."""
from __future__ import annotations

import torch

from ..network import MoGe2Network
from .base import RawMaps, Runner


class TorchRunner(Runner):
    name = "torch"

    def __init__(self, network: MoGe2Network, canvas_size: tuple, num_tokens: int, device: torch.device):
        self.network = network.to(device)
        self.canvas_size = tuple(canvas_size)
        self.num_tokens = num_tokens
        self.device = device

    @torch.inference_mode()
    def forward(self, canvas: torch.Tensor) -> RawMaps:
        out = self.network(canvas.to(self.device, torch.float32), self.num_tokens)
        host = {k: v[0].to("cpu", torch.float32) for k, v in out.items()}
        scale = host.get("metric_scale")
        return RawMaps(host["points"], host.get("normal"), host.get("mask"), None if scale is None else float(scale))

    def close(self) -> None:
        self.network = None
