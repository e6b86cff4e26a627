"""The fast CPU runner: the fixed-shape graph (`FixedShapeMoGe2`) in bfloat16, channels-last, with the constant
work done at load and the fused native attention (`cpu_kernels`) where the CPU has AVX512-BF16; "int8" adds
smoothed int8 ViT matmuls. See docs/devices-and-precision.md for what it costs in accuracy against
the float32 reference (`TorchRunner`, precision="fp32")."""
from __future__ import annotations

import ctypes
import os
import sys

import torch

from ..network import MoGe2Network
from .base import RawMaps, Runner
from .cpu_kernels import native_library
from .fixed_graph import FixedShapeMoGe2
from .precision import DTYPES

__all__ = ["CpuGraphRunner", "keep_freed_memory", "MALLOC_TUNING_ENV"]

MALLOC_TUNING_ENV = "TT_MOGE_CPU_MALLOC_TUNING"  # "0" leaves glibc's malloc settings alone
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_KEEP_BYTES = 1 << 30
_malloc_tuned = False


def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and keep freed memory (up to 1 GiB) for reuse.

    By default glibc maps every block above ~32 MB fresh from the kernel and unmaps it on free, so each
    forward page-faults its big activations in again: about 200 000 faults, 0.6 s of kernel time per ViT-L
    1920x1080 forward on one thread here. Process-wide and idempotent; glibc on Linux only; set
    TT_MOGE_CPU_MALLOC_TUNING=0 to opt out. Returns whether the settings are in effect.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if os.environ.get(MALLOC_TUNING_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
    return _malloc_tuned


class CpuGraphRunner(Runner):
    """`FixedShapeMoGe2` on the CPU in bfloat16 ("bf16"), bfloat16 with int8 ViT matmuls ("int8"), or float32
    (for tests of the graph itself)."""

    name = "cpu-graph"

    def __init__(self, network: MoGe2Network, canvas_size: tuple, num_tokens: int, precision: str = "bf16"):
        if precision not in ("bf16", "int8", "fp32"):
            raise ValueError(f"the CPU graph runner runs 'bf16', 'int8' or 'fp32', got {precision!r}")
        self.precision = precision
        self.device = torch.device("cpu")
        self.canvas_size = tuple(canvas_size)
        self.num_tokens = num_tokens
        self.malloc_tuned = keep_freed_memory()
        self.native = native_library() if precision != "fp32" else None  # fused attention, int8 glue
        dtype = torch.bfloat16 if precision == "int8" else DTYPES[precision]  # int8: bf16 + int8 ViT matmuls
        self.graph = FixedShapeMoGe2(network.to("cpu"), canvas_size, num_tokens, dtype,
                                     attention="heads", vit_int8=precision == "int8", native=self.native).eval()
        self._kernels = {"attention": "native fused" if self.graph.blocks[0].lib is not None else "torch head by head"}
        if precision == "int8":
            self._kernels.update(native_int8_glue=self.native is not None, int8_smoothing=self.graph.int8_smoothing)

    @torch.inference_mode()
    def forward(self, canvas: torch.Tensor) -> RawMaps:
        if self.native is not None:  # the native kernels use as many threads as torch does now (chosen at load:
            # MOGE_HOST=torch set later does not take them away)
            self.native.moge_runner_set_threads(torch.get_num_threads())
        return RawMaps.from_outputs(self.graph(canvas.to("cpu", torch.float32)))

    def describe(self) -> dict:
        return {**super().describe(), "threads": torch.get_num_threads(), "malloc_tuned": self.malloc_tuned,
                **self._kernels}

    def close(self) -> None:
        self.graph = None
