"""Batch inference on Ray Data: `tt-moge batch INPUTS... -o OUT` and `run_batch(...)`, the same pipeline as
`tt-moge predict`, spread over model replicas on one machine or a Ray cluster.

The job (one Ray Data dataset, streamed):

    collect_images(INPUTS)            on the driver; images whose output is complete are skipped (resume)
    -> read + decode                  Ray tasks, in parallel: file bytes -> RGB uint8 array, or the error
    -> predict + write                an actor pool of `replicas`; each actor loads one MoGeModel once, runs
                                      `predict_many` on a batch and writes each image (export.write_outputs,
                                      or one Parquet shard per batch)
    -> per-image status               streamed back to the driver: progress bar, OUT/failures.jsonl, summary

Ray is optional (the `ray` extra: `pip install -e "code/[ray]"` from a clone): this module imports it only
inside `run_batch`, and without it raises `RayMissingError` (the CLI exits with code 3).

Resume: an image is done when OUT/NAME/result.json exists (files; written last by write_outputs) or when its
name is in a Parquet shard (each shard is written to a temporary name and renamed, so one that exists is
whole). A rerun of the same command only runs the rest, and starts no Ray at all when nothing is left.

Exactly once: a replica that dies (killed, out of memory) is restarted by Ray and its batch is retried
(`max_retries`); outputs of the failed attempt are never streamed back. A retried batch rewrites the same
files, and its Parquet shard has the same name (a hash of the batch's image names), so nothing is duplicated.

A driver that dies (kill -9): the local Ray it started is ended by a watcher process within seconds, and a
later local start ends whatever an earlier dead driver left (`ray_reaper`). The images it finished are kept;
the rerun does the rest.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from .export import DEFAULT_FORMATS, DEFAULT_MESH_STEP, FORMATS, check_formats

__all__ = ["run_batch", "BatchJob", "BatchSummary", "RayMissingError", "OUTPUT_FORMATS", "FAILURES_FILE", "SHARDS_DIR",
           "completed_names", "local_ray_cpus", "init_local_ray", "MIN_OBJECT_STORE_MB",
           "replica_resources", "check_ray_address"]

OUTPUT_FORMATS = ("files", "parquet")
FAILURES_FILE = "failures.jsonl"  # one JSON object per failed image of the last run: input, name, error
RECORD_FILE = "batch.json"  # the last run: options, counts, timing
SHARDS_DIR = "parquet"  # OUT/parquet/part-<hash>.parquet in --format parquet
PARQUET_COLUMNS = ("name", "source", "result", "npz")
DEFAULT_BATCH_SIZE = 4  # images per actor call (one predict_many); also images per read task
DEFAULT_OBJECT_STORE_MB = 200  # the embedded local Ray's shared-memory object store (the machine may be shared)
MIN_OBJECT_STORE_MB = 80  # Ray refuses a smaller object store
DEFAULT_MAX_RETRIES = 3  # restarts of a dead replica, and retries of the batch it was running
READER_CPUS = 1  # logical CPUs one read task asks for (see local_ray_cpus)
RAY_INSTALL_HINT = "from a clone of the repository: pip install -e \"code/[ray]\" (or: pip install \"ray[data]>=2.9\")"
# Test-only fault injection: when this names a folder holding a file "armed", the first replica to take a batch
# renames it to "fired" (atomic: exactly one replica wins) and kills its own process after writing the batch's
# outputs and before reporting them, i.e. at the worst moment for exactly-once.
CRASH_ENV = "TT_MOGE_BATCH_CRASH_ONCE"
# Passed on to the replicas (they may run on other machines, where the driver's environment is not inherited).
FORWARDED_ENV = ("MOGE_WEIGHTS_DIR", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", CRASH_ENV)


class RayMissingError(ImportError):
    """Ray Data is not installed."""


@dataclass
class BatchSummary:
    """What one `run_batch` did. Counts are images; seconds is the Ray Data job (replica start-up included, Ray
    start excluded); images_per_second = done / seconds."""

    out: Path
    total: int  # images found in the inputs
    done: int  # computed and written by this run
    failed: int  # this run's failures (listed in OUT/failures.jsonl)
    skipped: int  # complete before this run (resume)
    seconds: float
    ray_start_seconds: float
    replicas: int  # replicas started (0: nothing to do, no Ray)
    output_format: str
    failures: list = field(default_factory=list)  # [(input path, error)]
    done_names: list = field(default_factory=list)  # output names of the images done by this run, as reported
    arrivals: list = field(default_factory=list)  # seconds after the job start at which each image's status came

    @property
    def steady_images_per_second(self) -> float:
        """Images/s after the first result (replica start-up and model loading left out): for benchmarks."""
        if len(self.arrivals) < 2 or self.arrivals[-1] <= self.arrivals[0]:
            return 0.0
        first = sum(1 for t in self.arrivals if t == self.arrivals[0])
        return (len(self.arrivals) - first) / (self.arrivals[-1] - self.arrivals[0])

    @property
    def images_per_second(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        if self.replicas == 0:
            return f"nothing to do: all {self.total} images already done (skipped {self.skipped})"
        rate = f", {self.images_per_second:.2f} images/s" if self.done else ""
        return (f"{self.done} done, {self.failed} failed, {self.skipped} skipped (already done) of {self.total} images "
                f"in {self.seconds:.1f} s{rate} with {self.replicas} replica{'s' * (self.replicas != 1)} "
                f"(Ray start {self.ray_start_seconds:.1f} s)")


def _import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401  (ray without the data extra lacks it)
    except ImportError as exc:
        raise RayMissingError(f"batch jobs need Ray Data, which is not installed ({exc}): {RAY_INSTALL_HINT}") from None
    return ray


# ------------------------------------------------------------------------------------------------ resume
def _shard_paths(out: Path) -> list:
    return sorted((out / SHARDS_DIR).glob("part-*.parquet"))


def completed_names(out: Union[str, os.PathLike], names: Sequence[str], output_format: str = "files") -> set:
    """The names (of `names`) whose output in `out` is complete: OUT/NAME/result.json exists (files), or NAME
    is a row of a Parquet shard (parquet)."""
    out = Path(out)
    if output_format == "files":
        return {n for n in names if (out / n / "result.json").is_file()}
    import pyarrow.parquet as pq

    found: set = set()
    for shard in _shard_paths(out):
        found.update(pq.read_table(shard, columns=["name"]).column("name").to_pylist())
    return found & set(names)


# ------------------------------------------------------------------------------------------- Ray set-up
def local_ray_cpus(replicas: int, cpus_per_replica: float) -> int:
    """Logical CPUs of the embedded local Ray: the cores of this machine, but at least enough for every replica
    plus one read task. Replicas hold their CPUs for the whole job; with no CPU left over the read tasks never
    run and the job waits forever (seen here: 2 replicas x 1 CPU on a 2-CPU Ray). The extra logical CPU
    oversubscribes the cores a little: decoding a photo takes milliseconds next to the model's hundreds."""
    return max(os.cpu_count() or 1, math.ceil(replicas * cpus_per_replica) + READER_CPUS)


