"""Predicting a list of image files and writing each result: the work of `tt-moge predict` and of each batch
replica (`tt_moge.batch`), in one place.

`predict_images(service, images, out_root, formats)` overlaps three things: decoding the next chunk of files (a
reader thread), the model on this chunk (`PredictionService.predict_many`, which itself overlaps the device
with the host steps) and writing finished images (writer threads, bounded so that finished maps do not pile up
in memory). `predict_chunk` is the model step alone: one bad image costs only itself.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from .export import DEFAULT_MESH_STEP, write_outputs
from .host import CallOptions, to_rgb_array

__all__ = ["DEFAULT_CHUNK", "predict_images", "predict_chunk", "predict_panoramas", "written_bytes"]

DEFAULT_CHUNK = (
    4  # images per predict_many call (the next chunk decodes meanwhile); its outputs are all in memory at once
)


def _decode(path: Path, exif: bool = False) -> Any:
    return to_rgb_array(path, exif=exif)  # its errors name the file: "image file '<path>': ..."


def _decoded_chunks(images: Sequence, size: int, reader: ThreadPoolExecutor, exif: bool = False) -> Iterator[list]:
    """Yield [(ImageInput, Future of its RGB array)] per chunk, with the next chunk already decoding."""
    chunks = [images[i : i + size] for i in range(0, len(images), size)]
    pending = [reader.submit(_decode, image.path, exif) for image in chunks[0]] if chunks else []
    for k, chunk in enumerate(chunks):
        current = pending
        if k + 1 < len(chunks):
            pending = [reader.submit(_decode, image.path, exif) for image in chunks[k + 1]]
        yield list(zip(chunk, current))


def failure_text(path: Any, exc: BaseException) -> str:
    """Why an input failed, naming its file once: the error's text, prefixed by the path unless it names it."""
    text = str(exc) or type(exc).__name__
    return text if str(path) in text else f"{path}: {text}"


def _write_reason(image: Any, folder: Path, exc: BaseException) -> str:
    return f"{image.path}: writing {folder} failed: {str(exc) or type(exc).__name__}"


def predict_images(
    service: Any,
    images: Sequence,
    out_root: Path,
    formats: Sequence[str],
    *,
    options: CallOptions = CallOptions(),
    chunk_size: int = DEFAULT_CHUNK,
    writers: int = 2,
    on_done: Optional[Callable[[Any, Optional[str]], None]] = None,
    mesh_step: int = DEFAULT_MESH_STEP,
    exif: bool = False,
    mesh_faces: Optional[int] = None,
    on_stage: Optional[Callable[[str], None]] = None,
) -> dict:
    """Run `service` (a `PredictionService`) over [ImageInput] with `options` and write each result to
    out_root / image.name with `write_outputs`. `exif`: turn each file by its EXIF orientation when decoding.

    Decoding of the next chunk, the model on this chunk (`predict_many`) and the writing of finished images
    overlap. An image that fails (unreadable, or its writing fails, e.g. on a full disk) is recorded and the
    run goes on; the files its writing had made are removed again (`write_outputs`), nothing else: clean-up
    only touches what this run wrote, inside out_root. Returns {image index: error message or None};
    `on_done(image, error)` is called for each image as it finishes; `on_stage(text)` before each chunk goes to
    the model (a model call on the CPU can take minutes: a progress display shows what is happening). A written
    image is recorded (`on_done`) by the writer thread that wrote it, one record at a time: an interruption of
    this thread cannot fall between a finished write and its record.
    `mesh_step` and `mesh_faces` go to `write_outputs`.

    An exception in this thread (a signal handler's, e.g. SIGTERM) stops the run: the writes already running
    finish (and are reported to `on_done`), the queued ones are dropped before they create anything.
    """
    status: dict = {}
    recording = threading.Lock()  # finish() runs in the writer threads: one image's record at a time

    def finish(index: int, image: Any, error: Optional[str]) -> None:
        with recording:
            status[index] = error
            if on_done is not None:
                on_done(image, error)

    def write_and_record(index: int, image: Any, output: Any, rgb: Any) -> None:
        """A writer thread's job: the files, then the record. Recorded here, not in the main thread, so that a
        signal's exception there never comes between a finished write and its record."""
        try:
            write_outputs(
                output,
                rgb,
                out_root / image.name,
                formats,
                source=str(image.path),
                mesh_step=mesh_step,
                mesh_faces=mesh_faces,
                root=out_root,
            )
        except Exception as exc:
            finish(index, image, _write_reason(image, out_root / image.name, exc))
        else:
            finish(index, image, None)

    reader = ThreadPoolExecutor(1, thread_name_prefix="tt_moge-read")
    writer = ThreadPoolExecutor(writers, thread_name_prefix="tt_moge-write")
    writing: list = []  # Futures of write_and_record, oldest first

    def collect(limit: int) -> None:
        while len(writing) > limit:
            writing[0].result()  # waits (its record is made in the writer thread); raises on_done's error
            writing.pop(0)

    try:
        index = 0
        for chunk in _decoded_chunks(images, chunk_size, reader, exif):
            decoded = []
            for image, future in chunk:
                exc = future.exception()
                if exc is None:
                    decoded.append((index, image, future.result()))
                else:
                    finish(index, image, failure_text(image.path, exc))
                index += 1
            if on_stage is not None and decoded:
                first, last = decoded[0][0] + 1, decoded[-1][0] + 1
                on_stage(f"model on image {first}" if first == last else f"model on images {first}-{last}")
            for (i, image, rgb), output in zip(decoded, predict_chunk(service, [d[2] for d in decoded], options)):
                if isinstance(output, BaseException):
                    finish(i, image, failure_text(image.path, output))
                    continue
                writing.append(writer.submit(write_and_record, i, image, output, rgb))
                collect(2 * writers)  # bounded: finished maps wait for a writer, not pile up in memory
        collect(0)
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        # after an interruption: the writes that started run to their end and record themselves; the queued
        # ones are cancelled before they create anything (and stay "not done")
        writer.shutdown(wait=True, cancel_futures=True)
    return status


