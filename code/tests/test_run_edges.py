"""The edges of a run into an output folder (issue 28), tried as an attacker would: photo names that would leave
OUT or take the place of the run's own files, clean-up after a failed write, the exit codes. `tt-moge predict`
runs for real, with a stand-in model (`tests/stand_in.py`) where the network is not the point."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.stand_in import SECONDS_ENV, stand_in
from tt_moge.cli import main
from tt_moge.runs import LOCK_FILE

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


# ---------------------------------------------------------------------------------------------- exit codes
def test_a_photo_named_run_json_cannot_make_the_run_lie(tmp_path, monkeypatch):
    """run.json.jpg used to make a folder run.json/: "could not write run.json", exit 0. Its folder is now
    _run.json/, run.json is written, exit 0; and a run whose run.json cannot be written exits 1."""
    photos = tmp_path / "photos"
    small_photo(photos / "run.json.jpg")
    small_photo(photos / "a.png", seed=1)
    out = tmp_path / "out"
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photos, "-o", out])
    assert code == 0, stdout + stderr
    assert (out / "run.json").is_file() and (out / "_run.json" / "result.json").is_file()
    assert json.loads((out / "run.json").read_text())["done"] == 2

    import tt_moge.export as export

    real = export.write_text_atomic

    def no_run_json(path, text):
        if Path(path).name == "run.json":
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(export, "write_text_atomic", no_run_json)
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photos, "-o", out])
    assert code == 1 and "could not write" in stderr and "no index" in stdout, (code, stdout, stderr)
    assert not (out / "run.json").exists(), "the last run's run.json must not stand for this one"


CODE_DIR = Path(__file__).resolve().parents[1]


def start_predict(photos: Path, out: Path, seconds: float, *extra: str) -> subprocess.Popen:
    """`tt-moge predict` in its own process with the stand-in model, each image taking `seconds`."""
    env = {**os.environ, SECONDS_ENV: str(seconds), "PYTHONPATH": str(CODE_DIR)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.stand_in", "predict", str(photos), "-o", str(out), "--chunk-size", "1", *extra],
        cwd=CODE_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def some_photos(folder: Path, n: int) -> Path:
    for i in range(n):
        small_photo(folder / f"p{i:02d}.png", seed=i)
    return folder


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_the_files_writes_run_json_and_exits_128_plus_it(tmp_path, signum, code):
    """SIGTERM used to kill predict at once: no message, no run.json. Now SIGTERM and SIGINT (Ctrl-C) both stop
    the run after the files being written: every image is done (result.json) or has no folder at all,
    run.json says which is which, a message says what happened, and the exit code is 143 / 130."""
    photos, out = some_photos(tmp_path / "photos", 20), tmp_path / "out"
    proc = start_predict(photos, out, 0.5)  # 10 s of work: the signal comes long before the end, even under load
    wait_for(lambda: any(out.glob("*/result.json")), proc, "a first result")
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, (proc.returncode, stdout, stderr)
    assert f"interrupted by {signal.Signals(signum).name}" in stderr, stderr
    run = json.loads((out / "run.json").read_text())
    assert run["interrupted"] == signal.Signals(signum).name
    states = {r["output"]: r["status"] for r in run["images"]}
    assert set(states.values()) == {"done", "not done"}, states
    for name, state in states.items():
        if state == "done":
            assert (out / name / "result.json").is_file(), name
        else:
            assert not (out / name).exists(), f"{name}: not done, but its folder is there"
    assert run["done"] == sum(s == "done" for s in states.values()) and run["not_done"] == 20 - run["done"]
    assert not (out / LOCK_FILE).exists(), "the lock file is removed at the end"


@contextlib.contextmanager
def own_sigterm_handler():
    """A SIGTERM handler of this test process for the block, instead of the default (which would end pytest): a
    command run in process must put its own in place; if the signal reaches this one, the test fails."""

    def not_handled(signum, frame):
        raise RuntimeError("SIGTERM reached the test's own handler: the command did not handle it")

    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        yield
        assert signal.getsignal(signal.SIGTERM) is not_handled, "the handler before the run is restored after it"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_swallowed_by_an_optional_import_still_stops_the_run(tmp_path, monkeypatch):
    """A SIGTERM that came while trimesh was first imported was lost: trimesh's optional imports catch
    BaseException (`try: import scipy ... except BaseException`), so the exception of the run's handler never
    arrived; the run went on to its end and exited 143 with "interrupted": null. Now the run checks for a
    signal after such code: it stops before the model loads, and run.json says why."""
    import tt_moge.export as export

    real = export.missing_format_library

    def swallowing(formats):  # what trimesh's import does with the handler's exception
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here
        except BaseException:
            pass
        return real(formats)

    monkeypatch.setattr(export, "missing_format_library", swallowing)
    photos, out = some_photos(tmp_path / "photos", 3), tmp_path / "out"
    with stand_in(monkeypatch) as model, own_sigterm_handler():
        code, stdout, stderr = run_cli(["predict", photos, "-o", out])
    assert code == 143 and "interrupted by SIGTERM" in stderr, (code, stderr)
    run = json.loads((out / "run.json").read_text())
    assert run["interrupted"] == "SIGTERM" and (run["done"], run["not_done"]) == (0, 3), run
    assert not model.calls, "the model ran after the signal"


def test_a_video_run_signalled_while_its_model_loads_writes_run_json_and_exits_143(tmp_path, monkeypatch):
    """A clip run installed its handler only after the model had loaded (a minute on a CPU): SIGTERM then killed
    it (exit -15; Ctrl-C: a traceback, 130) and no run.json was written. Now the run is interrupted like any
    other: run.json lists every clip as "not done", exit 143."""
    import tt_moge.cli.video as video_cli

    def loading(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler's exception comes here
        raise AssertionError("the signal did not stop the load")

    monkeypatch.setattr(video_cli, "load_model", loading)
    clips = [tmp_path / "a.mp4", tmp_path / "b.mov"]
    for clip in clips:
        clip.write_bytes(b"never read: the model does not load")
    out = tmp_path / "out"
    with own_sigterm_handler():
        code, stdout, stderr = run_cli(["predict", *clips, "-o", out])
    assert code == 143 and "interrupted by SIGTERM" in stderr, (code, stderr)
    run = json.loads((out / "run.json").read_text())
    assert run["interrupted"] == "SIGTERM" and run["not_done"] == 2 and run["done"] == run["failed"] == 0, run
    assert [c["status"] for c in run["clips"]] == ["not done", "not done"]
    assert sorted(p.name for p in out.iterdir()) == ["run.json"], "no clip folder, no lock left"


@pytest.mark.parametrize("kind", ["photos", "clip"])
def test_a_model_that_cannot_load_leaves_the_earlier_run_json(tmp_path, kind):
    """A run whose model cannot load (bad weights: exit 3) deleted the earlier run's run.json first and wrote
    none, so OUT's files lost their index. Such a run changes nothing in OUT, as a usage error does (exit 2)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text('{"earlier": true}')
    if kind == "photos":
        inputs = [some_photos(tmp_path / "photos", 2)]
    else:
        inputs = [tmp_path / "a.mp4"]
        inputs[0].write_bytes(b"never read")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    code, stdout, stderr = run_cli(["predict", *inputs, "-o", out, "--weights", tmp_path / "bad.pt", "-q"])
    assert code == 3 and "could not load the model" in stderr, (code, stderr)
    assert (out / "run.json").read_text() == '{"earlier": true}'
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