def init_local_ray(ray: Any, num_cpus: int, object_store_mb: int = DEFAULT_OBJECT_STORE_MB, quiet: bool = False,
                   num_gpus: Optional[int] = None) -> Optional[Any]:
    """Start the embedded local Ray: always a new one (address "local", never another user's Ray on this
    machine), no dashboard, `object_store_mb` of shared memory, the node advertised on 127.0.0.1.
    Ray's servers still listen on every interface (Ray has no option against it); Ray's token authentication,
    on by default for a local Ray since 2.5x, is what keeps other hosts out.

    Its processes do not outlive this process for long, however it ends (`ray_reaper`): first, whatever an
    earlier driver that died left is ended; then a watcher starts. Returns the watcher (None where it cannot
    run): call its release() after ray.shutdown(), or let this process's end release it."""
    from .ray_reaper import Watcher, sweep_dead

    for driver, pids in sweep_dead():
        print(f"tt-moge batch: ended {len(pids)} Ray process(es) left by an earlier run whose driver (pid {driver}) "
              f"died", file=sys.stderr)
    context = ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_mb * 2**20,
                       include_dashboard=False, _node_ip_address="127.0.0.1", **_log_options(quiet))
    session_dir = (getattr(context, "address_info", None) or {}).get("session_dir", "")
    try:
        return Watcher.start(ray.get_runtime_context().get_node_id(), session_dir)
    except OSError as exc:  # no temp dir to write the record to: run without it
        print(f"tt-moge batch: warning: cannot watch the local Ray ({exc}); if this process is killed, its Ray "
              f"processes may outlive it", file=sys.stderr)
        return None


