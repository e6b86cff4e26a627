"""The CUDA runner: the whole fixed-shape forward captured once as a CUDA graph (the "trace"), replayed per call.

Per call: the host canvas is copied into a pinned staging buffer and uploaded asynchronously into the static
input; the graph replays on the runner's stream; the static outputs are copied into fresh pinned host tensors
on a second stream. `submit` returns before that copy ends, so `predict_many` can upload and start the next
canvas while the previous maps come down. The graph is captured by the first forward (the first warm-up
forward of `from_pretrained`), after a few eager passes on the side stream that let cuBLAS / cuDNN choose
their kernels.

NOT YET RUN ON A GPU: written against the documented `torch.cuda.CUDAGraph` / `torch.cuda.graph` API and
checked on CPU only through the code it shares (`FixedShapeMoGe2`). See docs/devices-and-precision.md.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from ..network import MoGe2Network
from .base import PendingMaps, RawMaps, Runner
from .fixed_graph import FixedShapeMoGe2
from .precision import DTYPES

__all__ = ["CudaGraphRunner"]


class ReferenceForward(nn.Module):
    """The reference network as a one-argument module: canvas -> raw dict (the float32 CUDA path)."""

    def __init__(self, network: MoGe2Network, num_tokens: int):
        super().__init__()
        self.network = network
        self.num_tokens = num_tokens

    def forward(self, canvas: torch.Tensor) -> dict:
        return self.network(canvas, self.num_tokens)


class _PendingCopy(PendingMaps):
    def __init__(self, host: dict, copied: torch.cuda.Event):
        self._host = host
        self._copied = copied

    @property
    def ready(self) -> bool:
        return self._copied.query()

    def result(self) -> RawMaps:
        self._copied.synchronize()
        return RawMaps.from_outputs(self._host)


class CudaGraphRunner(Runner):
    """MoGe-2 on one CUDA device: float16 / bfloat16 fixed-shape graph, or the float32 reference (TF32 off)."""

    name = "cuda-graph"

    def __init__(
        self,
        network: MoGe2Network,
        canvas_size: tuple,
        num_tokens: int,
        device: torch.device,
        precision: str = "fp16",
        *,
        use_graph: bool = True,
        warmup_passes: int = 3,
    ):
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {tuple(DTYPES)} here, got {precision!r}")
        if precision == "bf16" and torch.cuda.get_device_capability(device)[0] < 8:  # bfloat16 tensor cores: Ampere+
            raise ValueError(
                f"precision='bf16': {torch.cuda.get_device_name(device)} has no bfloat16 support; use 'fp16' or 'auto'"
            )
        self.device = torch.device(device)
        self.precision = precision
        self.canvas_size = tuple(canvas_size)
        self.num_tokens = num_tokens
        self.use_graph = use_graph
        self.warmup_passes = warmup_passes
        width, height = self.canvas_size
        with torch.cuda.device(self.device):
            network = network.to(self.device).eval()
            if precision == "fp32":
                self.module: nn.Module = ReferenceForward(network, num_tokens)
            else:
                self.module = FixedShapeMoGe2(
                    network, self.canvas_size, num_tokens, DTYPES[precision], attention="sdpa"
                ).eval()
            self.stream = torch.cuda.Stream(self.device)
            self.copy_stream = torch.cuda.Stream(self.device)
            self.static_canvas = torch.zeros(1, 3, height, width, device=self.device)
            self.staging = torch.empty(1, 3, height, width, pin_memory=True)
        self._staging_free: Optional[torch.cuda.Event] = None  # the last upload out of `staging` has finished
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_out: Optional[dict] = None

    @contextlib.contextmanager
    def _kernel_choice(self):
        """cuDNN autotuning for the fixed shapes; no TF32 in the float32 path (it must stay float32)."""
        exact = self.precision == "fp32"
        matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32 and not exact
        try:
            with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=not exact):
                yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = matmul_tf32

    @torch.no_grad()
    def _capture(self) -> None:
        with torch.cuda.device(self.device), self._kernel_choice():
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for _ in range(self.warmup_passes):  # kernel selection and lazy state, outside the capture
                    self.module(self.static_canvas)
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                self.static_out = self.module(self.static_canvas)
            self.graph = graph

    @torch.no_grad()
    def submit(self, canvas: torch.Tensor) -> PendingMaps:
        if tuple(canvas.shape) != tuple(self.static_canvas.shape):
            raise ValueError(f"canvas must have shape {tuple(self.static_canvas.shape)}, got {tuple(canvas.shape)}")
        if self.use_graph and self.graph is None:
            self._capture()
        if self._staging_free is not None:
            self._staging_free.synchronize()
        self.staging.copy_(canvas)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.static_canvas.copy_(self.staging, non_blocking=True)
            self._staging_free = torch.cuda.Event()
            self._staging_free.record(self.stream)
            if self.graph is not None:
                self.graph.replay()
            else:
                with self._kernel_choice():
                    self.static_out = self.module(self.static_canvas)
                for v in self.static_out.values():
                    v.record_stream(self.copy_stream)  # eager outputs are read on the copy stream
            computed = torch.cuda.Event()
            computed.record(self.stream)
        host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in self.static_out.items()}
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(computed)
            for k, v in self.static_out.items():
                host[k].copy_(v, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        self.stream.wait_event(copied)  # the next replay may overwrite the static outputs only after this copy
        return _PendingCopy(host, copied)

    def forward(self, canvas: torch.Tensor) -> RawMaps:
        return self.submit(canvas).result()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "cuda_graph": self.graph is not None,
            "gpu": torch.cuda.get_device_name(self.device),
        }

    def close(self) -> None:
        if self.graph is not None or self.static_out is not None:
            torch.cuda.synchronize(self.device)
        self.graph = None
        self.static_out = None
        self.module = None
        self.static_canvas = None
        self.staging = None
        torch.cuda.empty_cache()
