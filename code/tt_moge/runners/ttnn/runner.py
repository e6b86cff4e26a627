"""The Tenstorrent runner: the MoGe-2 forward on one Blackhole chip through ttnn (`graph.TtnnGraph`).

Load: the chip is opened (or the caller's open device used), the weights are prepared from the same folded
fixed-shape graph the CPU and CUDA runners use (`prepare.prepare_weights`; cached on disk per checkpoint,
canvas and token budget, so a second load skips it), uploaded once, and the first forward compiles the
kernels and prepares the conv weights on the device. The first `submit` after that captures the whole forward
as a ttnn trace; every later call replays it.

Per call (`submit`): on the host, the canvas is resized (antialiased bilinear, as the reference) to the token
grid and unfolded into the patch matrix (`prepare.host_input`); it is written into the persistent device input
on command queue 0; the trace replays on queue 0; the finest phase maps and the class token are read back, on
queue 1 after an event when the chip was opened with two command queues (worker dispatch only), else on
queue 0. The host then interleaves the phases, adds the constant map, resizes to the canvas and applies the
output activations in torch (`fixed_graph.raw_outputs`, the CPU and CUDA runners' own tail), and runs the
scale MLP on the class token.

Nothing outside this package knows ttnn: `MoGeModel` sees a `Runner`.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ... import env
from ..base import RawMaps, Runner
from ..fixed_graph import raw_outputs
from .device import close_chip, device_count, import_ttnn, open_chip
from .graph import CONFIGS, TtnnGraph
from .prepare import PLAN_VERSION, Prepared, depth_to_space, host_input, metric_scale, prepare_weights

__all__ = [
    "TtnnRunner",
    "prepared_weights",
    "default_cache_dir",
    "graph_config_name",
    "PRECISION_FORMATS",
    "TRACE_ENV",
    "CACHE_ENV",
    "GRAPH_ENV",
    "patch_matrix",
    "raw_maps",
]

TRACE_ENV = "MOGE_TTNN_TRACE"  # "0": no trace capture (the mock device cannot capture one)
CACHE_ENV = "MOGE_TTNN_CACHE"  # folder of the prepared weights (default: ~/.cache/tt_moge/ttnn)
GRAPH_ENV = "MOGE_TTNN_GRAPH"  # "safe": the first graph (graph.CONFIGS), the switch back from the default "fast"
# precision= -> graph.FORMATS (the same in both graph configurations)
PRECISION_FORMATS = {"bf16": "bf16", "bfp8": "bfp8-vit"}


def graph_config_name() -> str:
    """$MOGE_TTNN_GRAPH: "fast" (default) or "safe"; anything else is an error that names the variable."""
    name = (env.get(GRAPH_ENV) or "").strip() or "fast"
    if name not in CONFIGS:
        raise ValueError(f"${GRAPH_ENV}={name!r}: expected one of {sorted(CONFIGS)}")
    return name


def default_cache_dir() -> Path:
    """$MOGE_TTNN_CACHE, else ~/.cache/tt_moge/ttnn (under $XDG_CACHE_HOME when set)."""
    explicit = env.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tt_moge" / "ttnn"


def _fingerprint(network: torch.nn.Module) -> str:
    """A hash of every weight (names, shapes, dtypes, bytes): the checkpoint's identity for the cache."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(network.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        digest.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return digest.hexdigest()


def prepared_weights(
    network: torch.nn.Module, canvas_size: tuple, num_tokens: int, cache_dir: Optional[Path] = None
) -> tuple:
    """(Prepared, its cache file): loaded from the cache when this network, canvas and token budget were
    prepared before, else prepared now and saved (written to a temporary name and renamed: never half a file)."""
    width, height = canvas_size
    folder = default_cache_dir() if cache_dir is None else Path(cache_dir)
    path = folder / f"moge2-{_fingerprint(network)}-{width}x{height}-{num_tokens}-v{PLAN_VERSION}.npz"
    if path.is_file():
        try:
            return Prepared.load(path), path
        except (OSError, ValueError, KeyError):
            pass  # unreadable (an older or damaged file): prepare again and replace it
    prepared = prepare_weights(network, canvas_size, num_tokens)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        prepared.save(path)
    except OSError:
        path = None  # a read-only cache only costs the preparation again next time
    return prepared, path


def patch_matrix(prepared: Prepared, canvas: torch.Tensor) -> np.ndarray:
    """The host step before the device: canvas (1, 3, H, W) in [0, 1] -> the patch matrix (the reference's
    antialiased resize to the token grid, in torch, then `prepare.host_input`)."""
    plan = prepared.plan
    size = (plan["rows"] * plan["patch"], plan["cols"] * plan["patch"])
    small = F.interpolate(canvas.to("cpu", torch.float32), size, mode="bilinear", align_corners=False, antialias=True)
    return host_input(plan, small.numpy())


def raw_maps(prepared: Prepared, readback: dict) -> RawMaps:
    """The host step after the device: the read-back phase maps and class token -> the raw maps at the canvas
    (phases interleaved, constant map added, bilinear resize and output activations in torch, as the CPU and
    CUDA runners finish; the scale MLP on the class token)."""
    plan = prepared.plan
    fin = plan["finest"]
    maps = depth_to_space(readback["finest"], fin["in_height"], fin["in_width"]) + prepared.arrays["finest.const"]
    width, height = plan["canvas"]
    maps = F.interpolate(torch.from_numpy(maps)[None], (height, width), mode="bilinear", align_corners=False)
    heads = [h["name"] for h in plan["heads"]]
    out = raw_outputs(maps, heads, [h["channels"] for h in plan["heads"]], plan["remap"])
    return RawMaps(
        out["points"][0],
        out["normal"][0] if "normal" in out else None,
        out["mask"][0] if "mask" in out else None,
        metric_scale(prepared, readback["cls_token"]),
    )


