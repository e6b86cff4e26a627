"""`tt-moge batch` on a local Ray with 2 CPU replicas and a tiny random-weight checkpoint: a folder of 20 small
photos plus a corrupt one. Checked: every npz is bit-identical to the Python API, the corrupt image is in the
failures file and the rest is done, a rerun recomputes nothing, a replica killed mid-job still leaves every image
done exactly once (Parquet: one row per image), and without Ray a clear error and exit code 3.

One local Ray for the module (started with the library's own init_local_ray, shut down at the end); the jobs
reuse it. About a minute on 2 busy cores, most of it replica start-up (torch import, model load)."""

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
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tt_moge.batch import FAILURES_FILE, SHARDS_DIR, BatchJob, init_local_ray, run_batch
from tt_moge.batch import job as batch_job
from tt_moge.cli import main
from tt_moge.output import MoGeOutput
from tt_moge.runs import LOCK_FILE

CANVAS, TOKENS = (448, 252), 1200
MODEL_ARGS = ["--device", "cpu", "--resolution", f"{CANVAS[0]}x{CANVAS[1]}", "--num-tokens", str(TOKENS)]
REPLICAS = 2
CORRUPT = "zz_broken.jpg"
CALL = {"fit": "stretch", "fov_x": 60.0}  # non-default call options: they must reach the replicas


def model_args(ckpt) -> dict:
    """The from_pretrained arguments of the test model (BatchJob.model)."""
    return {"pretrained_model_name_or_path": ckpt, "device": "cpu", "resolution": CANVAS, "num_tokens": TOKENS}


CODE_DIR = Path(__file__).resolve().parents[1]


def run_cli(args: list) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict:
    """20 photos of 64-160 px (PNG and JPEG, some in a subfolder) and a corrupt JPEG -> {output name: path}."""
    from tt_moge.testing import calibration_image

    root = tmp_path_factory.mktemp("photos")
    names = {}
    for i in range(20):
        w, h = 64 + 5 * i, 160 - 4 * i
        rgb = (calibration_image(w, h, seed=i)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
        rgb[h // 4 : h // 2, w // 3 : 2 * w // 3] = (250, 240, 30)  # a sharp-edged block: depth discontinuities
        rel = f"sub/p{i:02d}.jpg" if i % 5 == 0 else f"p{i:02d}.png"
        (root / rel).parent.mkdir(exist_ok=True)
        Image.fromarray(rgb).save(root / rel, quality=90)
        names[rel.rsplit(".", 1)[0]] = root / rel
    (root / CORRUPT).write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4)  # a JPEG header, then noise
    return {"root": root, "valid": names, "corrupt": root / CORRUPT}


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="the batch tests need the ray extra: pip install 'code/[ray]'")
    pytest.importorskip("ray.data")
    assert not ray.is_initialized()
    watcher = init_local_ray(ray, 3, num_gpus=0, quiet=True)  # 2 replicas x 1 CPU + a read task, on any machine
    yield ray
    ray.shutdown()
    if watcher is not None:
        watcher.release()


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("tiny-vits-normal")


@pytest.fixture(scope="module")
def expected(ckpt, photos) -> dict:
    """{output name: npz arrays} from MoGeModel in this process, same checkpoint and options, one torch thread
    like each replica (the CPU kernels' summation order depends on the thread count)."""
    with one_thread_model(ckpt) as model:
        return {name: model(path, **CALL).npz_arrays() for name, path in photos["valid"].items()}


@contextlib.contextmanager
def one_thread_model(ckpt, resolution=CANVAS):
    """The test model in this process with one torch thread, like each replica (the CPU kernels' summation order
    depends on the thread count), so that its arrays are the replicas' bit for bit."""
    import torch

    from tt_moge import MoGeModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with MoGeModel.from_pretrained(
            ckpt, device="cpu", resolution=resolution, num_tokens=TOKENS, warmup=0, warmup_variants="none"
        ) as model:
            yield model
    finally:
        torch.set_num_threads(threads)


def assert_same_arrays(got: dict, want: dict, name: str) -> None:
    assert sorted(got) == sorted(want), name
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key], equal_nan=True), (
            f"{name}: {key}"
        )
    valid = want["mask"].mean()
    assert 0.05 < valid < 0.995, (
        f"{name}: valid fraction {valid} (a comparison of all-valid/all-invalid maps proves little)"
    )
    assert np.isfinite(want["points"][want["mask"].astype(bool)]).all()


