"""Batch inference on Ray Data: `tt-moge batch INPUTS... -o OUT` and `run_batch(...)`, the same pipeline as
`tt-moge predict`, spread over model replicas on one machine or a Ray cluster.

The job (one Ray Data dataset, streamed):

    collect_images(INPUTS)            on the driver; images whose output is complete are skipped (resume)
    -> read + decode                  Ray tasks, in parallel: file bytes -> RGB uint8 array, or the error
    -> predict + write                an actor pool of `replicas`; each actor loads one MoGeModel once, runs its
                                      PredictionService on a batch and writes each image (export.write_outputs,
                                      or one Parquet shard per batch)
    -> per-image status               streamed back to the driver: progress bar, OUT/failures.jsonl, summary

One module per job:

    session.py    Ray: importing it, starting or joining it, the resources a job needs, Ray Data's output
    replica.py    the Ray stages: read_images (tasks) and Replica (the actor: one model, predict, write)
    sinks.py      where results go: OUT/NAME/ files or Parquet shards, resume, the failures file, batch.json
    job.py        BatchJob, BatchSummary, run_batch: the driver

Ray is optional (the `ray` extra: `pip install -e "code/[ray]"` from a clone): it is imported only inside
`run_batch`, and without it `run_batch` raises `RayMissingError` (the CLI exits with code 3).

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

from .job import DEFAULT_BATCH_SIZE, DEFAULT_MAX_RETRIES, BatchJob, BatchSummary, replica_resources, run_batch
from .session import (
    DEFAULT_OBJECT_STORE_MB,
    MIN_OBJECT_STORE_MB,
    RayMissingError,
    check_ray_address,
    init_local_ray,
    local_ray_cpus,
)
from .sinks import FAILURES_FILE, OUTPUT_FORMATS, RECORD_FILE, SHARDS_DIR, completed_names

__all__ = [
    "run_batch",
    "BatchJob",
    "BatchSummary",
    "RayMissingError",
    "OUTPUT_FORMATS",
    "FAILURES_FILE",
    "SHARDS_DIR",
    "RECORD_FILE",
    "completed_names",
    "local_ray_cpus",
    "init_local_ray",
    "MIN_OBJECT_STORE_MB",
    "DEFAULT_OBJECT_STORE_MB",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_RETRIES",
    "replica_resources",
    "check_ray_address",
]
