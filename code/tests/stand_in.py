"""A stand-in for the model where the network is not the point: `tt-moge predict` / `batch` with a fake MoGeModel
whose PredictionService returns a fixed, well-formed MoGeOutput at each image's size, at once (or after
`MOGE_STAND_IN_SECONDS` per image). The file writing, naming, locking, signals and exit codes are the real ones.

    python -m tests.stand_in predict photos/ -o out/      # from code/: the tt-moge command with the stand-in
    with stand_in(monkeypatch): main(["predict", ...])    # in a test's own process

`in_process_ray()` stands in for Ray the same way, for a batch job whose Ray is not the point: the driver
(`run_batch`) and the replicas (`batch.replica`) run as they are, in this process, one batch after the other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from typing import Any, Callable, Iterator, Optional

import numpy as np

from tt_moge.output import MoGeOutput

SECONDS_ENV = "MOGE_STAND_IN_SECONDS"  # seconds each image takes "on the device" (default 0)


def tilted_plane(h: int, w: int) -> MoGeOutput:
    """A plane 2-3 m away, seen by a 60-degree camera, every pixel valid: every kept pixel has neighbours, so
    the mesh has triangles."""
    f = np.float32(0.5 * w / np.tan(np.radians(30)))
    v, u = np.arange(h, dtype=np.float32)[:, None], np.arange(w, dtype=np.float32)[None, :]  # float32, broadcast:
    depth = np.broadcast_to(np.float32(2.0) + u / np.float32(max(w - 1, 1)), (h, w))  # cheap at 24 MP too
    points = np.empty((h, w, 3), np.float32)
    points[..., 0] = (u - np.float32(w / 2)) / f * depth
    points[..., 1] = (v - np.float32(h / 2)) / f * depth
    points[..., 2] = depth
    normal = np.zeros((h, w, 3), np.float32)
    normal[..., 2] = -1.0
    k = np.array([[f / w, 0, 0.5], [0, f / h, 0.5], [0, 0, 1]], np.float32)
    return MoGeOutput(
        points=points,
        depth=np.ascontiguousarray(depth),
        normal=normal,
        mask=np.ones((h, w), bool),
        intrinsics=k,
        intrinsics_pixels=np.array([[f, 0, w / 2], [0, f, h / 2], [0, 0, 1]], np.float32),
        metric_scale=1.0,
        fov_x=60.0,
        fov_y=float(np.degrees(2 * np.arctan(h / 2 / f))),
    )


class StandInModel:
    """What `tt-moge predict` uses of a MoGeModel: a context manager with a `service` (predict_many, predict)
    and info(). `make(h, w)` builds each output (default: `tilted_plane`)."""

    def __init__(self, make: Optional[Callable[[int, int], MoGeOutput]] = None):
        self.make = make or tilted_plane
        self.seconds = float(os.environ.get(SECONDS_ENV, "0") or 0)
        self.calls: list = []  # the CallOptions of each call

    def __enter__(self) -> "StandInModel":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    @property
    def service(self) -> "StandInModel":
        return self

    def predict(self, rgb: Any, options: Any = None, timing: Any = None) -> MoGeOutput:
        self.calls.append(options)
        time.sleep(self.seconds)
        return self.make(*np.asarray(rgb).shape[:2])

    def predict_many(self, arrays: list, options: Any = None) -> list:
        return [self.predict(a, options) for a in arrays]

    def info(self) -> dict:
        return {"model": "stand-in"}


@contextlib.contextmanager
def stand_in(monkeypatch: Any, model: Optional[StandInModel] = None) -> Iterator[StandInModel]:
    """`tt-moge predict` in this process loads `model` (a new StandInModel by default) instead of a MoGeModel."""
    import tt_moge.cli.predict as predict_cli

    model = model or StandInModel()
    monkeypatch.setattr(predict_cli, "load_model", lambda args: model)
    yield model


class _Dataset:
    """What a batch job uses of a Ray Data dataset, run in this process: each map_batches stage in turn (a class
    is made once with its fn_constructor_kwargs, as Ray makes an actor), batches of `batch_size` rows."""

    def __init__(self, rows: list, stages: tuple = ()):
        self.rows, self.stages = rows, stages

    def map_batches(self, fn: Any, batch_size: Optional[int] = None, fn_constructor_kwargs: Any = None, **_: Any):
        return _Dataset(self.rows, self.stages + ((fn, batch_size or len(self.rows) or 1, fn_constructor_kwargs),))

    def iter_batches(self, batch_size: Any = None, batch_format: str = "numpy") -> Iterator[dict]:
        batches = [{k: [r[k] for r in self.rows[i : i + 1]] for k in self.rows[0]} for i in range(len(self.rows))]
        for fn, size, kwargs in self.stages:
            fn = fn(**(kwargs or {})) if isinstance(fn, type) else fn
            rows = [{k: batch[k][i] for k in batch} for batch in batches for i in range(len(batch["name"]))]
            batches = [fn({k: [r[k] for r in rows[i : i + size]] for k in rows[0]}) for i in range(0, len(rows), size)]
        yield from batches


@contextlib.contextmanager
def in_process_ray() -> Iterator[types.ModuleType]:
    """`import ray` (and `ray.data`) give a stand-in that runs a batch job's stages in this process, as a Ray that
    this process already started (so `run_batch` neither starts nor stops one). Restores the real modules after."""
    ray = types.ModuleType("ray")
    data = types.ModuleType("ray.data")
    context = types.SimpleNamespace(enable_progress_bars=True)
    data.DataContext = types.SimpleNamespace(get_current=lambda: context)
    data.ActorPoolStrategy = lambda size=1, **_: types.SimpleNamespace(size=size)
    data.from_items = lambda items, **_: _Dataset(list(items))
    ray.data = data
    ray.is_initialized = lambda: True
    ray.cluster_resources = lambda: {"CPU": 1024.0, "GPU": 1024.0}
    saved = {name: sys.modules.get(name) for name in ("ray", "ray.data")}
    sys.modules.update({"ray": ray, "ray.data": data})
    try:
        yield ray
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def main(argv: list) -> int:
    import tt_moge.cli.predict as predict_cli
    from tt_moge.cli import main as cli_main

    model = StandInModel()
    predict_cli.load_model = lambda args: model
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
