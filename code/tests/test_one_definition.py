"""One definition per option and per output field: a load option, a call option, an output field, a server setting
and a batch job setting, each added in one place (its dataclass field), reach every surface.

The Python signatures that take options (`from_pretrained`, `model(...)`, `predict`, ..., `predict_video`,
`CallOptions.make`) and the server's query parameters are written out in their defs, so that a reader and a static
tool see them: `test_written_signatures_match_the_definitions` checks each against the fields (the names, kinds,
defaults and annotations `fields.signature` gives), so an option added to its dataclass but not to one of them fails
there. That is the one other place a new option goes.

The big test copies the package, adds the five fields to the copy's sources (`LoadOptions` in options.py,
`CallOptions` in host/call_options.py, `MoGeOutput` in output.py, `ServerSettings` in server/settings.py, `BatchJob`
in batch/job.py) and the new load and call options' parameters to the written signatures, and checks in a fresh
process that the copy's command line, Python signatures, BatchJob, warm-up keys, HTTP query parameters and OpenAPI
schema, npz, summary and web page all carry them; then that what the commands are given reaches what they run:
`tt-moge serve` (its uvicorn stood in for by a TestClient) hands the load option to the model it loads and the
setting to the server, and `tt-moge batch` (Ray and the replicas' model stood in for, in this process:
tests/stand_in.py) hands the load option to the replicas' model, the call option to every call of it and the job
setting to its BatchJob. A surface that keeps its own list of names, or forwards options by hand, misses them and
fails here."""

from __future__ import annotations

import ast
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tt_moge"
pytest.importorskip("fastapi", reason="the server surfaces need the server extra")

# (file, class, source of the new field): each goes after the class's last field
NEW_FIELDS = [
    (
        "options.py",
        "LoadOptions",
        'cache_tag: Optional[str] = option(None, "a tag for this load (test)", required=True, metavar="TAG")',
    ),
    ("host/call_options.py", "CallOptions", 'sharpen: bool = option(False, "sharpen the image first (test)")'),
    (
        "server/settings.py",
        "ServerSettings",
        'banner: Optional[str] = option(None, "a line for the log (test)", metavar="TEXT")',
    ),
    ("batch/job.py", "BatchJob", 'note: Optional[str] = option(None, "a note on the job (test)", metavar="TEXT")'),
    (
        "output.py",
        "MoGeOutput",
        'sharpness: float = output_field("how sharp the image is (test)", ("float32", "()"), summary="sharpness", '
        "default=0.25)",
    ),
]


# the parameter of each new option in a written signature (a query parameter: `Annotated` with its Query)
NEW_PARAMETERS = {"LoadOptions": ("cache_tag", "Optional[str]", "None"), "CallOptions": ("sharpen", "bool", "False")}


