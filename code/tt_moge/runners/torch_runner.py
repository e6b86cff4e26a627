"""The reference runner: `MoGe2Network` itself, float32, on a torch device. Bit-identical to the reference. On the
CPU its thread count is chosen per forward by measurement (`cpu_threads.ThreadGovernor`), as the CPU graph's."""

from __future__ import annotations

import contextlib

import torch

from ..network import MoGe2Network
from .base import RawMaps, Runner
from .cpu_threads import ThreadGovernor


class TorchRunner(Runner):
    name = "torch"
    precision = "fp32"

    def __init__(self, network: MoGe2Network, canvas_size: tuple, num_tokens: int, device: torch.device):
        self.network = network.to(device)
        self.canvas_size = tuple(canvas_size)
        self.num_tokens = num_tokens
        self.device = device
        self.threads = ThreadGovernor.from_env(torch.get_num_threads()) if device.type == "cpu" else None

    @torch.inference_mode()
    def forward(self, canvas: torch.Tensor) -> RawMaps:
        with self.threads.forward() if self.threads is not None else contextlib.nullcontext():
            out = self.network(canvas.to(self.device, torch.float32), self.num_tokens)
            return RawMaps.from_outputs({k: v.to("cpu", torch.float32) for k, v in out.items()})

    def describe(self) -> dict:
        info = super().describe()
        return {**info, "threads": self.threads.describe()} if self.threads is not None else info

    def close(self) -> None:
        self.network = None