def _log_options(quiet: bool) -> dict:
    return dict(logging_level="WARNING" if quiet else "INFO", log_to_driver=not quiet)


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """A ValueError naming `address` when nothing answers at its host:port (Ray itself would retry for minutes).
    "auto", "local" and addresses without a port are left to Ray."""
    import socket

    target = address[len("ray://"):] if address.startswith("ray://") else address
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ValueError(f"address={address!r}: nothing answers at {host}:{port} ({exc.strerror or exc}); start the Ray "
                         "head there, or fix --address / $RAY_ADDRESS") from None


@contextlib.contextmanager
def _ray_session(ray: Any, address: Optional[str], num_cpus: int, object_store_mb: int,
                 quiet: bool) -> Iterator[tuple]:
    """Yield (where, seconds to start). Reuses a Ray this process already started (and leaves it running);
    else connects to `address`, or starts a local Ray (init_local_ray), and shuts it down after."""
    t0 = time.perf_counter()
    if ray.is_initialized():
        yield "the Ray of this process", 0.0
        return
    watcher = None
    if address:
        check_ray_address(address)
        ray.init(address=address, include_dashboard=False, **_log_options(quiet))
        where = f"the Ray cluster at {address}"
    else:
        watcher = init_local_ray(ray, num_cpus, object_store_mb, quiet)
        where = f"a local Ray ({num_cpus} logical CPUs, {object_store_mb} MB object store)"
    try:
        yield where, time.perf_counter() - t0
    finally:
        ray.shutdown()
        if watcher is not None:
            watcher.release()


# ------------------------------------------------------------------------------------- the Ray stages
def _read_images(batch: dict) -> dict:
    """Ray task: {path, name} -> + rgb ((H, W, 3) uint8; (0, 0, 3) when unreadable) and error ('' or why)."""
    import numpy as np

    from .host.decode import read_image_file

    rgbs, errors = [], []
    for path in batch["path"]:
        try:
            rgbs.append(read_image_file(str(path)))
            errors.append("")
        except Exception as exc:  # a corrupt or vanished file costs only itself
            rgbs.append(np.zeros((0, 0, 3), np.uint8))  # same ndim and dtype: Ray keeps a ragged tensor column
            errors.append(str(exc) or type(exc).__name__)
    return {"path": batch["path"], "name": batch["name"], "rgb": rgbs, "error": errors}


def _maybe_crash_for_test() -> None:
    folder = os.environ.get(CRASH_ENV)
    if not folder:
        return
    try:
        os.rename(os.path.join(folder, "armed"), os.path.join(folder, "fired"))
    except OSError:
        return  # not armed, or another replica took it
    sys.stderr.flush()
    os._exit(17)


