"""The Tenstorrent runner: the MoGe-2 forward on one Blackhole chip through ttnn (`graph.TtnnGraph`).

Load: the chip is opened (or the caller's open device used), the weights are prepared from the same folded
fixed-shape graph the CPU and CUDA runners use (`prepare.prepare_weights`; cached on disk per checkpoint,
canvas and token budget, so a second load skips it), uploaded once, and the first forward compiles the
kernels and prepares the conv weights on the device. The first `submit` of a canvas dtype after that captures the
whole forward as two ttnn traces (one per slot); every later call replays one. The canvas is 8-bit for a photo
(`takes_uint8`: uint8 planes, 6 MB at 1920x1080 where float32 is 25 MB) and float32 only for a float image of the
canvas size; each dtype has its persistent device inputs (all allocated at load, before any trace).

Per call (`submit`, which returns before the forward ends; `forward` is `submit(...).result()`): the canvas (uint8
or float32, as the canvas fit made it) is written into one of two persistent device inputs of its dtype, used in
turn (`pipeline.DevicePipeline`: double-buffered inputs, traces and outputs); that slot's trace replays on queue 0:
the canvas's antialiased resize to the token grid and its unfold into patches (`pre.DeviceInput`), the network
(`graph.TtnnGraph`), then the phase interleave, the constant map, the bilinear resize to the canvas and the output
activations (`post.DeviceOutput`), copied into the slot's outputs; the raw maps (channels-first, in
`post.READBACK`'s formats: the normals bfloat16, the rest float32) and the class token are read back into recycled
host tensors (`post.DeviceOutput.start_read`). With two command queues (worker dispatch only) the uploads and reads
run on queue 1, ordered by events, while the next trace runs on queue 0; with one, everything runs in order on
queue 0. The host views the maps as (H, W, 3) through strides (no copy) and runs the scale MLP on the class token
(a few thousand multiply-adds).

The timing boundary of `forward` (the spec's): from the canvas handed to the runner to the raw maps on the host:
the upload, the device graph and the read-back. Decode, canvas fit, the focal / shift solve and the finish are
the host stages around it (`service.PredictionService` times them apart). `patch_matrix` and `raw_maps` below
are the same steps on the host, kept as the references the device steps are tested against.

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
from ..base import PendingMaps, RawMaps, Runner
from ..fixed_graph import raw_outputs
from .device import close_chip, device_count, import_ttnn, open_chip
from .graph import CONFIGS, TtnnGraph
from .pipeline import DevicePipeline
from .post import DeviceOutput
from .pre import DeviceInput
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
    "device_raw_maps",
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
    """The host reference of the device's input side (`pre.DeviceInput`): canvas (1, 3, H, W) in [0, 1] -> the
    patch matrix (the reference's antialiased resize to the token grid, in torch, then `prepare.host_input`)."""
    plan = prepared.plan
    size = (plan["rows"] * plan["patch"], plan["cols"] * plan["patch"])
    small = F.interpolate(canvas.to("cpu", torch.float32), size, mode="bilinear", align_corners=False, antialias=True)
    return host_input(plan, small.numpy())


def raw_maps(prepared: Prepared, readback: dict) -> RawMaps:
    """The host reference of the device's output side (`post.DeviceOutput`): the finest phase maps and class
    token -> the raw maps at the canvas (phases interleaved, constant map added, bilinear resize and output
    activations in torch, as the CPU and CUDA runners finish; the scale MLP on the class token)."""
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


def device_raw_maps(prepared: Prepared, maps: dict, cls_token: np.ndarray) -> RawMaps:
    """The device's read-back ({head: (n, H, W) float32, or uint16 bfloat16 bits}, class token) -> RawMaps: (H, W, 3)
    strided views of the channels-first maps (no copy; the solve and the finish take strides), the mask plane, the
    metric scale. bfloat16 bits become torch bfloat16 views (no copy, no widening: the native finish and solve read
    bfloat16; see post.READBACK)."""

    def tensor(array):
        if array.dtype == np.uint16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    def hwc(name):
        return tensor(maps[name]).permute(1, 2, 0) if name in maps else None

    mask = tensor(maps["mask"])[0] if "mask" in maps else None
    return RawMaps(hwc("points"), hwc("normal"), mask, metric_scale(prepared, cls_token))


class _PendingCall(PendingMaps):
    """A submitted canvas (`pipeline.Call`); `result()` waits for its maps and views them as RawMaps."""

    def __init__(self, runner: "TtnnRunner", call):
        self._runner, self._call = runner, call

    @property
    def ready(self) -> bool:
        return self._call.complete

    def result(self) -> RawMaps:
        maps, cls_token = self._runner.pipeline.wait(self._call)
        return device_raw_maps(self._runner.prepared, maps, cls_token)


class TtnnRunner(Runner):
    """MoGe-2 on one Tenstorrent chip. `chip` is an `options.TtChip`: its `handle` (an open ttnn device the
    caller owns and closes) or its `device_id` (opened here with `dispatch` / `num_command_queues`, closed by
    `close()`). `trace=None` follows $MOGE_TTNN_TRACE (default on). `ttnn` replaces the ttnn module (tests)."""

    name = "ttnn"
    takes_uint8 = True  # the device converts (pre.DeviceInput): the host sends a photo's canvas as uint8 planes

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
        self.pipeline: Optional[DevicePipeline] = None
        self.graph: Optional[TtnnGraph] = None
        self.pre: Optional[DeviceInput] = None
        self.post: Optional[DeviceOutput] = None
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
            self.graph.finest_tiles = True  # the output side (post.py) takes the finest maps in tiles
            self._load_graph()
            self.pre = DeviceInput(self.ttnn, self._device, self.prepared, self.graph.formats.activations)
            self.post = DeviceOutput(self.ttnn, self._device, self.prepared)
            self.pre.load()
            self.post.load()
            self.pipeline = DevicePipeline(
                self.ttnn, self._device, self.graph, self.pre, self.post, queues=self.queues, trace=self.trace
            )
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
    @torch.inference_mode()
    def submit(self, canvas: torch.Tensor) -> PendingMaps:
        """Start the device forward of a canvas and return before it ends (`pipeline.DevicePipeline.submit`: the
        canvas goes up, its trace is enqueued, and its read-back); `.result()` waits for the raw maps. `canvas`:
        (1, 3, H, W) uint8 (0..255) or float (in [0, 1]); its bytes are copied before this returns."""
        height, width = canvas.shape[-2:]
        if (width, height) != self.canvas_size:
            raise ValueError(
                f"canvas: this runner runs {self.canvas_size[0]}x{self.canvas_size[1]}, got {width}x{height}"
            )
        if self.graph is None:
            raise RuntimeError("this Tenstorrent runner is closed")
        if canvas.dtype == torch.uint8:
            array = canvas.detach().cpu().numpy()
        else:
            array = canvas.detach().to("cpu", torch.float32).numpy()
        return _PendingCall(self, self.pipeline.submit(array))

    def forward(self, canvas: torch.Tensor) -> RawMaps:
        """The device forward (the spec's `forward`): upload the canvas, run the device graph (resize and unfold,
        the network, interleave, resize to the canvas, activations), read back the raw maps and the class token;
        on the host only the scale MLP on the class token and (H, W, 3) views of the maps."""
        return self.submit(canvas).result()

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
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        for side in (self.pre, self.post):
            if side is not None:
                side.close()
        self.pre = self.post = None
        if self.graph is not None:
            for tensor in self.graph.tensors():
                T.deallocate(tensor)
            self.graph = None
        if device is not None and self.owns_device:
            close_chip(T, device)