@pytest.mark.parametrize("kind", ["photos", "panoramas"])
def test_an_interruption_at_any_line_loses_no_finished_image(tmp_path, kind):
    """run.json listed a finished image as "not done" once in 8 interrupted runs: the run's exception could come
    between a write that had ended and its record. Here the exception (a signal's, as SignalGuard raises it) is
    raised at each line the run's thread executes in turn (`sys.settrace`), one run per line, until a run gets
    to its end: after each, every image with a result.json on disk must have been reported done, and no
    image reported done may lack one."""
    import dis

    from tests.stand_in import StandInModel, tilted_plane
    from tt_moge import jobs
    from tt_moge.inputs import collect_images

    class Stop(BaseException):
        pass

    images = collect_images([some_photos(tmp_path / "photos", 3)])
    model = StandInModel()
    model.predict_panorama = lambda rgb, apply_mask=True: tilted_plane(*rgb.shape[:2])
    target = 0
    while True:
        target += 1
        out, reported, seen = tmp_path / f"out{target}", {}, [0]

        def tracer(frame, event, arg, target=target, seen=seen):
            if frame.f_code.co_filename != jobs.__file__:
                return None
            # a line's NOP (a `try:`) is no place a signal's handler runs; an exception raised there by a trace
            # function skips the enclosing `finally` (CPython 3.11)
            if event == "line" and dis.opname[frame.f_code.co_code[frame.f_lasti]] != "NOP":
                seen[0] += 1
                if seen[0] == target:
                    raise Stop
            return tracer

        def on_done(image, error, reported=reported):
            reported[image.name] = error

        sys.settrace(tracer)
        try:
            if kind == "photos":
                jobs.predict_images(model, images, out, ["npz"], chunk_size=1, writers=1, on_done=on_done)
            else:
                jobs.predict_panoramas(model, images, out, ["npz"], on_done=on_done)
            finished = True
        except Stop:
            finished = False
        finally:
            sys.settrace(None)
        on_disk = {p.parent.name for p in out.glob("*/result.json")}
        done = {name for name, error in reported.items() if error is None}
        assert on_disk == done, f"stopped at line {target}: written {sorted(on_disk)}, reported done {sorted(done)}"
        if finished:
            break
    assert target > 20 and len(done) == 3, (target, done)


