"""The fast CPU runner: the fixed-shape graph (`FixedShapeMoGe2`) in bfloat16, channels-last, with the constant
work done at load; "int8" adds smoothed int8 ViT matmuls. Chosen by measurement on this machine at load
(`kernel_choice`): the attention kernel (PyTorch SDPA, head by head, or the fused native kernel of `cpu_kernels`
where the CPU has AVX512-BF16); for "int8", the dtype of the rest of the graph (bfloat16, or float32 where
bfloat16 is only emulated) and the ViT's matmul (`Int8Linear`'s per-token `_int_mm`, oneDNN's int8 linear
`OnednnInt8Linear`, or no int8 at all where neither beats the plain GEMM); where the ViT's matmuls are float,
`nn.Linear` or oneDNN's packed linear with GELU fused (`OnednnLinear`). The thread count of each forward can
be chosen by measurement too, and re-checked under load (`cpu_threads`, opt-in); OpenMP's idle threads sleep
instead of spinning (`tt_moge.openmp`, set at `import tt_moge`) so that other jobs on the machine do not cost
it twice. See docs/devices-and-precision.md for
what it costs in accuracy against the float32 reference (`TorchRunner`, precision="fp32")."""

from __future__ import annotations

import copy
import ctypes
import functools
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import env
from ..network import MoGe2Network, token_grid
from . import folding
from . import precision as precision_mod
from .base import RawMaps, Runner
from .conv_kernels import OnednnResBlock, fusable, onednn_conv_available
from .cpu_kernels import attention_bf16, native_attention_supported, native_library
from .cpu_threads import ThreadGovernor
from .fixed_graph import FixedShapeMoGe2
from .kernel_choice import KernelCache, choose, cpu_signature
from .precision import DTYPES
from .vit_kernels import (
    INT8_KERNELS,
    INT8_SMOOTHING,
    HeadByHeadAttention,
    Int8Linear,
    OnednnInt8Linear,
    OnednnLinear,
    make_linear,
    onednn_int8_available,
    onednn_linear_available,
)

__all__ = ["CpuGraphRunner", "keep_freed_memory", "MALLOC_TUNING_ENV"]

