"""The device runner interface: a canvas goes in, the raw maps come out. Nothing else knows the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RawMaps:
    """The raw forward outputs for one canvas, on the host, at the canvas resolution (float32, CPU; the Tenstorrent
    runner's normal and mask are bfloat16, its read-back format: the host steps read both).

    points (H, W, 3) affine point map (after MoGe's output remap, before focal/shift recovery);
    normal (H, W, 3) unit normals or None; mask (H, W) validity probability or None; metric_scale or None.
    """

    points: torch.Tensor
    normal: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    metric_scale: Optional[float]

    @classmethod
    def from_outputs(cls, out: dict) -> "RawMaps":
        """From the network's raw dict (batch of 1, float32, on the host)."""
        maps = {k: v[0] for k, v in out.items()}
        scale = maps.get("metric_scale")
        return cls(maps["points"], maps.get("normal"), maps.get("mask"), None if scale is None else float(scale))


class PendingMaps:
    """The raw maps of a forward that may still be running or copying; `result()` waits for them."""

    def __init__(self, maps: RawMaps):
        self._maps = maps

    @property
    def ready(self) -> bool:
        """True when `result()` would not wait (the maps are on the host)."""
        return True

    def result(self) -> RawMaps:
        return self._maps


class Runner:
    """Runs the fixed-shape MoGe-2 forward for one canvas size and token budget on one device."""

    name = "base"
    device = "none"
    precision = "fp32"
    # True: the runner also takes (1, 3, H, W) uint8 canvases (0..255, contiguous planes), and the host hands it one
    # whenever the canvas is 8-bit (every image but a float one of the canvas size: `host.canvas.fit_to_canvas`)
    takes_uint8 = False

    def forward(self, canvas: torch.Tensor) -> RawMaps:
        """canvas (1, 3, H, W) float32 in [0, 1] (or uint8 in 0..255 where `takes_uint8`), on the host -> RawMaps
        on the host."""
        raise NotImplementedError

    def submit(self, canvas: torch.Tensor) -> PendingMaps:
        """Start a forward and return at once where the device allows it (the CUDA runner); the caller may
        prepare the next canvas before calling `result()`. The default runs `forward` now."""
        return PendingMaps(self.forward(canvas))

    def describe(self) -> dict:
        return {"runner": self.name, "device": str(self.device), "precision": self.precision}

    def close(self) -> None:
        pass


class ReplayRunner(Runner):
    """Returns the same raw maps for every canvas: the host warm-ups of `MoGeModel` run every host path of a
    call kind without running the device again (see `tt_moge.warmup`)."""

    name = "replay"

    def __init__(self, maps: RawMaps, like: Runner):
        self._maps = maps
        self.device = like.device
        self.precision = like.precision
        self.takes_uint8 = like.takes_uint8  # the host path of the replayed runner, canvas included

    def forward(self, canvas: torch.Tensor) -> RawMaps:
        return self._maps

    def submit(self, canvas: torch.Tensor) -> PendingMaps:
        return PendingMaps(self._maps)
