"""Device runners: each turns a canvas into raw maps on one kind of device.

`make_runner(network, canvas_size, num_tokens, device, precision)` picks the runner for a device and a
concrete precision (resolved once by `tt_moge.options.LoadOptions`; see `precision.py` for the table): the
float32 reference (`TorchRunner`), the bfloat16 CPU graph (`CpuGraphRunner`) or the CUDA-graph runner
(`CudaGraphRunner`). The names are imported on first use, so that `runners.ttnn`'s device graph (numpy and
ttnn only) imports without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PRECISIONS",
    "PendingMaps",
    "RawMaps",
    "Runner",
    "TorchRunner",
    "CpuGraphRunner",
    "make_runner",
    "resolve_precision",
    "cpu_has_native_bf16",
]

_LAZY = {
    "PendingMaps": "base",
    "RawMaps": "base",
    "Runner": "base",
    "CpuGraphRunner": "cpu",
    "TorchRunner": "torch_runner",
    "PRECISIONS": "precision",
    "resolve_precision": "precision",
    "cpu_has_native_bf16": "precision",
    "cpu_has_int8_dot": "precision",
    "DTYPES": "precision",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_runner(
    network: Any, canvas_size: tuple, num_tokens: int, device: Any = "cpu", precision: str = "bf16", **tt_options: Any
) -> Any:
    """The runner for `device` ("cpu", "cuda[:N]", a torch.device, or a Tenstorrent chip: `options.TtChip`) at a
    concrete `precision` ("fp32", "bf16", "fp16", "int8", "bfp8"; see `resolve_precision` for "auto").
    `tt_options` (dispatch, num_command_queues, verbose) reach the Tenstorrent runner only. Takes ownership of
    `network` (it may be moved or converted)."""
    import warnings

    import torch

    if getattr(device, "type", None) == "tt" and not isinstance(device, torch.device):
        from .ttnn.runner import TtnnRunner  # imported here: ttnn only where it is used

        return TtnnRunner(network, canvas_size, num_tokens, device, precision=precision, **tt_options)

    from . import precision as precisions
    from .cpu import CpuGraphRunner
    from .torch_runner import TorchRunner

    device = torch.device(device)
    if precisions.resolve_precision(precision, device) != precision:  # the one table of what runs where
        raise ValueError(f"make_runner takes a resolved precision (see resolve_precision), got {precision!r}")
    if device.type == "cpu":
        if precision == "fp32":
            return TorchRunner(network, canvas_size, num_tokens, device)
        if precision == "bf16" and not precisions.cpu_has_native_bf16():
            warnings.warn(
                f"precision={precision!r}: this CPU has no bfloat16 dot-product instructions (AVX512-BF16 / AMX), "
                "so PyTorch emulates them and the forward is slower than 'fp32'",
                RuntimeWarning,
                stacklevel=2,
            )
        # "int8" needs no warning: its graph dtype and int8 kernel are chosen by measurement at load (a CPU
        # without bfloat16 or int8 instructions gets float32 where that is faster: runner.describe() says)
        return CpuGraphRunner(network, canvas_size, num_tokens, precision)
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r}: no CUDA GPU is available on this machine (torch {torch.__version__})"
        )
    from .cuda import CudaGraphRunner  # imported here: nothing CUDA-specific runs on CPU-only machines

    return CudaGraphRunner(network, canvas_size, num_tokens, device, precision)
