"""The edges of a run into an output folder (issue 28), tried as an attacker would: photo names that would leave
OUT or take the place of the run's own files, clean-up after a failed write, the exit codes. `tt-moge predict`
runs for real, with a stand-in model (`tests/stand_in.py`) where the network is not the point."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.stand_in import stand_in
from tt_moge.cli import main

# name of the photo file -> what the names of its kind want to do
HOSTILE = {
    "...png": "stem '..': the parent of OUT",
    "..png": "stem '.': OUT itself",
    "run.json.jpg": "a folder run.json/ where the run writes its own run.json",
    "batch.json.png": "batch's record",
    "failures.jsonl.png": "batch's failures file",
    "two\nlines.png": "a newline in a folder name",
    "RUN.JSON.png": "run.json on a case-insensitive file system",
}
SENTINELS = ("depth.png", "mask.png", "normal.png", "depth.exr", "mesh.glb", "result.json")


def run_cli(args: list) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def small_photo(path: Path, size: tuple = (24, 16), seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(
        path, format="PNG" if path.suffix.lower() == ".png" else "JPEG"
    )
    return path


@pytest.fixture
def hostile_photos(tmp_path) -> Path:
    photos = tmp_path / "photos"
    for i, name in enumerate(HOSTILE):
        small_photo(photos / name, seed=i)
    small_photo(photos / "sub" / "...png", seed=20)  # a dots-only stem below a folder
    return photos


def guarded_out(tmp_path: Path) -> tuple:
    """OUT inside a parent folder that holds a file of every output name: any of them touched is an escape."""
    parent = tmp_path / "parent"
    out = parent / "out"
    out.mkdir(parents=True)
    for name in SENTINELS:
        (parent / name).write_text(f"sentinel {name}")
    return parent, out


def untouched(parent: Path) -> list:
    """The sentinels of `guarded_out` that were changed or removed."""
    return [n for n in SENTINELS if not (parent / n).is_file() or (parent / n).read_bytes() != f"sentinel {n}".encode()]


def test_output_names_stay_inside_out_and_never_take_the_runs_own_names(tmp_path, hostile_photos):
    from tt_moge.inputs import collect_images, output_name
    from tt_moge.runs import RESERVED_NAMES, inside

    images = collect_images([hostile_photos])
    names = [im.name for im in images]
    assert len(set(n.casefold() for n in names)) == len(names) == len(HOSTILE) + 1
    out = tmp_path / "OUT"
    for im in images:
        parts = im.name.split("/")
        assert all(p and p.strip(".") and "\n" not in p for p in parts), im.name
        assert parts[0].casefold() not in {n.casefold() for n in RESERVED_NAMES} and not parts[0].startswith(".")
        assert inside(out / im.name, out) and (out / im.name).resolve() != out.resolve(), im.name
    renamed = {im.path.relative_to(hostile_photos).as_posix(): im for im in images if im.renamed}
    assert set(renamed) == {*HOSTILE, "sub/...png"}, "each hostile name is renamed, and says why"
    assert renamed["...png"].wanted == ".." and "not a folder name" in renamed["...png"].renamed
    assert renamed["sub/...png"].name == "sub/__"
    assert output_name(hostile_photos / "ok.png") == ("ok", ""), "a plain name is kept"


@pytest.mark.parametrize("write_fails", [False, True], ids=["written", "write-fails"])
def test_predict_writes_and_cleans_up_only_inside_out(tmp_path, hostile_photos, monkeypatch, write_fails):
    """`tt-moge predict` over the hostile names: every folder inside OUT, nothing outside touched (also when
    every write fails and is cleaned up), run.json a file that names each renamed input, exit 0 / 1."""
    parent, out = guarded_out(tmp_path)
    if write_fails:
        import tt_moge.export as export

        def full_disk(path, depth):
            Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(export, "write_depth_exr", full_disk)
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", hostile_photos, "-o", out])
    assert untouched(parent) == [], f"files outside OUT were changed: {untouched(parent)}"
    assert sorted(p.name for p in parent.iterdir()) == sorted([*SENTINELS, "out"])
    run = json.loads((out / "run.json").read_text())
    assert len(run["images"]) == len(HOSTILE) + 1
    renamed = {
        Path(r["input"]).relative_to(hostile_photos).as_posix(): r["renamed"] for r in run["images"] if "renamed" in r
    }
    assert set(renamed) == {*HOSTILE, "sub/...png"} and renamed["..png"]["asked"] == "."
    if write_fails:
        assert code == 1 and run["failed"] == len(run["images"]), stdout + stderr
        left = [p for p in out.rglob("*") if p.name != "run.json"]
        assert left == [], f"a failed write left {left}"
    else:
        assert code == 0 and run["done"] == len(run["images"]), stdout + stderr
        for record in run["images"]:
            folder = out / record["output"]
            assert (folder / "result.json").is_file() and folder.resolve().parent.is_relative_to(out.resolve())
