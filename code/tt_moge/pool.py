"""ModelPool: one MoGe-2 replica per device (every chip of a Tenstorrent box, every GPU, or CPU replicas sharing
the cores), behind the calls of one MoGeModel.

    with ModelPool.from_pretrained(devices="tt:0,tt:1,tt:2,tt:3") as pool:   # or "all", "cuda:0,cuda:1", "cpu,cpu"
        out = pool("photo.jpg")                # on the least busy replica
        outs = pool.predict_many(photos)       # chunks of CHUNK images spread over the replicas as they free up

Each replica is a `MoGeModel` loaded with the same options on its own device, so an answer is the arrays
`MoGeModel.from_pretrained(device=<that device>, ...)` gives: a chip or a GPU computes the same bits whichever
replica it is in a pool of. CPU replicas split torch's threads between them (each runs its forwards with its share:
`cpu,cpu` on 8 threads is two replicas of 4), and their results are those of a model loaded with that many
threads (float sums depend on the thread count).

A replica whose device fails (its runner raises: `service.DeviceError`; never for a bad image) is taken out of
service and the call runs once more on another replica; when no replica is left in service, or the second try
fails too, the call raises `NoReplicaError` (the server answers 503). `replicas` reports each one (device, busy,
done, failures, why it left service). The HTTP server takes a pool where it takes a model (`tt-moge serve
--devices`); the video and panorama paths, which call `predict_many` / `forward_many` / `finish_many`, take it too.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar, Union

import torch

from .host import CallOptions
from .model import MoGeModel
from .output import MoGeOutput
from .service import DeviceError

__all__ = ["ModelPool", "Replica", "NoReplicaError", "parse_devices", "every_device", "CHUNK"]

CHUNK = 4  # images per predict_many call on one replica: enough to overlap its host steps with its device
T = TypeVar("T")


class NoReplicaError(DeviceError):
    """No replica of the pool can run the call: every one is out of service, or the retry failed as well."""


def every_device(verbose: bool = False) -> list:
    """Every device of the kind a model would choose by default: each Tenstorrent chip ttnn sees, else each CUDA
    GPU, else the CPU once."""
    from .runners.ttnn.device import chips_here

    chips = chips_here(verbose)
    if chips:
        return [f"tt:{i}" for i in range(chips)]
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def parse_devices(devices: Union[str, Sequence[str]]) -> list:
    """ "tt:0,tt:1" / "cuda:0,cuda:1" / "cpu,cpu" / "all" (or a list of such names) -> the device names, checked:
    no name twice but "cpu", and one kind of device only (replicas of one pool are alike)."""
    if isinstance(devices, str):
        names = [part.strip().lower() for part in devices.split(",")]
    elif isinstance(devices, Sequence) and all(isinstance(d, str) for d in devices):
        names = [d.strip().lower() for d in devices]
    else:
        raise TypeError(f"devices must be a string such as 'tt:0,tt:1' or a list of device names, got {devices!r}")
    if names == ["all"]:
        return every_device()
    if not names or any(not n for n in names) or "all" in names:
        raise ValueError(
            f"devices must be 'all' or device names separated by commas (tt:N, cuda:N, cpu), got {devices!r}"
        )
    repeated = sorted({n for n in names if n != "cpu" and names.count(n) > 1})
    if repeated:
        raise ValueError(f"devices: {repeated} named twice; only 'cpu' may repeat (its replicas share the cores)")
    kinds = {n.split(":")[0] for n in names}
    if len(kinds) > 1:
        raise ValueError(f"devices: one kind of device per pool, got {sorted(kinds)} in {devices!r}")
    return names


@dataclass
class Replica:
    """One model of a pool and what it has done: `busy` calls running on it now, `done` calls finished, `failures`
    device failures; `out_of_service` says why it takes no more calls (None while it serves)."""

    model: MoGeModel
    device: str
    busy: int = 0
    done: int = 0
    failures: int = 0
    out_of_service: Optional[str] = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self) -> dict:
        return {
            "device": self.device,
            "in_service": self.out_of_service is None,
            "busy": self.busy,
            "done": self.done,
            "failures": self.failures,
            "out_of_service": self.out_of_service,
        }


class PoolService:
    """The pool as a PredictionService, the calls that take a validated `CallOptions`: `predict(image, options,
    timing, exif=...)` on the least busy replica's service, with the pool's failover (the server's);
    `predict_many` / `forward_many` spread in chunks over the replicas' services, and `finish_many` (the pool's
    own calls, after parsing their keyword arguments once, and the video path's, with the clip's options)."""

    def __init__(self, pool: "ModelPool"):
        self.pool = pool

    def predict(self, image: Any, options: CallOptions = CallOptions(), timing: Optional[dict] = None, **kw: Any):
        return self.pool.run(lambda model: model.service.predict(image, options, timing, **kw))

    def predict_many(self, images: Iterable[Any], options: CallOptions = CallOptions()) -> list:
        return self.pool._spread(list(images), lambda model, chunk: model.service.predict_many(chunk, options))

    def forward_many(self, images: Iterable[Any], options: CallOptions = CallOptions()) -> list:
        return self.pool._spread(list(images), lambda model, chunk: model.service.forward_many(chunk, options))

    def finish_many(self, forwarded: Iterable[Any], options: CallOptions = CallOptions()) -> list:
        self.pool.check_open()
        return self.pool.replicas[0].model.service.finish_many(forwarded, options)

    def check_open(self) -> None:
        self.pool.check_open()

    @property
    def closed(self) -> bool:
        return self.pool.closed


class ModelPool:
    """MoGe-2 replicas, one per device (see the module docstring). Thread-safe; `close()` closes every replica."""

    def __init__(self, models: Sequence[MoGeModel], devices: Optional[Sequence[str]] = None):
        models = list(models)
        if not models or not all(isinstance(m, MoGeModel) for m in models):
            raise TypeError("models must be a non-empty list of MoGeModel")
        first = models[0]
        for m in models[1:]:
            if (m.resolution, m.num_tokens, m.source) != (first.resolution, first.num_tokens, first.source):
                raise ValueError("the replicas of a pool must be loaded alike (weights, resolution, num_tokens)")
        names = list(devices) if devices is not None else [m.device for m in models]
        self.replicas = [Replica(m, d) for m, d in zip(models, names)]
        self.resolution, self.num_tokens = first.resolution, first.num_tokens
        self.config, self.source = first.config, first.source
        self.service = PoolService(self)
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------------------------------- load
    @classmethod
    def from_pretrained(cls, *args: Any, devices: Union[str, Sequence[str]] = "all", **options: Any) -> "ModelPool":
        """One `MoGeModel.from_pretrained(*args, device=d, **options)` per device of `devices` (`parse_devices`). CPU
        replicas each get torch's thread count divided by their number (at least 1), for their load-time choices
        and every forward. Chips and GPUs load in parallel; CPU replicas one after the other (their load times
        their kernels on the cores)."""
        for name in ("device", "device_id"):
            if name in options:
                raise TypeError(f"ModelPool.from_pretrained takes devices=..., not {name}=")
        names = parse_devices(devices)
        cpus = names.count("cpu")
        share = max(1, torch.get_num_threads() // cpus) if cpus else None

        def load(name: str) -> MoGeModel:
            if name != "cpu":
                return MoGeModel.from_pretrained(*args, device=name, **options)
            previous = torch.get_num_threads()
            torch.set_num_threads(share)  # this thread's count: the runner reads it at load as its own
            try:
                return MoGeModel.from_pretrained(*args, device=name, **options)
            finally:
                torch.set_num_threads(previous)

        models: list = []
        try:
            if cpus:
                for name in names:
                    models.append(load(name))
            else:
                with ThreadPoolExecutor(len(names), thread_name_prefix="tt_moge-pool-load") as loader:
                    futures = [loader.submit(load, name) for name in names]
                    for future in futures:
                        models.append(future.result())
        except BaseException:
            for m in models:
                m.close()
            raise
        return cls(models, names)

    # ------------------------------------------------------------------------------------------ state
    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ModelPool is closed; load a new one with ModelPool.from_pretrained(...)")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_service(self) -> list:
        return [r for r in self.replicas if r.out_of_service is None]

    @property
    def device(self) -> str:
        return ",".join(r.device for r in self.replicas)

    @property
    def has_normal(self) -> bool:
        return self.replicas[0].model.has_normal

    def info(self) -> dict:
        """The first replica's `MoGeModel.info()` with `device` naming them all, and `replicas`: each one's record."""
        return {**self.replicas[0].model.info(), "device": self.device, "replicas": [r.record() for r in self.replicas]}

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.in_service)} of {len(self.replicas)} in service"
        return f"ModelPool({self.source}, {self.device}, {state})"

    # ------------------------------------------------------------------------------------- dispatch
    def _take(self, exclude: Sequence[Replica] = ()) -> Replica:
        """The least busy replica in service (the one that has done fewest on a tie), counted busy."""
        with self._lock:
            self.check_open()
            ready = [r for r in self.in_service if r not in exclude]
            if not ready:
                reasons = "; ".join(f"{r.device}: {r.out_of_service}" for r in self.replicas if r.out_of_service)
                raise NoReplicaError(f"no replica of the pool can run this call ({reasons or 'none left to try'})")
            replica = min(ready, key=lambda r: (r.busy, r.done))
            replica.busy += 1
            return replica

    def _release(self, replica: Replica, failure: Optional[BaseException]) -> None:
        with self._lock:
            replica.busy -= 1
            if failure is None:
                replica.done += 1
            else:
                replica.failures += 1
                replica.out_of_service = f"{type(failure).__name__}: {failure}"

    def run(self, call: Callable[[MoGeModel], T]) -> T:
        """`call(model)` on the least busy replica; after a device failure (the replica is taken out of service)
        once more on another. Any other error is the call's own (a bad image): raised as it is."""
        tried: list = []
        for attempt in range(2):
            replica = self._take(tried)
            try:
                result = call(replica.model)
            except DeviceError as exc:
                self._release(replica, exc)
                tried.append(replica)
                if attempt == 1:
                    raise NoReplicaError(f"the call failed on {replica.device} after another replica: {exc}") from exc
                continue
            except BaseException:
                self._release(replica, None)
                raise
            self._release(replica, None)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _spread(self, items: list, call: Callable[[MoGeModel, list], list]) -> list:
        """`call(model, chunk)` over chunks of CHUNK items, each on the replica that frees up first; the results
        in the items' order."""
        chunks = [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]
        if len(chunks) <= 1:
            return self.run(lambda model: call(model, items)) if items else []
        workers = min(len(chunks), max(1, len(self.in_service)))
        with ThreadPoolExecutor(workers, thread_name_prefix="tt_moge-pool") as pool:
            parts = list(pool.map(lambda chunk: self.run(lambda model: call(model, chunk)), chunks))
        return [out for part in parts for out in part]

    # ---------------------------------------------------------------------------------------- calls
    def predict(self, image: Any, *, timing: Optional[dict] = None, **options: Any) -> MoGeOutput:
        """`MoGeModel.predict` on the least busy replica."""
        return self.run(lambda model: model.predict(image, timing=timing, **options))

    def __call__(self, image: Any, **options: Any) -> Union[MoGeOutput, list]:
        if isinstance(image, (list, tuple)):
            return self.predict_many(image, **options)
        return self.predict(image, **options)

    def predict_many(self, images: Iterable[Any], **options: Any) -> list:
        """`MoGeModel.predict_many` over the replicas: chunks of CHUNK images, each on the replica that frees up
        first; the outputs in the images' order."""
        call = CallOptions.of_call("predict_many", (), options)  # parsed once, here, not in every chunk
        return self.service.predict_many(images, call)

    def forward_many(self, images: Iterable[Any], **options: Any) -> list:
        """`MoGeModel.forward_many` over the replicas, as `predict_many`."""
        return self.service.forward_many(images, CallOptions.of_call("forward_many", (), options))

    def finish_many(self, forwarded: Iterable[Any], **options: Any) -> list:
        """`MoGeModel.finish_many`: host steps only, on the caller's thread and any replica's host path."""
        self.check_open()
        return self.service.finish_many(forwarded, CallOptions.of_call("finish_many", (), options))

    def predict_panorama(self, image: Any, *, return_views: bool = False, apply_mask: bool = True) -> Any:
        """`MoGeModel.predict_panorama`, its 12 views spread over the replicas."""
        from .panorama import predict_panorama

        self.check_open()
        return predict_panorama(self, image, return_views=return_views, apply_mask=apply_mask)

    def predict_video(self, source: Any, **options: Any) -> Any:
        """`MoGeModel.predict_video`, each chunk of the clip on the replica that frees up first."""
        from .video import predict_video

        self.check_open()
        return predict_video(self, source, **options)

    # ------------------------------------------------------------------------------------------- life
    def close(self) -> None:
        """Close every replica. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for replica in self.replicas:
            replica.model.close()

    def __enter__(self) -> "ModelPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
