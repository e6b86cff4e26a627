"""The fast CPU runner: the fixed-shape graph (`FixedShapeMoGe2`) in bfloat16, channels-last, with the constant
work done at load; "int8" adds smoothed int8 ViT matmuls. The attention kernel (PyTorch SDPA, head by head, or
the fused native kernel of `cpu_kernels` where the CPU has AVX512-BF16) and the int8 matmul (int8 or bfloat16)
are chosen by measurement on this machine at load (`kernel_choice`). See docs/devices-and-precision.md for
what it costs in accuracy against the float32 reference (`TorchRunner`, precision="fp32")."""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Optional

import torch

from .. import env
from ..network import MoGe2Network, token_grid
from .base import RawMaps, Runner
from .cpu_kernels import attention_bf16, native_attention_supported, native_library
from .fixed_graph import FixedShapeMoGe2, HeadByHeadAttention, Int8Linear, make_linear
from .kernel_choice import KernelCache, choose, cpu_signature
from .precision import DTYPES

__all__ = ["CpuGraphRunner", "keep_freed_memory", "MALLOC_TUNING_ENV"]

MALLOC_TUNING_ENV = "MOGE_CPU_MALLOC_TUNING"  # "0" leaves glibc's malloc settings alone
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_KEEP_BYTES = 1 << 30
_malloc_tuned = False


def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and keep freed memory (up to 1 GiB) for reuse.

    By default glibc maps every block above ~32 MB fresh from the kernel and unmaps it on free, so each
    forward page-faults its big activations in again (docs/performance.md has the count and the time).
    Process-wide and idempotent; glibc on Linux only; set MOGE_CPU_MALLOC_TUNING=0 to opt out. Returns whether
    the settings are in effect.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if env.get(MALLOC_TUNING_ENV, "1") == "0" or not sys.platform.startswith("linux"):
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

    def __init__(
        self,
        network: MoGe2Network,
        canvas_size: tuple,
        num_tokens: int,
        precision: str = "bf16",
        cache: Optional[KernelCache] = None,
    ):
        if precision not in ("bf16", "int8", "fp32"):
            raise ValueError(f"the CPU graph runner runs 'bf16', 'int8' or 'fp32', got {precision!r}")
        self.precision = precision
        self.device = torch.device("cpu")
        self.canvas_size = tuple(canvas_size)
        self.num_tokens = num_tokens
        self.malloc_tuned = keep_freed_memory()
        self.native = native_library() if precision != "fp32" else None  # fused attention, int8 glue
        dtype = torch.bfloat16 if precision == "int8" else DTYPES[precision]  # int8: bf16 + int8 ViT matmuls
        network = network.to("cpu")
        self.choices = self._choose_kernels(network, dtype, KernelCache() if cache is None else cache)
        int8 = precision == "int8" and self.choices["int8_matmul"].kernel == "int8"
        self.graph = FixedShapeMoGe2(
            network,
            canvas_size,
            num_tokens,
            dtype,
            attention=self.choices["attention"].kernel,
            vit_int8=int8,
            native=self.native,
        ).eval()
        self._kernels: dict = {}
        for point, choice in self.choices.items():
            self._kernels.update({point: choice.kernel, f"{point}_why": choice.describe()})
        if precision == "int8":
            self._kernels.update(
                native_int8_glue=int8 and self.native is not None,
                int8_smoothing=self.graph.int8_smoothing if int8 else None,
            )

    @torch.inference_mode()
    def _choose_kernels(self, network: MoGe2Network, dtype: torch.dtype, cache: KernelCache) -> dict:
        """Time the candidate kernels of each choice point on this graph's shapes (once per machine: cached)."""
        spec = network.encoder.backbone.spec
        rows, cols = token_grid(self.num_tokens, self.canvas_size[0] / self.canvas_size[1])
        tokens, dim, heads = rows * cols + 1 + spec.num_register_tokens, spec.embed_dim, spec.num_heads
        threads = torch.get_num_threads()
        if self.native is not None:
            self.native.moge_runner_set_threads(threads)
        key = (
            f"{cpu_signature()} | torch {torch.__version__} | {threads} "
            f"threads | {dtype} | {tokens}x{dim}, {heads} heads"
        )

        # The candidates' inputs are made on their first call only: a cached or forced choice times nothing.
        @functools.lru_cache(maxsize=None)
        def qkv() -> tuple:
            data = torch.randn(tokens, 3 * dim, generator=torch.Generator().manual_seed(0)).div_(4).to(dtype)
            return data, data.t().contiguous(), HeadByHeadAttention()

        def sdpa() -> torch.Tensor:
            q, k, v = qkv()[0].view(1, tokens, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)

        attention = {"sdpa": sdpa, "heads": lambda: qkv()[2](qkv()[1], heads)}
        if dtype == torch.bfloat16 and native_attention_supported(self.native, dim // heads):
            attention = {"native": lambda: attention_bf16(qkv()[0], heads, self.native), **attention}
        choices = {"attention": choose("attention", attention, key, cache=cache)}
        if self.precision == "int8":
            mlp = network.encoder.backbone.blocks[0].mlp
            hidden = (mlp.w12 if hasattr(mlp, "w12") else mlp.fc1).out_features

            @functools.lru_cache(maxsize=None)
            def ffn() -> tuple:
                gen = torch.Generator().manual_seed(1)
                weight, bias = torch.randn(hidden, dim, generator=gen).div_(dim**0.5), torch.zeros(hidden)
                x = torch.randn(tokens, dim, generator=gen).to(dtype)
                return x, Int8Linear(weight, bias, dtype, self.native), make_linear(weight, bias, dtype)

            matmul = {"int8": lambda: ffn()[1](ffn()[0]), "bf16": lambda: ffn()[2](ffn()[0])}
            choices["int8_matmul"] = choose("int8_matmul", matmul, f"{key} | ffn {dim}->{hidden}", cache=cache)
        return choices

    @torch.inference_mode()
    def forward(self, canvas: torch.Tensor) -> RawMaps:
        if self.native is not None:  # the native kernels use as many threads as torch does now (chosen at load:
            # MOGE_HOST=torch set later does not take them away)
            self.native.moge_runner_set_threads(torch.get_num_threads())
        return RawMaps.from_outputs(self.graph(canvas.to("cpu", torch.float32)))

    def describe(self) -> dict:
        return {
            **super().describe(),
            "threads": torch.get_num_threads(),
            "malloc_tuned": self.malloc_tuned,
            **self._kernels,
        }

    def close(self) -> None:
        self.graph = None