class _Replica:
    """Ray actor: one MoGeModel, loaded once; each call predicts a batch and writes it."""

    def __init__(self, model_kwargs: dict, out: str, output_format: str, formats: tuple, fit: str,
                 fov_x: Optional[float], writers: int, threads: int, mesh_step: int = DEFAULT_MESH_STEP):
        import torch

        from . import native
        from .model import MoGeModel

        torch.set_num_threads(max(1, threads))  # this replica's share of the cores, for torch ...
        if not os.environ.get("MOGE_SERVE_THREADS"):
            native.set_threads(max(1, threads))  # ... and for the native host kernels
        self.model = MoGeModel.from_pretrained(**{**model_kwargs, "warmup": 0, "warmup_variants": "none"})
        self.out, self.output_format, self.formats, self.mesh_step = Path(out), output_format, formats, mesh_step
        self.fit, self.fov_x = fit, fov_x
        self.writer = ThreadPoolExecutor(writers, thread_name_prefix="tt_moge-write")

    def __call__(self, batch: dict) -> dict:
        from .jobs import predict_chunk

        names, paths = [str(n) for n in batch["name"]], [str(p) for p in batch["path"]]
        errors = [str(e) for e in batch["error"]]
        todo = [i for i, e in enumerate(errors) if not e]
        outputs = predict_chunk(self.model, [batch["rgb"][i] for i in todo], self.fit, self.fov_x)
        results: dict = {}
        for i, output in zip(todo, outputs):
            if isinstance(output, BaseException):
                errors[i] = str(output) or type(output).__name__
            else:
                results[i] = output
        if self.output_format == "files":
            self._write_files(results, batch["rgb"], names, paths, errors)
        else:
            self._write_shard(results, names, paths, errors)
        _maybe_crash_for_test()
        return {"name": names, "path": paths, "error": errors}

    def _write_files(self, results: dict, rgbs: Any, names: list, paths: list, errors: list) -> None:
        from .export import write_outputs

        jobs = {i: self.writer.submit(write_outputs, output, rgbs[i], self.out / names[i], self.formats, source=paths[i],
                                      mesh_step=self.mesh_step)
                for i, output in results.items()}
        for i, job in jobs.items():
            exc = job.exception()
            if exc is not None:
                errors[i] = f"writing {self.out / names[i]} failed: {exc}"

    def _write_shard(self, results: dict, names: list, paths: list, errors: list) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from .export import to_json

        rows = {key: [] for key in PARQUET_COLUMNS}
        for i, output in results.items():
            try:
                npz = output.to_npz_bytes()
                record = to_json({"source": paths[i], **output.summary(depth_percentiles=True)})
            except Exception as exc:
                errors[i] = f"{paths[i]}: could not serialise the result: {exc}"
                continue
            for key, value in zip(PARQUET_COLUMNS, (names[i], paths[i], record, npz)):
                rows[key].append(value)
        if not rows["name"]:
            return
        # Named by the batch's images: a retried batch replaces its own shard instead of adding a second one.
        digest = hashlib.sha1("\n".join(sorted(rows["name"])).encode()).hexdigest()[:20]
        shard = self.out / SHARDS_DIR / f"part-{digest}.parquet"
        table = pa.table({"name": pa.array(rows["name"], pa.string()), "source": pa.array(rows["source"], pa.string()),
                          "result": pa.array(rows["result"], pa.string()), "npz": pa.array(rows["npz"], pa.large_binary())})
        tmp = shard.with_name(f".{shard.name}.{os.getpid()}.tmp")
        try:
            pq.write_table(table, tmp)
            os.replace(tmp, shard)  # a shard that exists is whole
        except Exception as exc:
            for i in results:
                if not errors[i]:
                    errors[i] = f"writing {shard} failed: {exc}"
            with contextlib.suppress(OSError):
                tmp.unlink()


