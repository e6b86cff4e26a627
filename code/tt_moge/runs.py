"""A run of many photos into one output folder (`tt-moge predict`, `tt-moge batch`, and any later command that
writes OUT/NAME/ folders): the names the run itself writes at the top of OUT, and a check that a path stays
inside OUT.

The output name of each input is made by `inputs.output_name` / `inputs.collect_images`; they map the names
below (case-insensitively) and every hidden top-level name to other, safe names, so that no photo's folder can
take the place of a file the run writes itself.
"""

from __future__ import annotations

import os
from typing import Union

__all__ = [
    "RUN_FILE",
    "BATCH_RECORD_FILE",
    "FAILURES_FILE",
    "SHARDS_DIR",
    "RESERVED_NAMES",
    "is_reserved",
    "inside",
]

RUN_FILE = "run.json"  # tt-moge predict's record of the run: options, model, every input's folder and status
BATCH_RECORD_FILE = "batch.json"  # tt-moge batch's record of the last run
FAILURES_FILE = "failures.jsonl"  # tt-moge batch: one JSON line per image that failed in the last run
SHARDS_DIR = "parquet"  # tt-moge batch --format parquet: OUT/parquet/part-<hash>.parquet
# Names at the top of OUT that belong to the run, not to a photo. Hidden names (a leading ".": the temporary
# files of atomic writes) are the run's too (`is_reserved`).
RESERVED_NAMES = (RUN_FILE, BATCH_RECORD_FILE, FAILURES_FILE, SHARDS_DIR)


def is_reserved(top_level_name: str) -> bool:
    """True for a name at the top of OUT that a photo's folder must not take: one of RESERVED_NAMES (ignoring
    case, as file systems on macOS and Windows do) or a hidden name (leading ".")."""
    return top_level_name.startswith(".") or top_level_name.casefold() in {n.casefold() for n in RESERVED_NAMES}


def inside(path: Union[str, os.PathLike], root: Union[str, os.PathLike]) -> bool:
    """True when `path` is `root` or below it, after resolving `..` and symbolic links of both."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root