MALLOC_TUNING_ENV = "MOGE_CPU_MALLOC_TUNING"  # "0" leaves glibc's malloc settings alone
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_KEEP_BYTES = 1 << 30
SCREEN_ROWS = 32  # tokens of the small shape on which the kernel candidates are screened (kernel_choice.screened)
BASE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
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
        self.threads = ThreadGovernor.from_env(torch.get_num_threads())  # per forward, re-checked under load
        self.native = native_library() if precision != "fp32" else None  # fused attention, int8 glue
        network = network.to("cpu")
        self.choices, dtype = self._choose_kernels(network, KernelCache() if cache is None else cache)
        int8 = self.choices["int8_matmul"].kernel if precision == "int8" else False
        int8 = int8 if int8 in INT8_KERNELS else False  # else the ViT stays in the graph's dtype
        self.graph = FixedShapeMoGe2(
            network,
            canvas_size,
            num_tokens,
            dtype,
            attention=self.choices["attention"].kernel,
            vit_int8=int8,
            native=self.native,
            vit_linear=self.choices["vit_linear"].kernel if "vit_linear" in self.choices else "aten",
            res_block=self.choices["res_block"].kernel if "res_block" in self.choices else "aten",
        ).eval()
        self._kernels: dict = {}
        for point, choice in self.choices.items():
            self._kernels.update({point: choice.kernel, f"{point}_why": choice.describe()})
        if precision == "int8":
            self._kernels.update(
                native_int8_glue=int8 == "int8" and self.native is not None,
                int8_smoothing=self.graph.int8_smoothing if int8 else None,
            )

    @torch.inference_mode()
    def _choose_kernels(self, network: MoGe2Network, cache: KernelCache) -> tuple:
        """Time the candidate kernels of each choice point on this graph's shapes (once per machine: cached).
        Returns ({choice point: KernelChoice}, the graph's dtype)."""
        spec = network.encoder.backbone.spec
        rows, cols = token_grid(self.num_tokens, self.canvas_size[0] / self.canvas_size[1])
        tokens, dim, heads = rows * cols + 1 + spec.num_register_tokens, spec.embed_dim, spec.num_heads
        threads = torch.get_num_threads()
        if self.native is not None:
            self.native.moge_runner_set_threads(threads)
        # the native library's build (its file name hashes its sources, flags and CPU): a changed native kernel is
        # timed again instead of losing to what an older build measured
        native_build = Path(self.native._name).stem if self.native is not None else "no native library"
        machine = f"{cpu_signature()} | torch {torch.__version__} | {threads} threads | {native_build}"
        mlp = network.encoder.backbone.blocks[0].mlp
        hidden = (mlp.w12 if hasattr(mlp, "w12") else mlp.fc1).out_features

        @functools.lru_cache(maxsize=None)
        def ffn(dt: torch.dtype, n: int) -> tuple:
            """The FFN's first matmul: its input (n tokens) and weights in `dt`."""
            gen = torch.Generator().manual_seed(1)
            weight, bias = torch.randn(hidden, dim, generator=gen).div_(dim**0.5), torch.zeros(hidden)
            return torch.randn(n, dim, generator=gen).to(dt), weight, bias

        def on(n: int, dt: torch.dtype, build) -> Callable[[], object]:
            layer = functools.lru_cache(maxsize=None)(lambda: build(*ffn(dt, n)[1:]))
            return lambda: layer()(ffn(dt, n)[0])

        choices = {}
        dtype = DTYPES.get(self.precision)
        if self.precision == "int8":
            # int8 runs the rest of the graph in bfloat16 where that is the faster, else in float32: a CPU
            # without bfloat16 instructions emulates it, several times slower than float32
            bases = {"bf16": torch.bfloat16, "fp32": torch.float32}
            base = {
                name: (lambda dt: lambda n: on(n, dt, lambda w, b: make_linear(w, b, dt)))(dt)
                for name, dt in bases.items()
            }
            choices["int8_base"] = choose(
                "int8_base",
                {name: make(tokens) for name, make in base.items()},
                f"{machine} | ffn {tokens}x{dim}->{hidden}",
                cache=cache,
                screen={name: make(SCREEN_ROWS) for name, make in base.items()},
            )
            dtype = bases[choices["int8_base"].kernel]
        key = f"{machine} | {dtype} | {tokens}x{dim}, {heads} heads"

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
        choices["attention"] = choose("attention", attention, key, cache=cache)
        # oneDNN's packed float linear is offered in float32, or in bfloat16 where the CPU has its instructions (where
        # bfloat16 is only emulated both candidates are, and timing them on the full shape takes minutes)
        packed_float = onednn_linear_available() and (dtype == torch.float32 or precision_mod.cpu_has_native_bf16())
        prefix = 1 + spec.num_register_tokens  # the class and register tokens: their own int8 scale (the graph's)

        def mlp(kernel: str, n: int) -> Callable[[], object]:
            """The ViT's MLP on `n` tokens: ffn_in, GELU, ffn_out, as the graph would run it with `kernel`: float
            ("aten", "onednn": packed, GELU fused) or int8 ("int8", "onednn-int8"; smoothed as the graph smooths,
            the prefix tokens apart). A whole MLP, not one matmul: an int8 kernel also quantizes each input (the
            second matmul's, four times wider, above all), which one matmul's time leaves out."""

            @functools.lru_cache(maxsize=None)
            def layers() -> tuple:
                x, w_in, b_in = ffn(dtype, n)
                gen = torch.Generator().manual_seed(2)
                w_out = torch.randn(dim, hidden, generator=gen).div_(hidden**0.5)
                seen = (x.float().abs().amax(dim=0), torch.rand(hidden, generator=gen).add_(0.1))  # |x| maxima
                if kernel == "onednn":
                    fused = OnednnLinear(w_in, b_in, dtype, "gelu", n)
                    return x, fused, lambda h: h, OnednnLinear(w_out, torch.zeros(dim), dtype, "none", n)
                if kernel == "int8":
                    build = lambda w, b, m: Int8Linear(w, b, dtype, self.native, m, INT8_SMOOTHING)  # noqa: E731
                elif kernel == "onednn-int8":
                    build = lambda w, b, m: OnednnInt8Linear(w, b, dtype, m, INT8_SMOOTHING, prefix)  # noqa: E731
                else:
                    build = lambda w, b, m: make_linear(w, b, dtype)  # noqa: E731
                first, second = build(w_in, b_in, seen[0]), build(w_out, torch.zeros(dim), seen[1])
                return x, first, torch.nn.functional.gelu, second

            def call() -> torch.Tensor:
                x, first, act, second = layers()
                return second(act(first(x)))

            return call

        if self.precision == "int8":
            # int8 against the float MLPs the default graph may run (nn.Linear, and packed where that is offered):
            # int8 pays only where its whole MLP is faster (on an AMX Xeon oneDNN's int8 matmul alone tied
            # bfloat16's, while its MLP took 1.8x the packed bfloat16 one's time: docs/performance.md)
            base = BASE_NAMES[dtype]
            kernels = {"int8": "int8", "onednn": "onednn-int8", base: "aten"}
            if packed_float:
                kernels[f"{base}-packed"] = "onednn"  # a float name: the ViT stays float, vit_linear picks its kernel
            if not onednn_int8_available():
                del kernels["onednn"]
            choices["int8_matmul"] = choose(
                "int8_matmul",
                {name: mlp(kernel, tokens) for name, kernel in kernels.items()},
                f"{key} | mlp {dim}->{hidden}->{dim}, {prefix} prefix tokens apart",
                cache=cache,
                screen={name: mlp(kernel, SCREEN_ROWS + prefix) for name, kernel in kernels.items()},
            )
        float_vit = self.precision != "int8" or choices["int8_matmul"].kernel not in INT8_KERNELS
        if float_vit and packed_float:
            mlps = {kernel: mlp(kernel, tokens) for kernel in ("aten", "onednn")}  # ties go to aten
            choices["vit_linear"] = choose("vit_linear", mlps, f"{key} | mlp {dim}->{hidden}->{dim}", cache=cache)
        block, size = _heaviest_res_block(network, rows, cols)
        if block is not None and onednn_conv_available():
            blocks = {name: _res_block_call(block, dtype, size, fused=name == "onednn") for name in ("aten", "onednn")}
            shape = f"{next(block.parameters()).shape[0]}x{size[0]}x{size[1]}"
            choices["res_block"] = choose("res_block", blocks, f"{key} | res block {shape}", cache=cache)  # ties: aten
        return choices, dtype

    @torch.inference_mode()
    def forward(self, canvas: torch.Tensor) -> RawMaps:
        with self.threads.forward() as threads:
            if self.native is not None:  # the native kernels use as many threads as torch does for this forward
                # (the library was chosen at load: MOGE_HOST=torch set later does not take it away)
                self.native.moge_runner_set_threads(threads)
            return RawMaps.from_outputs(self.graph(canvas.to("cpu", torch.float32)))

    def describe(self) -> dict:
        return {
            **super().describe(),
            "threads": self.threads.describe(),
            "malloc_tuned": self.malloc_tuned,
            **self._kernels,
        }

    def close(self) -> None:
        self.graph = None


