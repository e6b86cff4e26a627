"""Device runners: each turns a canvas into raw maps on one kind of device.

`make_runner(network, canvas_size, num_tokens, device, precision)` picks the runner for a device and a
precision (see `precision.py` for the table): the float32 reference (`TorchRunner`), the bfloat16 CPU graph
(`CpuGraphRunner`) or the CUDA-graph runner (`CudaGraphRunner`).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ..network import MoGe2Network
from .base import PendingMaps, RawMaps, Runner
from .cpu import CpuGraphRunner
from .precision import PRECISIONS, cpu_has_int8_dot, cpu_has_native_bf16, resolve_precision
from .torch_runner import TorchRunner

__all__ = ["PRECISIONS", "PendingMaps", "RawMaps", "Runner", "TorchRunner", "CpuGraphRunner", "make_runner",
           "resolve_precision", "cpu_has_native_bf16"]


def make_runner(network: MoGe2Network, canvas_size: tuple, num_tokens: int, device: Any = "cpu",
                precision: str = "auto") -> Runner:
    """The runner for `device` ("cpu", "cuda[:N]" or a torch.device) at `precision` ("auto", "fp32", "bf16",
    "fp16", "int8"). Takes ownership of `network` (it may be moved or converted)."""
    device = torch.device(device)
    chosen = resolve_precision(precision, device)
    if device.type == "cpu":
        if chosen == "fp32":
            return TorchRunner(network, canvas_size, num_tokens, device)
        if not cpu_has_native_bf16():
            warnings.warn(f"precision={chosen!r}: this CPU has no bfloat16 dot-product instructions (AVX512-BF16 / AMX), "
                          "so PyTorch emulates them and the forward is slower than 'fp32'", RuntimeWarning, stacklevel=2)
        if chosen == "int8" and not cpu_has_int8_dot():
            warnings.warn("precision='int8': this CPU has no int8 dot-product instructions (VNNI / AMX), so the int8 "
                          "matmuls are slower than 'bf16'", RuntimeWarning, stacklevel=2)
        return CpuGraphRunner(network, canvas_size, num_tokens, chosen)
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: no CUDA GPU is available on this machine (torch {torch.__version__})")
    from .cuda import CudaGraphRunner  # imported here: nothing CUDA-specific runs on CPU-only machines

    return CudaGraphRunner(network, canvas_size, num_tokens, device, chosen)
