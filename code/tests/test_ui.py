"""The web page's server side (tt_moge/server/ui.py), in process: the page and its files, results equal to the
API's, the API's errors, auth and admission queue, a bounded result folder, a bounded 3D view.

The page in a real browser against a real server: test_ui_browser.py.
Run: cd code && python -m pytest tests/test_ui.py -q
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from tt_moge.server import ServerSettings  # noqa: E402

from .server_harness import encode_image, micro_config, photo  # noqa: E402

PNG = "image/png"
KEY = "ui-test-key"
STATIC = Path(__file__).resolve().parents[1] / "tt_moge" / "server" / "static"


@pytest.fixture(scope="module")
def model(checkpoint):
    m = load_fp32(checkpoint("tiny-vits-normal", well_posed=True), (448, 252))
    yield m
    m.close()


def load_fp32(weights, resolution):
    """A float32 CPU model of `weights` at `resolution` (1200 tokens), without warm-up: the page tests' model."""
    from tt_moge import MoGeModel

    return MoGeModel.from_pretrained(
        weights,
        device="cpu",
        resolution=resolution,
        num_tokens=1200,
        warmup=0,
        warmup_variants="none",
        precision="fp32",
    )


def make_client(model, tmp_path, settings=None, keep=None, ui=True):
    from tt_moge.server.app import create_app
    from tt_moge.server.ui import ResultStore, mount_ui

    app = create_app(model, settings or ServerSettings(queue_size=2, host_threads=2))
    store = None
    if ui:
        store = ResultStore(parent=str(tmp_path), **({"keep": keep} if keep else {}))
        mount_ui(app, store)
    return TestClient(app), store


@pytest.fixture(scope="module")
def image():
    return encode_image(photo(640, 360, 3), "PNG")


def without_timing(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "timing_ms"}


