"""The Ray stages of a batch job: `read_images` (Ray tasks: files -> RGB arrays) and `Replica` (an actor: one
model, loaded once; each call predicts a batch with the model's PredictionService and writes it); for clips,
`ClipReplica` (an actor: one model; each call runs one video file through `tt_moge.video` into its folder); for
panoramas, `PanoramaReplica` (an actor: one model; each call runs one panorama's 12 views and writes it)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from ..export import DEFAULT_MESH_STEP
from ..host import CallOptions
from ..jobs import failure_text
from .sinks import write_files, write_shard

__all__ = ["read_images", "Replica", "ClipReplica", "PanoramaReplica"]


def load_replica_model(model_kwargs: dict, threads: int) -> object:
    """One replica's MoGeModel (from_pretrained arguments, no warm-up), with torch and the native host kernels
    on the replica's share of the cores (`threads`)."""
    import torch

    from .. import env, native
    from ..model import MoGeModel

    torch.set_num_threads(max(1, threads))
    if not env.get("MOGE_SERVE_THREADS"):
        native.set_threads(max(1, threads))
    return MoGeModel.from_pretrained(**{**model_kwargs, "warmup": 0, "warmup_variants": "none"})


def read_images(batch: dict, exif: bool = False) -> dict:
    """Ray task: {path, name} -> + rgb ((H, W, 3) uint8; (0, 0, 3) when unreadable) and error ('' or why);
    `exif`: each photo turned by its EXIF orientation (`BatchJob.exif`)."""
    import numpy as np

    from ..host.decode import read_image_file

    rgbs, errors = [], []
    for path in batch["path"]:
        try:
            rgbs.append(read_image_file(str(path), exif=exif))
            errors.append("")
        except Exception as exc:  # a corrupt or vanished file costs only itself
            rgbs.append(np.zeros((0, 0, 3), np.uint8))  # same ndim and dtype: Ray keeps a ragged tensor column
            errors.append(str(exc) or type(exc).__name__)
    return {"path": batch["path"], "name": batch["name"], "rgb": rgbs, "error": errors}


class Replica:
    """Ray actor: one MoGeModel, loaded once (`model_kwargs`: from_pretrained arguments, no warm-up); each
    call predicts a batch with `options` and writes it to `out` (`output_format` "files" or "parquet")."""

    def __init__(
        self,
        model_kwargs: dict,
        out: str,
        output_format: str,
        formats: tuple,
        options: CallOptions,
        writers: int,
        threads: int,
        mesh_step: int = DEFAULT_MESH_STEP,
        mesh_faces: Optional[int] = None,
    ):
        self.mesh_faces = mesh_faces
        self.model = load_replica_model(model_kwargs, threads)
        self.out, self.output_format, self.formats, self.mesh_step = Path(out), output_format, formats, mesh_step
        self.options = options
        self.writer = ThreadPoolExecutor(writers, thread_name_prefix="tt_moge-write")

    def __call__(self, batch: dict) -> dict:
        """{name, path, rgb, error} -> {name, path, error}: each image predicted and written, or why not. Only
        what is returned counts as done: a replica that dies before returning has its batch retried."""
        from ..jobs import predict_chunk

        names, paths = [str(n) for n in batch["name"]], [str(p) for p in batch["path"]]
        errors = [str(e) for e in batch["error"]]
        todo = [i for i, e in enumerate(errors) if not e]
        outputs = predict_chunk(self.model.service, [batch["rgb"][i] for i in todo], self.options)
        results: dict = {}
        for i, output in zip(todo, outputs):
            if isinstance(output, BaseException):
                errors[i] = str(output) or type(output).__name__
            else:
                results[i] = output
        if self.output_format == "files":
            write_files(
                self.writer,
                self.out,
                results,
                batch["rgb"],
                names,
                paths,
                errors,
                self.formats,
                self.mesh_step,
                self.mesh_faces,
            )
        else:
            write_shard(self.out, results, names, paths, errors)
        return {"name": names, "path": paths, "error": errors}