class Written(NamedTuple):
    """A def with options as its parameters, written out: the parameters before the options, the records whose
    options follow (in order; keyword-only or not), the parameters after them; `query`: a FastAPI dependency,
    whose parameters are `Annotated[type, option_query(record, name)]`."""

    func: typing.Any
    leading: tuple
    records: tuple
    keyword_only: bool = True
    trailing: tuple = ()
    query: bool = False

    @property
    def label(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"


def written_signatures() -> list:
    """Every written signature of the options (the package's defs that take them as parameters)."""
    from tt_moge import MoGeModel
    from tt_moge.host import CallOptions
    from tt_moge.options import LoadOptions
    from tt_moge.server.serving import call_options_query
    from tt_moge.server.video import video_options_query
    from tt_moge.video import VideoOptions, iter_video, predict_video

    load, call, clip = (LoadOptions,), (CallOptions,), (CallOptions, VideoOptions)
    upstream = (
        "self",
        "image",
        "fov_x",
        "force_projection",
        "apply_mask",
        "num_tokens",
        "resolution_level",
        "use_fp16",
    )
    return [
        Written(MoGeModel.from_pretrained, (), load),
        Written(LoadOptions.arguments, (), load),
        Written(LoadOptions.resolve, (), load),
        Written(MoGeModel.__call__, ("self", "image"), call),
        Written(MoGeModel.predict, ("self", "image"), call, trailing=("timing",)),
        Written(MoGeModel.predict_many, ("self", "images"), call),
        Written(MoGeModel.forward_many, ("self", "images"), call),
        Written(MoGeModel.finish_many, ("self", "forwarded"), call),
        Written(MoGeModel.infer, upstream, call),  # upstream's own parameters first, then the other call options
        Written(MoGeModel.predict_video, ("self", "source"), clip),
        Written(predict_video, ("model", "source"), clip),
        Written(iter_video, ("model", "source"), clip),
        Written(CallOptions.make, (), call, keyword_only=False),
        Written(VideoOptions.make, (), (VideoOptions,), keyword_only=False),
        Written(call_options_query, (), call, query=True),
        Written(video_options_query, (), (VideoOptions,), query=True),
    ]


def _parameters(func: typing.Any) -> list:
    """The parameters of a def with their annotations evaluated in its module (they are strings there)."""
    namespace = inspect.unwrap(func).__globals__
    return [
        p.replace(annotation=eval(p.annotation, namespace)) if isinstance(p.annotation, str) else p
        for p in inspect.signature(func).parameters.values()
    ]


def signature_problems(written: Written) -> list:
    """How the written signature differs from what the definitions of its options give (`fields.signature`, and
    for a query parameter `serving.query_type` and `serving.option_query`); [] when it does not."""
    from tt_moge.fields import options_of, signature
    from tt_moge.server.serving import option_query, query_type

    expected = [
        p
        for record in written.records
        for p in signature(record, keyword_only=written.keyword_only).parameters.values()
        if p.name not in written.leading
    ]
    params = _parameters(written.func)
    names, want = [p.name for p in params], [*written.leading, *(p.name for p in expected), *written.trailing]
    if names != want:
        return [f"{written.label}: parameters {names}; the definitions give {want}"]
    problems = []
    infos = {info.argument: (record, info) for record in written.records for info in options_of(record)}
    for p, e in zip(params[len(written.leading) :], expected):
        annotation = e.annotation
        if written.query:
            record, info = infos[p.name]
            parts = typing.get_args(p.annotation) if typing.get_origin(p.annotation) is typing.Annotated else ()
            made = option_query(record, p.name)
            annotation = query_type(info)
            if len(parts) != 2 or (parts[1].description, parts[1].metadata) != (made.description, made.metadata):
                problems.append(f"{written.label}({p.name}): not Annotated with option_query({record.__name__}, ...)")
            p = p.replace(annotation=parts[0] if parts else p.annotation)
        for what, got, wanted in (
            ("kind", p.kind, e.kind),
            ("default", p.default, e.default),
            ("annotation", p.annotation, annotation),
        ):
            if got != wanted:
                problems.append(f"{written.label}({p.name}): {what} {got!r}; the definition gives {wanted!r}")
    return problems


def test_written_signatures_match_the_definitions():
    """Each written signature has the parameters the definitions of its options give: their names in field order,
    kinds, defaults and annotations (an option added to its dataclass and not to a signature fails here)."""
    problems = [problem for written in written_signatures() for problem in signature_problems(written)]
    assert problems == [], "\n".join(problems)


def add_parameter(written: Written, copy: Path, record: str) -> None:
    """In the copy of the package at `copy`, add the new option of `record` (NEW_PARAMETERS) to the written signature
    `written`, after the parameter of the record's last option."""
    from tt_moge.fields import options_of

    name, annotation, default = NEW_PARAMETERS[record]
    if written.query:
        annotation = f'Annotated[{annotation}, option_query({record}, "{name}")]'
    source = inspect.unwrap(written.func)
    path = copy / Path(source.__code__.co_filename).relative_to(PACKAGE)
    last = options_of(next(r for r in written.records if r.__name__ == record))[-1].argument
    text = path.read_text()

    def find(body: list, qualname: list) -> ast.AST:
        node = next(n for n in body if getattr(n, "name", None) == qualname[0])
        return node if len(qualname) == 1 else find(node.body, qualname[1:])

    args = find(ast.parse(text).body, source.__qualname__.split(".")).args
    defaults = dict(zip([a.arg for a in args.args][len(args.args) - len(args.defaults) :], args.defaults))
    defaults.update((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults))
    end = defaults[last]
    lines = text.splitlines(keepends=True)
    line, at = lines[end.end_lineno - 1], end.end_col_offset
    lines[end.end_lineno - 1] = f"{line[:at]}, {name}: {annotation} = {default}{line[at:]}"
    path.write_text("".join(lines))


def add_field(path: Path, class_name: str, source: str) -> None:
    """Insert `source` as the last field of `class_name` in the file at `path`."""
    text = path.read_text()
    tree = ast.parse(text)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    last = [n for n in cls.body if isinstance(n, ast.AnnAssign)][-1]
    lines = text.splitlines(keepends=True)
    indent = " " * last.col_offset
    lines.insert(last.end_lineno, f"{indent}{source}\n")
    path.write_text("".join(lines))


CHECKS = textwrap.dedent("""
    import dataclasses, inspect, io, json, sys, time, warnings
    from pathlib import Path
    import numpy as np

    import tt_moge
    assert tt_moge.__file__.startswith(sys.argv[2]), tt_moge.__file__  # the copy, not the package under test
    failures = []

    def check(surface, test):
        try:
            ok = test()
        except BaseException as exc:  # argparse exits on an unknown flag
            ok = False
            surface += f" ({type(exc).__name__}: {exc})"
        if not ok:
            failures.append(surface)

    # --- Python signatures and records
    from tt_moge import MoGeModel
    from tt_moge.host import CallOptions
    from tt_moge.options import LoadOptions
    check("from_pretrained signature", lambda: "cache_tag" in inspect.signature(MoGeModel.from_pretrained).parameters)
    for method in (MoGeModel.__call__, MoGeModel.predict, MoGeModel.predict_many):
        check(f"{method.__name__} signature", lambda: "sharpen" in inspect.signature(method).parameters)
    check("CallOptions.make", lambda: CallOptions.make(sharpen=True).sharpen is True)
    check("LoadOptions.arguments", lambda: LoadOptions.arguments(cache_tag="t")["cache_tag"] == "t")

    # --- the command line
    from tt_moge.cli import build_parser
    from tt_moge.cli.common import call_options, model_kwargs
    parser = build_parser()
    for command in ("predict", "batch", "info", "serve", "bench"):
        positional = ["x.png"] if command in ("predict", "batch") else []
        check(f"tt-moge {command} --cache-tag", lambda: model_kwargs(
            parser.parse_args([command, *positional, "--cache-tag", "t"])).get("cache_tag") == "t")
    for command in ("predict", "batch"):
        check(f"tt-moge {command} --sharpen",
              lambda: call_options(parser.parse_args([command, "x.png", "--sharpen"])).sharpen is True)

    # --- warm-up keys
    from tt_moge.warmup import canonical_variant, expand_variants
    check("warm-up keys", lambda: dict(canonical_variant({"sharpen": True}, (64, 64))).get("sharpen") is True)
    check("warm-up presets", lambda: all(dict(v)["sharpen"] is False for v in expand_variants("all", (64, 64))))

    # --- BatchJob
    from tt_moge.batch import BatchJob
    check("BatchJob field", lambda: "sharpen" in {f.name for f in dataclasses.fields(BatchJob)})
    check("BatchJob.call_options", lambda: BatchJob(["x.png"], "out", sharpen=True).call_options().sharpen is True)
    check("BatchJob.model",
          lambda: BatchJob(["x.png"], "out", model={"cache_tag": "t"}).model_arguments()["cache_tag"] == "t")

    # --- a model: the load option is resolved, the call option accepted, the output field produced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MoGeModel.from_pretrained(sys.argv[1], device="cpu", resolution=(128, 96), num_tokens=1200,
                                          warmup=1, warmup_variants="minimal", precision="fp32", cache_tag="t")
    check("LoadOptions field", lambda: model.options.cache_tag == "t")
    check("warm-up of the option", lambda: model.warmup(sharpen=True) > 0)
    rgb = (np.random.default_rng(0).random((60, 80, 3)) * 255).astype(np.uint8)
    out = model(rgb)
    check("model(image, sharpen=True)", lambda: model(rgb, sharpen=True).sharpness == 0.25)
    check("MoGeOutput field", lambda: out.sharpness == 0.25)
    check("npz layout", lambda: "sharpness" in out.npz_arrays())
    check("from_npz", lambda: tt_moge.MoGeOutput.from_npz(out.to_npz_bytes()).sharpness == 0.25)
    check("summary", lambda: out.summary().get("sharpness") == 0.25)
    check("predict_many", lambda: model.predict_many([rgb], sharpen=True)[0].sharpness == 0.25)
    import torch
    chw = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255
    check("infer signature", lambda: "sharpen" in inspect.signature(MoGeModel.infer).parameters)
    check("infer(image, sharpen=True)", lambda: model.infer(chw, sharpen=True)["depth"].shape == (60, 80))
    infer_calls, real_infer = [], MoGeModel.infer
    MoGeModel.infer = lambda self, image, **kwargs: infer_calls.append(kwargs) or real_infer(self, image, **kwargs)
    check("warm-up of infer passes the option", lambda: model.warmup(call="infer", sharpen=True) > 0
          and infer_calls[-1].get("sharpen") is True)
    MoGeModel.infer = real_infer

    # --- the server and its web page
    from PIL import Image
    from fastapi.testclient import TestClient
    from tt_moge.server.app import create_app
    from tt_moge.server.ui import mount_ui
    app = create_app(model)
    mount_ui(app)
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, format="PNG")
    body = dict(content=png.getvalue(), headers={"Content-Type": "image/png"})
    with TestClient(app, raise_server_exceptions=False) as client:
        schema = client.get("/openapi.json").json()
        for path in ("/predict", "/predict/summary"):
            check(f"OpenAPI parameter of {path}", lambda: "sharpen" in {
                p["name"] for p in schema["paths"][path]["post"].get("parameters", [])})
        check("OpenAPI Summary", lambda: "sharpness" in schema["components"]["schemas"]["Summary"]["properties"])
        check("POST /predict/summary", lambda: client.post("/predict/summary", params={"sharpen": "true"},
                                                           **body).json().get("sharpness") == 0.25)
        check("POST /predict npz", lambda: "sharpness" in np.load(io.BytesIO(
            client.post("/predict", params={"sharpen": "true"}, **body).content)).files)
        check("page controls", lambda: "sharpen" in [o["name"] for o in client.get("/ui/api/config").json()["options"]])
        check("page numbers", lambda: "sharpness" in [n["key"] for n in client.get("/ui/api/config").json()["numbers"]])
        page = {}
        check("page result", lambda: page.update(client.post("/ui/api/predict", params={"sharpen": "true"},
                                                             **body).json()) or page["summary"]["sharpness"] == 0.25)
        check("page download", lambda: "sharpness" in np.load(io.BytesIO(
            client.get(page["downloads"]["result.npz"]).content)).files)

    # --- what reaches the model: tt-moge batch, with Ray and the replicas' model stood in for (in this process)
    sys.path.append(sys.argv[3])  # code/, for the tests' stand-ins; tt_moge is still the copy
    from tests.stand_in import StandInModel, in_process_ray
    import tt_moge.batch as batch_package
    from tt_moge.cli import main as cli_main
    tmp = Path.cwd()
    (tmp / "photos").mkdir()
    Image.fromarray(rgb).save(tmp / "photos" / "a.png")
    loads, jobs, replica_model = [], [], StandInModel()
    real_from_pretrained, real_run_batch = MoGeModel.from_pretrained, batch_package.run_batch
    MoGeModel.from_pretrained = lambda *args, **kwargs: loads.append(kwargs) or replica_model
    batch_package.run_batch = lambda job, **kwargs: jobs.append(job) or real_run_batch(job, **kwargs)
    with in_process_ray():
        code = cli_main(["batch", str(tmp / "photos"), "-o", str(tmp / "batch"), "--npz", "-q", "--weights",
                         sys.argv[1], "--device", "cpu", "--cache-tag", "t", "--sharpen", "--note", "n"])
    MoGeModel.from_pretrained, batch_package.run_batch = real_from_pretrained, real_run_batch
    check("tt-moge batch ran", lambda: code == 0 and (tmp / "batch" / "a" / "result.npz").is_file())
    check("tt-moge batch: the load option reaches the replicas' model", lambda: loads[0]["cache_tag"] == "t")
    check("tt-moge batch: the call option reaches each call of the model",
          lambda: replica_model.calls and all(o.sharpen is True for o in replica_model.calls))
    check("tt-moge batch: the job setting reaches BatchJob", lambda: jobs[0].note == "n")

    # --- what reaches the model and the server: tt-moge serve, its uvicorn stood in for by a TestClient
    import tt_moge.cli.serve as serve_cli
    served = {}

    class Server:  # what run() starts: here the app runs in a TestClient; the CLI's own socket is closed
        def __init__(self, config):
            self.config = config

        def run(self, sockets):
            for sock in sockets:
                sock.close()
            with TestClient(self.config.app) as client:
                deadline = time.monotonic() + 120
                while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.05)
                served["settings"] = self.config.app.serving.settings
                served["info"] = client.get("/info").json()
                served["summary"] = client.post("/predict/summary", params={"sharpen": "true"}, **body).json()

    serve_cli._make_server = lambda uvicorn, config, on_stop: Server(config)
    MoGeModel.load = lambda options: served.update(options=options) or model  # the app closes it at the end
    code = cli_main(["serve", "--weights", sys.argv[1], "--device", "cpu", "--resolution", "128x96",
                     "--num-tokens", "1200", "--precision", "fp32", "--warmup", "0", "--warmup-variants", "none",
                     "--port", "0", "--no-access-log", "--log-level", "warning", "--no-ui", "--cache-tag", "t",
                     "--banner", "b"])
    check("tt-moge serve ran", lambda: code == 0 and "summary" in served)
    check("tt-moge serve: the load option reaches the model it loads", lambda: served["options"].cache_tag == "t")
    check("tt-moge serve: the setting reaches the server", lambda: served["settings"].banner == "b")
    check("tt-moge serve: /info lists the setting", lambda: served["info"]["server"]["limits"]["banner"] == "b")
    check("tt-moge serve: the call option reaches the model", lambda: served["summary"]["sharpness"] == 0.25)
    model.close()
    print(json.dumps(failures))
""")


def test_a_field_added_in_one_place_reaches_every_surface(tmp_path, checkpoint):
    copy = tmp_path / "pkg" / "tt_moge"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for written in written_signatures():  # the written signatures first: add_field moves the lines below it
        for record in NEW_PARAMETERS:
            if record in {r.__name__ for r in written.records}:
                add_parameter(written, copy, record)
    for relative, class_name, source in NEW_FIELDS:
        add_field(copy / relative, class_name, source)
    env = {**os.environ, "PYTHONPATH": str(copy.parent), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHECKS, str(checkpoint("tiny-vits-normal")), str(copy), str(PACKAGE.parent)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert failures == [], f"surfaces that did not get the new fields: {failures}"


def test_tt_prepare_takes_its_model_flags_from_load_options(monkeypatch, tmp_path):
    """`python -m tt_moge.cli.tt_prepare` prepares what a model loaded with the same flags runs: LoadOptions' canvas,
    token budget and revision (the pinned one, not the default branch) unless its flags say otherwise."""
    import tt_moge.runners.ttnn.runner as runner
    import tt_moge.weights
    from tt_moge.cli import tt_prepare
    from tt_moge.fields import options_of
    from tt_moge.options import LoadOptions

    seen: dict = {}
    monkeypatch.setattr(tt_moge.weights, "load_network", lambda w, r: seen.update(weights=w, revision=r) or (0, 0))
    monkeypatch.setattr(
        runner,
        "prepared_weights",
        lambda net, canvas, tokens, cache: seen.update(canvas=canvas, tokens=tokens) or (0, 1),
    )
    defaults = {info.name: info.default for info in options_of(LoadOptions)}
    assert tt_prepare.main(["--weights", "someone/repo", "--cache", str(tmp_path)]) == 0
    assert seen == dict(
        weights="someone/repo",
        revision=defaults["revision"],
        canvas=defaults["resolution"],
        tokens=defaults["num_tokens"],
    )
    assert (
        tt_prepare.main(["--weights", "w", "--revision", "main", "--resolution", "640x480", "--num-tokens", "1200"])
        == 0
    )
    assert seen == dict(weights="w", revision=None, canvas=(640, 480), tokens=1200)


@pytest.mark.parametrize("page, record", [("server.md", "ServerSettings"), ("batch.md", "BatchJob")])
def test_the_docs_list_every_generated_flag_with_its_default(page, record):
    """docs/server.md and docs/batch.md have a row per flag generated from ServerSettings / BatchJob, with the
    default that --help shows (a new setting without its row, or a default changed in one place only, fails)."""
    from tt_moge.batch import BatchJob
    from tt_moge.fields import own_options
    from tt_moge.server.settings import ServerSettings

    rows = [line for line in (PACKAGE.parents[1] / "docs" / page).read_text().splitlines() if line.startswith("| `")]
    for info in own_options({"ServerSettings": ServerSettings, "BatchJob": BatchJob}[record]):
        names = [f"| `{info.flag}`", f"| `{info.flag} "] + ([f"| `{info.spec.short}`"] if info.spec.short else [])
        row = next((line for line in rows if line.startswith(tuple(names))), None)
        assert row is not None, f"docs/{page} has no row for {info.flag}"
        if info.default is not None and info.type is not bool:
            assert f" {info.shown_default()} |" in row or f"`{info.shown_default()}` |" in row, (info.flag, row)
