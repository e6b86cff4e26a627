"""MoGeModel: load MoGe-2 once, then turn images into metric depth, points, normals, mask and intrinsics.

    with MoGeModel.from_pretrained(device="cpu") as model:
        out = model("photo.jpg")

One call = decode -> canvas fit -> device forward -> focal/shift solve -> finish: the model's
`PredictionService` (`tt_moge.service`), which the server, the CLI and batch jobs call too. The device forward
runs one canvas at a time under a lock; the host stages of different calls run in parallel.

The keyword arguments of `from_pretrained` are the fields of `options.LoadOptions`, those of `model(image, ...)`,
`predict` and `predict_many` the fields of `host.CallOptions` (and `predict_video`'s those of
`video.VideoOptions` too), written out below in their order; tests/test_one_definition.py checks each signature
against the fields, and the defs pass them on with `arguments_of(record, locals())`.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import threading
import time
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from . import __version__, native, openmp
from .constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS
from .fields import arguments_of, takes_options
from .host import CallOptions
from .options import LoadOptions
from .output import MoGeOutput
from .progress import slow_step
from .runners import make_runner
from .runners.base import RawMaps, Runner
from .service import PredictionService
from .synthetic import synthetic_photo
from .video.options import DEFAULT_CALIBRATION_FRAMES, DEFAULT_NEW_CHAIN_AFTER, VideoOptions
from .warmup import canonical_variant, run_variant
from .weights import DEFAULT_REPO, DEFAULT_REVISION, load_network

__all__ = ["MoGeModel"]


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[tt_moge] {message}", file=sys.stderr, flush=True)


class MoGeModel:
    """MoGe-2 on one device, with a canvas size and token budget fixed at load time.

    Create it with `MoGeModel.from_pretrained(...)`. Calls are thread-safe; the device runs one image at a time.
    """

    def __init__(
        self, runner: Runner, options: LoadOptions, *, network_config: Any, source: str, revision: Optional[str]
    ):
        self.service = PredictionService(runner, options.resolution)
        self.options = options
        self.config = network_config
        self.source = source
        self.revision = revision
        self.resolution = tuple(options.resolution)
        self.num_tokens = options.num_tokens
        self.verbose = options.verbose
        self._state_lock = threading.Lock()
        self._warmed: dict = {}
        self._warm_raw: Optional[RawMaps] = None  # the raw maps of the last device warm-up (host warm-ups replay them)

    # ------------------------------------------------------------------------------------------- load
    @classmethod
    @takes_options("from_pretrained")
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

        The arguments are the options of `tt_moge.options.LoadOptions` (its fields: default, meaning, checks).
        `precision`: "auto" (default: bf16 on CPUs with bfloat16 instructions, else fp32; fp16 on CUDA), "fp32"
        (the reference network, exact), "bf16", "fp16" (CUDA only) or "int8" (CPU only, opt-in: int8 ViT
        matmuls). See `tt_moge.runners.precision`. `revision` "main" (or None) is the Hub's default branch.

        `dispatch` and `num_command_queues` are Tenstorrent options: validated here, used by the ttnn runner,
        ignored by the CPU and CUDA runners.
        """
        return cls.load(LoadOptions.resolve(**arguments_of(LoadOptions, locals())))

    @classmethod
    def load(cls, options: LoadOptions) -> "MoGeModel":
        """`from_pretrained` with options already resolved (`LoadOptions.resolve`)."""
        t0 = time.perf_counter()
        with slow_step(f"loading the weights {options.weights}"):
            network, ckpt = load_network(options.weights, options.revision)
        _log(options.verbose, f"loaded {ckpt.source} ({network.config.describe()}) in {time.perf_counter() - t0:.1f} s")
        with slow_step(f"preparing the {options.device} runner ({options.precision} precision)"):
            runner = make_runner(
                network,
                options.resolution,
                options.num_tokens,
                options.device,
                options.precision,
                dispatch=options.dispatch,
                num_command_queues=options.num_command_queues,
                verbose=options.verbose,
            )
        model = cls(runner, options, network_config=network.config, source=ckpt.source, revision=ckpt.revision)
        del network  # the runner holds what it needs (a graph runner: only its folded copy)
        try:
            with slow_step("building the native host library (its first use on this machine)"):
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
        # the canvas as a call makes it (8-bit for a runner that takes that), so the warm-up runs the calls' path
        canvas = self.service.prepare(synthetic_photo(self.resolution), CallOptions()).canvas
        for i in range(count):
            t = time.perf_counter()
            with slow_step(f"warm-up forward {i + 1} of {count} on {self.device}"):
                self._warm_raw = self.service.forward_raw(canvas)
            _log(self.verbose, f"device warm-up forward {i + 1}/{count}: {time.perf_counter() - t:.2f} s")

    # ------------------------------------------------------------------------------------ properties
    @property
    def _runner(self) -> Runner:
        return self.service.runner

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
            "model": self.source,
            "revision": self.revision,
            "architecture": self.config.describe(),
            "device": self.device,
            "runner": self._runner.describe(),
            "canvas": list(self.resolution),
            "num_tokens": self.num_tokens,
            "precision": self._runner.precision,
            "normal": self.has_normal,
            "host": native.host_path(),
            **({"openmp_wait": openmp.describe()} if self.device == "cpu" else {}),  # threads sleep or spin
            "version": __version__,
        }

    def __repr__(self) -> str:
        state = "closed" if self.service.closed else self.device
        return f"MoGeModel({self.source}, {self.resolution[0]}x{self.resolution[1]}, {self.num_tokens} tokens, {state})"

    # --------------------------------------------------------------------------------------- calls
    @takes_options("predict")
    def predict(
        self,
        image: Any,
        *,
        fit: str = "pad",
        fov_x: Optional[float] = None,
        apply_mask: bool = True,
        force_projection: bool = True,
        intrinsics: Any = None,
        timing: Optional[dict] = None,
    ) -> MoGeOutput:
        """One image -> MoGeOutput. `timing`, if a dict, receives stage times in ms (`service.STAGES`: decode,
        canvas, device_wait (another call held the device), device (the forward only), solve, finish)."""
        return self.service.predict(image, CallOptions.of_arguments(locals()), timing)

    @takes_options("model")
    def __call__(
        self,
        image: Any,
        *,
        fit: str = "pad",
        fov_x: Optional[float] = None,
        apply_mask: bool = True,
        force_projection: bool = True,
        intrinsics: Any = None,
    ) -> Union[MoGeOutput, list]:
        """An image -> MoGeOutput at its own resolution; a list of images -> a list of MoGeOutput."""
        options = arguments_of(CallOptions, locals())
        if isinstance(image, (list, tuple)):
            return self.predict_many(image, **options)
        return self.predict(image, **options)

    @takes_options("predict_many")
    def predict_many(
        self,
        images: Iterable[Any],
        *,
        fit: str = "pad",
        fov_x: Optional[float] = None,
        apply_mask: bool = True,
        force_projection: bool = True,
        intrinsics: Any = None,
    ) -> list:
        """Several images, in order, with the same options. While the device runs image i, a host thread
        decodes image i+1 and another finishes image i-1. Same results as single calls."""
        return self.service.predict_many(images, CallOptions.of_arguments(locals()))

    @takes_options("forward_many")
    def forward_many(
        self,
        images: Iterable[Any],
        *,
        fit: str = "pad",
        fov_x: Optional[float] = None,
        apply_mask: bool = True,
        force_projection: bool = True,
        intrinsics: Any = None,
    ) -> list:
        """Several images' forwards without the host steps: `host.Forwarded`s (raw maps on the canvas, where the
        image sits), for `finish_many`: one forward, finished with as many sets of options as wanted (the video
        path finishes its calibration frames twice). Options: those of `predict_many`; `fit` places each image on
        the canvas, and given `intrinsics` are checked against each image here."""
        return self.service.forward_many(images, CallOptions.of_arguments(locals()))

    @takes_options("finish_many")
    def finish_many(
        self,
        forwarded: Iterable[Any],
        *,
        fit: str = "pad",
        fov_x: Optional[float] = None,
        apply_mask: bool = True,
        force_projection: bool = True,
        intrinsics: Any = None,
    ) -> list:
        """`forward_many`'s forwards -> MoGeOutputs with these call options (the `fit` they were forwarded with):
        what `predict_many` gives for their images with these options, without running the network again."""
        return self.service.finish_many(forwarded, CallOptions.of_arguments(locals()))

    def predict_panorama(self, image: Any, *, return_views: bool = False, apply_mask: bool = True) -> Any:
        """A 360-degree equirectangular image (width = 2 x height) -> PanoramaOutput: distance (H, W) metres,
        points (H, W, 3) on the unit-sphere directions x distance, mask; the per-view MoGeOutputs with
        `return_views`. The 12 views run through `predict_many`. A square canvas (PANORAMA_CANVAS) fits the views
        best; see docs/panorama.md for the axes, the metric scale and the cost."""
        from .panorama import predict_panorama

        self.service.check_open()
        return predict_panorama(self, image, return_views=return_views, apply_mask=apply_mask)

    @takes_options("predict_video")
    def predict_video(
        self,
        source: Any,
        *,
        fit: str = "pad",
        fov_x: Optional[float] = None,
        apply_mask: bool = True,
        force_projection: bool = True,
        intrinsics: Any = None,
        stride: int = 1,
        max_frames: Optional[int] = None,
        calibration_frames: int = DEFAULT_CALIBRATION_FRAMES,
        window: Optional[int] = None,
        new_chain_after: int = DEFAULT_NEW_CHAIN_AFTER,
        calibrate_chains: bool = True,
        voxel_size: Optional[float] = None,
    ) -> Any:
        """A clip (a video file, a folder of frames, video bytes, an (N, H, W, 3) array or an iterable of images)
        -> VideoOutput: every frame's MoGeOutput with one set of intrinsics and one metric scale for the clip,
        camera poses from frame-to-frame registration, a fused point cloud. Options: the call options of
        `model(image, ...)` and those of `tt_moge.video.VideoOptions` (see `tt_moge.video.predict_video`,
        docs/video.md); `tt_moge.video.iter_video` streams clips that do not fit in memory."""
        from .video import predict_video

        options = {**arguments_of(CallOptions, locals()), **arguments_of(VideoOptions, locals())}
        self.service.check_open()
        return predict_video(self, source, **options)

    def forward(self, image: Any) -> dict:
        """The raw forward on a canvas-sized image, like upstream `MoGeModel.forward`: a dict of torch tensors
        `points` (1, H, W, 3) affine, `normal` (1, H, W, 3), `mask` (1, H, W) probability, `metric_scale` (1,)."""
        raw = self.service.forward(image)
        out = {"points": raw.points[None]}  # float32 (the Tenstorrent runner's bfloat16 normal and mask widened)
        if raw.normal is not None:
            out["normal"] = raw.normal[None].float()
        if raw.mask is not None:
            out["mask"] = raw.mask[None].float()
        if raw.metric_scale is not None:
            out["metric_scale"] = torch.tensor([raw.metric_scale], dtype=torch.float32)
        return out

    @takes_options("infer")
    def infer(
        self,
        image: Any,
        fov_x: Any = None,
        force_projection: bool = True,
        apply_mask: bool = True,
        num_tokens: Optional[int] = None,
        resolution_level: int = 9,
        use_fp16: bool = True,
        *,
        fit: str = "pad",
        intrinsics: Any = None,
    ) -> dict:
        """Drop-in for upstream `MoGeModel.infer`: (3, H, W) or (B, 3, H, W) float in [0, 1] -> dict of torch
        tensors points, intrinsics, depth, mask, normal (batched for a batched input). Images are fitted with
        fit="pad" unless `fit` says otherwise. `num_tokens` must be None or the load-time budget;
        `resolution_level` and `use_fp16` are ignored (the precision is chosen at load). The positional arguments
        are upstream's; the keyword-only ones the other options of `model(image, ...)` (the fields of
        `host.CallOptions`: fit, intrinsics), as there."""
        given = arguments_of(CallOptions, locals())
        self.service.check_open()
        if num_tokens is not None and num_tokens != self.num_tokens:
            raise ValueError(
                f"num_tokens={num_tokens}: this model runs {self.num_tokens} "
                "tokens (fixed at load); pass None or load another model"
            )
        device = image.device if isinstance(image, torch.Tensor) else torch.device("cpu")
        batched = isinstance(image, (torch.Tensor, np.ndarray)) and image.ndim == 4
        items = list(image) if batched else [image]
        if batched and isinstance(fov_x, (torch.Tensor, np.ndarray)) and np.ndim(fov_x) == 1:
            fovs = [float(f) for f in fov_x]
        else:
            fovs = [fov_x] * len(items)
        calls = [CallOptions.of_arguments({**given, "fov_x": f}) for f in fovs]  # checked before any forward
        outs = [self.service.predict(img, call).to_torch() for img, call in zip(items, calls)]
        result = {k: torch.stack([o[k] for o in outs]) if batched else outs[0][k] for k in outs[0]}
        return {k: v.to(device) for k, v in result.items()}

    # ------------------------------------------------------------------------------------- warm-up
    def warmup(self, **variant: Any) -> float:
        """Prepare one call variant (see `tt_moge.warmup`) so that its first real call is fast.
        Idempotent: a variant already warmed returns 0.0. Returns the seconds it took."""
        self.service.check_open()
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
        with slow_step(f"warming the host steps for {', '.join(f'{k}={val}' for k, val in key) or 'the default call'}"):
            run_variant(self._replaying(self._warm_raw), key, {} if photos is None else photos)
        seconds = time.perf_counter() - t
        with self._state_lock:
            self._warmed[key] = seconds
        _log(self.verbose, f"warm-up {', '.join(f'{k}={val}' for k, val in key)}: {seconds:.2f} s")
        return seconds

    def _replaying(self, raw: RawMaps) -> "MoGeModel":
        """A shallow copy of this model that shares everything but the device: its service returns `raw`."""
        clone = copy.copy(self)
        clone.service = self.service.replaying(raw)
        return clone

    # --------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Release the runner (and its device memory). Idempotent; a `with` block calls it."""
        self.service.close()
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