# ------------------------------------------------------------------------------------------ the driver
@dataclass
class BatchJob:
    """One batch job: which images, where the results go, the model, and how Ray spreads the work.

    `model` holds keyword arguments of `MoGeModel.from_pretrained` (pretrained_model_name_or_path, revision,
    device, resolution, num_tokens, precision, ...); each replica loads its own model with them (without
    warm-up). A missing `pretrained_model_name_or_path` is the default repo (or $MOGE_WEIGHTS_DIR); a missing
    `device` is CUDA when the replicas get GPUs (or, on a local Ray, when this machine has one), else the CPU.

    output_format "files": OUT/NAME/ as `tt-moge predict` writes it (`formats` picks the files); "parquet":
    OUT/parquet/part-*.parquet, one row per image (name, source, result = result.json text, npz = the npz bytes).
    Ray: `address` (or $RAY_ADDRESS) joins a cluster; without one a local Ray starts on this machine (loopback
    only, `object_store_mb`) and stops at the end; a Ray already started in this process is used as it is.
    Each of `replicas` actors takes `cpus_per_replica` (default: local CPU device, the cores / replicas; else 1)
    and `gpus_per_replica` (default 1 when the device is CUDA, else 0) and runs torch with that many threads.
    """

    inputs: Sequence[Union[str, os.PathLike]]
    out: Union[str, os.PathLike]
    model: dict = field(default_factory=dict)
    fit: str = "pad"
    fov_x: Optional[float] = None
    formats: Sequence[str] = DEFAULT_FORMATS
    mesh_step: int = DEFAULT_MESH_STEP
    output_format: str = "files"
    replicas: int = 1
    cpus_per_replica: Optional[float] = None
    gpus_per_replica: Optional[float] = None
    batch_size: int = DEFAULT_BATCH_SIZE
    writers: int = 2
    max_retries: int = DEFAULT_MAX_RETRIES
    address: Optional[str] = None
    object_store_mb: int = DEFAULT_OBJECT_STORE_MB
    quiet: bool = False
    progress: bool = True

    def checked_formats(self) -> tuple:
        """Validate the job's own options (a ValueError naming the field); returns the format groups."""
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {self.output_format!r}")
        formats = check_formats(self.formats)
        if not formats:
            raise ValueError(f"formats: expected at least one of {', '.join(FORMATS)}")
        for name, low in (("replicas", 1), ("batch_size", 1), ("max_retries", 0), ("object_store_mb", MIN_OBJECT_STORE_MB), ("writers", 1),
                          ("mesh_step", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("cpus_per_replica", "gpus_per_replica"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.cpus_per_replica == 0:
            raise ValueError("cpus_per_replica must be > 0 (a replica runs the host steps on the CPU)")
        from .host.pipeline import CallOptions  # (torch: imported when a job runs, not with this module)

        CallOptions.make(fit=self.fit, fov_x=self.fov_x)  # checked now, not in every replica for every image
        unknown = set(self.model) - _MODEL_KEYS
        if unknown:
            raise ValueError(f"model: unknown from_pretrained argument(s) {sorted(unknown)}")
        return formats


# from_pretrained arguments a batch job passes on (warm-up is always off in replicas)
_MODEL_KEYS = {"pretrained_model_name_or_path", "revision", "device", "device_id", "resolution", "num_tokens",
               "precision", "dispatch", "num_command_queues", "warmup", "warmup_variants", "verbose"}


def replica_resources(device: Optional[str], gpus_per_replica: Optional[float], cpus_per_replica: Optional[float],
                      replicas: int, local: bool) -> tuple:
    """(device, GPUs, CPUs) of each replica: the device first (None: CUDA where this machine, running a local
    Ray, has a GPU; "cuda" when GPUs are asked for), then the GPUs it needs unless given (1 on CUDA, else 0),
    then the CPUs unless given (a local CPU job: the cores / replicas; else 1)."""
    if device is None:
        if gpus_per_replica:
            device = "cuda"
        elif local:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            device = "cpu"  # a cluster: ask for GPUs with gpus_per_replica (or device="cuda")
    gpus = gpus_per_replica if gpus_per_replica is not None else (1.0 if device.startswith("cuda") else 0.0)
    cpus = cpus_per_replica if cpus_per_replica is not None else (
        float(max(1, (os.cpu_count() or 1) // replicas)) if local and gpus == 0 else 1.0)
    if device.startswith("cuda") and gpus == 0:
        raise ValueError(f"device {device!r} needs GPUs for the replicas: gpus_per_replica > 0 (--gpus-per-replica)")
    return device, gpus, cpus


def run_batch(job: BatchJob, on_failure: Optional[Callable[[str, str], None]] = None) -> BatchSummary:
    """Run MoGe-2 over every image of `job.inputs` (files, folders, glob patterns: `collect_images`) on Ray Data
    and write the results into `job.out`; returns a BatchSummary.

    Images already complete in OUT are skipped. Failed images go to OUT/failures.jsonl (rewritten by each run);
    `on_failure(path, error)` is called for each as it arrives.

    Raises RayMissingError without Ray, InputPathError for inputs that name nothing, ValueError for bad options,
    CheckpointError / OSError / RuntimeError when the weights or the device are unusable.
    """
    from .inputs import InputPathError, collect_images
    from .options import normalize_revision
    from .weights import DEFAULT_REPO, DEFAULT_REVISION

    formats = job.checked_formats()
    out = Path(job.out)
    images = collect_images([os.fspath(i) for i in job.inputs], exclude=out)
    if not images:
        raise InputPathError(f"inputs: no PNG or JPEG images found in {', '.join(map(str, job.inputs))}")
    ray = _import_ray()
    out.mkdir(parents=True, exist_ok=True)
    if job.output_format == "parquet":
        (out / SHARDS_DIR).mkdir(exist_ok=True)
    done_before = completed_names(out, [im.name for im in images], job.output_format)
    todo = [im for im in images if im.name not in done_before]
    failures_path = out / FAILURES_FILE

    summary = BatchSummary(out=out, total=len(images), done=0, failed=0, skipped=len(images) - len(todo), seconds=0.0,
                           ray_start_seconds=0.0, replicas=job.replicas, output_format=job.output_format)
    options = {"output_format": job.output_format, "formats": list(formats) if job.output_format == "files" else None,
               "mesh_step": job.mesh_step if job.output_format == "files" and "glb" in formats else None, "fit": job.fit, "fov_x": job.fov_x, "batch_size": job.batch_size, "max_retries": job.max_retries}
    if not todo:  # nothing to do: no Ray, no model
        summary.replicas = 0
        failures_path.write_text("")
        _write_record(out, summary, "nowhere (nothing to do)", None, options)
        return summary

    replicas = min(job.replicas, math.ceil(len(todo) / job.batch_size))  # no idle replicas for a short remainder
    summary.replicas = replicas
    address = job.address or os.environ.get("RAY_ADDRESS") or None
    local = address is None and not ray.is_initialized()
    model_kwargs = dict(job.model)
    device, gpus, cpus = replica_resources(model_kwargs.get("device"), job.gpus_per_replica, job.cpus_per_replica,
                                           replicas, local)
    model_kwargs["device"] = device
    options.update(replicas=replicas, cpus_per_replica=cpus, gpus_per_replica=gpus)
    weights = os.fspath(model_kwargs.get("pretrained_model_name_or_path") or DEFAULT_REPO)
    revision = normalize_revision(model_kwargs.get("revision", DEFAULT_REVISION))
    if address is None:  # the replicas share this file system: resolve (and download) the weights once, here
        from .weights import resolve_checkpoint

        weights = str(resolve_checkpoint(weights, revision)[0].resolve())
        revision = None
    model_kwargs.update(pretrained_model_name_or_path=weights, revision=revision)
    if "resolution" in model_kwargs:
        model_kwargs["resolution"] = list(model_kwargs["resolution"])
    model_record = dict(model_kwargs)
    if address is not None and os.environ.get("MOGE_WEIGHTS_DIR"):  # the replicas resolve it, and it wins over a repo id
        model_record["MOGE_WEIGHTS_DIR"] = os.environ["MOGE_WEIGHTS_DIR"]

    with _ray_session(ray, address, local_ray_cpus(replicas, cpus), job.object_store_mb, job.quiet) as (where, start_s):
        summary.ray_start_seconds = start_s
        _check_resources(ray, replicas, cpus, gpus, strict=address is None)
        if not job.quiet:
            print(f"tt-moge batch: {len(todo)} images to do ({summary.skipped} already done) on {where}, "
                  f"{replicas} replica(s) x ({cpus:g} CPU, {gpus:g} GPU), device {device}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with _ray_data_output(ray, job.quiet):
            dataset = _build_dataset(ray, job, todo, out, formats, model_kwargs, replicas, cpus, gpus, address is None)
            _collect(dataset, summary, failures_path, len(todo), job.progress and not job.quiet, on_failure, t0)
        summary.seconds = time.perf_counter() - t0
    _write_record(out, summary, where, model_record, options)
    return summary


def _check_resources(ray: Any, replicas: int, cpus: float, gpus: float, strict: bool) -> None:
    """Every replica, plus one read task, must fit in the Ray cluster, or the job waits forever."""
    have = ray.cluster_resources()
    short = [f"{need:g} {kind} ({replicas} replica(s) x {per:g}{' + 1 read task' * (kind == 'CPU')}), it has "
             f"{have.get(kind, 0):g}" for kind, per, need in (("CPU", cpus, replicas * cpus + READER_CPUS),
                                                               ("GPU", gpus, replicas * gpus))
             if need > have.get(kind, 0) + 1e-9]
    if not short:
        return
    message = "the job needs " + "; ".join(short)
    if strict:
        raise ValueError(f"{message}: ask for fewer replicas or fewer CPUs/GPUs per replica")
    print(f"tt-moge batch: warning: {message}; it waits until the cluster has them (autoscaling)", file=sys.stderr)


@contextlib.contextmanager
def _ray_data_output(ray: Any, quiet: bool) -> Iterator[None]:
    """Ray Data's progress bars and log lines, off when quiet; its settings are restored afterwards."""
    import logging

    context, logger = ray.data.DataContext.get_current(), logging.getLogger("ray.data")
    saved = context.enable_progress_bars, logger.level
    if quiet:
        context.enable_progress_bars = False
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        context.enable_progress_bars, _ = saved
        logger.setLevel(saved[1])


def _write_record(out: Path, summary: BatchSummary, where: str, model: Optional[dict], options: dict) -> None:
    from .export import to_json, write_text_atomic

    write_text_atomic(out / RECORD_FILE, to_json({
        "tt_moge": _version(), "where": where, "model": model, "options": options,
        "total": summary.total, "done": summary.done, "failed": summary.failed, "skipped": summary.skipped,
        "seconds": round(summary.seconds, 3), "images_per_second": round(summary.images_per_second, 3),
        "ray_start_seconds": round(summary.ray_start_seconds, 3)}))


def _version() -> str:
    from . import __version__

    return __version__


def _build_dataset(ray: Any, job: BatchJob, todo: list, out: Path, formats: tuple, model_kwargs: dict, replicas: int,
                   cpus: float, gpus: float, local: bool) -> Any:
    batch_size, max_retries = job.batch_size, job.max_retries
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    if local:  # workers import the very tt_moge this driver runs, installed or not (a source tree, a script's sys.path)
        here = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([here] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    runtime_env = {"env_vars": env} if env else None
    items = [{"path": str(im.path.resolve()), "name": im.name} for im in todo]
    blocks = min(len(items), max(1, math.ceil(len(items) / batch_size)))  # one read task per batch of images
    try:
        dataset = ray.data.from_items(items, override_num_blocks=blocks)
    except TypeError:  # Ray < 2.10 names it parallelism
        dataset = ray.data.from_items(items, parallelism=blocks)
    dataset = dataset.map_batches(_read_images, batch_size=batch_size, num_cpus=READER_CPUS, runtime_env=runtime_env)
    with warnings.catch_warnings():
        # Ray Data has no named parameter for the actors' fault tolerance yet; its default is to restart a dead
        # replica and retry its batch without limit, which never ends on an image that kills the process each time.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return dataset.map_batches(
            _Replica, batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=replicas),
            fn_constructor_kwargs=dict(model_kwargs=model_kwargs, out=str(out.resolve()), output_format=job.output_format,
                                       formats=formats, fit=job.fit, fov_x=job.fov_x, writers=job.writers,
                                       threads=int(cpus), mesh_step=job.mesh_step),
            num_cpus=cpus, num_gpus=gpus or None, runtime_env=runtime_env,
            max_restarts=max_retries, max_task_retries=max_retries)


def _collect(dataset: Any, summary: BatchSummary, failures_path: Path, total: int, progress: bool,
             on_failure: Optional[Callable[[str, str], None]], t0: float) -> None:
    """Stream the per-image statuses: count them, append failures to the failures file as they come."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="img", desc="tt-moge batch", file=sys.stderr, dynamic_ncols=True, disable=not progress)
    try:
        with open(failures_path, "w") as failures:
            for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
                arrived = time.perf_counter() - t0
                for name, path, error in zip(batch["name"], batch["path"], batch["error"]):
                    if error:
                        summary.failed += 1
                        summary.failures.append((str(path), str(error)))
                        failures.write(json.dumps({"input": str(path), "name": str(name), "error": str(error)}) + "\n")
                        failures.flush()
                        if on_failure is not None:
                            on_failure(str(path), str(error))
                    else:
                        summary.done += 1
                        summary.done_names.append(str(name))
                    summary.arrivals.append(arrived)
                    bar.update(1)
    finally:
        bar.close()