class ClipReplica:
    """Ray actor: one MoGeModel (as `Replica`); each call runs one clip ({name, path} of a video file) with the
    call `options` and the clip options `video`, written to OUT/NAME/ (`video.files.ClipWriter`, result.json
    last). Only a returned status counts: a replica that dies has its clip retried."""

    def __init__(
        self,
        model_kwargs: dict,
        out: str,
        formats: tuple,
        options: CallOptions,
        video: object,
        writers: int,
        threads: int,
        mesh_step: int = DEFAULT_MESH_STEP,
    ):
        self.model = load_replica_model(model_kwargs, threads)
        self.out, self.formats, self.mesh_step, self.writers = Path(out), formats, mesh_step, writers
        self.options, self.video = options, video

    def __call__(self, batch: dict) -> dict:
        from ..video import VideoStream
        from ..video.files import ClipWriter

        names, paths = [str(n) for n in batch["name"]], [str(p) for p in batch["path"]]
        errors = []
        for name, path in zip(names, paths):
            writer = None
            try:
                with VideoStream(self.model, path, self.options, self.video) as stream:
                    fps = None if stream.fps is None else stream.fps / self.video.stride
                    writer = ClipWriter(
                        self.out / name, self.formats, mesh_step=self.mesh_step, fps=fps, writers=self.writers
                    )
                    for frame in stream:
                        writer.add(frame.index, frame.output, frame.image, frame.record(), frame.depth_range)
                    writer.finish(stream.result)
                errors.append("")
            except Exception as exc:  # a bad clip costs only itself, and leaves no folder
                if writer is not None:
                    writer.abort(remove=True)
                errors.append(failure_text(path, exc))
        return {"name": names, "path": paths, "error": errors}


class PanoramaReplica:
    """Ray actor: one MoGeModel (as `Replica`, on the panorama canvas); each call runs the panoramas of its batch
    ({name, path} of equirectangular images). `output_format` "files": through `jobs.predict_panoramas`, the very
    loop of `tt-moge predict --panorama`, into OUT/NAME/ (result.json last); "parquet": `model.predict_panorama`
    on each, the batch one shard (`sinks.write_shard`: the row's npz is `PanoramaOutput.to_npz_bytes()`). Only
    a returned status counts: a replica that dies has its batch retried."""

    def __init__(
        self,
        model_kwargs: dict,
        out: str,
        formats: tuple,
        threads: int,
        exif: bool = True,
        mesh_step: int = DEFAULT_MESH_STEP,
        mesh_faces: Optional[int] = None,
        apply_mask: bool = True,
        output_format: str = "files",
    ):
        self.model = load_replica_model(model_kwargs, threads)
        self.out, self.formats, self.exif, self.apply_mask = Path(out), formats, exif, apply_mask
        self.mesh_step, self.mesh_faces, self.output_format = mesh_step, mesh_faces, output_format

    def __call__(self, batch: dict) -> dict:
        from types import SimpleNamespace

        from ..jobs import predict_panoramas

        names, paths = [str(n) for n in batch["name"]], [str(p) for p in batch["path"]]
        if self.output_format == "parquet":
            return {"name": names, "path": paths, "error": self._shard(names, paths)}
        images = [SimpleNamespace(path=Path(p), name=n) for n, p in zip(names, paths)]
        status = predict_panoramas(
            self.model,
            images,
            self.out,
            self.formats,
            mesh_step=self.mesh_step,
            exif=self.exif,
            mesh_faces=self.mesh_faces,
            apply_mask=self.apply_mask,
        )
        return {"name": names, "path": paths, "error": [status.get(i) or "" for i in range(len(images))]}

    def _shard(self, names: list, paths: list) -> list:
        """The panoramas of one call as one Parquet shard -> each one's error ('' when done)."""
        from ..host.decode import read_image_file

        results, errors = {}, [""] * len(paths)
        for i, path in enumerate(paths):
            try:
                rgb = read_image_file(path, exif=self.exif)
                results[i] = self.model.predict_panorama(rgb, apply_mask=self.apply_mask)
            except Exception as exc:  # unreadable, not 2:1, no valid view: it costs only itself
                errors[i] = failure_text(path, exc)
        write_shard(self.out, results, names, paths, errors)
        return errors
