"""The reference runner: `MoGe2Network` itself, float32, on a torch device. Bit-identical to the reference."""

from __future__ import annotations

import torch

from ..network import MoGe2Network
from .base import RawMaps, Runner


class TorchRunner(Runner):
    name = "torch"
    precision = "fp32"

    def __init__(self, network: MoGe2Network, canvas_size: tuple, num_tokens: int, device: torch.device):
        self.network = network.to(device)
        self.canvas_size = tuple(canvas_size)
        self.num_tokens = num_tokens
        self.device = device

    @torch.inference_mode()
    def forward(self, canvas: torch.Tensor) -> RawMaps:
        out = self.network(canvas.to(self.device, torch.float32), self.num_tokens)
        return RawMaps.from_outputs({k: v.to("cpu", torch.float32) for k, v in out.items()})

    def close(self) -> None:
        self.network = None
