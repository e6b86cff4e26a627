"""MoGeModel: load MoGe-2 once, then turn images into metric depth, points, normals, mask and intrinsics.

    with MoGeModel.from_pretrained(device="cpu") as model:
        out = model("photo.jpg")

One call = decode -> canvas fit -> device forward -> focal/shift solve -> finish (see `tt_moge.host`). The
device forward runs one canvas at a time under a lock; the host stages of different calls run in parallel.
"""
from __future__ import annotations

import copy
import gc
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from . import __version__, native
from .constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS
from .host import CallOptions, InputError, Stopwatch, postprocess, prepare
from .options import LoadOptions
from .output import MoGeOutput
from .runners import make_runner
from .runners.base import PendingMaps, RawMaps, ReplayRunner, Runner
from .warmup import canonical_variant, run_variant, synthetic_photo
from .weights import DEFAULT_REPO, DEFAULT_REVISION, load_network

__all__ = ["MoGeModel"]


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[tt_moge] {message}", file=sys.stderr, flush=True)


class MoGeModel:
    """MoGe-2 on one device, with a canvas size and token budget fixed at load time.

    Create it with `MoGeModel.from_pretrained(...)`. Calls are thread-safe; the device runs one image at a time.
    """

    def __init__(self, runner: Runner, options: LoadOptions, *, network_config: Any, source: str,
                 revision: Optional[str]):
        self._runner = runner
        self.options = options
        self.config = network_config
        self.source = source
        self.revision = revision
        self.resolution = tuple(options.resolution)
        self.num_tokens = options.num_tokens
        self.verbose = options.verbose
        self._device_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._closed = False
        self._warmed: dict = {}
        self._warm_raw: Optional[RawMaps] = None  # the raw maps of the last device warm-up (host warm-ups replay them)

    # ------------------------------------------------------------------------------------------- load
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike] = DEFAULT_REPO,
        *,
        device: Any = None,
        device_id: int = 0,
        revision: Optional[str] = DEFAULT_REVISION,
        resolution: Sequence[int] = DEFAULT_CANVAS,
        num_tokens: int = DEFAULT_NUM_TOKENS,
        dispatch: str = "eth",
        num_command_queues: Optional[int] = None,
        warmup: int = 2,
        warmup_variants: Any = "default",
        verbose: bool = False,
        precision: str = "auto",
    ) -> "MoGeModel":
        """Load the weights, build the runner for the device, run `warmup` device forwards, warm the host paths.

        `precision`: "auto" (default: bf16 on CPUs with bfloat16 instructions, else fp32; fp16 on CUDA), "fp32"
        (the reference network, exact), "bf16", "fp16" (CUDA only) or "int8" (CPU only, opt-in: int8 ViT
        matmuls). See `tt_moge.runners.precision`. `revision` "main" (or None) is the Hub's default branch.

        `dispatch` and `num_command_queues` are Tenstorrent options: validated here, used by the ttnn runner,
        ignored by the CPU and CUDA runners.
        """
        return cls.load(LoadOptions.resolve(
            pretrained_model_name_or_path, device=device, device_id=device_id, revision=revision,
            resolution=resolution, num_tokens=num_tokens, dispatch=dispatch, num_command_queues=num_command_queues,
            warmup=warmup, warmup_variants=warmup_variants, verbose=verbose, precision=precision))

    @classmethod
    def load(cls, options: LoadOptions) -> "MoGeModel":
        """`from_pretrained` with options already resolved (`LoadOptions.resolve`)."""
        t0 = time.perf_counter()
        network, ckpt = load_network(options.weights, options.revision)
        _log(options.verbose, f"loaded {ckpt.source} ({network.config.describe()}) in {time.perf_counter() - t0:.1f} s")
        runner = make_runner(network, options.resolution, options.num_tokens, options.device, options.precision,
                             dispatch=options.dispatch, num_command_queues=options.num_command_queues,
                             verbose=options.verbose)
        model = cls(runner, options, network_config=network.config, source=ckpt.source, revision=ckpt.revision)
        del network  # the runner holds what it needs (a graph runner: only its folded copy)
        try:
            native.library()  # build (first use on this machine) and load the native library now, not in a call
            model._device_warmup(options.warmup)
            photos: dict = {}  # one synthetic photo per size for all the variants of this load
            for variant in options.warmup_variants:
                model._warm_variant(variant, photos)
        except BaseException:
            model.close()
            raise
        gc.collect()  # the collection that load-time allocations would otherwise trigger inside the first call
        _log(options.verbose, f"ready on {runner.describe()['device']} in {time.perf_counter() - t0:.1f} s")
        return model

    def _device_warmup(self, count: int) -> None:
        canvas = torch.from_numpy(synthetic_photo(self.resolution)).permute(2, 0, 1)[None].float().div_(255)
        for i in range(count):
            t = time.perf_counter()
            self._warm_raw = self._forward_raw(canvas)
            _log(self.verbose, f"device warm-up forward {i + 1}/{count}: {time.perf_counter() - t:.2f} s")

    # ------------------------------------------------------------------------------------ properties
    @property
    def device(self) -> str:
        return str(self._runner.device)

    @property
    def has_normal(self) -> bool:
        return self.config.has_normal

    @property
    def warmed_variants(self) -> dict:
        """{canonical variant (tuple of (key, value)): seconds its warm-up took}."""
        return dict(self._warmed)

    def info(self) -> dict:
        """What is loaded and where: for logs, the server's /info and `tt-moge info`."""
        return {
            "model": self.source, "revision": self.revision, "architecture": self.config.describe(),
            "device": self.device, "runner": self._runner.describe(), "canvas": list(self.resolution),
            "num_tokens": self.num_tokens, "precision": self._runner.precision, "normal": self.has_normal,
            "host": native.host_path(),
            "version": __version__,
        }

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.device
        return f"MoGeModel({self.source}, {self.resolution[0]}x{self.resolution[1]}, {self.num_tokens} tokens, {state})"

    # --------------------------------------------------------------------------------------- calls
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this MoGeModel is closed; load a new one with MoGeModel.from_pretrained(...)")

    def _forward_raw(self, canvas: torch.Tensor, timing: Optional[dict] = None) -> RawMaps:
        """The device forward, one canvas at a time; `timing` gets "device_wait" (waiting for the device while
        another call runs) and "device" (the forward only), in ms."""
        watch = Stopwatch(timing)
        pending = self._submit_raw(canvas, watch)
        raw = pending.result()
        watch.lap("device")
        return raw

    def _submit_raw(self, canvas: torch.Tensor, watch: Optional[Stopwatch] = None) -> PendingMaps:
        """Start the device forward (on CUDA it returns before the maps are back; `.result()` waits)."""
        with self._device_lock:
            if watch is not None:
                watch.lap("device_wait")
            self._check_open()
            return self._runner.submit(canvas)

    def predict(self, image: Any, *, fit: str = "pad", fov_x: Optional[float] = None, apply_mask: bool = True,
                force_projection: bool = True, timing: Optional[dict] = None) -> MoGeOutput:
        """One image -> MoGeOutput. `timing`, if a dict, receives stage times in ms: decode, canvas,
        device_wait (another call held the device), device (the forward only), solve, finish."""
        self._check_open()
        options = CallOptions.make(fit, fov_x, apply_mask, force_projection)
        prepared = prepare(image, self.resolution, options, timing)
        raw = self._forward_raw(prepared.canvas, timing)
        return postprocess(raw, prepared.plan, options, timing)

    def __call__(self, image: Any, *, fit: str = "pad", fov_x: Optional[float] = None, apply_mask: bool = True,
                 force_projection: bool = True) -> Union[MoGeOutput, list]:
        """An image -> MoGeOutput at its own resolution; a list of images -> a list of MoGeOutput."""
        options = dict(fit=fit, fov_x=fov_x, apply_mask=apply_mask, force_projection=force_projection)
        if isinstance(image, (list, tuple)):
            return self.predict_many(image, **options)
        return self.predict(image, **options)

    def predict_many(self, images: Iterable[Any], **options: Any) -> list:
        """Several images, in order, with the same options. While the device runs image i, a host thread
        decodes image i+1 and another finishes image i-1. Same results as single calls."""
        self._check_open()
        unknown = set(options) - {"fit", "fov_x", "apply_mask", "force_projection"}
        if unknown:
            raise TypeError(f"predict_many got unexpected option(s) {sorted(unknown)}")
        opts = CallOptions.make(**options)
        images = list(images)
        if not images:
            return []
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tt_moge-host") as pool:
            next_prepared = pool.submit(prepare, images[0], self.resolution, opts, None, "images[0]")
            finishing, running = [], None  # running: (pending raw maps, plan) of the image on the device
            for i in range(len(images)):
                prepared = next_prepared.result()
                if i + 1 < len(images):
                    next_prepared = pool.submit(prepare, images[i + 1], self.resolution, opts, None, f"images[{i + 1}]")
                pending = self._submit_raw(prepared.canvas)  # on CUDA, starts while image i-1 still copies back
                if running is not None:
                    finishing.append(pool.submit(postprocess, running[0].result(), running[1], opts))
                running = (pending, prepared.plan)
            finishing.append(pool.submit(postprocess, running[0].result(), running[1], opts))
            return [f.result() for f in finishing]

    def predict_panorama(self, image: Any, *, return_views: bool = False, apply_mask: bool = True) -> Any:
        """A 360-degree equirectangular image (width = 2 x height) -> PanoramaOutput: distance (H, W) metres,
        points (H, W, 3) on the unit-sphere directions x distance, mask; the per-view MoGeOutputs with
        `return_views`. The 12 views run through `predict_many`. A square canvas (PANORAMA_CANVAS) fits the views
        best; see docs/panorama.md for the axes, the metric scale and the cost."""
        from .panorama import predict_panorama

        self._check_open()
        return predict_panorama(self, image, return_views=return_views, apply_mask=apply_mask)

    def forward(self, image: Any) -> dict:
        """The raw forward on a canvas-sized image, like upstream `MoGeModel.forward`: a dict of torch tensors
        `points` (1, H, W, 3) affine, `normal` (1, H, W, 3), `mask` (1, H, W) probability, `metric_scale` (1,)."""
        self._check_open()
        prepared = prepare(image, self.resolution, CallOptions(), None)
        if not prepared.plan.is_identity:
            w, h = prepared.plan.image_size
            raise InputError(f"image: forward takes a canvas-sized image ({self.resolution[0]}x{self.resolution[1]}), "
                             f"got {w}x{h}; use model(image) for other sizes")
        raw = self._forward_raw(prepared.canvas)
        out = {"points": raw.points[None]}
        if raw.normal is not None:
            out["normal"] = raw.normal[None]
        if raw.mask is not None:
            out["mask"] = raw.mask[None]
        if raw.metric_scale is not None:
            out["metric_scale"] = torch.tensor([raw.metric_scale], dtype=torch.float32)
        return out

    def infer(self, image: Any, fov_x: Any = None, force_projection: bool = True, apply_mask: bool = True,
              num_tokens: Optional[int] = None, resolution_level: int = 9, use_fp16: bool = True) -> dict:
        """Drop-in for upstream `MoGeModel.infer`: (3, H, W) or (B, 3, H, W) float in [0, 1] -> dict of torch
        tensors points, intrinsics, depth, mask, normal (batched for a batched input). Images are fitted with
        fit="pad". `num_tokens` must be None or the load-time budget; `resolution_level` and `use_fp16` are
        ignored (the precision is chosen at load)."""
        self._check_open()
        if num_tokens is not None and num_tokens != self.num_tokens:
            raise ValueError(f"num_tokens={num_tokens}: this model runs {self.num_tokens} tokens (fixed at load); pass None or load another model")
        device = image.device if isinstance(image, torch.Tensor) else torch.device("cpu")
        batched = isinstance(image, (torch.Tensor, np.ndarray)) and image.ndim == 4
        items = list(image) if batched else [image]
        if batched and isinstance(fov_x, (torch.Tensor, np.ndarray)) and np.ndim(fov_x) == 1:
            fovs = [float(f) for f in fov_x]
        else:
            fovs = [fov_x] * len(items)
        outs = [self.predict(img, fov_x=f, apply_mask=apply_mask, force_projection=force_projection).to_torch()
                for img, f in zip(items, fovs)]
        result = {k: torch.stack([o[k] for o in outs]) if batched else outs[0][k] for k in outs[0]}
        return {k: v.to(device) for k, v in result.items()}

    # ------------------------------------------------------------------------------------- warm-up
    def warmup(self, **variant: Any) -> float:
        """Prepare one call variant (see `tt_moge.warmup`) so that its first real call is fast.
        Idempotent: a variant already warmed returns 0.0. Returns the seconds it took."""
        self._check_open()
        return self._warm_variant(canonical_variant(variant, self.resolution))

    def _warm_variant(self, key: tuple, photos: Optional[dict] = None) -> float:
        with self._state_lock:
            if key in self._warmed:
                return 0.0
        t = time.perf_counter()
        if self._warm_raw is None:  # no device warm-up ran: one forward for the raw maps
            self._device_warmup(1)
        # The device part is the same fixed-shape forward for every variant (warmed by the device warm-up);
        # variants warm the host paths, on a copy of this model whose runner replays the warm-up's raw maps.
        run_variant(self._replaying(self._warm_raw), key, {} if photos is None else photos)
        seconds = time.perf_counter() - t
        with self._state_lock:
            self._warmed[key] = seconds
        _log(self.verbose, f"warm-up {', '.join(f'{k}={val}' for k, val in key)}: {seconds:.2f} s")
        return seconds

    def _replaying(self, raw: RawMaps) -> "MoGeModel":
        """A shallow copy of this model that shares everything but the device: its runner returns `raw`."""
        clone = copy.copy(self)
        clone._runner = ReplayRunner(raw, like=self._runner)
        clone._device_lock = threading.Lock()
        return clone

    # --------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Release the runner (and its device memory). Idempotent; a `with` block calls it."""
        with self._device_lock:
            if not self._closed:
                self._closed = True
                self._runner.close()
                self._warm_raw = None

    def __enter__(self) -> "MoGeModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass
