"""Device runners: each turns a canvas into raw maps on one kind of device."""
from .base import RawMaps, Runner
from .torch_runner import TorchRunner

__all__ = ["RawMaps", "Runner", "TorchRunner"]
