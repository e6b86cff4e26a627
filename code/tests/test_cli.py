"""`tt-moge` end to end on a tiny random-weight checkpoint: a folder of PNG/JPEG photos of several sizes (nested,
with clashing names) plus a corrupt file, every output file read back and checked against the Python API and
against an independent implementation of the documented export rules; bad command lines; info/serve/bench."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from PIL import Image

from tt_moge.cli import main
from tt_moge.constants import DEPTH_EDGE_RTOL
from tt_moge.export import DEFAULT_MESH_STEP
from tt_moge.output import MoGeOutput

CODE_DIR = Path(__file__).resolve().parents[1]
CANVAS, TOKENS = (448, 252), 1200
MODEL_ARGS = ["--device", "cpu", "--resolution", f"{CANVAS[0]}x{CANVAS[1]}", "--num-tokens", str(TOKENS)]
GL = np.array([1, -1, -1], np.float32)  # the documented axis flip of the 3D exports
# name in the output -> (file below the input folder, size, mode)
PHOTOS = {
    "a_png": ("a.png", (320, 240), "RGB"),
    "a_jpg": ("a.jpg", (256, 256), "RGB"),  # same stem as a.png in the same folder: both names get the extension
    "nested/tall": ("nested/tall.png", (200, 300), "RGBA"),  # alpha is dropped, as by the API
    "nested/deeper/wide": ("nested/deeper/wide.jpeg", (500, 281), "RGB"),
}
CORRUPT = "broken.jpg"  # no image by its header: reported before the model loads
TRUNCATED = "b_truncated.png"  # a sound PNG header, then cut short: found when decoded, inside a chunk


def run_cli(args: list) -> tuple:
    """main(args) in this process -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def photo(size: tuple, seed: int, mode: str = "RGB") -> Image.Image:
    """A smooth photo-like image with a sharp-edged block (so that the depth has discontinuities)."""
    from tt_moge.testing import calibration_image

    w, h = size
    rgb = (calibration_image(w, h, seed=seed)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    rgb[h // 4 : h // 2, w // 3 : 2 * w // 3] = (250, 240, 30)
    img = Image.fromarray(rgb)
    if mode == "RGBA":
        img.putalpha(Image.fromarray(np.full((h, w), 128, np.uint8)))
    return img


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    # image_detail=0.1 makes the random-weight depth vary enough with the image that the edge rule removes part
    # of the valid pixels (with the default 0.01 it removes none and the edge checks would prove nothing).
    return checkpoint("tiny-vits-normal", image_detail=0.1)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    for seed, (rel, size, mode) in enumerate(PHOTOS.values()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        photo(size, seed, mode).save(path, quality=92) if path.suffix != ".png" else photo(size, seed, mode).save(path)
    (root / CORRUPT).write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4)  # a JPEG header, then noise
    png = io.BytesIO()
    photo((64, 48), 9).save(png, format="PNG")
    (root / TRUNCATED).write_bytes(png.getvalue()[: len(png.getvalue()) // 2])
    (root / "notes.txt").write_text("not an image: folders only yield .png/.jpg/.jpeg")
    return root


@pytest.fixture(scope="module")
def folder_run(ckpt, photos, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    # --chunk-size 2: five decodable-looking images in three predict_many chunks, the truncated one inside the
    # second; the corrupt one never reaches the model. Every format.
    code, stdout, stderr = run_cli(
        [
            "predict",
            photos,
            "-o",
            out,
            "--weights",
            ckpt,
            *MODEL_ARGS,
            "--chunk-size",
            "2",
            "--maps",
            "--npz",
            "--ply",
            "--glb",
        ]
    )
    return code, stdout, stderr, out


@pytest.fixture(scope="module")
def api(ckpt):
    from tt_moge import MoGeModel

    with MoGeModel.from_pretrained(
        ckpt, device="cpu", resolution=CANVAS, num_tokens=TOKENS, warmup=0, warmup_variants="none"
    ) as model:
        yield model


def image_rgb(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def expected_kept(npz) -> np.ndarray:
    """The documented edge rule, written independently of tt_moge.export: a valid pixel is kept unless the
    valid depths of its 3x3 neighbourhood span more than DEPTH_EDGE_RTOL of its own depth (float32)."""
    depth = npz["depth"].astype(np.float32)
    valid = npz["mask"].astype(bool) & np.isfinite(depth)
    hi = np.pad(np.where(valid, depth, -np.inf), 1, constant_values=-np.inf)
    lo = np.pad(np.where(valid, depth, np.inf), 1, constant_values=np.inf)
    spread = sliding_window_view(hi, (3, 3)).max(axis=(-2, -1)) - sliding_window_view(lo, (3, 3)).min(axis=(-2, -1))
    with np.errstate(invalid="ignore", over="ignore"):
        return valid & ~(spread > np.float32(DEPTH_EDGE_RTOL) * depth)


# ------------------------------------------------------------------------------------- the folder run
def test_corrupt_file_is_reported_and_the_rest_is_done(folder_run, photos):
    code, stdout, stderr, out = folder_run
    assert code == 1, "exit code 1 says that some images failed"
    first = stderr.splitlines()[0]  # reported from its header, before the model loads
    assert first.startswith(f"tt-moge: failed: image file '{photos / CORRUPT}'") and "not a decodable image" in first
    assert f"failed: image file '{photos / TRUNCATED}'" in stderr  # found by the decoder
    assert "4 of 6 images done, 2 failed" in stdout and str(photos / CORRUPT) in stdout
    assert "5/5" in stderr, "a progress bar for a run of several images"
    run = json.loads((out / "run.json").read_text())
    assert (run["done"], run["failed"]) == (4, 2)
    status = {
        Path(r["input"]).relative_to(photos).as_posix(): (r["status"], r["output"], r["error"]) for r in run["images"]
    }
    assert set(status) == {rel for rel, _, _ in PHOTOS.values()} | {CORRUPT, TRUNCATED}, (
        "notes.txt is not an image input"
    )
    assert status[CORRUPT][0] == "failed" and "not a decodable image" in status[CORRUPT][2]
    assert status[TRUNCATED][0] == "failed" and "truncated" in status[TRUNCATED][2]
    for name, (rel, _, _) in PHOTOS.items():
        assert status[rel] == ("done", name, None)
    assert not (out / "broken").exists()


def test_every_image_has_all_files(folder_run):
    out = folder_run[3]
    files = {"depth.png", "normal.png", "mask.png", "depth.exr", "result.npz", "points.ply", "mesh.glb", "result.json"}
    folders = {p.parent.relative_to(out).as_posix() for p in out.rglob("result.json")}
    assert folders == set(PHOTOS)
    for name in PHOTOS:
        assert {p.name for p in (out / name).iterdir() if p.is_file()} == files
        assert set(json.loads((out / name / "result.json").read_text())["files"]) == files


def test_npz_and_json_equal_the_api(folder_run, photos, api):
    out = folder_run[3]
    for name, (rel, size, _) in PHOTOS.items():
        expected = api(str(photos / rel))
        assert expected.size == size and 0.05 < expected.valid_fraction < 0.95, "a non-trivial comparison"
        assert np.isfinite(expected.depth[expected.mask]).all()
        with np.load(out / name / "result.npz") as npz:
            arrays = expected.npz_arrays()
            assert sorted(npz.files) == sorted(arrays)
            for key, value in arrays.items():
                assert npz[key].dtype == value.dtype and np.array_equal(npz[key], value), f"{name}: {key}"
        record = json.loads((out / name / "result.json").read_text())
        assert (record["width"], record["height"]) == size and record["source"] == str(photos / rel)
        assert record["fov_x_deg"] == pytest.approx(expected.fov_x, rel=1e-6)
        assert record["fov_y_deg"] == pytest.approx(expected.fov_y, rel=1e-6)
        assert np.allclose(record["intrinsics"], expected.intrinsics, rtol=1e-6)
        assert np.allclose(record["intrinsics_pixels"], expected.intrinsics_pixels, rtol=1e-6)
        assert record["metric_scale"] == pytest.approx(expected.metric_scale, rel=1e-6)
        assert record["valid_fraction"] == pytest.approx(expected.valid_fraction, rel=1e-12)
        assert record["median_depth_m"] == pytest.approx(expected.median_depth, rel=1e-6)
        assert MoGeOutput.from_npz(out / name / "result.npz").size == size


def test_maps(folder_run, photos):
    import cv2
    import OpenEXR

    turbo = cv2.applyColorMap(np.arange(256, dtype=np.uint8)[:, None], cv2.COLORMAP_TURBO)[:, 0, ::-1].astype(int)
    turbo_key = turbo[:, 0] << 16 | turbo[:, 1] << 8 | turbo[:, 2]  # the 256 turbo colours are distinct
    key_order = np.argsort(turbo_key)
    for name, (_rel, (w, h), _) in PHOTOS.items():
        folder = folder_run[3] / name
        npz = np.load(folder / "result.npz")
        mask, depth = npz["mask"].astype(bool), npz["depth"]
        with OpenEXR.File(str(folder / "depth.exr")) as exr:
            exr_depth = exr.channels()["Y"].pixels
        assert exr_depth.dtype == np.float32 and np.array_equal(exr_depth, depth), "depth.exr is the exact depth"
        assert np.array_equal(np.asarray(Image.open(folder / "mask.png")), mask.astype(np.uint8) * 255)

        normal_png = np.asarray(Image.open(folder / "normal.png").convert("RGB")).astype(int)
        expected = (npz["normal"].astype(np.float32) * GL + 1) * 127.5  # float16 in the npz: within one level
        assert (normal_png[~mask] == 0).all() and np.abs(normal_png[mask] - expected[mask]).max() <= 1

        picture = np.asarray(Image.open(folder / "depth.png").convert("RGB")).astype(int)
        assert picture.shape[0] == h and picture.shape[1] > w, "the colour bar sits beside the image"
        assert (picture[:, :w][~mask] == 0).all()
        # Each valid pixel is a turbo colour; its level must fall as the depth grows (inverse-depth colouring).
        colours = picture[:, :w][mask]
        keys = colours[:, 0] << 16 | colours[:, 1] << 8 | colours[:, 2]
        found = np.searchsorted(turbo_key[key_order], keys).clip(0, 255)
        assert np.array_equal(turbo_key[key_order][found], keys), "every valid pixel has a turbo colour"
        level = key_order[found]
        order = np.argsort(depth[mask], kind="stable")
        assert np.all(np.diff(level[order]) <= 0) and level.max() - level.min() > 200
        near, far = json.loads((folder / "result.json").read_text())["depth_png_range_m"]
        assert (near, far) == pytest.approx(tuple(np.percentile(depth[mask], [1, 99])), rel=1e-6)


def test_ply_point_cloud(folder_run, photos):
    import trimesh

    removed = 0
    for name, (rel, _, _) in PHOTOS.items():
        folder = folder_run[3] / name
        npz = np.load(folder / "result.npz")
        kept = expected_kept(npz)
        valid = npz["mask"].astype(bool)
        removed += int(valid.sum() - kept.sum())
        cloud = trimesh.load(folder / "points.ply", process=False)
        assert isinstance(cloud, trimesh.PointCloud)
        assert len(cloud.vertices) == kept.sum() == json.loads((folder / "result.json").read_text())["vertices"]
        assert np.array_equal(np.asarray(cloud.vertices, np.float32), npz["points"][kept] * GL)
        assert np.array_equal(np.asarray(cloud.colors)[:, :3], image_rgb(photos / rel)[kept])
        with open(folder / "points.ply", "rb") as f:
            normals = trimesh.exchange.ply.load_ply(f)["vertex_normals"]
        assert np.abs(normals - npz["normal"][kept].astype(np.float32) * GL).max() < 2e-3  # npz normal is float16
    assert removed > 0, "the edge rule removed pixels: the count check above is not vacuous"


def check_glb_mesh(folder: Path, photo_path: Path, size: tuple, step: int) -> None:
    """mesh.glb against the documented rules, on the grid of every `step`-th row and column."""
    import trimesh

    w, h = size
    record = json.loads((folder / "result.json").read_text())
    assert record["mesh_step"] == step
    with np.load(folder / "result.npz") as full:
        npz = {key: full[key][::step, ::step] for key in ("depth", "mask", "points")}
    kept = expected_kept(npz)
    assert 0.2 < kept.sum() / npz["mask"].sum() < 1.0, "some pixels on edges, most kept"
    scene = trimesh.load(folder / "mesh.glb", process=False)
    (mesh,) = scene.geometry.values()
    assert np.allclose(scene.graph.get(scene.graph.nodes_geometry[0])[0], np.eye(4))
    assert len(mesh.vertices) == kept.sum() == record["mesh_vertices"]
    assert np.array_equal(np.asarray(mesh.vertices, np.float32), npz["points"][kept] * GL)

    # Topology: the two documented triangles of each pixel quad, exactly where all three corners are kept.
    rows, cols = np.nonzero(kept)
    pix = np.stack([rows, cols], 1)[mesh.faces]  # (F, 3 corners, (row, col))
    offsets = pix - pix[:, :1]
    upper = (offsets == [[0, 0], [1, 0], [0, 1]]).all(axis=(1, 2))
    lower = (offsets == [[0, 0], [1, -1], [1, 0]]).all(axis=(1, 2))
    assert (upper | lower).all()
    n_upper = (kept[:-1, :-1] & kept[1:, :-1] & kept[:-1, 1:]).sum()
    n_lower = (kept[:-1, 1:] & kept[1:, :-1] & kept[1:, 1:]).sum()
    assert (upper.sum(), lower.sum()) == (n_upper, n_lower) and n_upper > 0
    assert len(np.unique(np.sort(mesh.faces, axis=1), axis=0)) == len(mesh.faces)

    tri = np.asarray(mesh.vertices)[mesh.faces]
    facing = np.einsum("ij,ij->i", np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), -tri.mean(axis=1))
    assert (facing > 0).all(), "every triangle faces the camera at the origin"
    z = -tri[..., 2]
    assert ((z.max(1) - z.min(1)) <= DEPTH_EDGE_RTOL * z.min(1) * (1 + 1e-5)).all(), "no triangle spans a depth edge"

    texture = np.asarray(mesh.visual.material.baseColorTexture.convert("RGB"))
    assert np.array_equal(texture, image_rgb(photo_path)), "the whole image is the texture"
    uv = np.asarray(mesh.visual.uv)
    assert np.array_equal(np.floor(uv[:, 0] * w).astype(int), cols * step)  # UVs address the full image
    assert np.array_equal(np.floor((1 - uv[:, 1]) * h).astype(int), rows * step)


def test_glb_mesh(folder_run, photos):
    for name, (rel, size, _) in PHOTOS.items():  # the default step: every second row and column
        check_glb_mesh(folder_run[3] / name, photos / rel, size, DEFAULT_MESH_STEP)


def test_glb_mesh_of_every_pixel(ckpt, photos, tmp_path):
    rel, size, _ = PHOTOS["nested/deeper/wide"]
    code, _, stderr = run_cli(
        ["predict", photos / rel, "-o", tmp_path, "--npz", "--glb", "--mesh-step", "1", "--weights", ckpt, *MODEL_ARGS]
    )
    assert code == 0, stderr
    check_glb_mesh(tmp_path / "wide", photos / rel, size, 1)


# ---------------------------------------------------------------------------- options, one image
def test_one_image_with_format_flag_and_call_options(ckpt, photos, api, tmp_path):
    rel = PHOTOS["a_jpg"][0]
    code, stdout, stderr = run_cli(
        [
            "predict",
            photos / rel,
            "-o",
            tmp_path,
            "--ply",
            "--fit",
            "stretch",
            "--fov-x",
            "60",
            "--weights",
            ckpt,
            *MODEL_ARGS,
        ]
    )
    assert code == 0, stderr
    # one image has its bar too (issue 48: a single photo showed nothing for 45 s on a CPU)
    assert "1 of 1 images done, 0 failed" in stdout and "0/1" in stderr and "model on image 1" in stderr, stderr
    assert {p.name for p in (tmp_path / "a").iterdir()} == {"points.ply", "result.json"}
    expected = api(str(photos / rel), fit="stretch", fov_x=60.0)
    record = json.loads((tmp_path / "a" / "result.json").read_text())
    assert record["fov_x_deg"] == pytest.approx(60.0, rel=1e-5)
    assert record["metric_scale"] == pytest.approx(expected.metric_scale, rel=1e-6)
    import trimesh

    valid = expected.mask
    assert 0.05 < valid.mean() < 0.95
    npz_like = {"depth": expected.depth, "mask": expected.mask}
    kept = expected_kept(npz_like)
    cloud = trimesh.load(tmp_path / "a" / "points.ply", process=False)
    assert np.array_equal(np.asarray(cloud.vertices, np.float32), expected.points[kept] * GL)


# -------------------------------------------------------------------------------- bad command lines
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["predict", "{photo}", "--obj"],
            "unrecognized arguments: --obj (formats are chosen with --maps, --npz, --ply, --glb)",
        ),
        (
            ["predict", "{photo}", "--resolution", "448by252"],
            "argument --resolution: expected WIDTHxHEIGHT, e.g. 1920x1080, got '448by252'",
        ),
        (
            ["predict", "{photo}", "--resolution", "10x10"],
            "argument --resolution: resolution must be a canvas of 64..4096 pixels",
        ),
        (["predict", "{photo}", "--num-tokens", "99"], "argument --num-tokens: num_tokens must be in [1200, 3600]"),
        (
            ["predict", "{photo}", "--fov-x", "200"],
            "argument --fov-x: the horizontal field of view must be in degrees, 0.001 < fov_x < 179.999, got 200",
        ),
        (["predict", "{photo}", "--fit", "crop"], "argument --fit: invalid choice: 'crop'"),
        (["predict", "/no/such/photo.jpg"], "input '/no/such/photo.jpg': no such file or folder"),
        (["predict", "{folder}/*.webp"], "the pattern matches no files"),
        (["predict", "{empty}"], "no PNG or JPEG images found in"),
        (["predict"], "the following arguments are required: INPUT"),
        ([], "usage: tt-moge"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message, photos, tmp_path):
    (tmp_path / "empty").mkdir()
    fill = {"photo": photos / PHOTOS["a_png"][0], "folder": photos, "empty": tmp_path / "empty"}
    code, stdout, stderr = run_cli([a.format(**fill) for a in args] + (["-o", tmp_path / "out"] if args else []))
    assert code == 2
    assert message in stderr
    assert not (tmp_path / "out" / "run.json").exists(), "nothing ran"


def test_missing_weights_cannot_start(photos, tmp_path):
    code, _, stderr = run_cli(
        ["predict", photos / PHOTOS["a_png"][0], "-o", tmp_path, "--weights", tmp_path / "nope", "--device", "cpu"]
    )
    assert code == 3 and "could not load the model" in stderr and str(tmp_path / "nope") in stderr


def test_a_file_that_is_no_image_is_found_before_the_model_loads(photos, tmp_path):
    fake = tmp_path / "fake.png"
    fake.write_text("not a PNG")
    code, stdout, stderr = run_cli(
        ["predict", fake, photos / CORRUPT, "-o", tmp_path / "out", "--weights", tmp_path / "nope"]
    )
    assert code == 1 and "could not load the model" not in stderr, stderr  # no image left: no model is loaded
    assert f"failed: image file '{fake}': not a decodable image" in stderr and "0 of 2 images done, 2 failed" in stdout


def test_module_entry_points_run(photos):
    env = {**os.environ, "PYTHONPATH": str(CODE_DIR)}
    helped = subprocess.run(
        [sys.executable, "-m", "tt_moge", "predict", "--help"], cwd=CODE_DIR, env=env, capture_output=True, text=True
    )
    assert helped.returncode == 0
    for section in (
        "output layout:",
        "exit codes:",
        "examples:",
        "formats (--maps --glb when no format",
        "--num-tokens N",
    ):
        assert section in helped.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tt_moge", "predict", "/no/such.png"],
        cwd=CODE_DIR,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "no such file or folder" in bad.stderr
    for module in ("tt_moge.server", "tt_moge.bench_breakdown"):  # the spec's module names of serve and bench
        helped = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=CODE_DIR, env=env, capture_output=True, text=True
        )
        assert helped.returncode == 0 and "--num-tokens" in helped.stdout and "--precision" in helped.stdout, module


# --------------------------------------------------------------------------------- other commands
def test_info(ckpt):
    code, stdout, _ = run_cli(["info", "--weights", ckpt, *MODEL_ARGS, "--json"])
    assert code == 0
    info = json.loads(stdout)
    assert info["canvas"] == list(CANVAS) and info["num_tokens"] == TOKENS and info["device"] == "cpu"
    assert info["model"] == str(ckpt) and info["normal"] is True
    assert info["host"].split()[0] in ("native", "torch")


def test_precision_reaches_the_model(ckpt):
    code, stdout, _ = run_cli(["info", "--weights", ckpt, *MODEL_ARGS, "--precision", "fp32", "--json"])
    assert code == 0
    info = json.loads(stdout)
    assert info["precision"] == "fp32" and info["runner"]["runner"] == "torch"  # the exact reference network
    code, stdout, _ = run_cli(["info", "--weights", ckpt, *MODEL_ARGS, "--precision", "int8", "--json"])
    assert code == 0 and json.loads(stdout)["runner"]["runner"] == "cpu-graph"  # int8 is never the default
    code, _, err = run_cli(["info", "--weights", ckpt, *MODEL_ARGS, "--precision", "fp64"])
    assert code == 2 and "--precision" in err


def test_serve_and_bench_take_their_arguments(monkeypatch):
    from tt_moge.cli import bench, serve

    calls = {}

    def serve_run(args):
        calls["serve"] = args.port
        return 7

    def bench_run(args, parser=None, argv=None):
        calls["bench"] = (args.runs, args.json, args.random_weights)
        return 0

    monkeypatch.setattr(serve, "run", serve_run)
    monkeypatch.setattr(bench, "run", bench_run)
    assert run_cli(["serve", "--port", "8123"])[0] == 7 and calls["serve"] == 8123
    code, _, stderr = run_cli(["serve", "--port", "x"])
    assert code == 2 and "tt-moge serve" in stderr
    assert run_cli(["bench", "--runs", "3", "--json", "--random-weights", "tiny-vits"])[0] == 0
    assert calls["bench"] == (3, True, "tiny-vits")


def test_serve_says_when_the_server_libraries_are_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import of a None entry raises ImportError
    code, _, stderr = run_cli(["serve", "--device", "cpu"])
    assert code == 3 and "server's libraries are not installed" in stderr and "code/[server]" in stderr


# ------------------------------------------------------------------------------------------ parts
def test_input_names_are_unique_and_stable(tmp_path):
    from tt_moge.inputs import InputPathError, collect_images

    for rel in ("x/a.png", "x/a.JPG", "x/A.jpeg", "x/sub.png", "x/sub/b.png", "x/sub/c.txt", "y/a.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    images = collect_images(
        [tmp_path / "x", tmp_path / "y" / "a.png", tmp_path / "x" / "a.png", str(tmp_path / "y" / "*.png")]
    )
    names = {img.path.relative_to(tmp_path).as_posix(): img.name for img in images}
    assert names == {
        "x/A.jpeg": "A_jpeg",
        "x/a.JPG": "a_JPG",
        "x/a.png": "a_png",
        "x/sub.png": "sub_png",
        "x/sub/b.png": "sub/b",
        "y/a.png": "a_png-2",
    }, "each file once, no name a folder of another"
    assert [img.name for img in collect_images([tmp_path / "x"])] == [
        img.name for img in collect_images([tmp_path / "x"])
    ]
    with pytest.raises(InputPathError, match="no such file or folder"):
        collect_images([tmp_path / "missing.png"])
    # the output folder inside an input folder: its files are not photos (unless named directly)
    assert {img.name for img in collect_images([tmp_path], exclude=tmp_path / "x" / "sub")} == {
        "x/a_png",
        "x/a_JPG",
        "x/A_jpeg",
        "x/sub",
        "y/a",
    }
    assert {
        img.name
        for img in collect_images(
            [str(tmp_path / "x" / "**" / "*.png"), tmp_path / "x" / "sub" / "b.png"], exclude=tmp_path / "x" / "sub"
        )
    } == {"a", "sub", "b"}


def test_depth_edge_rule():
    from tt_moge.export import depth_edges

    depth = np.full((6, 8), 2.0, np.float32)
    depth[:, 4:] = 2.0 * (1 + DEPTH_EDGE_RTOL) * 1.01  # a step just over the threshold
    depth[0, 0] = 2.0 * (1 + DEPTH_EDGE_RTOL) * 0.99  # a bump just under it
    mask = np.ones_like(depth, bool)
    mask[5, :] = False  # invalid pixels (sky) do not make their neighbours edges
    depth[5, :] = np.inf
    edges = depth_edges(depth, mask)
    expected = np.zeros_like(mask)
    expected[:5, 3:5] = True
    assert np.array_equal(edges, expected)


def test_one_failing_image_in_a_chunk_costs_only_itself(tmp_path):
    """If predict_many raises for a chunk, the images are retried one by one; the good ones are written."""
    from tt_moge.inputs import collect_images
    from tt_moge.jobs import predict_images

    for i in range(3):
        Image.new("RGB", (40, 30), (10 * i, 0, 0)).save(tmp_path / f"p{i}.png")
    images = collect_images([tmp_path / f"p{i}.png" for i in range(3)])
    reference = MoGeOutput(
        points=np.ones((30, 40, 3), np.float32),
        depth=np.ones((30, 40), np.float32),
        normal=None,
        mask=np.ones((30, 40), bool),
        intrinsics=np.eye(3, dtype=np.float32),
        intrinsics_pixels=np.eye(3, dtype=np.float32),
        metric_scale=1.0,
        fov_x=60.0,
        fov_y=50.0,
    )

    class Service:  # a PredictionService whose chunk call fails
        def predict_many(self, arrays, options):
            raise RuntimeError("one of them is bad")

        def predict(self, rgb, options):
            if rgb[0, 0, 0] == 10:  # p1.png
                raise RuntimeError("device error on this one")
            return reference

    seen = []
    status = predict_images(
        Service(),
        images,
        tmp_path / "out",
        ["npz"],
        chunk_size=3,
        on_done=lambda img, err: seen.append((img.name, err)),
    )
    assert status[0] is None and status[2] is None and "device error on this one" in status[1]
    assert sorted(n for n, _ in seen) == ["p0", "p1", "p2"]
    assert (tmp_path / "out" / "p0" / "result.npz").exists() and not (tmp_path / "out" / "p1").exists()


def test_an_image_without_valid_pixels_still_gets_its_maps(tmp_path):
    from tt_moge.export import write_outputs

    h, w = 20, 30
    nothing = MoGeOutput(
        points=np.full((h, w, 3), np.inf, np.float32),
        depth=np.full((h, w), np.inf, np.float32),
        normal=np.zeros((h, w, 3), np.float32),
        mask=np.zeros((h, w), bool),
        intrinsics=np.eye(3, dtype=np.float32),
        intrinsics_pixels=np.eye(3, dtype=np.float32),
        metric_scale=1.0,
        fov_x=60.0,
        fov_y=40.0,
    )
    record = write_outputs(nothing, np.zeros((h, w, 3), np.uint8), tmp_path, ("maps", "npz", "ply", "glb"))
    assert record["vertices"] == 0 and record["median_depth_m"] is None and "not written" in record["note"]
    assert (
        sorted(p.name for p in tmp_path.iterdir())
        == sorted(record["files"])
        == sorted(["depth.png", "normal.png", "mask.png", "depth.exr", "result.npz", "result.json"])
    )
    assert json.loads((tmp_path / "result.json").read_text())["valid_fraction"] == 0.0


# --------------------------------------------------------------------------------------------- a full disk
_FULL_DISK_SCRIPT = """
mount -t tmpfs -o size="$FS_SIZE" tmpfs "$OUT" || exit 97
"$@"
code=$?
cp -a "$OUT/." "$SNAPSHOT/"
exit $code
"""


def _run_on_a_full_disk(args: list, out: Path, snapshot: Path) -> tuple:
    """Run `python -m tt_moge predict ... -o out` with too little space for all outputs -> (how, exit code,
    stdout, stderr); what it left in out is copied to snapshot.

    A real full file system where possible: a small tmpfs mounted on out inside a user + mount namespace
    (`unshare`, no root needed; it vanishes with the process, hence the copy). Where namespaces are not
    allowed (some CI runners), RLIMIT_FSIZE instead: writing a file past the limit fails with EFBIG."""
    import resource
    import shutil
    import signal

    env = {**os.environ, "PYTHONPATH": str(CODE_DIR), "OUT": str(out), "SNAPSHOT": str(snapshot), "FS_SIZE": "8m"}
    command = [sys.executable, "-m", "tt_moge", "predict", *map(str, args), "-o", str(out)]
    if shutil.which("unshare"):
        done = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _FULL_DISK_SCRIPT, "full-disk", *command],
            env=env,
            cwd=CODE_DIR,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 97 and "unshare:" not in done.stderr:
            return "tmpfs of 8 MiB", done.returncode, done.stdout, done.stderr

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, 1_500_000))

    done = subprocess.run(
        command, env=env, cwd=CODE_DIR, capture_output=True, text=True, timeout=600, preexec_fn=limit_file_size
    )
    shutil.copytree(out, snapshot, dirs_exist_ok=True)
    return "RLIMIT_FSIZE of 1.5 MB", done.returncode, done.stdout, done.stderr