# ------------------------------------------------------------------------------------------------ the page
def test_page_and_its_files_are_served_from_this_server_only(model, tmp_path):
    client, _ = make_client(model, tmp_path)
    with client:
        for path in ("/", "/ui", "/ui/"):
            r = client.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
            assert "default-src 'self'" in r.headers["content-security-policy"]
        page = client.get("/").text
        assets = re.findall(r'(?:src|href)="([^"]+)"', page)
        assert {"/ui/static/app.js", "/ui/static/style.css"} <= set(assets)
        for asset in assets:
            assert asset.startswith(("/ui/static/", "/docs", "data:")), asset  # nothing from another host
        for name, kind in (("app.js", "text/javascript"), ("viewer.js", "text/javascript"), ("style.css", "text/css")):
            r = client.get(f"/ui/static/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.content) > 500
        r = client.get("/ui/static/../app.py")
        assert r.status_code == 404 and r.headers["content-type"] == "application/json"
        assert client.get("/ui/api/config").json()["auth"] is False
        demo = client.get("/ui/demo.png")
        assert demo.status_code == 200
        from PIL import Image

        assert np.array_equal(
            np.asarray(Image.open(io.BytesIO(demo.content))),
            np.asarray(Image.open(Path(__file__).resolve().parents[2] / "media" / "source.png")),
        )
    for path in STATIC.iterdir():  # no CDN, no external URL in the page's own code
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", path.read_text()), path.name


def test_without_the_page_the_api_is_unchanged(model, tmp_path):
    with_ui, _ = make_client(model, tmp_path)
    without, _ = make_client(model, tmp_path, ui=False)
    with with_ui, without:
        assert with_ui.get("/openapi.json").json() == without.get("/openapi.json").json()  # the page is not in the API
        r = without.get("/")
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        assert without.get("/ui/api/config").status_code == 404


# ------------------------------------------------------------------------------------------ same results
def test_page_results_are_the_api_results(model, tmp_path, image):
    from tt_moge.export import write_outputs
    from tt_moge.host.decode import decode_bytes
    from tt_moge.server.ui import VIEW_MAX_BYTES

    client, _ = make_client(model, tmp_path)
    query = {"fov_x": "55", "apply_mask": "false", "fit": "stretch", "force_projection": "false"}  # every call option
    with client:
        r = client.post("/ui/api/predict", content=image, headers={"Content-Type": PNG}, params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        api = client.post("/predict/summary", content=image, headers={"Content-Type": PNG}, params=query).json()
        assert without_timing(page["summary"]) == without_timing(api)
        assert page["summary"]["fov_x_deg"] == pytest.approx(55.0, abs=1e-4)  # the options reached the model
        assert set(page["summary"]["timing_ms"]) == set(api["timing_ms"])

        npz = client.get(page["downloads"]["result.npz"])
        assert npz.status_code == 200 and npz.headers["content-type"] == "application/x-npz"
        assert (
            npz.content == client.post("/predict", content=image, headers={"Content-Type": PNG}, params=query).content
        )

        expected = write_outputs(
            model(image, fit="stretch", fov_x=55.0, apply_mask=False, force_projection=False),
            decode_bytes(image),
            tmp_path / "cli",
            formats=("maps", "ply", "glb"),
        )
        assert {"mesh.glb", "points.ply", "depth.exr"} <= set(expected["files"])
        for name in ("mesh.glb", "points.ply", "depth.exr"):
            first = client.get(page["downloads"][name])
            assert first.status_code == 200, first.text
            assert first.content == (tmp_path / "cli" / name).read_bytes(), f"{name} differs from `tt-moge predict`'s"
            assert client.get(page["downloads"][name]).content == first.content  # made once, served again

        for key, kind, width in (
            ("depth", "image/jpeg", None),
            ("normal", "image/jpeg", 640),
            ("mask", "image/png", 640),
        ):
            pic = client.get(page["images"][key])
            assert pic.status_code == 200 and pic.headers["content-type"] == kind
            from PIL import Image

            size = Image.open(io.BytesIO(pic.content)).size
            assert size[1] == 360 and (size[0] == width if width else size[0] > 640)  # depth has its colour bar
        view = client.get(page["view"]["url"])
        assert view.content[:4] == b"glTF" and len(view.content) == page["view"]["bytes"] <= VIEW_MAX_BYTES
        assert page["view"]["vertices"] > 1000 and page["view"]["faces"] > 1000


def test_downloads_of_an_exif_turned_photo_are_of_the_turned_photo(model, tmp_path):
    """A phone photo stored sideways (EXIF orientation 6): the page's mesh and point cloud are those of the photo
    as shown, the one the model saw (`tt-moge predict` on the same file), not of its stored pixel order."""
    from PIL import Image

    from tt_moge.export import write_outputs
    from tt_moge.host.decode import decode_bytes

    exif = Image.Exif()
    exif[0x0112] = 6  # turn 90 degrees clockwise to show
    stored = io.BytesIO()
    Image.fromarray(photo(360, 240, 5)).save(stored, format="JPEG", quality=92, exif=exif.tobytes())
    data = stored.getvalue()
    shown = decode_bytes(data, exif=True)
    assert shown.shape[:2] == (360, 240)  # turned: 240 wide, 360 high
    client, _ = make_client(model, tmp_path)
    with client:
        page = client.post("/ui/api/predict", content=data, headers={"Content-Type": "image/jpeg"}).json()
        assert (page["summary"]["width"], page["summary"]["height"]) == (240, 360)
        expected = write_outputs(model(shown), shown, tmp_path / "cli", formats=("ply", "glb"))
        assert {"mesh.glb", "points.ply"} <= set(expected["files"])
        for name in ("mesh.glb", "points.ply"):
            r = client.get(page["downloads"][name])
            assert r.status_code == 200, r.text
            assert r.content == (tmp_path / "cli" / name).read_bytes(), name


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """The server tests' micro checkpoint on a small canvas: a panorama is 12 forwards."""
    from tt_moge.testing import make_checkpoint

    m = load_fp32(make_checkpoint(tmp_path_factory.mktemp("micro"), micro_config()), (224, 224))
    yield m
    m.close()


def test_a_panorama_on_the_page_is_the_api_panorama(small_model, tmp_path):
    """POST /ui/api/predict_panorama: the summary and npz of `model.predict_panorama` (those of the API's
    panorama routes), the mesh and cloud of `tt-moge predict --panorama`'s writer, a view that closes around the viewer,
    and the measure route on the panorama's points (distance from the viewpoint as its depth)."""
    import dataclasses

    from tt_moge.export import write_outputs
    from tt_moge.server.ui import view_mesh
    from tt_moge.testing.room import render_panorama

    rgb = render_panorama(256, 128).image
    data = encode_image(rgb, "PNG")
    model = small_model
    local = model.predict_panorama(data)
    assert local.valid_fraction > 0.5 and np.std(local.distance[local.mask]) > 0.01  # not vacuous
    client, _ = make_client(model, tmp_path)
    with client:
        r = client.post("/ui/api/predict_panorama", content=data, headers={"Content-Type": PNG})
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["kind"] == "panorama" and page["images"]["normal"] is None
        # /predict/panorama's summary and npz are the Python API's (test_server.py): compared with that here
        drop = ("seconds", "timing_ms", "merge_residual")
        assert {k: v for k, v in page["summary"].items() if k not in drop} == {
            k: v for k, v in local.summary().items() if k not in drop
        }
        npz = client.get(page["downloads"]["result.npz"])
        assert npz.status_code == 200 and npz.content == local.to_npz_bytes(compress=True)  # not loopback: deflated

        expected = write_outputs(local, rgb, tmp_path / "cli", formats=("ply", "glb"))
        assert {"mesh.glb", "points.ply"} <= set(expected["files"])
        for name in ("mesh.glb", "points.ply"):
            assert client.get(page["downloads"][name]).content == (tmp_path / "cli" / name).read_bytes(), name
        view = client.get(page["view"]["url"])
        assert view.content[:4] == b"glTF" and page["view"]["faces"] > 1000

        class Flat(type(local)):  # the same maps, not joined at the seam
            is_panorama = False

        _, flat = view_mesh(Flat(**{f.name: getattr(local, f.name) for f in dataclasses.fields(local)}), rgb)
        assert page["view"]["faces"] > flat["faces"]  # the view's mesh closes around the viewer
        import trimesh

        seen = trimesh.load(io.BytesIO(view.content), file_type="glb", force="mesh")
        u = seen.visual.uv[seen.faces, 0]  # no face spans the texture: the seam's copies sit past u = 1
        assert np.ptp(u, axis=1).max() < 0.05 and (u > 1).any()

        valid = np.argwhere(local.mask)[:: max(1, int(local.mask.sum()) // 3)][:3]
        at = [f"{x},{y}" for y, x in valid]
        got = client.get(page["points"], params={"at": at}).json()["points"]
        for (y, x), p in zip(valid, got):
            assert p["point"] == local.points[y, x].tolist() and p["depth_m"] == float(local.distance[y, x])
        wide = client.post(
            "/ui/api/predict_panorama", content=encode_image(photo(300, 100, 1), "PNG"), headers={"Content-Type": PNG}
        )
        assert wide.status_code == 422 and wide.json()["code"] == "not_a_panorama"
        r = client.post("/ui/api/predict_panorama", content=data, headers={"Content-Type": PNG}, params={"fit": "pad"})
        assert r.status_code == 422 and "fit" in r.json()["detail"]  # not an option of a panorama


def test_measured_points_are_the_api_points(model, tmp_path, image):
    """GET /ui/results/<id>/points (the page's measuring tool) gives the 3D point, depth and mask of POST
    /predict's arrays at each pixel asked for, None where the mask took the point out; bad pixels get a 422
    naming `at`, an unknown result a 404."""
    from tt_moge import MoGeOutput
    from tt_moge.server.ui import MEASURE_MAX_PIXELS

    client, _ = make_client(model, tmp_path)
    with client:
        page = client.post("/ui/api/predict", content=image, headers={"Content-Type": PNG}).json()
        api = MoGeOutput.from_npz(client.post("/predict", content=image, headers={"Content-Type": PNG}).content)
        valid, invalid = np.argwhere(api.mask), np.argwhere(~api.mask)
        assert len(valid) > 1000 and len(invalid) > 100  # both kinds of pixel are asked for
        pixels = [(int(x), int(y)) for y, x in (*valid[:: len(valid) // 5][:5], *invalid[:: len(invalid) // 3][:3])]
        pixels.append((639, 359))  # the last pixel
        r = client.get(page["points"], params={"at": [f"{x},{y}" for x, y in pixels]})
        assert r.status_code == 200, r.text
        got = r.json()["points"]
        assert [p["pixel"] for p in got] == [list(p) for p in pixels]
        for (x, y), p in zip(pixels, got):
            assert p["valid"] == bool(api.mask[y, x])
            if api.mask[y, x]:
                assert p["point"] == api.points[y, x].tolist() and p["depth_m"] == float(api.depth[y, x])
            else:  # masked out: inf in the arrays
                assert p["point"] is None and p["depth_m"] is None
        a, b = (np.array(p["point"]) for p in got[:2])
        assert np.linalg.norm(a - b) > 0  # two different points: a distance to measure

        for at, expected in (
            (["640,10"], "outside the 640x360 image"),
            (["3,-1"], "outside"),
            (["1.5,2"], "whole pixels"),
            (["1,2,3"], "whole pixels"),
            ([], "1 to"),
            (["1,1"] * (MEASURE_MAX_PIXELS + 1), "1 to"),
        ):
            r = client.get(page["points"], params={"at": at})
            assert r.status_code == 422 and r.json()["code"] == "invalid_option", (at, r.text)
            assert r.json()["detail"].startswith("at: ") and expected in r.json()["detail"], r.json()
        r = client.get(page["points"].replace(page["id"], "0" * 32), params={"at": "1,1"})
        assert r.status_code == 404 and r.json()["code"] == "result_expired"
        assert client.get(page["points"], params={"at": "1,1"}).status_code == 200  # still serving


def test_page_requests_get_the_api_errors_and_need_its_key(model, tmp_path):
    settings = ServerSettings(queue_size=2, host_threads=2, max_body_bytes=300_000, max_pixels=1_000_000, api_key=KEY)
    client, _ = make_client(model, tmp_path, settings)
    good = encode_image(photo(160, 90, 1), "PNG")
    truncated = good[: len(good) // 2]
    big = encode_image(np.zeros((900, 1200, 3), np.uint8), "PNG")  # small file, 1.08 MP
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [
        (good, {"Content-Type": PNG}, {}, 401),
        (good, {"Content-Type": PNG, "Authorization": "Bearer wrong"}, {}, 401),
        (truncated, {"Content-Type": PNG, **auth}, {}, 400),
        (b"GIF89a" + bytes(100), {"Content-Type": PNG, **auth}, {}, 415),
        (good, {"Content-Type": "image/gif", **auth}, {}, 415),
        (bytes(400_000), {"Content-Type": PNG, **auth}, {}, 413),
        (big, {"Content-Type": PNG, **auth}, {}, 413),
        (good, {"Content-Type": PNG, **auth}, {"fov_x": "200"}, 422),
        (good, {"Content-Type": PNG, **auth}, {"fit": "crop"}, 422),
        (good, {"Content-Type": PNG, **auth}, {"fov_x": "wide"}, 422),
    ]
    with client:
        assert client.get("/ui/api/config").json()["auth"] is True  # the page asks for the key
        for body, headers, params, status in cases:
            page = client.post("/ui/api/predict", content=body, headers=headers, params=params)
            api = client.post("/predict/summary", content=body, headers=headers, params=params)
            assert page.status_code == api.status_code == status, (status, page.text, api.text)
            assert page.json()["code"] == api.json()["code"], (page.text, api.text)
            if status in (400, 401, 413, 415):  # the very same message as the API (options are phrased by the model)
                assert page.json() == api.json()
            else:
                assert params and list(params)[0] in page.json()["detail"]
        assert (
            client.post(
                "/ui/api/predict", content=good, headers={"Content-Type": PNG, **auth}, params={"compress": "true"}
            ).status_code
            == 422
        )  # not an option of the page
        r = client.get("/ui/results/no-such-result/result.npz")
        assert r.status_code == 404 and r.json()["code"] == "result_expired"
        assert client.get("/health").json()["status"] == "ok"
        assert client.post("/ui/api/predict", content=good, headers={"Content-Type": PNG, **auth}).status_code == 200


def test_page_requests_share_the_admission_queue_of_predict(model, tmp_path, monkeypatch):
    """queue_size 1: while a page request holds the slot, /predict, the page and downloads get 503 + Retry-After."""
    client, _ = make_client(model, tmp_path, ServerSettings(queue_size=1, host_threads=2))
    image = encode_image(photo(160, 90, 2), "PNG")
    with client:
        done = client.post("/ui/api/predict", content=image, headers={"Content-Type": PNG}).json()
        entered, release = threading.Event(), threading.Event()
        predict = model.service.predict  # what the server's routes and the page call

        def blocking(*args, **kwargs):
            entered.set()
            assert release.wait(30)
            return predict(*args, **kwargs)

        monkeypatch.setattr(model.service, "predict", blocking)
        holder = {}
        thread = threading.Thread(
            target=lambda: holder.update(r=client.post("/ui/api/predict", content=image, headers={"Content-Type": PNG}))
        )
        thread.start()
        try:
            assert entered.wait(30)
            for r in (
                client.post("/predict", content=image, headers={"Content-Type": PNG}),
                client.post("/ui/api/predict", content=image, headers={"Content-Type": PNG}),
                client.get(done["downloads"]["mesh.glb"]),
            ):
                assert r.status_code == 503 and r.json()["code"] == "queue_full" and r.headers["retry-after"] == "1"
            assert client.get("/health").json()["in_flight"] == 1
        finally:
            release.set()
            thread.join(60)
        assert holder["r"].status_code == 200
        assert client.get(done["downloads"]["mesh.glb"]).status_code == 200
        assert client.get("/health").json()["in_flight"] == 0


# ------------------------------------------------------------------------------------------ bounded files
def result_dirs(store) -> list:
    return sorted(p.name for p in store.root.iterdir()) if store.root.exists() else []


def test_result_folder_stays_bounded_under_load_and_goes_at_shutdown(model, tmp_path):
    client, store = make_client(model, tmp_path, ServerSettings(queue_size=4, host_threads=2), keep=3)
    images = [encode_image(photo(96 + 8 * i, 64, i), "PNG") for i in range(4)]
    ids, sizes = [], []
    with client:

        def one(i: int) -> None:
            r = client.post("/ui/api/predict", content=images[i % 4], headers={"Content-Type": PNG})
            if r.status_code == 200:
                page = r.json()
                ids.append(page["id"])
                client.get(page["downloads"]["mesh.glb"])
            sizes.append(len(result_dirs(store)))

        for wave in range(3):  # 3 waves of 4 concurrent clients: 12 results for a store that keeps 3
            threads = [threading.Thread(target=one, args=(4 * wave + i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert len(ids) >= 8, "too few requests got through to test the bound"
        assert max(sizes) <= 3 + 4, sizes  # kept results + those held by requests in flight
        assert len(result_dirs(store)) <= 3 and len(store) <= 3
        assert set(result_dirs(store)) <= set(ids)
        gone = [rid for rid in ids if rid not in result_dirs(store)]
        r = client.get(f"/ui/results/{gone[0]}/depth.jpg")
        assert r.status_code == 404 and r.json()["code"] == "result_expired"
        assert client.get("/health").json()["in_flight"] == 0
    assert not store.root.exists(), "the result folder outlived the server"
    assert list(tmp_path.iterdir()) == [] or all(not p.name.startswith("tt_moge-ui-") for p in tmp_path.iterdir())


def test_store_keeps_a_held_result_until_its_reader_is_done(tmp_path):
    """Oldest unheld result first; a held one dropped over the byte budget stays on disk until released."""
    from tt_moge.server.errors import ApiError
    from tt_moge.server.ui import ResultStore

    store = ResultStore(keep=2, keep_bytes=15_000, keep_seconds=3600, parent=str(tmp_path))
    first = store.create()
    (first.path / "a.bin").write_bytes(bytes(4000))
    store.added(first, first.path / "a.bin")
    store.release(first)
    reader = store.acquire(first.rid)  # a download in progress
    second = store.create()
    store.release(second)
    third = store.create()  # one over `keep`: the oldest result nobody holds goes
    store.release(third)
    assert result_dirs(store) == sorted([first.rid, third.rid])
    big = store.create()  # `third` goes
    (big.path / "b.bin").write_bytes(bytes(12_000))
    store.added(big, big.path / "b.bin")  # over keep_bytes, every result held: the oldest is dropped...
    assert len(store) == 1 and first.path.exists()  # ...but stays on disk while it is read
    with pytest.raises(ApiError):
        store.acquire(first.rid)
    store.release(reader)
    assert not first.path.exists()
    store.release(big)
    assert result_dirs(store) == [big.rid]
    store.keep_seconds = 0.01
    time.sleep(0.02)
    with pytest.raises(ApiError):
        store.acquire(big.rid)  # expired
    assert result_dirs(store) == []
    store.close()
    assert not store.root.exists()


# ------------------------------------------------------------------------------------------ the 3D view
def test_view_mesh_stays_under_15_mb_for_any_image():
    """The worst case: a square image, every pixel valid and off edges, a noise texture (JPEG at its largest)."""
    from tt_moge.output import MoGeOutput
    from tt_moge.server.ui import TEXTURE_MAX_SIDE, VIEW_MAX_BYTES, VIEW_MAX_SIDE, view_mesh

    assert VIEW_MAX_BYTES < 15_000_000
    side = 2000
    rng = np.random.default_rng(0)
    v, u = np.mgrid[0:side, 0:side].astype(np.float32)
    depth = np.full((side, side), 5.0, np.float32)
    points = np.stack([(u - side / 2) / side * depth, (v - side / 2) / side * depth, depth], -1)
    k = np.array([[1, 0, 0.5], [0, 1, 0.5], [0, 0, 1]], np.float32)
    out = MoGeOutput(
        points=points,
        depth=depth,
        normal=None,
        mask=np.ones((side, side), bool),
        intrinsics=k,
        intrinsics_pixels=k * side,
        metric_scale=1.0,
        fov_x=53.1,
        fov_y=53.1,
    )
    texture = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    glb, record = view_mesh(out, texture)
    grid = -(-side // record["step"])
    assert record["step"] == -(-side // VIEW_MAX_SIDE) and record["vertices"] == grid * grid
    assert record["faces"] == 2 * (grid - 1) ** 2
    assert len(glb) == record["bytes"] <= VIEW_MAX_BYTES and max(record["texture"]) == TEXTURE_MAX_SIDE
    tighter = len(glb) - 1_000_000  # a budget the full texture misses: the texture shrinks until the GLB fits
    smaller, record = view_mesh(out, texture, max_bytes=tighter)
    assert len(smaller) <= tighter and max(record["texture"]) < TEXTURE_MAX_SIDE
    header = json.loads(glb[20 : 20 + int.from_bytes(glb[12:16], "little")])
    assert header["images"][0]["mimeType"] == "image/jpeg"
    assert set(header["meshes"][0]["primitives"][0]["attributes"]) == {"POSITION", "TEXCOORD_0"}