class TtnnRunner(Runner):
    """MoGe-2 on one Tenstorrent chip. `chip` is an `options.TtChip`: its `handle` (an open ttnn device the
    caller owns and closes) or its `device_id` (opened here with `dispatch` / `num_command_queues`, closed by
    `close()`). `trace=None` follows $MOGE_TTNN_TRACE (default on). `ttnn` replaces the ttnn module (tests)."""

    name = "ttnn"

    def __init__(
        self,
        network: torch.nn.Module,
        canvas_size: tuple,
        num_tokens: int,
        chip: Any,
        *,
        dispatch: str = "eth",
        num_command_queues: Optional[int] = None,
        precision: str = "bf16",
        verbose: bool = False,
        trace: Optional[bool] = None,
        cache_dir: Optional[Path] = None,
        ttnn: Any = None,
    ):
        self.graph_config = graph_config_name()
        if precision not in PRECISION_FORMATS:
            raise ValueError(f"precision={precision!r}: the Tenstorrent runner runs {sorted(PRECISION_FORMATS)}")
        self.formats = PRECISION_FORMATS[precision]
        self.ttnn = ttnn if ttnn is not None else import_ttnn(verbose)
        self.canvas_size = tuple(int(v) for v in canvas_size)
        self.num_tokens = num_tokens
        self.precision = precision
        self.queues = num_command_queues or 1
        self.trace = env.get(TRACE_ENV, "1") != "0" if trace is None else bool(trace)
        self.owns_device = chip.handle is None
        self.device_id = chip.device_id
        self.device = f"tt:{chip.device_id}"
        self._trace_id = None
        self._outputs: Optional[dict] = None
        self.graph: Optional[TtnnGraph] = None
        t0 = time.perf_counter()
        self.prepared, self.cache_file = prepared_weights(network, self.canvas_size, num_tokens, cache_dir)
        self.prepare_seconds = time.perf_counter() - t0
        if self.owns_device:
            found = device_count(self.ttnn)
            if chip.device_id >= found:
                raise ValueError(f"device=tt:{chip.device_id}: no such Tenstorrent chip here ({found} found by ttnn)")
            self._device, self.dispatch = open_chip(self.ttnn, chip.device_id, dispatch, self.queues)
        else:
            self._device, self.dispatch = chip.handle, "the caller's"
        try:
            self.graph = TtnnGraph(
                self.ttnn, self._device, self.prepared, formats=self.formats, config=self.graph_config
            )
            self._load_graph()
            self._input = self.graph.allocate_input()
        except BaseException:
            self.close()
            raise

    def _load_graph(self) -> None:
        """Upload the weights and run the first (compiling) forward; a graph that does not fit the chip's L1
        at this canvas and token budget is a ValueError that says so."""
        try:
            self.graph.load()
        except RuntimeError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith(" ---")]
            width, height = self.canvas_size
            raise ValueError(
                f"the MoGe-2 graph at canvas {width}x{height} with {self.num_tokens} tokens does not run on "
                f"this chip: {' | '.join(lines[:2])[:400]}; try a smaller canvas or token budget"
            ) from None

    # ----------------------------------------------------------------------------------------- calls
    def _run(self) -> dict:
        """The forward on the current input: replay the trace (captured on the first call), or run it eagerly."""
        T = self.ttnn
        if not self.trace:
            return self.graph.forward(self._input)
        if self._trace_id is None:
            self._trace_id = T.begin_trace_capture(self._device, cq_id=0)
            self._outputs = self.graph.forward(self._input)
            T.end_trace_capture(self._device, self._trace_id, cq_id=0)
        T.execute_trace(self._device, self._trace_id, cq_id=0, blocking=False)
        return self._outputs

    @torch.inference_mode()
    def forward(self, canvas: torch.Tensor) -> RawMaps:
        height, width = canvas.shape[-2:]
        if (width, height) != self.canvas_size:
            raise ValueError(
                f"canvas: this runner runs {self.canvas_size[0]}x{self.canvas_size[1]}, got {width}x{height}"
            )
        if self.graph is None:
            raise RuntimeError("this Tenstorrent runner is closed")
        self.graph.upload(patch_matrix(self.prepared, canvas), into=self._input, cq_id=0)
        outputs = self._run()
        read_queue = 0
        if self.queues == 2:  # read back on the second queue once the forward on the first has finished
            self.ttnn.wait_for_event(1, self.ttnn.record_event(self._device, 0))
            read_queue = 1
        return raw_maps(self.prepared, self.graph.read(outputs, cq_id=read_queue))

    # -------------------------------------------------------------------------------------- lifetime
    def describe(self) -> dict:
        info = {
            **super().describe(),
            "dispatch": self.dispatch,
            "command_queues": self.queues,
            "trace": self.trace,
            "graph": self.graph_config,
            "formats": self.formats,
            "prepared_cache": str(self.cache_file) if self.cache_file else None,
        }
        if self.graph is not None:
            info["grid"] = "x".join(map(str, self.graph.grid))
        return info

    def close(self) -> None:
        """Release the trace and the device buffers; close the chip only if this runner opened it."""
        T = self.ttnn
        device, self._device = getattr(self, "_device", None), None
        if device is not None and self._trace_id is not None:
            T.release_trace(device, self._trace_id)
        self._trace_id, self._outputs = None, None
        if self.graph is not None:
            for tensor in list(self.graph.w.values()) + [getattr(self, "_input", None)]:
                if tensor is not None:
                    T.deallocate(tensor)
            self.graph = None
        if device is not None and self.owns_device:
            close_chip(T, device)
