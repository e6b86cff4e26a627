"""The video path end to end on a tiny random-weight checkpoint: a short clip of the analytic walk, written to an
mp4 by OpenCV, through the Python API (`model.predict_video`), `tt-moge predict clip.mp4` and the server's
/predict/video and /predict/video/summary. The CLI's files and the server's arrays must be the API's, exactly;
bad requests get the documented 4xx. (The geometry is checked against truth in test_video.py, with a stand-in
model: random weights predict nothing meaningful.)"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from tt_moge.scene import camera_path, render_path
from tt_moge.testing.compare import ULP_LIMIT, assert_same_maps, max_ulps

from .conftest import TEST_CANVAS, TEST_TOKENS

FRAMES, SIZE, CALIBRATION = 4, (160, 120), 2


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    import cv2

    path = tmp_path_factory.mktemp("clip") / "walk.mp4"
    renders = render_path(camera_path(5 * FRAMES)[::5], *SIZE)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 8.0, SIZE)
    for r in renders:
        writer.write(np.ascontiguousarray(r.image[..., ::-1]))
    writer.release()
    return path


@pytest.fixture(scope="module")
def api_clip(tiny_model, clip):
    return tiny_model.predict_video(clip, calibration_frames=CALIBRATION)


def test_the_api_gives_a_consistent_clip(api_clip):
    assert len(api_clip) == FRAMES and api_clip.fps == pytest.approx(8.0) and api_clip.name == "walk"
    for out in api_clip.frames:
        assert out.size == SIZE and np.array_equal(out.intrinsics, api_clip.intrinsics)
        assert 0.05 < out.valid_fraction < 0.999 and np.isfinite(out.depth[out.mask]).all()
    assert np.allclose(api_clip.poses[0], np.eye(4)) and api_clip.poses.shape == (FRAMES, 4, 4)
    np.testing.assert_allclose(api_clip.scale, [o.metric_scale for o in api_clip.frames])


def test_the_cli_writes_the_apis_clip(api_clip, clip, checkpoint, tiny_model, tmp_path):
    import OpenEXR
    import torch

    from tt_moge.cli import main

    out = tmp_path / "out"
    args = ["predict", clip, "-o", out, "--weights", checkpoint("tiny-vits-normal"), "--device", "cpu"]
    args += ["--resolution", f"{TEST_CANVAS[0]}x{TEST_CANVAS[1]}", "--num-tokens", TEST_TOKENS, "--precision", "fp32"]
    args += ["--calibration-frames", CALIBRATION, "-q"]
    stderr = io.StringIO()
    # the CLI's model takes torch's thread count at its load, as the API's did at its own: the same count here
    threads = torch.get_num_threads()
    torch.set_num_threads(tiny_model._runner.threads.current)
    try:
        with contextlib.redirect_stderr(stderr):
            assert main([str(a) for a in args]) == 0, stderr.getvalue()
    finally:
        torch.set_num_threads(threads)
    folder = out / "walk"
    record = json.loads((folder / "result.json").read_text())
    assert record["frames"] == FRAMES and record["files"][-1] == "result.json"
    assert record["registered"] == int(api_clip.registered.sum())
    run = json.loads((out / "run.json").read_text())
    assert run["kind"] == "video" and run["clips"][0]["status"] == "done" and run["clips"][0]["output"] == "walk"
    row = run["clips"][0]
    summary = api_clip.summary()
    assert (row["registered"], row["relocalised"], row["chains"]) == (
        record["registered"],
        summary["relocalised"],
        len(summary["chains"]),
    )
    # the CLI loads its own model: its answers are the API's within the host paths' few ulp (testing.compare)
    assert record["main_chain"] == summary["main_chain"] and len(record["chains"]) == len(summary["chains"])
    for written, expected in zip(record["chains"], summary["chains"]):
        assert written == dict(expected, path_length_m=pytest.approx(expected["path_length_m"], abs=2e-6))
    for i, expected in enumerate(api_clip.frames):
        with OpenEXR.File(str(folder / "frames" / f"{i:06d}" / "depth.exr")) as exr:
            depth = exr.channels()["Y"].pixels
        assert max_ulps(depth, expected.depth) <= ULP_LIMIT, f"frame {i}: depth.exr is the API's depth"
    poses = json.loads((folder / "poses.json").read_text())["frames"]
    for i, frame in enumerate(poses):
        if frame["pose"] is not None:
            np.testing.assert_allclose(frame["pose"], api_clip.poses[i], atol=1e-6)
        assert frame["registered"] == bool(api_clip.registered[i])
        assert frame["scale"] == pytest.approx(api_clip.scale[i], rel=1e-6)
    lines = (folder / "trajectory.txt").read_text().splitlines()
    assert len(lines) == 1 + int(api_clip.registered.sum())


@pytest.fixture(scope="module")
def client(tiny_model):
    from fastapi.testclient import TestClient

    from tt_moge.server.app import create_app

    with TestClient(create_app(tiny_model)) as c:
        yield c


VIDEO = {"Content-Type": "video/mp4"}
PNG = {"Content-Type": "image/png"}


def test_the_server_answers_the_apis_arrays(api_clip, clip, client):
    response = client.post(f"/predict/video?calibration_frames={CALIBRATION}", content=clip.read_bytes(), headers=VIDEO)
    assert response.status_code == 200, response.text
    npz = np.load(io.BytesIO(response.content))
    assert max_ulps(npz["depth"], np.stack([o.depth for o in api_clip.frames])) <= ULP_LIMIT
    assert np.array_equal(npz["mask"], np.stack([o.mask for o in api_clip.frames]).astype(np.uint8))
    np.testing.assert_allclose(npz["poses"], api_clip.poses, atol=1e-6)  # NaN where not registered, in both
    assert np.array_equal(npz["intrinsics"], api_clip.intrinsics)
    np.testing.assert_allclose(npz["scale"], api_clip.scale, rtol=1e-6)
    assert npz["cloud_points"].shape == api_clip.cloud_points.shape
    np.testing.assert_allclose(npz["cloud_points"], api_clip.cloud_points, atol=1e-5)

    summary = client.post(
        f"/predict/video/summary?calibration_frames={CALIBRATION}", content=clip.read_bytes(), headers=VIDEO
    )
    assert summary.status_code == 200, summary.text
    record = summary.json()
    assert record["frames"] == FRAMES and [p["registered"] for p in record["poses"]] == api_clip.registered.tolist()
    assert np.allclose(record["intrinsics"], api_clip.intrinsics, atol=1e-8)
    assert "timing_ms" in record and record["timing_ms"]["total"] > 0


@pytest.mark.parametrize(
    "query,body,headers,status,code",
    [
        ("", b"not a video" * 50, VIDEO, 400, "bad_video"),
        ("", b"", VIDEO, 400, "empty_body"),
        ("", None, {"Content-Type": "image/png"}, 415, "unsupported_media_type"),
        ("?strides=2", None, VIDEO, 422, "invalid_option"),
        ("?intrinsics=1,2,3", None, VIDEO, 422, "invalid_option"),
        ("?stride=0", None, VIDEO, 422, "invalid_option"),
        ("?max_frames=1", None, VIDEO, 422, "clip_too_short"),
    ],
)
def test_bad_clip_requests_get_clear_4xx(client, clip, query, body, headers, status, code):
    response = client.post(
        "/predict/video" + query, content=clip.read_bytes() if body is None else body, headers=headers
    )
    assert response.status_code == status and response.json()["code"] == code, response.text


def test_one_forward_finished_again_is_predict_many(tiny_model, clip, monkeypatch):
    """forward_many then finish_many gives predict_many's arrays, exactly, for any call options of the same fit,
    without running the network again; so a clip runs each frame through the network once (its calibration
    frames' forwards are kept and finished again with the clip's intrinsics), not its calibration frames twice.
    A forward finished with another fit, or something that is not a forward, is refused by name. The clip's call
    options are parsed once, not again in each of its calls."""
    from tt_moge.host import CallOptions, InputError, Intrinsics

    images = [r.image for r in render_path(camera_path(9)[::3], *SIZE)]
    runner, forwards = tiny_model.service.runner, []
    submit = runner.submit
    monkeypatch.setattr(runner, "submit", lambda canvas: forwards.append(canvas.shape) or submit(canvas))
    forwarded = tiny_model.forward_many(images)
    assert len(forwards) == len(images)
    k = Intrinsics(0.62, 0.83, 0.48, 0.52, normalised=True)
    for options in ({}, dict(intrinsics=k, apply_mask=False), dict(fov_x=60.0, force_projection=False)):
        again = tiny_model.finish_many(forwarded, **options)
        for a, b in zip(again, tiny_model.predict_many(images, **options)):
            assert 0.05 < b.valid_fraction < 0.999 and np.isfinite(b.depth[b.mask]).all()  # not vacuous
            for name in ("depth", "points", "normal", "mask", "intrinsics"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert len(forwards) == 4 * len(images)  # the forwards, then 3 x predict_many
    with pytest.raises(InputError, match=r"fit: forwarded\[0\] was forwarded with fit='pad', got fit='stretch'"):
        tiny_model.finish_many(forwarded, fit="stretch")
    with pytest.raises(InputError, match=r"forwarded\[1\]: expected a forward of MoGeModel.forward_many"):
        tiny_model.finish_many([forwarded[0], images[1]])

    forwards.clear()
    parse, parsed = CallOptions.of_arguments.__func__, []
    monkeypatch.setattr(CallOptions, "of_arguments", classmethod(lambda cls, g: parsed.append(g) or parse(cls, g)))
    tiny_model.predict_video(clip, calibration_frames=CALIBRATION)
    assert len(forwards) == FRAMES
    assert len(parsed) == 1  # the clip's options, once: each call gets them parsed (the model's service)


def test_clip_limits(tiny_model, clip):
    """More frames than --max-video-frames: 413 before any work; a clip whose cost can never fit the memory
    budget: 413 naming the budget."""
    from fastapi.testclient import TestClient

    from tt_moge.server.app import create_app
    from tt_moge.server.settings import ServerSettings

    few = ServerSettings(max_video_frames=FRAMES - 1)
    with TestClient(create_app(tiny_model, few)) as c:
        response = c.post("/predict/video", content=clip.read_bytes(), headers=VIDEO)
        assert response.status_code == 413 and response.json()["code"] == "too_many_frames"
        assert "--max-video-frames" in response.json()["detail"]
    pixels = SIZE[0] * SIZE[1]
    tight = ServerSettings(max_pixels=pixels, max_body_bytes=1 << 20, memory_budget_bytes=80 * pixels + (3 << 20))
    with TestClient(create_app(tiny_model, tight)) as c:
        response = c.post("/predict/video", content=clip.read_bytes(), headers=VIDEO)
        assert response.status_code == 413 and response.json()["code"] == "clip_too_large"


def test_a_clips_cost_counts_the_calibration_frames_kept_forwards(tiny_model, clip):
    """The memory a clip is counted for includes its calibration frames' kept forwards (28 bytes per canvas pixel
    each): a budget between the cost with them and the cost without is refused (413), one at the cost admitted."""
    from fastapi.testclient import TestClient

    from tt_moge.server.app import create_app
    from tt_moge.server.settings import ServerSettings

    body = clip.read_bytes()
    w, h = tiny_model.resolution
    costs = [
        ServerSettings.clip_cost(FRAMES, SIZE[0] * SIZE[1], len(body), CALIBRATION, canvas) for canvas in (0, w * h)
    ]
    assert costs[1] - costs[0] >= 28 * w * h * CALIBRATION
    query = {"calibration_frames": CALIBRATION}
    for budget, status in ((costs[1] - 1, 413), (costs[1], 200)):
        settings = ServerSettings(max_pixels=SIZE[0] * SIZE[1], max_body_bytes=1 << 20, memory_budget_bytes=budget)
        with TestClient(create_app(tiny_model, settings)) as c:
            response = c.post("/predict/video", params=query, content=body, headers=VIDEO)
        assert response.status_code == status, (budget, costs, response.text[:300])
        assert status == 200 or response.json()["code"] == "clip_too_large"


def test_known_intrinsics_on_every_photo_surface(tiny_model, client, checkpoint, tmp_path):
    """intrinsics= (one call option): model(...), predict_many, tt-moge predict --intrinsics and /predict?intrinsics=
    give exactly the given intrinsics and the same arrays; impossible values are refused on each surface."""
    import cv2

    from tt_moge.cli import main
    from tt_moge.host import Intrinsics
    from tt_moge.output import MoGeOutput
    from tt_moge.scene import render

    k = np.array([[260.0, 0.0, 171.5], [0.0, 251.0, 97.25], [0.0, 0.0, 1.0]])
    image = render(320, 200).image
    one = tiny_model(image, intrinsics=k)
    assert np.array_equal(one.intrinsics_pixels, k.astype(np.float32))
    many = tiny_model.predict_many([image, image], intrinsics="260,251,171.5,97.25")
    assert all(np.array_equal(o.depth, one.depth) for o in many)
    normalised = Intrinsics.from_matrix(k / np.array([[320], [200], [1]]), normalised=True)
    assert np.array_equal(
        tiny_model(image, intrinsics=normalised).intrinsics, normalised.normalised_matrix((320, 200)).astype(np.float32)
    )
    assert 0.05 < one.valid_fraction < 0.999

    path = tmp_path / "photo.png"
    cv2.imwrite(str(path), image[..., ::-1])
    response = client.post(
        "/predict?intrinsics=260,251,171.5,97.25", content=path.read_bytes(), headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 200, response.text
    served = MoGeOutput.from_npz(response.content)
    assert_same_maps(one, served, ("depth",), label="/predict")
    assert np.array_equal(served.intrinsics_pixels, one.intrinsics_pixels)

    out = tmp_path / "out"
    args = ["predict", path, "-o", out, "--weights", checkpoint("tiny-vits-normal"), "--device", "cpu", "--npz", "-q"]
    args += ["--resolution", f"{TEST_CANVAS[0]}x{TEST_CANVAS[1]}", "--num-tokens", TEST_TOKENS, "--precision", "fp32"]
    assert main([str(a) for a in args + ["--intrinsics", "260,251,171.5,97.25"]]) == 0
    written = MoGeOutput.from_npz(out / "photo" / "result.npz")
    assert_same_maps(one, written, ("depth",), label="tt-moge predict")
    assert np.array_equal(written.intrinsics_pixels, one.intrinsics_pixels)

    for bad, message in (
        ((260, 251, 500, 97), "principal point"),
        ("1,2,3", "expected"),
        ((0.5, 0.8, 0.5, 0.5), "normalised"),
    ):
        with pytest.raises(ValueError, match=message):
            tiny_model(image, intrinsics=bad)
    with pytest.raises(ValueError, match="give one of them"):
        tiny_model(image, intrinsics=k, fov_x=60)
    bad = client.post("/predict?intrinsics=0,1,2,3", content=path.read_bytes(), headers={"Content-Type": "image/png"})
    assert bad.status_code == 422 and "focal lengths must be > 0" in bad.json()["detail"]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert main([str(a) for a in args + ["--intrinsics", "1,2"]]) == 2
    assert "--intrinsics" in stderr.getvalue()

    # bounded as fov_x is (issue 48, item 11): 1e308 pixels made the camera matrix infinite (null in JSON), 1e-300
    # normalised made fx 0 (a 180-degree view, no pixel valid); both were accepted everywhere
    for extreme, status in (("1e308,1e308,160,100", 400), ("1e-300,1e-300,0.5,0.5,normalised", 422)):
        with pytest.raises(ValueError, match="field of view of .* expected 0.001 < fov_x < 179.999"):
            tiny_model(image, intrinsics=extreme)
        # pixels are judged against the photo (400 bad_image), normalised values as the parameter is read (422)
        refused = client.post(f"/predict?intrinsics={extreme}", content=path.read_bytes(), headers=PNG)
        assert refused.status_code == status and "field of view" in refused.json()["detail"], refused.text
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):  # normalised: known without the image, a usage error before loading
        assert main([str(a) for a in args + ["--intrinsics", "1e-300,1e-300,0.5,0.5,normalised"]]) == 2
    assert "--intrinsics" in stderr.getvalue() and "field of view" in stderr.getvalue(), stderr.getvalue()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):  # pixels: checked against each photo's size, which fails alone
        assert main([str(a) for a in args + ["--intrinsics", "1e308,1e308,160,100"]]) == 1
    assert "photo.png" in stderr.getvalue() and "field of view" in stderr.getvalue(), stderr.getvalue()


def test_the_cli_takes_a_sequence_of_frames_and_refuses_mixed_inputs(checkpoint, clip, tmp_path):
    """--sequence: a folder of frames is one clip, OUT/<folder name>/; a file with --sequence, or photos beside a
    video, are usage errors before any model loads."""
    import cv2

    from tt_moge.cli import main
    from tt_moge.scene import camera_path, render_path

    frames = tmp_path / "corridor"
    frames.mkdir()
    for i, r in enumerate(render_path(camera_path(9)[::4], *SIZE)):
        cv2.imwrite(str(frames / f"f{i}.png"), r.image[..., ::-1])
    out = tmp_path / "out"
    model = ["--weights", checkpoint("tiny-vits-normal"), "--device", "cpu", "--precision", "fp32"]
    model += ["--resolution", f"{TEST_CANVAS[0]}x{TEST_CANVAS[1]}", "--num-tokens", TEST_TOKENS]
    args = ["predict", "--sequence", frames, "-o", out, *model, "--calibration-frames", 2, "-q", "--npz"]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert main([str(a) for a in args]) == 0, stderr.getvalue()
    record = json.loads((out / "corridor" / "result.json").read_text())
    assert record["frames"] == 3 and record["frame_files"] == ["npz"]
    assert sorted(p.name for p in (out / "corridor" / "frames" / "000002").iterdir()) == ["result.json", "result.npz"]
    for bad, message in (
        (["predict", "--sequence", clip, "-o", out, *model], "--sequence takes folders"),
        (["predict", clip, frames / "f0.png", "-o", out, *model], "separate runs"),
    ):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            assert main([str(a) for a in bad]) == 2
        assert message in stderr.getvalue(), stderr.getvalue()