def test_a_full_disk_fails_images_cleanly(ckpt, photos, tmp_path):
    out, snapshot = tmp_path / "out", tmp_path / "snapshot"
    out.mkdir()
    snapshot.mkdir()
    every_format = ["--maps", "--npz", "--ply", "--glb", "--mesh-step", "1"]  # enough bytes to fill the disk
    how, code, stdout, stderr = _run_on_a_full_disk(
        [photos, "--weights", ckpt, *MODEL_ARGS, *every_format], out, snapshot
    )
    assert code == 1 and "Traceback" not in stderr, f"{how}:\n{stdout}\n{stderr}"
    run = json.loads((snapshot / "run.json").read_text())
    by_input = {Path(r["input"]).relative_to(photos).as_posix(): r for r in run["images"]}
    assert set(by_input) == {rel for rel, _, _ in PHOTOS.values()} | {CORRUPT, TRUNCATED}
    write_failures = [r for r in run["images"] if r["status"] == "failed" and "writing" in (r["error"] or "")]
    assert write_failures, f"{how}: the disk never filled up: {run['images']}"
    unreadable = 2  # CORRUPT (by its header) and TRUNCATED (by the decoder)
    assert run["failed"] == len(write_failures) + unreadable and run["done"] + run["failed"] == len(by_input)
    assert f"{run['done']} of 6 images done, {run['failed']} failed" in stdout, stdout
    for record in run["images"]:
        folder = snapshot / record["output"]
        if record["status"] == "done":
            result = json.loads((folder / "result.json").read_text())
            assert sorted(p.name for p in folder.iterdir()) == sorted(result["files"]), folder
        else:
            assert f"tt-moge: failed: {record['error']}" in stderr
            assert not folder.exists() or not any(folder.iterdir()), (
                f"partial files of a failed image: {list(folder.iterdir())}"
            )
    leftovers = [p for p in snapshot.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    assert not leftovers, leftovers


def test_run_json_that_cannot_be_written_is_one_line_and_exit_1(photos, tmp_path, monkeypatch):
    import tt_moge.cli.predict as predict_cli
    import tt_moge.export as export

    def flat_result(h: int, w: int) -> MoGeOutput:
        return MoGeOutput(
            points=np.ones((h, w, 3), np.float32),
            depth=np.full((h, w), 2.0, np.float32),
            normal=None,
            mask=np.ones((h, w), bool),
            intrinsics=np.eye(3, dtype=np.float32),
            intrinsics_pixels=np.eye(3, dtype=np.float32),
            metric_scale=1.0,
            fov_x=60.0,
            fov_y=50.0,
        )

    class Model:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        @property
        def service(self):  # a PredictionService
            return self

        def predict_many(self, arrays, options):
            return [flat_result(*a.shape[:2]) for a in arrays]

        def info(self):
            return {"model": "fake"}

    written = export.write_text_atomic

    def no_space_for_run_json(path, text):
        if Path(path).name == "run.json":
            raise OSError(28, "No space left on device")
        written(path, text)

    monkeypatch.setattr(predict_cli, "load_model", lambda args: Model())
    monkeypatch.setattr(export, "write_text_atomic", no_space_for_run_json)
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text('{"stale": true}')  # an earlier run's: it must not pass for this run's
    code, stdout, stderr = run_cli(["predict", photos / "a.png", photos / "a.jpg", "-o", out, "--npz"])
    assert code == 1 and "Traceback" not in stderr
    assert stderr.count(f"could not write {out / 'run.json'}: [Errno 28] No space left on device") == 1, stderr
    assert "2 of 2 images done, 0 failed" in stdout and "no index: run.json could not be written" in stdout
    assert not (out / "run.json").exists()
    assert sorted(p.parent.name for p in out.rglob("result.json")) == ["a_jpg", "a_png"]
