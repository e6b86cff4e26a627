"""PredictionService: images through the five stages, timed, on one device runner.

    decode -> canvas fit -> device forward -> focal/shift solve -> finish      (STAGES, in milliseconds)

Every prediction of tt_moge is a call of this one object: `MoGeModel.__call__` / `predict` / `predict_many`,
the server's /predict routes and its web page (`server/app.py`, `server/ui.py`), `tt-moge predict` and each
batch replica (`jobs.py`). The same image and `CallOptions` therefore give the same arrays on every surface.

Canvases are submitted to the device one at a time under a lock (a runner whose `submit` returns before its
forward ends, CUDA's and Tenstorrent's, then has the next call's canvas in flight while the last one runs); the
host stages (`host.prepare`, `host.postprocess`) of different calls run in parallel. `predict_many` overlaps the
decode of the next image and the finish of the previous one with the device. `forward_many` and `finish_many`
are its two halves: one forward, finished as often as asked with different options.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional

import torch

from .host import CallOptions, Forwarded, InputError, Prepared, Stopwatch, postprocess, prepare, refinish
from .output import MoGeOutput
from .runners.base import PendingMaps, RawMaps, ReplayRunner, Runner

__all__ = ["PredictionService", "STAGES", "DeviceError"]


class DeviceError(RuntimeError):
    """The device runner failed a forward (its exception is the cause): the device, not the image, is at fault.
    A `ModelPool` takes such a replica out of service and runs the call again on another one."""


class _DevicePending(PendingMaps):
    """A runner's pending maps whose failure, once waited for, is a DeviceError."""

    def __init__(self, pending: PendingMaps, runner: str):
        self._pending, self._runner = pending, runner

    @property
    def ready(self) -> bool:
        return self._pending.ready

    def result(self) -> RawMaps:
        try:
            return self._pending.result()
        except Exception as exc:
            raise DeviceError(f"the {self._runner} runner's forward failed: {exc}") from exc


# The stages one prediction is timed in, in the order it passes them: {name: what it times}. A `timing` dict
# given to `predict` receives them in milliseconds; the server adds its own stages around them.
STAGES = {
    "decode": "the input -> RGB (PNG/JPEG decode, array checks)",
    "canvas": "fit onto the model's canvas",
    "device_wait": "waiting while the device ran other calls",
    "device": "the device forward only",
    "solve": "focal / shift recovery",
    "finish": "crop, resize, re-projection, mask",
}