def test_clip_names_never_collide_and_renamed_clips_say_so(tmp_path, monkeypatch):
    """`a.mp4`, `a.mov` and `a-2.mp4` all went to one folder `a-2/` (a counter on a clash, which `a-2.mp4` asks
    for itself), with all three "done" in run.json and no `renamed` record. Clips are now named by the rules of
    photos (`inputs.unique_names`): a_mp4, a_mov, a-2, each renamed one saying why."""
    import tt_moge.cli.video as video_cli
    from tests.stand_in import StandInModel

    monkeypatch.setattr(video_cli, "load_model", lambda args: StandInModel())
    clips = [tmp_path / name for name in ("a.mp4", "a.mov", "a-2.mp4")]
    for clip in clips:
        clip.write_bytes(b"not a video")  # each fails to open: the names are the point
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["predict", *clips, "-o", out, "-q"])
    assert code == 1, stderr
    rows = json.loads((out / "run.json").read_text())["clips"]
    assert [r["output"] for r in rows] == ["a_mp4", "a_mov", "a-2"], rows
    assert [r.get("renamed", {}).get("asked") for r in rows] == ["a", "a", None], rows
    assert "another input asks for 'a' too" in rows[0]["renamed"]["why"], rows


def test_clashing_names_at_the_length_limit_are_cut_to_fit(tmp_path, monkeypatch):
    """Two 251-byte stems that clash (they differ only in case) were renamed to 257 bytes (+ "_png", + "-2"):
    ENAMETOOLONG, and the photo failed. The name is now cut to 255 bytes before its suffix (at a character:
    two-byte letters stay whole), and run.json says so."""
    photos, out = tmp_path / "photos", tmp_path / "out"
    stems = ["a" * 251, "A" * 251, "é" * 125 + "x", "É" * 125 + "x"]  # 251 bytes each, two clashing pairs
    for i, stem in enumerate(stems):
        small_photo(photos / f"{stem}.png", seed=i)
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photos, "-o", out, "-q", "--npz"])
    assert code == 0, stderr
    rows = json.loads((out / "run.json").read_text())["images"]
    assert [r["status"] for r in rows] == ["done"] * 4, rows
    names = [r["output"] for r in rows]
    assert len({n.casefold() for n in names}) == 4 and all(len(n.encode()) <= 255 for n in names), names
    assert all((out / n / "result.json").is_file() for n in names)
    assert any("cut to fit 255 bytes" in r["renamed"]["why"] for r in rows), rows