def predict_chunk(service: Any, arrays: list, options: CallOptions = CallOptions()) -> list:
    """MoGeOutputs for decoded arrays (a `PredictionService`); if the chunk call fails, image by image, so one bad
    image costs only itself."""
    if not arrays:
        return []
    try:
        return service.predict_many(arrays, options)
    except Exception:
        results: list = []
        for rgb in arrays:
            try:
                results.append(service.predict(rgb, options))
            except Exception as exc:
                results.append(exc)
        return results


def predict_panoramas(
    model: Any,
    images: Sequence,
    out_root: Path,
    formats: Sequence[str],
    *,
    on_done: Optional[Callable[[Any, Optional[str]], None]] = None,
    mesh_step: int = DEFAULT_MESH_STEP,
    exif: bool = False,
    mesh_faces: Optional[int] = None,
    on_stage: Optional[Callable[[str], None]] = None,
    apply_mask: bool = True,
) -> dict:
    """`predict_images` for 360-degree equirectangular panoramas: per image, `model.predict_panorama` (whose 12
    views already keep the device busy through predict_many) and `write_outputs`; the writing of one panorama
    overlaps the next one's views. A panorama that fails (unreadable, not 2:1, no valid view) is recorded and
    the run goes on; views that failed inside a panorama are listed in its result.json ("views_failed").
    Returns {image index: error message or None}."""
    status: dict = {}
    recording = threading.Lock()

    def finish(index: int, image: Any, error: Optional[str]) -> None:
        with recording:
            status[index] = error
            if on_done is not None:
                on_done(image, error)

    def write_and_record(index: int, image: Any, output: Any, rgb: Any) -> None:
        """In the writer thread: the files, then the record (as predict_images: no window between them)."""
        try:
            write_outputs(
                output,
                rgb,
                out_root / image.name,
                formats,
                source=str(image.path),
                mesh_step=mesh_step,
                mesh_faces=mesh_faces,
                root=out_root,
            )
        except Exception as exc:
            finish(index, image, failure_text(image.path, exc))
        else:
            finish(index, image, None)

    writer = ThreadPoolExecutor(1, thread_name_prefix="tt_moge-write")
    pending: list = []  # the write of the previous panorama, while the next one's views run

    def settle() -> None:
        while pending:
            pending[0].result()
            pending.pop(0)

    try:
        for index, image in enumerate(images):
            try:
                rgb = _decode(image.path, exif)
                if on_stage is not None:
                    on_stage(f"model on panorama {index + 1}")
                output = model.predict_panorama(rgb, apply_mask=apply_mask)
            except Exception as exc:
                settle()
                finish(index, image, failure_text(image.path, exc))
                continue
            settle()
            pending.append(writer.submit(write_and_record, index, image, output, rgb))
        settle()
    finally:
        writer.shutdown(wait=True, cancel_futures=True)  # after an interruption: the running write records itself
    return status


def written_bytes(out_root: Path, names: Sequence[str]) -> int:
    """The bytes of the files that each named output folder's result.json lists: what a run wrote."""
    import json

    total = 0
    for name in names:
        folder = Path(out_root) / name
        try:
            files = json.loads((folder / "result.json").read_text())["files"]
        except (OSError, ValueError, KeyError):
            continue
        total += sum((folder / f).stat().st_size for f in files if (folder / f).is_file())
    return total
