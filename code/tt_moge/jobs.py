"""Predicting a list of image files and writing each result: the work of `tt-moge predict` and of each batch
replica (`tt_moge.batch`), in one place.

`predict_images(model, images, out_root, formats)` overlaps three things: decoding the next chunk of files (a
reader thread), the model on this chunk (`predict_many`, which itself overlaps the device with the host steps)
and writing finished images (writer threads, bounded so that finished maps do not pile up in memory).
`predict_chunk` is the model step alone: one bad image costs only itself.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from .export import remove_outputs, write_outputs
from .host import to_rgb_array

__all__ = ["DEFAULT_CHUNK", "predict_images", "predict_chunk"]

DEFAULT_CHUNK = 4  # images per predict_many call (the next chunk decodes meanwhile); its outputs are all in memory at once


def _decode(path: Path) -> Any:
    return to_rgb_array(path, name=str(path))


def _decoded_chunks(images: Sequence, size: int, reader: ThreadPoolExecutor) -> Iterator[list]:
    """Yield [(ImageInput, Future of its RGB array)] per chunk, with the next chunk already decoding."""
    chunks = [images[i:i + size] for i in range(0, len(images), size)]
    pending = [reader.submit(_decode, image.path) for image in chunks[0]] if chunks else []
    for k, chunk in enumerate(chunks):
        current = pending
        if k + 1 < len(chunks):
            pending = [reader.submit(_decode, image.path) for image in chunks[k + 1]]
        yield list(zip(chunk, current))


def _reason(image: Any, exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if str(image.path) in text else f"{image.path}: {text}"


def _write_reason(image: Any, folder: Path, exc: BaseException) -> str:
    return f"{image.path}: writing {folder} failed: {str(exc) or type(exc).__name__}"


def predict_images(model: Any, images: Sequence, out_root: Path, formats: Sequence[str], *, fit: str = "pad",
                   fov_x: Optional[float] = None, chunk_size: int = DEFAULT_CHUNK, writers: int = 2,
                   on_done: Optional[Callable[[Any, Optional[str]], None]] = None) -> dict:
    """Run `model` over [ImageInput] and write each result to out_root / image.name with `write_outputs`.

    Decoding of the next chunk, the model on this chunk (`predict_many`) and the writing of finished images
    overlap. An image that fails (unreadable, or its writing fails, e.g. on a full disk) is recorded and the
    run goes on; its files in out_root / image.name are removed (also those of an earlier run), so that no
    folder of a failed image can pass for a result. Returns {image index: error message or None};
    `on_done(image, error)` is called for each image as it finishes.
    """
    status: dict = {}

    def finish(index: int, image: Any, error: Optional[str]) -> None:
        status[index] = error
        if error is not None:
            remove_outputs(out_root / image.name, stop_at=out_root)
        if on_done is not None:
            on_done(image, error)

    reader = ThreadPoolExecutor(1, thread_name_prefix="tt_moge-read")
    writer = ThreadPoolExecutor(writers, thread_name_prefix="tt_moge-write")
    writing: list = []  # [(index, image, Future)], oldest first

    def collect(limit: int) -> None:
        while len(writing) > limit:
            index, image, future = writing.pop(0)
            exc = future.exception()
            finish(index, image, None if exc is None else _write_reason(image, out_root / image.name, exc))

    try:
        index = 0
        for chunk in _decoded_chunks(images, chunk_size, reader):
            decoded = []
            for image, future in chunk:
                exc = future.exception()
                if exc is None:
                    decoded.append((index, image, future.result()))
                else:
                    finish(index, image, _reason(image, exc))
                index += 1
            for (i, image, rgb), output in zip(decoded, predict_chunk(model, [d[2] for d in decoded], fit, fov_x)):
                if isinstance(output, BaseException):
                    finish(i, image, _reason(image, output))
                    continue
                job: Future = writer.submit(write_outputs, output, rgb, out_root / image.name, formats, source=str(image.path))
                writing.append((i, image, job))
                collect(2 * writers)  # bounded: finished maps wait for a writer, not pile up in memory
        collect(0)
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        writer.shutdown(wait=True, cancel_futures=True)
    return status


def predict_chunk(model: Any, arrays: list, fit: str, fov_x: Optional[float]) -> list:
    """MoGeOutputs for decoded arrays; if the chunk call fails, image by image, so one bad image costs only itself."""
    if not arrays:
        return []
    try:
        return model.predict_many(arrays, fit=fit, fov_x=fov_x)
    except Exception:
        results: list = []
        for rgb in arrays:
            try:
                results.append(model.predict(rgb, fit=fit, fov_x=fov_x))
            except Exception as exc:
                results.append(exc)
        return results