def one_frame_clip(path: Path) -> Path:
    """A valid mp4 of a single 32x24 frame: it opens, then fails as a clip (at least 2 frames are needed)."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 8.0, (32, 24))
    writer.write(np.full((24, 32, 3), 128, np.uint8))
    writer.release()
    return path


def test_a_failed_clip_leaves_no_folder_and_bytes_are_not_named_by_their_temporary_file(tmp_path, monkeypatch):
    """A clip that failed once its folder was made (here: a single frame, found when the frames are read) left an
    empty OUT/NAME/ behind; the folder goes now, as a failed photo's does. And `predict_video(<bytes>)` named its
    temporary copy (`tt_moge-video-*/upload.video`) in its errors, a path the caller never gave: they say "the
    video bytes" now."""
    import tt_moge.cli.video as video_cli
    from tests.stand_in import StandInModel
    from tt_moge.host import InputError
    from tt_moge.video import predict_video

    clip, out = one_frame_clip(tmp_path / "short.mp4"), tmp_path / "out"
    monkeypatch.setattr(video_cli, "load_model", lambda args: StandInModel())
    code, stdout, stderr = run_cli(["predict", clip, "-o", out, "-q"])
    assert code == 1 and "has 1 frame" in stderr, (code, stderr)
    assert json.loads((out / "run.json").read_text())["clips"][0]["status"] == "failed"
    assert sorted(p.name for p in out.iterdir()) == ["run.json"], "the failed clip's folder is gone"

    for data, message in ((b"not a video at all", "cannot read"), (clip.read_bytes(), "has 1 frame")):
        with pytest.raises(InputError, match=message) as caught:
            predict_video(StandInModel(), data)
        assert "the video bytes" in str(caught.value), caught.value
        assert "upload.video" not in str(caught.value) and "tt_moge-video-" not in str(caught.value), caught.value


def test_removing_an_unfinished_folder_takes_only_the_writers_files(tmp_path):
    """`export.remove_incomplete` (a batch job stopped while a replica wrote): the files write_outputs writes and
    its temporary files go, then the folders left empty up to OUT; anything else stays, and a complete folder
    (result.json) is not touched."""
    from tt_moge.export import remove_incomplete

    out = tmp_path / "out"
    partial, mixed, complete = out / "trip" / "a", out / "b", out / "c"
    for folder, names in (
        (partial, ["depth.png", "result.npz", ".result.json.77.tmp"]),
        (mixed, ["depth.png", "notes.txt"]),
        (complete, ["depth.png", "result.json"]),
    ):
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_bytes(b"x")
    assert remove_incomplete(partial, out) and not (out / "trip").exists() and out.is_dir()
    assert not remove_incomplete(mixed, out) and sorted(p.name for p in mixed.iterdir()) == ["notes.txt"]
    assert not remove_incomplete(complete, out) and sorted(p.name for p in complete.iterdir()) == [
        "depth.png",
        "result.json",
    ]
    assert not remove_incomplete(tmp_path / "elsewhere", out) and not remove_incomplete(out, out)


# ---------------------------------------------------------------------------------------------- the lock
def test_a_second_run_into_a_folder_in_use_is_refused_or_waits(tmp_path, monkeypatch):
    """Two runs into one OUT used to mix silently. While another process holds OUT (here: this test process),
    a run is refused (exit 2, a message naming the folder, the holder and --wait), or with --wait it waits,
    says so, and runs once the holder lets go."""
    from tt_moge.runs import OutputLock

    photos, out = some_photos(tmp_path / "photos", 3), tmp_path / "out"
    out.mkdir()
    lock = OutputLock(out).acquire()
    try:
        with stand_in(monkeypatch):
            code, stdout, stderr = run_cli(["predict", photos, "-o", out, "-q"])
        assert code == 2 and "is in use by another run" in stderr and "--wait" in stderr, (code, stdout, stderr)
        assert f"pid {os.getpid()}" in stderr, "the message names the holder"
        assert not (out / "run.json").exists() and not (out / "p00").exists(), "the refused run wrote nothing"
        waiting = start_predict(photos, out, 0.0, "--wait")
        line = waiting.stderr.readline()  # its first line, once it is blocked on the lock
        assert "waiting for it to end" in line, line + waiting.communicate()[1]
        assert waiting.poll() is None and not (out / "run.json").exists(), "it waits, and writes nothing meanwhile"
    finally:
        lock.release()
    stdout, stderr = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, stderr
    assert json.loads((out / "run.json").read_text())["done"] == 3
    assert not (out / LOCK_FILE).exists()


