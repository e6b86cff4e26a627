"""The driver of a batch job: `BatchJob` (what to do), `run_batch` (do it), `BatchSummary` (what was done).

`run_batch` collects the images, skips those already done (`sinks.completed_names`), resolves the weights
once on a local Ray, starts or joins Ray (`session`), streams the dataset of read tasks and replicas
(`replica`) and collects each image's status into the summary and OUT/failures.jsonl.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from ..export import DEFAULT_FORMATS, DEFAULT_MESH_STEP, FORMATS, check_formats
from ..fields import Limit, checked, include_options, option, options_of, own_options
from ..host import CallOptions
from ..options import LoadOptions
from ..runs import OutputLock
from ..video import VideoOptions
from .replica import ClipReplica, PanoramaReplica, Replica, read_images
from .session import (
    DEFAULT_OBJECT_STORE_MB,
    MIN_OBJECT_STORE_MB,
    READER_CPUS,
    check_resources,
    chip_request,
    import_ray,
    local_ray_cpus,
    ray_data_output,
    ray_session,
    replica_runtime_env,
)
from .sinks import FAILURES_FILE, OUTPUT_FORMATS, RECORD_FILE, SHARDS_DIR, FailureLog, completed_names, write_record

__all__ = [
    "BatchJob",
    "BatchSummary",
    "run_batch",
    "replica_resources",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_RETRIES",
]

DEFAULT_BATCH_SIZE = 4  # images per actor call (one predict_many); also images per read task
DEFAULT_MAX_RETRIES = 3  # restarts of a dead replica, and retries of the batch it was running
_ONE = Limit(1)


def _check_address(address: Optional[str]) -> Optional[str]:
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ValueError(f"address must be a Ray address such as ray://head:10001, or None, got {address!r}")
    return address


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
    failed_names: list = field(default_factory=list)  # output names of this run's failures
    not_done: int = 0  # images neither done nor failed: the job was interrupted before them
    interrupted: Optional[str] = None  # what stopped the job ("SIGTERM", "SIGINT", "KeyboardInterrupt"), if anything
    renamed: list = field(default_factory=list)  # [{input, output, asked, why}]: inputs not named as they asked
    arrivals: list = field(default_factory=list)  # seconds after the job start at which each image's status came
    unit: str = "images"  # what the counts count: "images", or "clips" for a job over video files

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
            return f"nothing to do: all {self.total} {self.unit} already done (skipped {self.skipped})"
        rate = f", {self.images_per_second:.2f} {self.unit}/s" if self.done else ""
        return (
            f"{self.done} done, {self.failed} failed, {self.skipped} skipped (already done) of {self.total} "
            f"{self.unit} in {self.seconds:.1f} s{rate} with {self.replicas} replica{'s' * (self.replicas != 1)} "
            f"(Ray start {self.ray_start_seconds:.1f} s)"
        )


@dataclass
@include_options(VideoOptions, after="model")
@include_options(CallOptions, after="model")
class BatchJob:
    """One batch job: which images, where the results go, the model, and how Ray spreads the work.

    `model` holds keyword arguments of `MoGeModel.from_pretrained` (the options of `options.LoadOptions`:
    pretrained_model_name_or_path, revision, device, resolution, num_tokens, precision, ...); each replica loads
    its own model with them (without warm-up). After `model` come the options of `model(image, ...)` (the fields
    of `host.CallOptions`: fit, fov_x, apply_mask, force_projection), applied to every image. A missing
    `pretrained_model_name_or_path` is the default repo (or $MOGE_WEIGHTS_DIR); a missing `device` is CUDA when
    the replicas get GPUs (or, on a local Ray, when this machine has one), else the CPU.

    Video files as inputs (all of them: photos and videos go in separate jobs): each clip is one job of one
    replica, written as `tt-moge predict clip.mp4` writes it (OUT/NAME/, `video.files`; per-frame `formats`, the
    video default when left at DEFAULT_FORMATS; "files" only), with the clip options (the fields of
    `video.VideoOptions`: stride, max_frames, calibration_frames, window, new_chain_after, calibrate_chains,
    voxel_size). A rerun skips the clips whose OUT/NAME/result.json exists (written last), so an interrupted job
    resumes clip by clip.

    `panorama`: every input is a 360-degree equirectangular photo, run and written as `tt-moge predict --panorama`
    runs and writes it (`jobs.predict_panoramas`: 12 views through one replica's model, OUT/NAME/ with
    result.json last), one panorama per replica call; with output_format "parquet", one shard per panorama
    whose npz is `PanoramaOutput.to_npz_bytes()` (`PanoramaOutput.from_npz(row["npz"])` reads it back). A
    missing `resolution` in `model` is then PANORAMA_CANVAS; of the call options only apply_mask applies (the
    others, set, are refused: the views' camera and canvas are fixed).

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
    # + the fields of CallOptions and VideoOptions (include_options)
    formats: Sequence[str] = DEFAULT_FORMATS  # the format flags of tt-moge predict / batch (cli.common)
    mesh_step: int = DEFAULT_MESH_STEP
    mesh_faces: Optional[int] = None  # at most this many faces per mesh.glb: a coarser step where needed (None: any)
    # The job's own settings: each is the one definition of its `tt-moge batch` flag (cli.common.add_options).
    output_format: str = option(
        "files",
        "files: a folder per image, as tt-moge predict (default); parquet: sharded Parquet rows",
        flag="--format",
        choices=OUTPUT_FORMATS,
        group="output",
    )
    panorama: bool = option(
        False,
        "the inputs are 360-degree equirectangular panoramas (width = 2 x height), each written as tt-moge predict "
        "--panorama writes it, or as a Parquet row (--format parquet); the canvas defaults to 512x512, the views' size",
        group="output",
    )
    address: Optional[str] = option(
        None,
        "a Ray cluster, e.g. ray://head:10001 or auto (default: $RAY_ADDRESS, else a local Ray)",
        metavar="ADDR",
        check=_check_address,
    )
    replicas: int = option(1, "model replicas (actors), one model each (default %(default)s)", metavar="N", limit=_ONE)
    cpus_per_replica: Optional[float] = option(
        None,
        "CPUs per replica, also its torch threads (default: local CPU runs, the cores / replicas; else 1)",
        metavar="X",
        limit=Limit(0, integer=False, strict=True, optional=True),
    )
    gpus_per_replica: Optional[float] = option(
        None,
        "GPUs per replica, fractions share a GPU (default: 1 when the replicas run on CUDA: --device cuda, or no "
        "--device where torch sees a GPU and Ray is local; else 0)",
        metavar="X",
        limit=Limit(0, integer=False, optional=True),
    )
    batch_size: int = option(
        DEFAULT_BATCH_SIZE,
        "images per replica call, one predict_many (default %(default)s)",
        metavar="N",
        limit=_ONE,
    )
    writers: int = option(2, "file-writing threads per replica (default %(default)s)", metavar="N", limit=_ONE)
    max_retries: int = option(
        DEFAULT_MAX_RETRIES,
        "restarts of a replica that died, and retries of its batch (default %(default)s)",
        metavar="N",
        limit=Limit(0),
    )
    object_store_mb: int = option(
        DEFAULT_OBJECT_STORE_MB,
        f"object store of a local Ray, at least {MIN_OBJECT_STORE_MB} (Ray's minimum; default %(default)s)",
        metavar="MB",
        limit=Limit(MIN_OBJECT_STORE_MB),
    )
    exif: bool = option(
        True,
        "turn each photo by its EXIF orientation tag first, as tt-moge predict does (--no-exif: the stored pixel "
        "order, as the Python API reads photos)",
    )
    quiet: bool = option(False, "no progress output and no summary; errors still print", short="-q")
    progress: bool = True  # a progress bar on stderr (unless quiet); the API's own, no flag
    wait: bool = option(
        False, "OUT is in use by another run: wait for it to end (default: stop at once, exit code 2)"
    )  # (runs.OutputLock; else OutputBusy)

    def call_options(self) -> CallOptions:
        """The options applied to every image, validated (a ValueError naming the option)."""
        return CallOptions.make(**{o.argument: getattr(self, o.name) for o in options_of(CallOptions)})

    def video_options(self) -> VideoOptions:
        """The options applied to every clip, validated (a ValueError naming the option)."""
        return VideoOptions.make(**{o.argument: getattr(self, o.name) for o in options_of(VideoOptions)})

    def model_arguments(self) -> dict:
        """`model` with the defaults of from_pretrained filled in, each checked (a ValueError naming it)."""
        try:
            return LoadOptions.arguments(**self.model)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model: {exc}") from None

    def checked_formats(self) -> tuple:
        """Validate the job's own options (a ValueError naming the field); returns the format groups."""
        for info in own_options(type(self)):  # each setting's own check (a ValueError naming it)
            checked(info, getattr(self, info.name))
        formats = check_formats(self.formats)
        if not formats:
            raise ValueError(f"formats: expected at least one of {', '.join(FORMATS)}")
        if isinstance(self.mesh_step, bool) or not isinstance(self.mesh_step, int) or self.mesh_step < 1:
            raise ValueError(f"mesh_step must be an integer >= 1, got {self.mesh_step!r}")
        if self.mesh_faces is not None and (
            isinstance(self.mesh_faces, bool) or not isinstance(self.mesh_faces, int) or self.mesh_faces < 2
        ):
            raise ValueError(f"mesh_faces must be an integer >= 2 or None, got {self.mesh_faces!r}")
        return formats


def replica_resources(
    device: Optional[str],
    gpus_per_replica: Optional[float],
    cpus_per_replica: Optional[float],
    replicas: int,
    local: bool,
) -> tuple:
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
    cpus = (
        cpus_per_replica
        if cpus_per_replica is not None
        else (float(max(1, (os.cpu_count() or 1) // replicas)) if local and gpus == 0 else 1.0)
    )
    if device.startswith("cuda") and gpus == 0:
        raise ValueError(f"device {device!r} needs GPUs for the replicas: gpus_per_replica > 0 (--gpus-per-replica)")
    return device, gpus, cpus


def run_batch(job: BatchJob, on_failure: Optional[Callable[[str, str], None]] = None) -> BatchSummary:
    """Run MoGe-2 over every image of `job.inputs` (files, folders, glob patterns: `collect_images`) on Ray Data
    and write the results into `job.out`; returns a BatchSummary.

    Images already complete in OUT are skipped. Failed images go to OUT/failures.jsonl (rewritten by each run);
    `on_failure(path, error)` is called for each as it arrives. OUT is locked while the job writes it
    (`runs.OutputLock`): another run into it raises OutputBusy, or is waited for with `job.wait`.

    Raises RayMissingError without Ray, InputPathError for inputs that name nothing, ValueError for bad options,
    OutputBusy when OUT is in use, CheckpointError / OSError / RuntimeError when the weights or the device are
    unusable.
    """
    from ..inputs import InputPathError, collect_images
    from ..panorama.predict import PANORAMA_CANVAS, options_not_for_panoramas
    from ..video import is_video_file
    from ..video.files import VIDEO_FRAME_FORMATS

    formats = job.checked_formats()
    call = job.call_options()  # checked now, not in every replica for every image
    if job.panorama:
        wrong = [info.argument for info in options_not_for_panoramas(call)]
        if wrong:
            raise ValueError(
                f"{' and '.join(wrong)}: not for panoramas (their views' camera and canvas are fixed); only "
                "apply_mask applies"
            )
    model_kwargs = job.model_arguments()
    if job.panorama and job.model.get("resolution") is None:
        model_kwargs["resolution"] = PANORAMA_CANVAS  # the views' own size, as tt-moge predict --panorama
    out = Path(job.out)
    images = collect_images([os.fspath(i) for i in job.inputs], exclude=out)
    if not images:
        raise InputPathError(f"inputs: no PNG or JPEG images found in {', '.join(map(str, job.inputs))}")
    clips = [im for im in images if is_video_file(im.path)]
    if clips and len(clips) != len(images):
        raise ValueError("inputs: photos and video files go in separate batch jobs")
    if clips and job.panorama:
        raise ValueError("inputs: panorama takes 360-degree photos, not video files")
    if clips and job.output_format != "files":
        raise ValueError("output_format: clips are written as files (OUT/NAME/, as tt-moge predict writes them)")
    if clips and tuple(formats) == tuple(DEFAULT_FORMATS):
        formats = VIDEO_FRAME_FORMATS  # the light per-frame default of videos
    video = job.video_options() if clips else None
    ray = import_ray()
    out.mkdir(parents=True, exist_ok=True)
    lock = OutputLock(out).acquire(
        wait=job.wait, on_wait=lambda message: print(f"tt-moge batch: {message}", file=sys.stderr, flush=True)
    )
    if lock.unsupported:
        print(f"tt-moge batch: note: {lock.unsupported}; a second run into it would not be stopped", file=sys.stderr)
    try:
        return _run_locked(job, ray, out, images, clips, formats, call, video, model_kwargs, on_failure)
    finally:
        lock.release()


def _run_locked(
    job: BatchJob,
    ray: Any,
    out: Path,
    images: list,
    clips: list,
    formats: tuple,
    call: CallOptions,
    video: Optional[VideoOptions],
    model_kwargs: dict,
    on_failure: Optional[Callable[[str, str], None]],
) -> BatchSummary:
    """run_batch, once OUT is locked."""
    from .. import env

    if job.output_format == "parquet":
        (out / SHARDS_DIR).mkdir(exist_ok=True)
    done_before = completed_names(out, [im.name for im in images], job.output_format)
    todo = [im for im in images if im.name not in done_before]
    failures_path = out / FAILURES_FILE

    summary = BatchSummary(
        out=out,
        total=len(images),
        done=0,
        failed=0,
        skipped=len(images) - len(todo),
        seconds=0.0,
        ray_start_seconds=0.0,
        replicas=job.replicas,
        output_format=job.output_format,
        renamed=[
            {"input": str(im.path), "output": im.name, "asked": im.wanted, "why": im.renamed}
            for im in images
            if im.renamed
        ],
        unit="clips" if clips else "panoramas" if job.panorama else "images",
    )
    files = job.output_format == "files"
    options = {
        "output_format": job.output_format,
        "formats": list(formats) if files else None,
        "mesh_step": job.mesh_step if files and "glb" in formats else None,
        "mesh_faces": job.mesh_faces if files and "glb" in formats else None,
        **call.kwargs(),
        **(video.kwargs() if video is not None else {"exif": job.exif}),
        "panorama": job.panorama,
        "batch_size": job.batch_size,
        "max_retries": job.max_retries,
    }
    if not todo:  # nothing to do: no Ray, no model
        summary.replicas = 0
        failures_path.write_text("")
        write_record(out, summary, "nowhere (nothing to do)", None, options)
        return summary

    per_call = 1 if clips or job.panorama else job.batch_size  # a clip, or a panorama's 12 views, per replica call
    replicas = min(job.replicas, math.ceil(len(todo) / per_call))  # no idle replicas for a short remainder
    summary.replicas = replicas
    address = job.address or os.environ.get("RAY_ADDRESS") or None
    local = address is None and not ray.is_initialized()
    given_device = job.model.get("device")  # None: chosen for the replicas' resources, not for this machine
    device, gpus, cpus = replica_resources(given_device, job.gpus_per_replica, job.cpus_per_replica, replicas, local)
    model_kwargs["device"], chips = chip_request(device)  # a chip per replica, as Ray hands them out
    options.update(replicas=replicas, cpus_per_replica=cpus, gpus_per_replica=gpus)
    if address is None:  # the replicas share this file system: resolve (and download) the weights once, here
        from ..weights import resolve_checkpoint

        weights = model_kwargs["pretrained_model_name_or_path"]
        model_kwargs.update(
            pretrained_model_name_or_path=str(resolve_checkpoint(weights, model_kwargs["revision"])[0].resolve()),
            revision=None,
        )
    model_kwargs["resolution"] = list(model_kwargs["resolution"])  # JSON
    model_record = dict(model_kwargs)
    weights_dir = env.get("MOGE_WEIGHTS_DIR")
    if address is not None and weights_dir:  # the replicas resolve it, and it wins over a repo id
        model_record["MOGE_WEIGHTS_DIR"] = weights_dir

    if replicas < job.replicas and not job.quiet:  # say why: the README's own example asked for 2 and got 1
        unit = summary.unit if len(todo) != 1 else summary.unit[:-1]
        each = (
            f"one {summary.unit[:-1]} per replica call"
            if per_call == 1
            else f"up to {per_call} per replica call (--batch-size)"
        )
        print(
            f"tt-moge batch: {replicas} replica{'s' * (replicas != 1)}, not the {job.replicas} asked for: "
            f"{len(todo)} {unit} to do, {each}; a replica more would have nothing to do",
            file=sys.stderr,
            flush=True,
        )
    # Ray's own INFO lines, its workers' output and Ray Data's progress bars only with the model's verbose flag
    # (tt-moge batch -v): the job's own progress bar and messages say what a user needs
    ray_quiet = job.quiet or not job.model.get("verbose")
    where, t0 = "a Ray that was still starting", time.perf_counter()
    try:
        with ray_session(ray, address, local_ray_cpus(replicas, cpus), job.object_store_mb, ray_quiet) as session:
            where, summary.ray_start_seconds = session
            check_resources(ray, replicas, cpus, gpus, strict=address is None)
            if not job.quiet:
                print(
                    f"tt-moge batch: {len(todo)} images to do ({summary.skipped} already done) on {where}, "
                    f"{replicas} replica(s) x ({cpus:g} CPU, {gpus:g} GPU), device {device}",
                    file=sys.stderr,
                    flush=True,
                )
            t0 = time.perf_counter()
            with ray_data_output(ray, ray_quiet):
                if clips or job.panorama:
                    actor, settings = (
                        (ClipReplica, dict(options=call, video=video, writers=job.writers))
                        if clips
                        else (
                            PanoramaReplica,
                            dict(
                                exif=job.exif,
                                mesh_faces=job.mesh_faces,
                                apply_mask=call.apply_mask,
                                output_format=job.output_format,
                            ),
                        )
                    )
                    kwargs = dict(model_kwargs=model_kwargs, out=str(out.resolve()), formats=formats, threads=int(cpus))
                    dataset = _one_per_call_dataset(
                        ray, job, todo, actor, {**kwargs, **settings}, replicas, cpus, gpus, address is None, chips
                    )
                else:
                    dataset = _build_dataset(
                        ray, job, todo, out, formats, call, model_kwargs, replicas, cpus, gpus, address is None, chips
                    )
                _collect(dataset, summary, failures_path, len(todo), job.progress and not job.quiet, on_failure, t0)
            summary.seconds = time.perf_counter() - t0
    except BaseException as exc:
        if isinstance(exc, Exception):
            raise
        # a signal's exception (the CLI's Interrupted, KeyboardInterrupt): Ray is shut down by now (ray_session),
        # so no replica writes any more; batch.json says what is on disk, then the exception goes on
        summary.seconds = time.perf_counter() - t0
        summary.interrupted = getattr(exc, "name", type(exc).__name__)
        _count_interrupted(out, todo, job.output_format, summary)
        try:
            write_record(out, summary, where, model_record, options)
        except OSError as error:  # the interruption stays what the caller hears of
            print(f"tt-moge batch: could not write {out / RECORD_FILE}: {error}", file=sys.stderr, flush=True)
        raise
    write_record(out, summary, where, model_record, options)
    return summary


def _count_interrupted(out: Path, todo: list, output_format: str, summary: BatchSummary) -> None:
    """After an interruption, the counts of what is on disk: an image is done when its output is complete
    (`completed_names`; a replica may have finished it after the driver stopped listening), failed when it was
    reported so, else not done; a not-done image's partial folder (a replica stopped while writing it) goes."""
    from ..export import remove_incomplete

    names = [im.name for im in todo]
    complete = completed_names(out, names, output_format)
    failed = set(summary.failed_names)
    summary.done_names = [name for name in names if name in complete]
    summary.done = len(summary.done_names)
    summary.failed = len(failed - complete)
    summary.not_done = len(todo) - summary.done - summary.failed
    if output_format == "files":
        for name in names:
            if name not in complete and name not in failed:
                remove_incomplete(out / name, out)


def _one_per_call_dataset(
    ray: Any,
    job: BatchJob,
    todo: list,
    actor: type,
    actor_kwargs: dict,
    replicas: int,
    cpus: float,
    gpus: float,
    local: bool,
    chips: dict,
) -> Any:
    """One item per input, one input per call of `actor` (`replica.ClipReplica` for clips, `PanoramaReplica` for
    panoramas: each reads its file itself, and one input is already a batch of frames or views)."""
    runtime_env = replica_runtime_env(local)
    items = [{"path": str(im.path.resolve()), "name": im.name} for im in todo]
    try:
        dataset = ray.data.from_items(items, override_num_blocks=len(items))
    except TypeError:  # Ray < 2.10 names it parallelism
        dataset = ray.data.from_items(items, parallelism=len(items))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return dataset.map_batches(
            actor,
            batch_size=1,
            compute=_actor_pool(ray, replicas),
            fn_constructor_kwargs=dict(actor_kwargs, mesh_step=job.mesh_step),
            num_cpus=cpus,
            num_gpus=gpus or None,
            runtime_env=runtime_env,
            **chips,
            max_restarts=job.max_retries,
            max_task_retries=job.max_retries,
        )


def _build_dataset(
    ray: Any,
    job: BatchJob,
    todo: list,
    out: Path,
    formats: tuple,
    call: CallOptions,
    model_kwargs: dict,
    replicas: int,
    cpus: float,
    gpus: float,
    local: bool,
    chips: dict,
) -> Any:
    max_retries = job.max_retries
    runtime_env = replica_runtime_env(local)
    items = [{"path": str(im.path.resolve()), "name": im.name} for im in todo]
    # a short job is split evenly over the replicas (6 photos, 2 replicas: 3 + 3, not 4 + 2), so that each one
    # gets a batch; with one batch in flight per replica, a replica that is ready first cannot take them all
    batch_size = max(1, min(job.batch_size, math.ceil(len(items) / replicas)))
    blocks = min(len(items), max(1, math.ceil(len(items) / batch_size)))  # one read task per batch of images
    try:
        dataset = ray.data.from_items(items, override_num_blocks=blocks)
    except TypeError:  # Ray < 2.10 names it parallelism
        dataset = ray.data.from_items(items, parallelism=blocks)
    dataset = dataset.map_batches(
        read_images,
        fn_kwargs={"exif": job.exif},
        batch_size=batch_size,
        num_cpus=READER_CPUS,
        runtime_env=runtime_env,
    )
    with warnings.catch_warnings():
        # Ray Data has no named parameter for the actors' fault tolerance yet; its default is to restart a dead
        # replica and retry its batch without limit, which never ends on an image that kills the process each time.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return dataset.map_batches(
            Replica,
            batch_size=batch_size,
            compute=_actor_pool(ray, replicas),
            fn_constructor_kwargs=dict(
                model_kwargs=model_kwargs,
                out=str(out.resolve()),
                output_format=job.output_format,
                formats=formats,
                options=call,
                writers=job.writers,
                threads=int(cpus),
                mesh_step=job.mesh_step,
                mesh_faces=job.mesh_faces,
            ),
            num_cpus=cpus,
            num_gpus=gpus or None,
            runtime_env=runtime_env,
            **chips,
            max_restarts=max_retries,
            max_task_retries=max_retries,
        )


def _actor_pool(ray: Any, replicas: int) -> Any:
    """`replicas` actors, each given one batch at a time: queued batches go to whichever replica is free, instead
    of piling up behind the first one to start (Ray Data's default lets each actor hold several)."""
    try:
        return ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1)
    except TypeError:  # an older Ray without the parameter
        return ray.data.ActorPoolStrategy(size=replicas)


def _collect(
    dataset: Any,
    summary: BatchSummary,
    failures_path: Path,
    total: int,
    progress: bool,
    on_failure: Optional[Callable[[str, str], None]],
    t0: float,
) -> None:
    """Stream the per-image statuses: count them, append failures to the failures file as they come."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="img", desc="tt-moge batch", file=sys.stderr, dynamic_ncols=True, disable=not progress)
    try:
        with FailureLog(failures_path) as failures:
            for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
                arrived = time.perf_counter() - t0
                for name, path, error in zip(batch["name"], batch["path"], batch["error"]):
                    if error:
                        summary.failed += 1
                        summary.failures.append((str(path), str(error)))
                        summary.failed_names.append(str(name))
                        failures.add(str(path), str(name), str(error))
                        if on_failure is not None:
                            on_failure(str(path), str(error))
                    else:
                        summary.done += 1
                        summary.done_names.append(str(name))
                    summary.arrivals.append(arrived)
                    bar.update(1)
    finally:
        bar.close()