class PredictionService:
    """The prediction pipeline of one runner on a canvas of `canvas_size` = (width, height). Thread-safe."""

    def __init__(self, runner: Runner, canvas_size: tuple):
        self.runner = runner
        self.canvas_size = tuple(canvas_size)
        self._device_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------------------------------ device
    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this MoGeModel is closed; load a new one with MoGeModel.from_pretrained(...)")

    def submit(self, canvas: torch.Tensor, watch: Optional[Stopwatch] = None) -> PendingMaps:
        """Start the device forward of a canvas (on CUDA and Tenstorrent it returns before the maps are back;
        `.result()` waits). `watch` laps "device_wait": the time spent waiting while another call held the device.
        A failure of the runner, when submitting or waiting, is a `DeviceError`."""
        with self._device_lock:
            if watch is not None:
                watch.lap("device_wait")
            self.check_open()
            try:
                return _DevicePending(self.runner.submit(canvas), self.runner.name)
            except Exception as exc:
                raise DeviceError(f"the {self.runner.name} runner's forward failed: {exc}") from exc

    def forward_raw(self, canvas: torch.Tensor, timing: Optional[dict] = None) -> RawMaps:
        """The device forward of one canvas; `timing` gets "device_wait" and "device" (the forward only)."""
        watch = Stopwatch(timing)
        raw = self.submit(canvas, watch).result()
        watch.lap("device")
        return raw

    # ------------------------------------------------------------------------------------------ images
    def prepare(
        self, image: Any, options: CallOptions, timing: Optional[dict] = None, name: str = "image", *, exif=False
    ) -> Prepared:
        """Decode and canvas fit (`host.prepare`) as this runner takes the canvas (8-bit where `takes_uint8`)."""
        return prepare(image, self.canvas_size, options, timing, name, exif=exif, uint8=self.runner.takes_uint8)

    def predict(
        self, image: Any, options: CallOptions = CallOptions(), timing: Optional[dict] = None, *, exif: bool = False
    ) -> MoGeOutput:
        """One image -> MoGeOutput at its own resolution. `timing`, if a dict, receives STAGES in ms. `exif`: an
        encoded image or file is turned by its EXIF orientation first (the server's uploads; `to_rgb_array`)."""
        self.check_open()
        prepared = self.prepare(image, options, timing, exif=exif)
        raw = self.forward_raw(prepared.canvas, timing)
        return postprocess(raw, prepared.plan, options, timing)

    def predict_many(self, images: Iterable[Any], options: CallOptions = CallOptions()) -> list:
        """Several images, in order, with the same options. While the device runs image i, a host thread
        decodes image i+1 and another finishes image i-1. Same results as single calls."""
        return self._pipelined(images, options, lambda raw, plan: postprocess(raw, plan, options))

    def forward_many(self, images: Iterable[Any], options: CallOptions = CallOptions()) -> list:
        """Several images' forwards without their host steps (`host.Forwarded`), decoded as `predict_many` does
        (the next image while the device runs this one)."""
        return self._pipelined(images, options, Forwarded)

    def finish_many(self, forwarded: Iterable[Any], options: CallOptions = CallOptions()) -> list:
        """`forward_many`'s forwards finished with these options (`host.refinish`), two at a time: the outputs
        `predict_many` gives for their images with these options."""
        forwarded = list(forwarded)
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tt_moge-host") as pool:
            jobs = [pool.submit(refinish, f, options, f"forwarded[{i}]") for i, f in enumerate(forwarded)]
            return [job.result() for job in jobs]

    def _pipelined(self, images: Iterable[Any], options: CallOptions, done: Callable[[RawMaps, Any], Any]) -> list:
        """`done(raw maps, canvas plan)` of each image, in order, on host threads: while the device runs image
        i, one thread decodes image i+1 and another runs `done` for image i-1."""
        self.check_open()
        images = list(images)
        if not images:
            return []
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tt_moge-host") as pool:
            next_prepared = pool.submit(self.prepare, images[0], options, None, "images[0]")
            finishing, running = [], None  # running: (pending raw maps, plan) of the image on the device

            def finish(pending, plan) -> None:  # on a host thread, once the maps are back
                finishing.append(pool.submit(done, pending.result(), plan))

            for i in range(len(images)):
                prepared = next_prepared.result()
                if i + 1 < len(images):
                    next_prepared = pool.submit(self.prepare, images[i + 1], options, None, f"images[{i + 1}]")
                if running is not None and running[0].ready:  # image i-1's maps are back (a runner whose submit
                    # waits for its forward: the CPU): finish it while the device runs image i
                    finish(*running)
                    running = None
                pending = self.submit(prepared.canvas)  # CUDA, Tenstorrent: starts while image i-1 still runs
                if running is not None:
                    finish(*running)
                running = (pending, prepared.plan)
            finish(*running)
            return [f.result() for f in finishing]

    def forward(self, image: Any) -> RawMaps:
        """The raw maps of a canvas-sized image (no solve, no finish); an InputError for any other size."""
        self.check_open()
        prepared = self.prepare(image, CallOptions())
        if not prepared.plan.is_identity:
            w, h = prepared.plan.image_size
            cw, ch = self.canvas_size
            raise InputError(
                f"image: forward takes a canvas-sized image ({cw}x{ch}), got {w}x{h}; use model(image) for other sizes"
            )
        return self.forward_raw(prepared.canvas)

    # ------------------------------------------------------------------------------------------ life
    def replaying(self, raw: RawMaps) -> "PredictionService":
        """A service with the same host path whose device part hands back `raw` (a warm-up of the host stages)."""
        return PredictionService(ReplayRunner(raw, like=self.runner), self.canvas_size)

    def close(self) -> None:
        """Release the runner (and its device memory). Idempotent."""
        with self._device_lock:
            if not self._closed:
                self._closed = True
                self.runner.close()

    @property
    def closed(self) -> bool:
        return self._closed