def file_times(out: Path) -> dict:
    return {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------- files, CLI
@pytest.fixture(scope="module")
def files_run(local_ray, ckpt, photos, tmp_path_factory):
    out = tmp_path_factory.mktemp("batch_files")
    code, stdout, stderr = run_cli(
        [
            "batch",
            photos["root"],
            "-o",
            out,
            "--weights",
            ckpt,
            *MODEL_ARGS,
            "--replicas",
            REPLICAS,
            "--batch-size",
            3,
            "--npz",
            "--fit",
            CALL["fit"],
            "--fov-x",
            CALL["fov_x"],
        ]
    )
    return code, stdout, stderr, out


def test_every_image_is_done_and_bit_identical_to_the_api(files_run, photos, expected):
    code, stdout, stderr, out = files_run
    assert code == 1, f"exit code 1: one image failed\n{stdout}\n{stderr}"
    assert "20 done, 1 failed, 0 skipped (already done) of 21 images" in stdout
    assert "images/s with 2 replicas" in stdout
    for name, want in expected.items():
        record = json.loads((out / name / "result.json").read_text())
        assert record["source"] == str(photos["valid"][name].resolve())
        assert record["files"] == ["result.npz", "result.json"]
        with np.load(out / name / "result.npz") as npz:
            assert_same_arrays(dict(npz), want, name)
    dirs = {p.parent.relative_to(out).as_posix() for p in out.rglob("result.json")}
    assert dirs == set(expected), "one folder per valid image, in the layout of tt-moge predict"
    record = json.loads((out / "batch.json").read_text())
    assert (record["done"], record["failed"], record["skipped"], record["total"]) == (20, 1, 0, 21)


def test_corrupt_image_is_in_the_failures_file(files_run, photos):
    code, stdout, stderr, out = files_run
    lines = (out / FAILURES_FILE).read_text().splitlines()
    assert len(lines) == 1
    failure = json.loads(lines[0])
    assert failure["input"] == str(photos["corrupt"].resolve()) and failure["name"] == "zz_broken"
    assert "not a decodable image" in failure["error"] and CORRUPT in failure["error"]
    assert f"failed: image file '{photos['corrupt'].resolve()}'" in stderr, "reported while the job runs"
    assert not (out / "zz_broken").exists()


def test_rerun_recomputes_nothing(files_run, local_ray, ckpt, photos):
    code, stdout, stderr, out = files_run
    before = file_times(out)
    again = run_batch(
        BatchJob(
            [photos["root"]],
            out,
            model=model_args(ckpt),
            formats=["npz"],
            replicas=REPLICAS,
            batch_size=3,
            progress=False,
        )
    )
    assert (again.done, again.failed, again.skipped, again.total) == (0, 1, 20, 21)
    assert again.replicas == 1, "one image left: one replica, not two"
    after = file_times(out)
    changed = {k for k in before if before[k] != after.get(k)} - {FAILURES_FILE, "batch.json"}
    assert not changed, f"a rerun rewrote {sorted(changed)}"
    assert set(after) == set(before)
    assert len((out / FAILURES_FILE).read_text().splitlines()) == 1, "the corrupt image was tried again, and failed"


def test_quiet_still_names_each_failed_image(files_run, local_ray, ckpt, photos):
    """-q drops the progress and the summary, never an error: the corrupt image is named on stderr."""
    out = files_run[-1]
    code, stdout, stderr = run_cli(
        [
            "batch",
            photos["root"],
            "-o",
            out,
            "--weights",
            ckpt,
            *MODEL_ARGS,
            "--npz",
            "--fit",
            CALL["fit"],
            "--fov-x",
            CALL["fov_x"],
            "-q",
        ]
    )
    assert code == 1 and stdout == ""
    assert f"failed: image file '{photos['corrupt'].resolve()}'" in stderr, stderr


def test_photos_named_like_the_runs_own_files_cannot_break_the_folder(local_ray, ckpt, tmp_path):
    """Photos named batch.json.png, failures.jsonl.png, run.json.jpg and ...png: every run and rerun used to end
    with exit 3 (a folder batch.json/ or failures.jsonl/), or wrote into the parent of OUT. Now each gets a safe
    folder inside OUT, the run and its rerun exit 0, and batch.json says who was renamed."""
    photos = tmp_path / "photos"
    photos.mkdir()
    hostile = ["batch.json.png", "failures.jsonl.png", "run.json.jpg", "...png"]
    for i, name in enumerate(hostile):
        rgb = np.random.default_rng(i).integers(0, 255, (48, 64, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(photos / name, format="JPEG" if name.endswith(".jpg") else "PNG")
    out = tmp_path / "parent" / "out"
    args = ["batch", photos, "-o", out, "--weights", ckpt, *MODEL_ARGS, "--npz", "-q"]
    code, stdout, stderr = run_cli(args)
    assert code == 0, stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"], "nothing written beside OUT"
    assert (out / "batch.json").is_file() and (out / FAILURES_FILE).is_file()
    record = json.loads((out / "batch.json").read_text())
    assert (record["done"], record["failed"]) == (4, 0)
    assert sorted(r["asked"] for r in record["renamed"]) == sorted(["batch.json", "failures.jsonl", "run.json", ".."])
    for r in record["renamed"]:
        assert (out / r["output"] / "result.npz").is_file()
    code, stdout, stderr = run_cli(args)
    assert code == 0, f"the rerun: {stderr}"
    assert json.loads((out / "batch.json").read_text())["skipped"] == 4


def pid_recording(folder: Path) -> type:
    """A Replica that leaves a file named by its process id for each batch it predicts (defined in a function,
    so that Ray ships the class itself to the replica processes)."""
    from tt_moge.batch.replica import Replica

    class PidReplica(Replica):
        def __call__(self, batch: dict) -> dict:
            (folder / f"{os.getpid()}-{uuid.uuid4().hex}").write_text(str(len(batch["name"])))
            return super().__call__(batch)

    return PidReplica


def test_two_replicas_on_six_photos_both_predict(local_ray, ckpt, tmp_path, monkeypatch):
    """`batch --replicas 2` on 6 photos ran one actor: batches of 4 + 2, and the replica that was ready first
    took both. The photos are now split evenly (3 + 3) and each replica holds one batch at a time."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(6):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(
            photos / f"{i}.png"
        )
    seen = tmp_path / "seen"
    seen.mkdir()
    monkeypatch.setattr(batch_job, "Replica", pid_recording(seen))
    code, stdout, stderr = run_cli(
        ["batch", photos, "-o", tmp_path / "out", "--weights", ckpt, *MODEL_ARGS, "--npz", "--replicas", "2", "-q"]
    )
    assert code == 0, stderr
    calls = {path.name.split("-")[0]: int(path.read_text()) for path in seen.iterdir()}
    assert len(calls) == 2 and sorted(calls.values()) == [3, 3], calls


def test_ray_is_quiet_unless_verbose(tmp_path, monkeypatch):
    """Ray's INFO lines (35 of them for one job) and its workers' output reach the terminal only with -v."""
    from tt_moge.batch import session

    assert session._log_options(True) == {"logging_level": "WARNING", "log_to_driver": False}
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(photos / "a.png")
    asked = []

    class Stop(Exception):
        pass

    def fake_session(ray, address, num_cpus, object_store_mb, quiet):
        asked.append(quiet)
        raise Stop

    monkeypatch.setattr(batch_job, "ray_session", fake_session)
    monkeypatch.setattr(batch_job, "replica_resources", lambda *args: ("cpu", 0.0, 1.0))
    monkeypatch.setattr("tt_moge.weights.resolve_checkpoint", lambda weights, revision: (Path(tmp_path), None))
    for verbose in (False, True):
        with pytest.raises(Stop):
            run_batch(BatchJob([photos], tmp_path / "out", model={"verbose": verbose}))
    assert asked == [True, False]


AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"  # Ray 2.60's logger of that notice


def test_a_job_that_works_shows_no_ray_noise_unless_verbose(monkeypatch, capfd, caplog):
    """A job that worked printed Ray's token-authentication WARNING and a line of Ray's C++ core ("Actor ... has
    constructor arguments in the object store", written to file descriptor 2 past every Python setting) in the
    middle of its progress bar. ray_session (quiet) now leaves both out; the job's own lines, a bar's carriage
    returns included, pass. With -v (quiet=False) Ray's lines show. A stand-in Ray, in process: what it writes is
    what the real one does at ray.init."""
    import logging
    import types

    import tt_moge.ray_reaper as reaper
    from tt_moge.batch import session

    native = b"[2026-12-07 01:49:21,965 E 8740 8740] core_worker.cc:2465: Actor with class name: 'MapWorker'\n"
    stderr_before = sys.stderr

    def init(**kwargs):
        logging.getLogger(AUTH_LOGGER).warning("Token authentication is enabled for this Ray cluster")
        os.write(2, native)
        return types.SimpleNamespace(address_info={"session_dir": "/nowhere"})

    ray = types.SimpleNamespace(
        is_initialized=lambda: False,
        init=init,
        shutdown=lambda: os.write(2, b"[2026-12-07 01:49:22,001 I 8740 8741] raylet.cc:1: bye\n"),
        get_runtime_context=lambda: types.SimpleNamespace(get_node_id=lambda: "node"),
    )
    monkeypatch.setattr(reaper, "sweep_dead", lambda: [])
    monkeypatch.setattr(reaper.Watcher, "start", classmethod(lambda cls, node, session_dir: None))
    for quiet in (True, False):
        caplog.clear()
        with session.ray_session(ray, None, 3, 200, quiet):
            print("tt-moge batch:  50%|#####     | 1/2\r", end="", file=sys.stderr, flush=True)
            os.write(2, b"a line of the job itself\n")
        err = capfd.readouterr().err
        assert "1/2\r" in err and "a line of the job itself" in err, err
        assert [line in err for line in ("core_worker.cc:2465", "raylet.cc:1: bye")] == [not quiet] * 2, (quiet, err)
        notices = [r for r in caplog.records if "Token authentication" in r.getMessage()]
        assert len(notices) == (0 if quiet else 1), (quiet, notices)
    assert sys.stderr is stderr_before, "sys.stderr is itself again"
    os.write(2, native)
    assert "core_worker.cc" in capfd.readouterr().err, "fd 2 is itself again: no filter left behind"


def test_replicas_capped_by_the_work_say_why(checkpoint, tmp_path, monkeypatch):
    """`tt-moge batch media/ --replicas 2` (the README's example: 2 photos, batches of 4) ran 1 replica without a
    word. A request capped by the work says so: how many, why. (Ray and the model stood in for, in process.)"""
    from tests.stand_in import StandInModel, in_process_ray
    from tt_moge import MoGeModel

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(2):
        Image.fromarray(np.full((16, 24, 3), 60 * i, np.uint8)).save(photos / f"p{i}.png")
    monkeypatch.setattr(MoGeModel, "from_pretrained", lambda *args, **kwargs: StandInModel())
    with in_process_ray():
        code, stdout, stderr = run_cli(
            ["batch", photos, "-o", tmp_path / "out", "--weights", checkpoint("tiny-vits-normal"), "--replicas", 2]
        )
    assert code == 0, stderr
    assert "1 replica, not the 2 asked for: 2 images to do, up to 4 per replica call (--batch-size)" in stderr, stderr


# ------------------------------------------------------------------------------ Parquet, a replica killed
def crashing_once(trap: Path) -> type:
    """A Replica whose first batch, in whichever replica takes it, ends its process after the batch's outputs
    are written and before they are reported: the worst moment for exactly-once. The trap file "armed" is
    renamed to "fired" (atomic: exactly one replica wins). Defined here, in a function, so that Ray ships the
    class itself (with `trap`) to the replica processes: product code has no fault switch."""
    from tt_moge.batch.replica import Replica

    class CrashingReplica(Replica):
        def __call__(self, batch: dict) -> dict:
            reported = super().__call__(batch)
            try:
                os.rename(trap / "armed", trap / "fired")
            except OSError:
                return reported  # not armed, or another replica took it
            sys.stderr.flush()
            os._exit(17)

    return CrashingReplica


def test_replica_killed_mid_job_every_image_done_exactly_once(local_ray, ckpt, photos, expected, tmp_path, monkeypatch):
    import shutil

    import pyarrow.parquet as pq

    inputs = tmp_path / "photos"
    shutil.copytree(photos["root"], inputs)
    trap = tmp_path / "trap"
    trap.mkdir()
    (trap / "armed").write_text("")  # the first replica to finish a batch kills itself before reporting it
    monkeypatch.setattr(batch_job, "Replica", crashing_once(trap))
    out = tmp_path / "out"
    summary = run_batch(
        BatchJob(
            [inputs],
            out,
            model=model_args(ckpt),
            output_format="parquet",
            replicas=REPLICAS,
            batch_size=3,
            progress=False,
            **CALL,
        )
    )
    assert (trap / "fired").exists() and not (trap / "armed").exists(), "a replica died mid-job"
    assert (summary.done, summary.failed, summary.skipped) == (20, 1, 0)
    assert sorted(summary.done_names) == sorted(expected), "each image reported once"
    assert [Path(p).name for p, _ in summary.failures] == [CORRUPT]

    rows = [row for shard in sorted((out / SHARDS_DIR).glob("*.parquet")) for row in pq.read_table(shard).to_pylist()]
    names = [row["name"] for row in rows]
    assert sorted(names) == sorted(expected), "every image exactly once on disk: no duplicate, none missing"
    assert not list((out / SHARDS_DIR).glob(".*")), "no temporary shard left behind"
    for row in rows:
        assert_same_arrays(MoGeOutput.from_npz(row["npz"]).npz_arrays(), expected[row["name"]], row["name"])
        assert (
            json.loads(row["result"])["source"]
            == row["source"]
            == str((inputs / photos["valid"][row["name"]].relative_to(photos["root"])).resolve())
        )

    # resume from the shards: with the corrupt file gone, the same command has nothing left to do (no job at all)
    (inputs / CORRUPT).unlink()
    resumed = run_batch(
        BatchJob(
            [inputs],
            out,
            model={"pretrained_model_name_or_path": ckpt},
            output_format="parquet",
            replicas=REPLICAS,
            progress=False,
        )
    )
    assert (resumed.done, resumed.failed, resumed.skipped, resumed.seconds) == (0, 0, 20, 0.0)


# ----------------------------------------------------------------------------------- no Ray, bad usage
def test_without_ray_a_clear_error_and_exit_code_3(photos, tmp_path, monkeypatch):
    from tt_moge.batch import RayMissingError

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.setitem(sys.modules, "ray.data", None)
    with pytest.raises(RayMissingError, match=r'pip install -e "code/\[ray\]"'):
        run_batch(BatchJob([photos["root"]], tmp_path / "out", model={"pretrained_model_name_or_path": "unused"}))
    code, stdout, stderr = run_cli(["batch", photos["root"], "-o", tmp_path / "out2", "-q"])
    assert code == 3 and 'pip install -e "code/[ray]"' in stderr  # the README installs from a clone


def test_the_package_imports_without_ray():
    script = (
        "import sys; sys.modules['ray'] = None\n"
        "import tt_moge, tt_moge.cli, tt_moge.batch, tt_moge.cli.batch\n"
        "assert tt_moge.cli.main(['batch', '--help']) == 0\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=CODE_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--replicas" in done.stdout and "RAY_ADDRESS" in done.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "parquet", "--npz"], "choose the files of --format files"),
        (["--replicas", "0"], "expected a positive integer"),
        (["--gpus-per-replica", "-1"], "expected a number >= 0"),
        (["--cpus-per-replica", "0"], "argument --cpus-per-replica: expected a finite number > 0"),
        (["--object-store-mb", "1"], "argument --object-store-mb: expected an integer >= 80"),
        (["--format", "csv"], "invalid choice"),
        (["--fov-x", "60", "--intrinsics", "100,100,50,50"], "give one of them"),
        (["--calibration-frames", "8", "--window", "4"], "must be at least calibration_frames"),
        (["--panorama", "--fov-x", "60"], "--fov-x does not apply to --panorama"),
        (["--panorama", "--intrinsics", "100,100,50,50"], "--intrinsics does not apply to --panorama"),
        (["--panorama", "--fit", "stretch", "--no-force-projection"], "--fit and --no-force-projection do not apply"),
    ],
)
def test_bad_command_lines_exit_2(photos, tmp_path, args, message):
    code, stdout, stderr = run_cli(["batch", photos["root"], "-o", tmp_path / "out", *args])
    assert code == 2 and message in stderr


def test_missing_input_exits_2_before_anything_starts(tmp_path):
    code, stdout, stderr = run_cli(["batch", tmp_path / "nope", "-o", tmp_path / "out"])
    assert code == 2 and "no such file or folder" in stderr
    assert not (tmp_path / "out").exists()


def test_a_job_that_cannot_fit_stops_before_it_starts(local_ray, ckpt, photos, tmp_path):
    # The module's Ray has 3 logical CPUs and no GPU: a GPU replica, or 3 replicas x 1 CPU + a read task, would
    # wait forever.
    code, stdout, stderr = run_cli(
        ["batch", photos["root"], "-o", tmp_path / "gpu", "--weights", ckpt, "--device", "cuda", "-q"]
    )
    assert code == 3 and "the job needs 1 GPU (1 replica(s) x 1), it has 0" in stderr
    with pytest.raises(ValueError, match=r"the job needs 4 CPU \(3 replica\(s\) x 1 \+ 1 read task\), it has 3"):
        run_batch(
            BatchJob(
                [photos["root"]],
                tmp_path / "cpu",
                model=model_args(ckpt),
                replicas=3,
                cpus_per_replica=1,
                progress=False,
            )
        )
    with pytest.raises(ValueError, match="needs GPUs for the replicas"):
        run_batch(
            BatchJob(
                [photos["root"]],
                tmp_path / "cpu",
                model={"pretrained_model_name_or_path": ckpt, "device": "cuda"},
                gpus_per_replica=0,
            )
        )
    assert not list((tmp_path / "cpu").rglob("result.json"))


def test_device_none_on_a_gpu_machine_asks_ray_for_a_gpu(monkeypatch):
    """No device and no --gpus-per-replica where torch sees a GPU (a local Ray): the replicas run on CUDA and
    each asks Ray for one GPU, instead of the default command being refused."""
    import torch

    from tt_moge.batch import replica_resources

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert replica_resources(None, None, None, replicas=2, local=True) == ("cuda", 1.0, 1.0)
    assert replica_resources(None, 0.5, None, replicas=2, local=False)[:2] == ("cuda", 0.5)  # a cluster: asked for
    assert replica_resources("cpu", None, None, replicas=2, local=True)[:2] == ("cpu", 0.0)
    with pytest.raises(ValueError, match="needs GPUs for the replicas"):
        replica_resources("cuda", 0.0, None, replicas=1, local=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert replica_resources(None, None, None, replicas=1, local=True)[:2] == ("cpu", 0.0)


def test_an_address_where_nothing_answers_is_a_clear_error_at_once():
    """Ray would retry a dead address for minutes; the job says at once that nothing answers there."""
    import socket

    from tt_moge.batch import check_ray_address

    with socket.socket() as sock:  # a port that was just free: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        t = time.monotonic()
        with pytest.raises(ValueError, match=rf"address='{re.escape(address)}': nothing answers at 127.0.0.1:{port}"):
            check_ray_address(address)
        assert time.monotonic() - t < 10
    with socket.socket() as server:  # a listening port passes
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
    check_ray_address("auto")  # no port: Ray's own lookup


@pytest.mark.parametrize("options, message", [(dict(fit="crop"), "fit must be one of"), (dict(fov_x=500.0), "fov_x")])
def test_bad_call_options_are_refused_before_anything_starts(photos, tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        run_batch(
            BatchJob([photos["root"]], tmp_path / "out", model={"pretrained_model_name_or_path": "unused"}, **options)
        )
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ the driver killed
def wait_for(condition, timeout_s: float, what):
    """condition()'s first true value, polled until timeout_s; else an AssertionError saying `what` (a str, or
    a callable giving it at that moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what() if callable(what) else what}: not within {timeout_s} s")
        time.sleep(0.1)


def descendants(root: int) -> dict:
    """{pid: (start time, name)} of the processes below `root` now, from /proc (independent of ray_reaper)."""
    table = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if fields[0] not in ("Z", "X"):
            table[int(stat_path.parent.name)] = (int(fields[1]), fields[19], name)
    found, stack = {}, [root]
    while stack:
        parent = stack.pop()
        for pid, (ppid, started, name) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = (started, name)
                stack.append(pid)
    return found


def still_running(processes: dict) -> list:
    alive = []
    for pid, (started, name) in processes.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[19] == started and fields[0] not in ("Z", "X"):
            alive.append(f"{pid} {name}")
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_driver_killed_mid_run_leaves_no_ray_process_and_the_rerun_finishes(local_ray, ckpt, photos, tmp_path):
    """`tt-moge batch` (its own local Ray) killed with SIGKILL once its first image is written: within 30 s no
    process that ran below it (its Ray) is alive, and a rerun does every other image, each once."""
    out = tmp_path / "out"
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tt_moge",
                "batch",
                str(photos["root"]),
                "-o",
                str(out),
                "--weights",
                str(ckpt),
                *MODEL_ARGS,
                "--batch-size",
                "1",
                "--npz",
                "-q",
            ],
            cwd=CODE_DIR,
            env={**os.environ, "PYTHONPATH": str(CODE_DIR)},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        wait_for(lambda: list(out.rglob("result.json")) or driver.poll() is not None, 300, "a first image")
        assert driver.poll() is None, (
            f"the job ended before it could be killed:\n{(tmp_path / 'driver.err').read_text()}"
        )
        below = descendants(driver.pid)
        names = sorted(name for _, name in below.values())
        assert "raylet" in names and "gcs_server" in names and any(n.startswith("ray::") for n in names), names
        driver.kill()
    finally:
        driver.kill()
        driver.wait(30)
    t = time.monotonic()
    wait_for(
        lambda: not still_running(below),
        30,
        lambda: f"Ray processes of the killed run still alive: {still_running(below)}",
    )
    print(
        f"\n[kill -9] none of the {len(below)} processes below the killed driver left {time.monotonic() - t:.1f} s "
        f"after the kill: {names}"
    )

    done_before = {p.parent.relative_to(out).as_posix() for p in out.rglob("result.json")}
    assert 0 < len(done_before) < len(photos["valid"])
    rerun = run_batch(
        BatchJob(
            [photos["root"]],
            out,
            model=model_args(ckpt),
            formats=["npz"],
            replicas=REPLICAS,
            batch_size=3,
            progress=False,
        )
    )
    assert (rerun.skipped, rerun.failed, rerun.total) == (len(done_before), 1, 21)
    assert sorted(rerun.done_names) == sorted(set(photos["valid"]) - done_before), (
        "each image done once over the two runs"
    )
    folders = {p.parent.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.parent != out}
    assert folders == set(photos["valid"]), "a folder per image, each complete (no partial folder of the killed run)"
    assert all((out / name / "result.json").is_file() for name in folders)


def test_sigterm_stops_a_real_job_with_exit_143_and_a_true_batch_json(ckpt, photos, tmp_path):
    """`tt-moge batch` told to stop by SIGTERM died with Ray's exit code (15, or 134 by SIGABRT) and its stack
    dumps, and wrote no batch.json: `ray.init` replaced the command's handler (the earlier test mocked the job,
    and Ray with it, so it could not see that). On a real local Ray: exit 143 within seconds, one line saying
    what happened, no stack dump, batch.json counting what is on disk, no folder without result.json."""
    out = tmp_path / "out"
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen(
            [sys.executable, "-m", "tt_moge", "batch", str(photos["root"]), "-o", str(out), "--weights", str(ckpt)]
            + [*MODEL_ARGS, "--batch-size", "1", "--npz"],
            cwd=CODE_DIR,
            env={**os.environ, "PYTHONPATH": str(CODE_DIR)},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        wait_for(lambda: list(out.rglob("result.json")) or driver.poll() is not None, 300, "a first image")
        assert driver.poll() is None, f"the job ended before the signal:\n{(tmp_path / 'driver.err').read_text()}"
        driver.send_signal(signal.SIGTERM)
        code = driver.wait(60)
    finally:
        driver.kill()
        driver.wait(30)
    stderr = (tmp_path / "driver.err").read_text()
    assert code == 143, (code, stderr)
    assert "interrupted by SIGTERM" in stderr and "rerun" in stderr, stderr
    assert "SIGTERM received" not in stderr and "Traceback" not in stderr, stderr
    record = json.loads((out / "batch.json").read_text())
    complete = {p.parent.relative_to(out).as_posix() for p in out.rglob("result.json")}
    assert record["interrupted"] == "SIGTERM" and record["done"] == len(complete) > 0, record
    assert record["done"] + record["failed"] + record["not_done"] == record["total"] == 21, record
    assert record["not_done"] > 0, "the job was stopped before its end"
    partial = [d for d in out.rglob("*") if d.is_dir() and not (d / "result.json").exists()]
    partial = [d for d in partial if not any(c.is_dir() for c in d.iterdir())]  # not a parent folder
    assert not partial, f"folders without result.json: {partial}"
    assert not (out / LOCK_FILE).exists()


def test_a_later_run_ends_what_a_dead_driver_left(tmp_path):
    """The sweep at the next local Ray start: the recorded processes of a node whose driver is gone are ended,
    and the processes naming its session directory; those of a driver that still runs are not (in process,
    without Ray: stand-in processes)."""
    from tt_moge.ray_reaper import _start_time, sweep_dead

    session = f"/no/ray/session_{uuid.uuid4().hex}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    recorded, named, kept = (
        subprocess.Popen(sleeper),
        subprocess.Popen([*sleeper, session]),
        subprocess.Popen([*sleeper, session + "_live"]),
    )
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        time.sleep(0.5)  # the stand-ins have exec'd
        records = {
            gone.pid: {
                "driver_pid": gone.pid,
                "driver_start": "1",
                "session_dir": session,
                "processes": [[recorded.pid, _start_time(recorded.pid)], [gone.pid, "1"]],
            },
            os.getpid(): {
                "driver_pid": os.getpid(),
                "driver_start": _start_time(os.getpid()),
                "session_dir": session + "_live",
                "processes": [[kept.pid, _start_time(kept.pid)]],
            },
        }
        for pid, record in records.items():
            (tmp_path / f"{pid}.json").write_text(json.dumps(record))
        assert sweep_dead(tmp_path) == [(gone.pid, sorted([recorded.pid, named.pid]))]
        assert recorded.wait(10) is not None and named.wait(10) is not None and kept.poll() is None
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"{os.getpid()}.json"]
    finally:
        for process in (recorded, named, kept):
            process.kill()
            process.wait()


# ---------------------------------------------------------------------------------------------- clips
def test_video_files_are_one_job_each_and_resume_clip_by_clip(local_ray, ckpt, tmp_path):
    """`tt-moge batch a.mp4 b.mp4`: each clip is one replica call, written as tt-moge predict writes it (its
    frames' depth the API's exactly); a rerun does nothing; after one clip's result.json is removed, a rerun
    does that clip only. Photos and videos in one job: refused before anything starts."""
    import cv2
    from OpenEXR import File as ExrFile

    from tt_moge.scene import camera_path, render_path

    clips = {}
    for name, start in (("a", 0), ("b", 6)):
        path = tmp_path / f"{name}.mp4"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 6.0, (96, 72))
        for r in render_path(camera_path(12)[start : start + 6 : 2], 96, 72):
            writer.write(np.ascontiguousarray(r.image[..., ::-1]))
        writer.release()
        clips[name] = path
    out = tmp_path / "out"
    args = ["batch", clips["a"], clips["b"], "-o", out, "--weights", ckpt, *MODEL_ARGS, "--calibration-frames", 2]
    code, stdout, stderr = run_cli(args)
    assert code == 0, stderr
    assert "2 done, 0 failed, 0 skipped (already done) of 2 clips" in stdout, stdout
    with one_thread_model(ckpt) as model:
        expected = {name: model.predict_video(path, calibration_frames=2) for name, path in clips.items()}
    for name, clip in expected.items():
        record = json.loads((out / name / "result.json").read_text())
        assert record["frames"] == len(clip) == 3 and record["registered"] == int(clip.registered.sum())
        for i, frame in enumerate(clip.frames):
            with ExrFile(str(out / name / "frames" / f"{i:06d}" / "depth.exr")) as exr:
                assert np.array_equal(exr.channels()["Y"].pixels, frame.depth), f"{name} frame {i}"
    before = file_times(out)
    code, stdout, _ = run_cli(args)
    assert code == 0 and "nothing to do: all 2 clips already done" in stdout, stdout
    (out / "b" / "result.json").unlink()
    code, stdout, _ = run_cli(args)
    assert code == 0 and "1 done, 0 failed, 1 skipped (already done) of 2 clips" in stdout, stdout
    after = file_times(out)
    assert all(after[k] == t for k, t in before.items() if k.startswith("a/")), "clip a was not redone"
    assert (out / "b" / "result.json").is_file()

    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(photo)
    code, _, stderr = run_cli(["batch", clips["a"], photo, "-o", tmp_path / "mixed", "--weights", ckpt, *MODEL_ARGS])
    assert code == 3 and "photos and video files go in separate batch jobs" in stderr


def test_exif_orientation_is_applied_as_predict_does(local_ray, ckpt, tmp_path):
    """A photo stored 64x48 whose EXIF says "rotate 90 CW": batch, like predict, gives maps of the displayed 48x64
    (batch used to read stored order only); --no-exif keeps the stored 64x48. batch.json records the choice."""
    photos = tmp_path / "photos"
    photos.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6
    rgb = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(photos / "turned.jpg", exif=exif, quality=95)
    for flag, shape in (([], (64, 48)), (["--no-exif"], (48, 64))):
        out = tmp_path / f"out{len(flag)}"
        code, stdout, stderr = run_cli(
            ["batch", photos, "-o", out, "--weights", ckpt, *MODEL_ARGS, "--npz", "-q", *flag]
        )
        assert code == 0, stderr
        with np.load(out / "turned" / "result.npz") as npz:
            assert npz["depth"].shape == shape, flag
        assert json.loads((out / "batch.json").read_text())["options"]["exif"] is (not flag)


# ------------------------------------------------------------------------------------------- panoramas
def test_panoramas_are_written_as_predict_writes_them_and_resume(local_ray, checkpoint, tmp_path):
    """`tt-moge batch --panorama`: two rendered room panoramas and a 3:1 image. Each panorama's npz equals
    model.predict_panorama's arrays exactly (the canvas defaults to the views' 512x512, as predict --panorama;
    --no-apply-mask reaches the replicas), its result.json is predict's; the 3:1 image is in the failures file,
    and a rerun retries only it. Through the API, --format parquet gives one row per panorama with the same
    arrays; call options other than apply_mask and video files are refused with a ValueError naming them."""
    import cv2

    from tt_moge.panorama import PANORAMA_CANVAS
    from tt_moge.testing.room import render_panorama

    ckpt = checkpoint("tiny-vits-normal", invalid_share=0.6)  # some views' pixels invalid: the mask says something
    inputs = tmp_path / "in"
    inputs.mkdir()
    room = render_panorama(256, 128).image
    panoramas = {"room": room, "turned": np.ascontiguousarray(np.roll(room, 64, axis=1)[:, ::-1])}
    for name, image in panoramas.items():
        cv2.imwrite(str(inputs / f"{name}.png"), image[..., ::-1])
    cv2.imwrite(str(inputs / "wide.png"), np.full((60, 180, 3), 90, np.uint8))
    out = tmp_path / "out"
    args = ["batch", inputs, "-o", out, "--panorama", "--weights", ckpt, "--device", "cpu", "--num-tokens", TOKENS]
    args += ["--npz", "--replicas", 2, "--no-apply-mask"]
    code, stdout, stderr = run_cli(args)
    assert code == 1, stderr
    assert "2 done, 1 failed, 0 skipped (already done) of 3 panoramas" in stdout, stdout
    failures = [json.loads(line) for line in (out / FAILURES_FILE).read_text().splitlines()]
    assert [f["name"] for f in failures] == ["wide"] and "twice as wide as high" in failures[0]["error"]
    record = json.loads((out / "batch.json").read_text())
    assert record["options"]["panorama"] is True and record["model"]["resolution"] == list(PANORAMA_CANVAS)

    with one_thread_model(ckpt, PANORAMA_CANVAS) as model:
        expected = {name: model.predict_panorama(image, apply_mask=False) for name, image in panoramas.items()}
    for name, pano in expected.items():
        result = json.loads((out / name / "result.json").read_text())
        assert result["kind"] == "panorama" and set(result["files"]) == {"result.npz", "result.json"}, result
        with np.load(out / name / "result.npz") as npz:
            for key, want in pano.npz_arrays().items():
                assert np.array_equal(npz[key], want, equal_nan=True), f"{name}: {key}"
        valid = pano.mask.mean()
        assert 0.05 < valid < 0.995, f"{name}: valid share {valid} proves little"
        assert np.isfinite(pano.distance).all()  # apply_mask=False: the fitted values on invalid pixels too
    assert not np.array_equal(expected["room"].distance, expected["turned"].distance)

    before = file_times(out)
    code, stdout, _ = run_cli(args)
    assert code == 1 and "0 done, 1 failed, 2 skipped (already done) of 3 panoramas" in stdout, stdout
    assert all(file_times(out)[k] == t for k, t in before.items() if k.startswith(("room/", "turned/")))

    import pyarrow.parquet as pq

    from tt_moge.panorama import PanoramaOutput

    weights = {"pretrained_model_name_or_path": ckpt, "device": "cpu", "num_tokens": TOKENS}
    job = dict(inputs=[inputs], out=tmp_path / "api", model=weights, panorama=True, cpus_per_replica=1.0)
    summary = run_batch(BatchJob(**job, output_format="parquet", apply_mask=False, progress=False, quiet=True))
    assert (summary.done, summary.failed, summary.unit) == (2, 1, "panoramas")
    rows = pq.read_table(tmp_path / "api" / SHARDS_DIR).to_pylist()
    assert sorted(row["name"] for row in rows) == ["room", "turned"]
    for row in rows:  # each row: the panorama's npz and summary, the API's arrays bit for bit
        got, want = PanoramaOutput.from_npz(row["npz"]).npz_arrays(), expected[row["name"]].npz_arrays()
        assert all(np.array_equal(got[k], want[k], equal_nan=True) for k in want), row["name"]
        assert json.loads(row["result"])["kind"] == "panorama"
    with pytest.raises(ValueError, match="fit and fov_x: not for panoramas"):
        run_batch(BatchJob(**job, fov_x=60.0, fit="stretch"))
    clip = tmp_path / "clips" / "a.mp4"
    clip.parent.mkdir()
    clip.write_bytes(b"")
    with pytest.raises(ValueError, match="not video files"):
        run_batch(BatchJob(**{**job, "inputs": [clip]}))