def _heaviest_res_block(network: MoGe2Network, rows: int, cols: int) -> tuple:
    """(a fusable residual block of the decoder's finest level that has them, its map's (height, width)), or
    (None, None): the level where the blocks cost the most (the most pixels, fewest channels)."""
    best = (None, None)
    heads = [getattr(network, f"{h}_head") for h in folding.HEADS if hasattr(network, f"{h}_head")]
    for stack in [network.neck] + heads:
        for level, blocks in enumerate(stack.res_blocks):
            if len(blocks) and fusable(blocks[0]) and (best[1] is None or rows << level > best[1][0]):
                best = (blocks[0], (rows << level, cols << level))
    return best


def _res_block_call(block, dtype: torch.dtype, size: tuple, fused: bool) -> Callable[[], object]:
    """A call of `block` on a (1, C, *size) channels-last map in `dtype`, as torch.nn runs it or fused
    (OnednnResBlock); the copies and the input are made on the first call."""

    @functools.lru_cache(maxsize=None)
    def made() -> tuple:
        plain = copy.deepcopy(block).to(dtype).to(memory_format=torch.channels_last).requires_grad_(False)
        channels = next(plain.parameters()).shape[1]
        x = torch.randn(1, channels, *size, generator=torch.Generator().manual_seed(4)).to(dtype)
        return (OnednnResBlock(plain) if fused else plain), x.contiguous(memory_format=torch.channels_last)

    return lambda: made()[0](made()[1])