def test_a_killed_run_does_not_leave_its_folder_locked(tmp_path, monkeypatch):
    """kill -9 leaves the lock file behind, but not the lock: the OS drops a dead process's flock."""
    photos, out = some_photos(tmp_path / "photos", 3), tmp_path / "out"
    proc = start_predict(photos, out, 5.0)
    wait_for(lambda: (out / LOCK_FILE).exists(), proc, "the lock")
    proc.kill()
    proc.communicate(timeout=30)
    assert (out / LOCK_FILE).exists()
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photos, "-o", out, "-q"])
    assert code == 0, stderr


def test_batch_into_a_folder_in_use_exits_2_before_ray_starts(tmp_path, monkeypatch):
    pytest.importorskip("ray.data", reason="the batch tests need the ray extra")
    from tt_moge.batch import session
    from tt_moge.runs import OutputLock

    photos, out = some_photos(tmp_path / "photos", 2), tmp_path / "out"
    out.mkdir()

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a job that must be refused")

    monkeypatch.setattr(session, "init_local_ray", no_ray)
    with OutputLock(out):
        code, stdout, stderr = run_cli(["batch", photos, "-o", out, "-q"])
    assert code == 2 and "is in use by another run" in stderr, (code, stdout, stderr)


# ------------------------------------------------------------------------------------------ the first hour
def test_a_16x16_photo_gets_its_files_and_no_crash(tmp_path, monkeypatch):
    """The default predict on a 16x16 photo used to fail (a mesh without triangles: trimesh raised, exit 1).
    Now every map is written, mesh.glb is left out with a note in result.json, exit 0."""
    photo = small_photo(tmp_path / "tiny.png", size=(16, 16))
    out = tmp_path / "out"
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photo, "-o", out])
    assert code == 0, stdout + stderr
    result = json.loads((out / "tiny" / "result.json").read_text())
    assert result["mesh_faces"] == 0 and "mesh.glb not written" in result["note"]
    assert sorted(result["files"]) == sorted(["depth.png", "normal.png", "mask.png", "depth.exr", "result.json"])
    assert sorted(p.name for p in (out / "tiny").iterdir()) == sorted(result["files"])


def test_the_default_mesh_of_a_24_mp_photo_is_bounded(tmp_path, monkeypatch):
    """A 6000x4000 photo used to get 8.8 M faces (250 MB) by default. The default mesh now has at most
    MESH_FACE_BUDGET faces (a coarser step); --mesh-step N is kept as given; 1920x1080 keeps step 2."""
    from tt_moge.export import DEFAULT_MESH_STEP, MESH_FACE_BUDGET, mesh_step_for

    assert mesh_step_for(1080, 1920, DEFAULT_MESH_STEP, MESH_FACE_BUDGET) == DEFAULT_MESH_STEP
    assert mesh_step_for(4000, 6000, DEFAULT_MESH_STEP, MESH_FACE_BUDGET) == 7
    assert mesh_step_for(4000, 6000, 1, None) == 1
    photo = tmp_path / "big.jpg"
    Image.new("RGB", (6000, 4000), (90, 120, 200)).save(photo, quality=50)
    out = tmp_path / "out"
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photo, "-o", out, "--glb"])
    assert code == 0, stdout + stderr
    result = json.loads((out / "big" / "result.json").read_text())
    assert result["mesh_step"] == 7 and 0 < result["mesh_faces"] <= MESH_FACE_BUDGET, result
    run = json.loads((out / "run.json").read_text())
    assert (run["mesh_step"], run["mesh_faces"]) == (DEFAULT_MESH_STEP, MESH_FACE_BUDGET)
    assert "(mesh every 7 px)" in stdout, stdout


