"""Where a batch job's results go, and how a rerun knows what is done.

    "files"     OUT/NAME/ as `tt-moge predict` writes it (export.write_outputs; result.json last)
    "parquet"   OUT/parquet/part-<hash>.parquet, one shard per batch, one row per image: name, source,
                result (the result.json text), npz (the npz bytes); written to a temporary name and renamed
    always      OUT/failures.jsonl (this run's failed images) and OUT/batch.json (the run's record)

A replica writes with `write_files` / `write_shard`; the driver asks `completed_names` before a job (resume)
and writes `FailureLog` and `write_record` while and after it runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from .. import runs

__all__ = [
    "OUTPUT_FORMATS",
    "FAILURES_FILE",
    "RECORD_FILE",
    "SHARDS_DIR",
    "PARQUET_COLUMNS",
    "completed_names",
    "write_files",
    "write_shard",
    "FailureLog",
    "write_record",
]

OUTPUT_FORMATS = ("files", "parquet")
FAILURES_FILE = runs.FAILURES_FILE  # one JSON object per failed image of the last run: input, name, error
RECORD_FILE = runs.BATCH_RECORD_FILE  # the last run: options, counts, timing
SHARDS_DIR = runs.SHARDS_DIR  # OUT/parquet/part-<hash>.parquet in --format parquet
PARQUET_COLUMNS = ("name", "source", "result", "npz")


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


def write_files(
    writer: Executor,
    out: Path,
    results: dict,
    rgbs: Any,
    names: list,
    paths: list,
    errors: list,
    formats: tuple,
    mesh_step: int,
    mesh_faces: Optional[int] = None,
) -> None:
    """Each result {index: MoGeOutput} into OUT/NAME/ on the `writer` threads; a failed write becomes that
    image's error."""
    from ..export import write_outputs

    jobs = {
        i: writer.submit(
            write_outputs,
            output,
            rgbs[i],
            out / names[i],
            formats,
            source=paths[i],
            mesh_step=mesh_step,
            mesh_faces=mesh_faces,
            root=out,
        )
        for i, output in results.items()
    }
    for i, job in jobs.items():
        exc = job.exception()
        if exc is not None:
            errors[i] = f"writing {out / names[i]} failed: {exc}"


def write_shard(out: Path, results: dict, names: list, paths: list, errors: list) -> None:
    """The results {index: MoGeOutput} of one batch as one Parquet shard, named by the batch's images (a
    retried batch replaces its own shard); a result that cannot be serialised, or a shard that cannot be
    written, becomes the images' error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..export import to_json

    rows: dict = {key: [] for key in PARQUET_COLUMNS}
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
    digest = hashlib.sha1("\n".join(sorted(rows["name"])).encode()).hexdigest()[:20]
    shard = out / SHARDS_DIR / f"part-{digest}.parquet"
    table = pa.table(
        {
            "name": pa.array(rows["name"], pa.string()),
            "source": pa.array(rows["source"], pa.string()),
            "result": pa.array(rows["result"], pa.string()),
            "npz": pa.array(rows["npz"], pa.large_binary()),
        }
    )
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


class FailureLog:
    """OUT/failures.jsonl of this run, one JSON line per failed image as it arrives (rewritten by each run)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "w")

    def add(self, path: str, name: str, error: str) -> None:
        self._file.write(json.dumps({"input": path, "name": name, "error": error}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "FailureLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_record(out: Path, summary: Any, where: str, model: Optional[dict], options: dict) -> None:
    """OUT/batch.json: the run's options, model arguments, counts and times (a BatchSummary's), and the inputs whose
    output folder is not the name they asked for (`inputs.output_name`), with why."""
    from .. import __version__
    from ..export import to_json, write_text_atomic

    write_text_atomic(
        out / RECORD_FILE,
        to_json(
            {
                "tt_moge": __version__,
                "where": where,
                "model": model,
                "options": options,
                "total": summary.total,
                "done": summary.done,
                "failed": summary.failed,
                "skipped": summary.skipped,
                "not_done": summary.not_done,
                "interrupted": summary.interrupted,
                "seconds": round(summary.seconds, 3),
                "images_per_second": round(summary.images_per_second, 3),
                "ray_start_seconds": round(summary.ray_start_seconds, 3),
                "renamed": summary.renamed,
            }
        ),
    )
