"""The first run without weights: the quickstart, `tt-moge predict` and `tt-moge serve` with an unreachable Hub
answer fast, without a traceback, in a few lines that name the three ways out; Python callers get the same text
as a CheckpointError.

"Unreachable" is a closed port on this machine given as HF_ENDPOINT (refused at once, like a machine without
network), with an empty Hugging Face cache and HF_HUB_OFFLINE unset, so the hub client's real code path runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tt_moge.weights import DEFAULT_REPO, DEFAULT_REVISION, RANDOM_WEIGHTS_ONE_LINER

CODE = Path(__file__).resolve().parents[1]
QUICKSTART = CODE / "examples" / "quickstart.py"
DEMO = CODE.parent / "media" / "source.png"
DEADLINE_S = 10.0  # the bound for the whole process, start-up included
MAX_LINES = 8


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


def _offline_env(tmp_path: Path, how: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MOGE_WEIGHTS_DIR", "HF_HUB_OFFLINE", "HF_ENDPOINT")}
    env.update(PYTHONPATH=str(CODE), HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(tmp_path / "hf-home" / "hub"))
    if how == "unreachable":
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    else:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _run(command: list, tmp_path: Path, how: str) -> tuple:
    t = time.perf_counter()
    run = subprocess.run(
        command, cwd=tmp_path, env=_offline_env(tmp_path, how), capture_output=True, text=True, timeout=120
    )
    return run, time.perf_counter() - t


def _check_the_ways_out(text: str) -> None:
    assert f"hf download {DEFAULT_REPO} model.pt --revision {DEFAULT_REVISION}" in text, text  # 1. the pinned download
    assert "MOGE_WEIGHTS_DIR=" in text and "--weights" in text, text  # 2. weights you have
    assert RANDOM_WEIGHTS_ONE_LINER in text, text  # 3. random weights


@pytest.mark.parametrize("how", ["unreachable", "HF_HUB_OFFLINE"])
@pytest.mark.parametrize("surface", ["quickstart", "predict"])
def test_no_weights_and_no_hub_is_a_short_fast_answer(surface, how, tmp_path):
    command = (
        [sys.executable, str(QUICKSTART)]
        if surface == "quickstart"
        else [sys.executable, "-m", "tt_moge", "predict", str(DEMO), "-o", str(tmp_path / "out")]
    )
    run, seconds = _run(command, tmp_path, how)
    assert run.returncode != 0
    assert seconds < DEADLINE_S, f"{surface} took {seconds:.1f} s to fail"
    assert "Traceback" not in run.stderr and "Retrying" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) <= MAX_LINES, run.stderr
    _check_the_ways_out(run.stderr)
    assert ("cannot be reached" if how == "unreachable" else "HF_HUB_OFFLINE is set") in run.stderr


def test_serve_without_weights_exits_fast_with_the_ways_out(tmp_path):
    run, seconds = _run(
        [sys.executable, "-m", "tt_moge", "serve", "--port", "0", "--no-access-log"], tmp_path, "unreachable"
    )
    assert run.returncode == 1 and seconds < DEADLINE_S, (seconds, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    _check_the_ways_out(run.stderr)


def test_the_readmes_server_snippet_ends_when_the_server_cannot_start(tmp_path):
    """The README's `until curl -sf .../ready ...; do sleep 2; done` waited forever when `tt-moge serve` had
    exited at start (no weights: exit 1). Its server lines, as written (only the port is a free one, so that no
    other server on this machine answers), run by bash without weights: they end within the deadline, after the
    server's message with the ways out."""
    readme = (CODE.parent / "README.md").read_text()
    block = next(b for b in readme.split("```bash")[1:] if "tt-moge serve" in b).split("```")[0].splitlines()
    first = next(i for i, line in enumerate(block) if line.startswith("tt-moge serve"))
    last = next(i for i, line in enumerate(block) if line.startswith("kill %1"))
    snippet = "\n".join(block[first : last + 1]).replace("8000", str(_closed_port()))
    assert "until curl" in snippet and "kill %1" in snippet, snippet
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "tt-moge").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tt_moge "$@"\n')
    (shims / "tt-moge").chmod(0o755)
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "source.png").symlink_to(DEMO)
    env = _offline_env(tmp_path, "unreachable")
    env["PATH"] = f"{shims}{os.pathsep}{env['PATH']}"
    t = time.perf_counter()
    try:
        run = subprocess.run(["bash", "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the README's server lines did not end within 60 s:\n{snippet}\n{exc.stderr}") from None
    seconds = time.perf_counter() - t
    assert seconds < 3 * DEADLINE_S, seconds
    _check_the_ways_out(run.stderr)
    assert not (tmp_path / "out.npz").exists(), "curl --fail saved no error answer"


def test_a_missing_extra_is_named_as_the_readme_installs_it(tmp_path, monkeypatch, capsys):
    """`tt-moge export onnx` without the export extra said `pip install 'tt-moge[export]'`, a form the README never
    uses (it installs from a clone: `pip install -e "code/[export]"`). The message now gives the README's form, and
    no message of the package names the wheel's extras."""
    from tt_moge.cli import main

    readme = (CODE.parent / "README.md").read_text()
    assert 'pip install -e "code/[export]"' in readme
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx: ImportError, as without the extra
    code = main(["export", "onnx", "-o", str(tmp_path / "m.onnx"), "--no-check", "--weights", str(_tiny(tmp_path))])
    err = capsys.readouterr().err
    assert code == 3 and 'pip install -e "code/[export]"' in err and "tt-moge[" not in err, err
    sources = [p for p in (CODE / "tt_moge").rglob("*.py") if "tt-moge[" in p.read_text()]
    assert not sources, f"install hints in the wheel's form: {sources}"


def _tiny(folder: Path) -> Path:
    from tt_moge.testing import make_checkpoint

    return make_checkpoint(folder / "tiny", "tiny-vits-normal")


def test_python_callers_get_a_checkpoint_error_with_the_same_text(tmp_path):
    script = (
        "from tt_moge import MoGeModel\n"
        "from tt_moge.weights import CheckpointError\n"
        "try:\n"
        "    MoGeModel.from_pretrained(device='cpu')\n"
        "except CheckpointError as exc:\n"
        "    print(exc)\n"
    )
    run, seconds = _run([sys.executable, "-c", script], tmp_path, "unreachable")
    assert run.returncode == 0 and seconds < DEADLINE_S, (seconds, run.stderr)
    _check_the_ways_out(run.stdout)
    cli, _ = _run([sys.executable, "-m", "tt_moge", "predict", str(DEMO), "--device", "cpu"], tmp_path, "unreachable")
    reason = run.stdout.strip().split("(ConnectError")[0]
    assert reason in cli.stderr  # the CLI prints the exception's own text, after its prefix


def test_a_cached_revision_loads_with_the_hub_unreachable(checkpoint, tmp_path):
    """The cache still serves a pinned revision (no request at all) and a branch (after the one failed request)."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-home" / "hub" / "models--someone--moge-2-test"
    (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "snapshots" / rev / "model.pt").write_bytes(checkpoint("tiny-vits").read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    script = (
        "from tt_moge.weights import resolve_checkpoint\n"
        f"print(resolve_checkpoint('someone/moge-2-test', revision={rev!r})[1])\n"
        "print(resolve_checkpoint('someone/moge-2-test', revision=None)[1])\n"
    )
    run, seconds = _run([sys.executable, "-c", script], tmp_path, "unreachable")
    assert run.returncode == 0 and seconds < DEADLINE_S, (seconds, run.stderr)
    assert run.stdout.split() == [f"someone/moge-2-test@{rev}", "someone/moge-2-test@main"]


# ------------------------------------------------------------------------------ outputs sized for folders
CANVAS_ARGS = ["--device", "cpu", "--resolution", "448x252", "--num-tokens", "1200"]  # the outputs are photo-sized
MB = 1e6
DEFAULT_BUDGET_MB = 60  # the bound for the default files of one 1920x1080 photo


def _cli(args: list) -> tuple:
    import contextlib
    import io

    from tt_moge.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def photo_1080p(tmp_path_factory) -> Path:
    """A 1920x1080 photo-like PNG (gradients, a horizon, mild noise): its texture weighs what a photo's does."""
    from PIL import Image

    from tt_moge.synthetic import synthetic_photo

    path = tmp_path_factory.mktemp("photo") / "photo.png"
    Image.fromarray(synthetic_photo((1920, 1080), seed=1)).save(path)
    return path


@pytest.mark.parametrize("invalid_share", [0.25, 0.0])  # a typical valid share, and the worst case: all valid
def test_default_files_of_one_1080p_photo_fit_the_budget(invalid_share, checkpoint, photo_1080p, tmp_path):
    weights = checkpoint("tiny-vits-normal", **({} if invalid_share == 0.25 else {"invalid_share": invalid_share}))
    code, stdout, stderr = _cli(["predict", photo_1080p, "-o", tmp_path, "--weights", weights, *CANVAS_ARGS])
    assert code == 0, stderr
    folder = tmp_path / "photo"
    record = json.loads((folder / "result.json").read_text())
    assert abs(record["valid_fraction"] - (1 - invalid_share)) < 0.05
    total = sum(p.stat().st_size for p in folder.iterdir())
    assert total <= DEFAULT_BUDGET_MB * MB, f"{total / MB:.1f} MB"
    assert sorted(record["files"]) == ["depth.exr", "depth.png", "mask.png", "mesh.glb", "normal.png", "result.json"]
    assert f"wrote --maps --glb (mesh every 2 px): {total / MB:.1f} MB, {total / MB:.1f} MB per image" in stdout, stdout
    assert json.loads((tmp_path / "run.json").read_text())["bytes_written"] == total


def test_the_sizes_in_help_are_measured_ones(checkpoint, photo_1080p, tmp_path):
    """Each format's size in `tt-moge predict --help` is within a third of what it writes for a 1080p photo
    with 3/4 of its pixels valid."""
    from tt_moge import MoGeModel, load_image
    from tt_moge.cli.common import FORMAT_MB, FULL_MESH_MB
    from tt_moge.export import FORMATS, write_outputs

    with MoGeModel.from_pretrained(
        checkpoint("tiny-vits-normal"),
        device="cpu",
        resolution=(448, 252),
        num_tokens=1200,
        warmup=0,
        warmup_variants="none",
    ) as model:
        output = model(str(photo_1080p))
    rgb = load_image(str(photo_1080p))
    measured = {}
    for name, step in [*((f, 2) for f in FORMATS), ("glb", 1)]:
        folder = tmp_path / f"{name}-{step}"
        write_outputs(output, rgb, folder, (name,), mesh_step=step)
        measured[name if step == 2 else "glb-full"] = (
            sum(p.stat().st_size for p in folder.iterdir() if p.name != "result.json") / MB
        )
    stated = {**FORMAT_MB, "glb-full": FULL_MESH_MB}
    for name, mb in stated.items():
        assert mb * 0.75 <= measured[name] <= mb * 1.33, (name, measured)


# ------------------------------------------------------------------------------------ the server, offline
DOCS = CODE.parent / "docs"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from .server_harness import shared_server

    return shared_server(tmp_path_factory.mktemp("server-weights"))


def test_docs_page_and_its_assets_come_from_this_server(server):
    import re

    import httpx

    page = httpx.get(server.url + "/docs", timeout=30)
    assert page.status_code == 200 and "swagger" in page.text.lower()
    assert "://" not in page.text and "//cdn" not in page.text, "the page names another host"
    assets = re.findall(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", page.text)
    assert len(assets) >= 3, page.text  # the style sheet, the icon, the script
    for url in assets:
        assert url.startswith("/"), url
        response = httpx.get(server.url + url, timeout=30)
        assert response.status_code == 200 and len(response.content) > 100, url
    assert httpx.get(server.url + "/openapi.json", timeout=30).json()["info"]["title"] == "tt_moge"
    assert httpx.get(server.url + "/redoc", timeout=30).status_code == 404  # it would load from a CDN


def test_the_documented_python_client_runs_with_the_server_extra(server, tmp_path):
    from .server_harness import API_KEY, encode_image, photo

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((CODE / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("httpx") for dep in extras["server"]), "the example imports httpx"
    text = (DOCS / "server.md").read_text()
    (example,) = [block for block in text.split("```python\n")[1:] if "import httpx" in block.split("```")[0]]
    example = example.split("```")[0]
    content_type = 'headers={"Content-Type": "image/jpeg"}'
    assert content_type in example and "http://127.0.0.1:8000" in example and '"photo.jpg"' in example
    example = example.replace("http://127.0.0.1:8000", server.url).replace(
        content_type, f'headers={{"Content-Type": "image/jpeg", "Authorization": "Bearer {API_KEY}"}}'
    )
    (tmp_path / "photo.jpg").write_bytes(encode_image(photo(320, 240), "JPEG", quality=90))
    run = subprocess.run(
        [sys.executable, "-c", example],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(CODE)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("MoGeOutput(320x240") and "device;dur=" in run.stdout, run.stdout


# --------------------------------------------------------------------------------------- the small items
def test_serve_names_the_weights_it_loads(tmp_path):
    env = {**_offline_env(tmp_path, "HF_HUB_OFFLINE"), "MOGE_WEIGHTS_DIR": str(tmp_path / "absent")}
    run = subprocess.run(
        [sys.executable, "-m", "tt_moge", "serve", "--port", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"(loading $MOGE_WEIGHTS_DIR={tmp_path / 'absent'};" in run.stderr, run.stderr  # not the repo id it replaces
    assert f"MOGE_WEIGHTS_DIR={tmp_path / 'absent'} does not exist" in run.stderr


def test_ready_polls_while_loading_are_not_logged(tmp_path, monkeypatch):
    """Each poll of /ready while the model loaded logged a `503 Service Unavailable` access line (the README's
    loop: one every 2 s for a minute). `tt-moge serve` now leaves out the 503s of /ready and /health while it
    loads; other lines stay, and so do a probe's 503s once loading is over (here: the server's status says)."""
    import logging

    import tt_moge.cli.serve as serve_cli
    from tt_moge.cli import main

    seen: list = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    class Server:  # what run() starts: no uvicorn; the app never starts, so the model stays "loading"
        def __init__(self, config):
            self.config = config

        def run(self, sockets):
            for sock in sockets:
                sock.close()
            access = logging.getLogger("uvicorn.access")
            access.setLevel(logging.INFO)
            access.addHandler(Collect())
            for path, status in (("/ready", 503), ("/health", 503), ("/predict", 503), ("/ready?x=1", 503)):
                access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", path, "1.1", status)
            self.config.app.serving.draining = True  # stopping: a probe's 503 says something again
            access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/ready", "1.1", 503)

    monkeypatch.setattr(serve_cli, "_make_server", lambda uvicorn, config, on_stop: Server(config))
    access = logging.getLogger("uvicorn.access")
    monkeypatch.setattr(access, "filters", [])
    monkeypatch.setattr(access, "handlers", [])
    main(["serve", "--weights", str(tmp_path / "nowhere"), "--port", "0", "--no-ui"])
    assert seen == [
        '127.0.0.1:5 - "GET /predict HTTP/1.1" 503',
        '127.0.0.1:5 - "GET /ready HTTP/1.1" 503',
    ], seen


def test_the_readmes_batch_example_takes_only_photos(monkeypatch):
    """`tt-moge batch media/` (the README's example) also ran media/web-ui.png, the screenshot of the web page, as
    a photo. The screenshot lives in docs/ now: the example's inputs are the demo photo alone."""
    import shlex

    from tt_moge.cli.entry import build_parser
    from tt_moge.inputs import collect_images

    readme = (CODE.parent / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("tt-moge batch "))
    inputs = build_parser(["batch"]).parse_args(shlex.split(line.split("#")[0])[1:]).inputs
    monkeypatch.chdir(CODE.parent)  # the README's commands run at the top of the clone
    found = [image.path.as_posix() for image in collect_images(inputs)]
    assert found == ["media/source.png"], found


def test_bench_help_shows_its_own_command():
    code, stdout, _ = _cli(["bench", "--help"])
    assert code == 0 and stdout.startswith("usage: tt-moge bench ")