def test_help_and_a_misspelt_command_answer_without_importing_torch():
    """`tt-moge --help` took 4.4 s: every command's module, and torch with them, was imported to build the
    parser. Only the command given is imported now; the top level, its help and its errors import none."""
    probe = (
        "import sys, contextlib, io\n"
        "from tt_moge.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "    codes = [main(['--help']), main([]), main(['predcit', 'x']), main(['--version'])]\n"
        "assert codes == [0, 2, 2, 0], codes\n"
        "assert 'predict' in out.getvalue() and 'invalid choice' in err.getvalue()\n"
        "heavy = sorted(m for m in ('torch', 'tt_moge.cli.predict', 'tt_moge.cli.common') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=CODE_DIR,
        env={**os.environ, "PYTHONPATH": str(CODE_DIR)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_each_commands_help_answers_without_importing_torch():
    """`tt-moge predict --help` took 6.6-7.9 s: building its flags from the option definitions imported torch
    (through the host, the network, the weights, the video pipeline). The definitions import without torch now
    (host/call_options.py; the packages' other names on first use): every command's help, in one fresh process,
    imports neither torch nor OpenCV."""
    probe = (
        "import sys, contextlib, io\n"
        "from tt_moge.cli import main\n"
        "for command in (['predict'], ['batch'], ['info'], ['serve'], ['bench'], ['export', 'onnx']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            code = main(command + ['--help'])\n"
        "        except SystemExit as exc:\n"
        "            code = exc.code\n"
        "    assert code == 0 and 'usage: tt-moge' in out.getvalue(), (command, code)\n"
        "heavy = sorted(m for m in ('torch', 'cv2') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=CODE_DIR,
        env={**os.environ, "PYTHONPATH": str(CODE_DIR)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_progress_moves_before_the_first_photo_is_done(tmp_path, monkeypatch):
    """The CPU progress bar sat at 0/5 for two minutes on ViT-L: it only moved when an image was written. It now
    names the images the model is on, and its clock is redrawn while the model runs."""
    from tests.stand_in import StandInModel

    photos = some_photos(tmp_path / "photos", 2)
    model = StandInModel()
    model.seconds = 1.3  # each image: the first chunk (both photos) takes 2.6 s, the bar is redrawn every second
    with stand_in(monkeypatch, model):
        code, stdout, stderr = run_cli(["predict", photos, "-o", tmp_path / "out"])
    assert code == 0, stderr
    before_first = [line for line in stderr.replace("\r", "\n").splitlines() if " 0/2 " in line]
    assert any("model on images 1-2" in line for line in before_first), stderr
    assert any("[00:0" in line and "[00:00" not in line for line in before_first), f"the clock stood still: {stderr}"


class Terminal(io.StringIO):
    """stderr as a person sees it: a terminal (slow steps name themselves only there, `tt_moge.progress`)."""

    def isatty(self) -> bool:
        return True


def test_slow_steps_of_a_load_say_what_they_do_on_a_terminal(checkpoint, monkeypatch):
    """from_pretrained's warm-up forwards said nothing (34 s on a tiny model at 1920x1080). Each step of a load
    that takes longer than SLOW_STEP_S now names itself on a terminal, and says how long it took; with the bound
    at 0 every step does. Piped stderr (not a terminal) stays silent."""
    from tt_moge import MoGeModel, progress

    def load(stderr) -> str:
        with contextlib.redirect_stderr(stderr):
            MoGeModel.from_pretrained(
                checkpoint("tiny-vits-normal"), device="cpu", resolution=(224, 126), num_tokens=1200, warmup=1
            ).close()
        return stderr.getvalue()

    monkeypatch.setattr(progress, "SLOW_STEP_S", 0.0)
    said = load(Terminal())
    for step in ("loading the weights", "preparing the cpu runner", "warm-up forward 1 of 1 on cpu ..."):
        assert step in said, said
    assert re.search(r"warm-up forward 1 of 1 on cpu: \d+\.\d s", said), said
    assert "warming the host steps" in said, said
    assert load(io.StringIO()) == "", "not a terminal: nothing"


def test_one_photo_shows_its_progress_bar(tmp_path, monkeypatch):
    """`tt-moge predict photo.jpg` showed nothing until its summary (45 s on a CPU with the ViT-L): the bar was
    for two images or more. One photo gets it too, naming the model's work and moving its clock."""
    photo = small_photo(tmp_path / "one.png")
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photo, "-o", tmp_path / "out"])
    assert code == 0, stderr
    assert "tt-moge predict:" in stderr and "1/1" in stderr and "model on image 1" in stderr, stderr


def test_a_clips_bar_names_the_calibration(tmp_path, monkeypatch):
    """A clip's bar sat at 0 % through its calibration (minutes on a CPU) with nothing named. The bar now shows
    the stage: "calibrating the camera on frames 1-4" while that runs, then the frames the model is on."""
    import cv2

    import tt_moge.cli.video as video_cli
    from tt_moge.cli.common import Ticker
    from tt_moge.scene import camera_path, render_path
    from tt_moge.testing.video import stand_in as video_stand_in

    renders = render_path(camera_path(12)[::2], 160, 120)
    frames = tmp_path / "walk"
    frames.mkdir()
    for i, r in enumerate(renders):
        cv2.imwrite(str(frames / f"f{i}.png"), r.image[..., ::-1])

    class SlowOracle:  # the video tests' stand-in model, 0.4 s per model call, as a context manager
        def __init__(self):
            self.oracle = video_stand_in(renders)

        def __getattr__(self, name):
            attribute = getattr(self.oracle, name)
            if name.endswith("_many"):

                def slow(*args, **kwargs):
                    time.sleep(0.4)
                    return attribute(*args, **kwargs)

                return slow
            return attribute

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def info(self):
            return {"model": "video stand-in"}

    monkeypatch.setattr(video_cli, "load_model", lambda args: SlowOracle())
    # no timed redraws: each stage must be drawn as it starts (CI once missed a calibration shorter than the
    # once-a-second redraw)
    monkeypatch.setattr(video_cli, "Ticker", lambda bar, stage: Ticker(bar, stage, every_s=3600.0))
    args = ["predict", "--sequence", frames, "-o", tmp_path / "out", "--calibration-frames", 4, "--npz"]
    code, stdout, stderr = run_cli(args)
    assert code == 0, stderr
    assert "calibrating the camera on frames 1-4" in stderr, stderr
    assert re.search(r"model on frames \d+-\d+", stderr), stderr


def test_the_summary_counts_the_whole_command(tmp_path):
    """The summary said `in 18.0 s` for a command that took 44.6 s: start-up and imports were not counted. It
    now gives the time since the process started, then its parts, and run.json has it too."""
    photos, out = some_photos(tmp_path / "photos", 2), tmp_path / "out"
    t = time.monotonic()
    proc = start_predict(photos, out, 0.0)
    stdout, stderr = proc.communicate(timeout=120)
    waited = time.monotonic() - t
    assert proc.returncode == 0, stderr
    line = next(line for line in stdout.splitlines() if line.startswith("tt-moge predict:"))
    found = re.search(r"in (\d+\.\d) s \(start-up (\d+\.\d) s, model load \d+\.\d s, images \d+\.\d s: ", line)
    assert found, line
    total, startup = float(found.group(1)), float(found.group(2))
    # all but the process's exit (an interpreter with torch takes a second or two to end on a busy machine)
    assert waited / 2 <= total <= waited + 0.1, (total, waited, line)
    assert startup > 0.3, f"imports take time: {line}"
    run = json.loads((out / "run.json").read_text())
    assert run["total_seconds"] == pytest.approx(total, abs=0.06) and run["startup_seconds"] >= startup - 0.06


def test_a_file_system_without_locks_runs_unlocked_and_says_so(tmp_path, monkeypatch):
    """Some network mounts refuse flock (ENOLCK): the run goes on without the lock, with a note, and leaves
    no lock file."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    photos, out = some_photos(tmp_path / "photos", 2), tmp_path / "out"
    with stand_in(monkeypatch):
        code, stdout, stderr = run_cli(["predict", photos, "-o", out, "-q"])
    assert code == 0 and "cannot be locked" in stderr, (code, stderr)
    assert not (out / LOCK_FILE).exists()


def test_batch_stopped_by_sigterm_says_so_and_exits_143(tmp_path, monkeypatch):
    """SIGTERM killed `tt-moge batch` at once, without a word. It now stops the job (Ray is shut down on the
    way out), says that the finished images are kept and a rerun does the rest, and exits 143."""
    pytest.importorskip("ray.data", reason="the batch tests need the ray extra")
    import tt_moge.batch as batch

    def job_in_progress(job, on_failure=None):
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this process, while the "job" runs
        time.sleep(30)
        raise AssertionError("the signal did not stop the job")

    def not_handled(signum, frame):  # instead of the default, which would end the test process itself
        raise RuntimeError("SIGTERM reached the test's own handler: the command did not handle it")

    monkeypatch.setattr(batch, "run_batch", job_in_progress)
    photos = some_photos(tmp_path / "photos", 1)
    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        code, stdout, stderr = run_cli(["batch", photos, "-o", tmp_path / "out"])
        assert signal.getsignal(signal.SIGTERM) is not_handled, "the handler before the run is restored after it"
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and "interrupted by SIGTERM" in stderr and "rerun" in stderr, (code, stderr)
