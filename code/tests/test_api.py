"""The Python API of the spec, row by row, on a tiny random-weight checkpoint (CPU, seconds)."""

from __future__ import annotations

import io
import math
import re
import threading
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from tt_moge import MoGeModel, MoGeOutput
from tt_moge.host import CallOptions
from tt_moge.host.decode import InputError
from tt_moge.output import INFER_KEYS, NPZ_LAYOUT
from tt_moge.runners.base import PendingMaps
from tt_moge.runners.ttnn.device import chips_here
from tt_moge.synthetic import synthetic_photo
from tt_moge.warmup import PRESETS
from tt_moge.weights import DEFAULT_REPO, DEFAULT_REVISION, WEIGHTS_DIR_ENV

from .conftest import TEST_CANVAS, TEST_TOKENS


def load(path, **kwargs):
    options = dict(device="cpu", resolution=TEST_CANVAS, num_tokens=TEST_TOKENS, warmup=0, warmup_variants="none")
    options.update(kwargs)
    return MoGeModel.from_pretrained(path, **options)


def assert_same(a: MoGeOutput, b: MoGeOutput) -> None:
    """Bit-identical outputs (inf and NaN patterns included)."""
    for key in ("points", "depth", "normal", "mask", "intrinsics", "intrinsics_pixels"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
    assert (a.metric_scale, a.fov_x, a.fov_y) == (b.metric_scale, b.fov_x, b.fov_y)


@pytest.fixture(scope="module")
def photo():
    return synthetic_photo((320, 240), seed=3)


@pytest.fixture(scope="module")
def photo_out(tiny_model, photo):
    return tiny_model(photo)


# --------------------------------------------------------------------------- from_pretrained arguments
def test_signature_defaults():
    import inspect

    params = inspect.signature(MoGeModel.from_pretrained).parameters
    assert params["pretrained_model_name_or_path"].default == DEFAULT_REPO == "Ruicheng/moge-2-vitl-normal"
    assert params["revision"].default == DEFAULT_REVISION and len(DEFAULT_REVISION) == 40
    assert params["resolution"].default == (1920, 1080) and params["num_tokens"].default == 1800
    assert params["device"].default is None and params["device_id"].default == 0
    assert params["dispatch"].default == "eth" and params["num_command_queues"].default is None
    assert params["warmup"].default == 2 and params["warmup_variants"].default == "default"
    assert params["verbose"].default is False
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in list(params)[2:])


def test_weights_from_directory_file_and_env(checkpoint, monkeypatch):
    path = checkpoint("tiny-vits-normal")
    with load(path.parent) as a, load(path) as b:
        assert (a.source, b.source) == (str(path.parent), str(path)) and a.config == b.config
    monkeypatch.setenv(WEIGHTS_DIR_ENV, str(path.parent))
    with load(DEFAULT_REPO) as c:  # $MOGE_WEIGHTS_DIR overrides the repo id
        assert WEIGHTS_DIR_ENV in c.source and c.revision is None


def test_devices(checkpoint, monkeypatch):
    path = checkpoint("tiny-vits-normal")
    with load(path, device=torch.device("cpu")) as m:
        assert m.device == "cpu"
    if not torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a CPU build of torch: the CPU is expected, no warning on every run
            monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
            with load(path, device=None) as m:
                assert m.device == "cpu"
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
        with pytest.warns(RuntimeWarning, match="CUDA build of torch .*CPU"):  # a GPU was expected
            with load(path, device=None) as m:
                assert m.device == "cpu"
        monkeypatch.undo()
        with pytest.raises(ValueError, match="no CUDA"):
            load(path, device="cuda")
        with pytest.raises(ValueError, match="no CUDA"):
            load(path, device="cuda:1")
    for bad, exc in [("tpu", ValueError), ("cpux", ValueError), (3.5, TypeError)]:
        with pytest.raises(exc, match="device"):
            load(path, device=bad)
    with pytest.raises(ValueError, match="device_id"):
        load(path, device_id=-1)
    if not torch.cuda.is_available() and chips_here() == 0:  # device_id=2 names a device this machine lacks
        with pytest.raises(ValueError, match="device_id=2: no Tenstorrent chip and no CUDA GPU"):
            load(path, device=None, device_id=2)

    class FakeTtnnDevice:
        pass

    FakeTtnnDevice.__module__ = "ttnn._ttnn.device"
    with pytest.raises(ValueError, match="ttnn"):
        load(path, device=FakeTtnnDevice())


def test_resolution_and_tokens(checkpoint):
    path = checkpoint("tiny-vits-normal")
    with load(path, resolution=(320, 240), num_tokens=1250) as m:
        raw = m.forward(synthetic_photo((320, 240)))
        assert raw["points"].shape == (1, 240, 320, 3)
        assert m.resolution == (320, 240) and m.num_tokens == 1250
    for bad in [(10, 10), (1920,), "1920x1080", (1920.0, 1080.0), (5000, 1080), (1920, 200)]:
        with pytest.raises(ValueError, match="resolution"):
            load(path, resolution=bad)
    for bad in [1199, 3601, 0]:
        with pytest.raises(ValueError, match=r"num_tokens must be in \[1200, 3600\]"):
            load(path, num_tokens=bad)
    with pytest.raises(TypeError, match="num_tokens"):
        load(path, num_tokens=1800.0)


def test_tenstorrent_options_are_validated(checkpoint):
    path = checkpoint("tiny-vits-normal")
    with load(path, dispatch="worker", num_command_queues=2):
        pass
    with pytest.raises(ValueError, match="dispatch"):
        load(path, dispatch="pcie")
    with pytest.raises(ValueError, match="num_command_queues"):
        load(path, num_command_queues=3)
    with pytest.raises(ValueError, match="num_command_queues"):
        load(path, num_command_queues=True)
    with pytest.raises(TypeError, match="verbose must be True or False"):
        load(path, verbose="no")
    with pytest.raises(ValueError, match="num_command_queues=2 needs dispatch='worker'"):
        load(path, dispatch="eth", num_command_queues=2)


def test_warmup_counts_device_forwards(checkpoint, monkeypatch):
    from tt_moge.runners.base import Runner

    calls = []
    original = Runner.submit  # every runner's device entry point (the CPU default is the bf16 graph runner)
    monkeypatch.setattr(Runner, "submit", lambda self, canvas: calls.append(1) or original(self, canvas))
    with load(checkpoint("tiny-vits-normal"), warmup=2, warmup_variants="default") as m:
        assert len(calls) == 2  # host variants reuse the device warm-up's raw maps
        assert len(m.warmed_variants) == len(PRESETS["default"])
        m(synthetic_photo((64, 48)))
        assert len(calls) == 3
    with pytest.raises(ValueError, match="warmup"):
        load(checkpoint("tiny-vits-normal"), warmup=-1)


def test_warmup_variants_presets_dicts_lists(checkpoint):
    path = checkpoint("tiny-vits-normal")
    with load(path, warmup=1, warmup_variants="minimal") as m:
        assert list(dict(k)["input"] for k in m.warmed_variants) == ["array"]
        assert m.warmup(input="png", size=(64, 48), fit="stretch") > 0
        assert m.warmup(input="png", size=(64, 48), fit="stretch") == 0.0  # idempotent
        assert len(m.warmed_variants) == 2
        assert all(isinstance(s, float) for s in m.warmed_variants.values())
    with load(path, warmup=0, warmup_variants=["minimal", {"input": "jpeg", "size": (80, 60)}, {"call": "infer"}]) as m:
        assert len(m.warmed_variants) == 3
    with load(path, warmup=0, warmup_variants="all") as m:
        assert len(m.warmed_variants) == len(PRESETS["all"])
        calls = {dict(k)["call"] for k in m.warmed_variants}
        assert calls == {"call", "predict_many", "infer", "forward"}
    for bad, match in [
        ("fast", "unknown preset"),
        ({"input": "gif"}, "input"),
        ({"colour": 1}, "unknown key"),
        ({"size": (4, 4)}, "size"),
        ({"call": "forward", "size": (64, 48)}, "canvas size"),
        (3, "warmup_variants"),
        (["minimal", {"input": "gif"}], r"variant 2 of 2\): input"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match) as info:
            load(path, warmup_variants=bad)
        assert str(info.value).startswith("warmup_variants"), info.value  # the argument is named


def test_warmup_does_not_change_outputs(checkpoint, photo):
    path = checkpoint("tiny-vits-normal")
    with load(path, warmup=0, warmup_variants="none") as cold, load(path, warmup=2, warmup_variants="all") as warm:
        assert_same(cold(photo), warm(photo))


def test_verbose(checkpoint, capsys):
    with load(checkpoint("tiny-vits-normal"), warmup=1, warmup_variants="minimal", verbose=True):
        pass
    err = capsys.readouterr().err
    assert "[tt_moge] loaded" in err and "device warm-up forward 1/1" in err and "warm-up input=array" in err
    with load(checkpoint("tiny-vits-normal"), warmup=1, warmup_variants="minimal"):
        pass
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------ model(image)
def canvas_of(image) -> torch.Tensor:
    from tt_moge.host.pipeline import CallOptions, prepare

    return prepare(image, TEST_CANVAS, CallOptions()).canvas


def test_every_input_kind_gives_the_same_output(tiny_model, photo, photo_out, tmp_path):
    png = tmp_path / "photo.png"
    Image.fromarray(photo).save(png)
    chw_float = torch.from_numpy(photo).permute(2, 0, 1).float() / 255
    inputs = {
        "path str": str(png),
        "path object": png,
        "bytes": png.read_bytes(),
        "PIL": Image.open(png),
        "uint8 HWC": photo,
        "uint8 CHW": photo.transpose(2, 0, 1).copy(),
        "float HWC": photo / 255.0,
        "float32 CHW": chw_float.numpy(),
        "tensor CHW": chw_float,
        "tensor 1CHW": chw_float[None],
        "tensor HWC uint8": torch.from_numpy(photo),
    }
    # Every kind reaches the device as the same canvas (the forward is deterministic) ...
    reference = canvas_of(photo)
    for name, image in inputs.items():
        assert torch.equal(canvas_of(image), reference), name
    # ... and, end to end, a few kinds give bit-identical outputs.
    for name in ("path str", "PIL", "tensor 1CHW"):
        assert_same(tiny_model(inputs[name]), photo_out)


def test_grayscale_inputs(tiny_model, photo):
    gray = photo[..., 1]
    rgb = np.repeat(gray[..., None], 3, axis=2)
    for image in (gray, gray[..., None], Image.fromarray(gray), gray / 255.0):
        assert torch.equal(canvas_of(image), canvas_of(rgb))
    assert_same(tiny_model(Image.fromarray(gray)), tiny_model(rgb))


def test_output_fields(photo_out, photo):
    out = photo_out
    h, w = photo.shape[:2]
    assert out.points.shape == (h, w, 3) and out.points.dtype == np.float32
    assert out.depth.shape == (h, w) and out.depth.dtype == np.float32
    assert out.normal.shape == (h, w, 3) and out.normal.dtype == np.float32
    assert out.mask.shape == (h, w) and out.mask.dtype == bool
    assert out.intrinsics.shape == out.intrinsics_pixels.shape == (3, 3)
    assert out.intrinsics.dtype == out.intrinsics_pixels.dtype == np.float32
    assert 0.05 < out.mask.mean() < 0.95
    valid = out.mask
    assert np.isfinite(out.depth[valid]).all() and (out.depth[valid] > 0).all()
    assert np.isinf(out.depth[~valid]).all() and np.isinf(out.points[~valid]).all()
    assert (out.normal[~valid] == 0).all()
    np.testing.assert_allclose(np.linalg.norm(out.normal[valid], axis=-1), 1, atol=1e-5)
    np.testing.assert_array_equal(out.points[..., 2], out.depth)
    k = out.intrinsics
    np.testing.assert_allclose(out.intrinsics_pixels, k * np.array([[w], [h], [1]], np.float32), rtol=1e-6)
    assert out.fov_x == pytest.approx(math.degrees(2 * math.atan(0.5 / k[0, 0])), rel=1e-6)
    assert out.fov_y == pytest.approx(math.degrees(2 * math.atan(0.5 / k[1, 1])), rel=1e-6)
    assert isinstance(out.metric_scale, float) and out.metric_scale > 0


def test_points_are_the_reprojected_depth(photo_out, photo):
    """force_projection: points = depth * K^-1 [u, v, 1] at pixel centres, in metres (metric scale applied)."""
    out = photo_out
    h, w = photo.shape[:2]
    kp = out.intrinsics_pixels.astype(np.float64)
    j, i = np.meshgrid(np.arange(w) + 0.5, np.arange(h) + 0.5)
    x = (j - kp[0, 2]) / kp[0, 0] * out.depth
    y = (i - kp[1, 2]) / kp[1, 1] * out.depth
    v = out.mask
    np.testing.assert_allclose(out.points[..., 0][v], x[v], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.points[..., 1][v], y[v], rtol=1e-4, atol=1e-5)


def test_metric_scale_is_applied(tiny_model, photo):
    out = tiny_model(photo)
    raw_depth = tiny_model(photo, apply_mask=False).depth / out.metric_scale
    assert out.metric_scale != pytest.approx(1.0, abs=0.05)
    np.testing.assert_allclose(out.depth[out.mask] / out.metric_scale, raw_depth[out.mask], rtol=1e-6)


def test_repr(photo_out):
    text = repr(photo_out)
    assert re.fullmatch(
        r"MoGeOutput\(320x240, valid \d+\.\d%, median depth \d+\.\d{3} m, fov_x \d+\.\d deg, "
        r"metric_scale \d+\.\d{4}\)",
        text,
    ), text
    assert f"{100 * photo_out.mask.mean():.1f}%" in text


def test_dict_access_to_dict_to_torch(photo_out):
    out = photo_out
    assert out.keys() == list(INFER_KEYS)
    assert out["depth"] is out.depth and out["fov_x"] == out.fov_x
    with pytest.raises(KeyError):
        out["nope"]
    d = out.to_dict()
    assert list(d) == list(INFER_KEYS) and d["points"] is out.points
    t = out.to_torch()
    assert all(isinstance(v, torch.Tensor) for v in t.values())
    assert t["mask"].dtype == torch.bool and t["depth"].dtype == torch.float32
    assert torch.equal(t["depth"], torch.from_numpy(out.depth))


def test_save_npz_layout_and_round_trip(photo_out, tmp_path):
    path = tmp_path / "result.npz"
    photo_out.save_npz(path)
    data = np.load(path)
    assert sorted(data.files) == sorted(NPZ_LAYOUT)
    for key, (dtype, _) in NPZ_LAYOUT.items():
        assert data[key].dtype == np.dtype(dtype), key
    assert data["mask"].max() == 1 and data["metric_scale"].shape == ()
    np.testing.assert_array_equal(data["normal"], photo_out.normal.astype(np.float16))
    back = MoGeOutput.from_npz(path)
    np.testing.assert_array_equal(back.depth, photo_out.depth)
    np.testing.assert_array_equal(back.mask, photo_out.mask)
    assert back.fov_x == pytest.approx(photo_out.fov_x, rel=1e-6)


def test_list_in_list_out(tiny_model, photo, photo_out):
    small = synthetic_photo((100, 60), seed=1)
    outs = tiny_model([photo, small], fit="stretch")
    assert isinstance(outs, list) and len(outs) == 2
    assert_same(outs[0], tiny_model(photo, fit="stretch"))
    assert outs[1].depth.shape == (60, 100)


def test_minimum_size(tiny_model):
    assert tiny_model(synthetic_photo((8, 8))).depth.shape == (8, 8)
    for size in [(7, 8), (8, 7), (4, 4)]:
        with pytest.raises(ValueError, match="minimum size is 8x8"):
            tiny_model(synthetic_photo(size))


def test_fit_pad_and_stretch(tiny_model, photo):
    """pad keeps the aspect ratio (square pixels); stretch fills the canvas (pixel aspect follows the stretch)."""
    pad, stretch = tiny_model(photo, fit="pad"), tiny_model(photo, fit="stretch")
    assert pad.depth.shape == stretch.depth.shape == (240, 320)
    assert pad.intrinsics_pixels[0, 0] == pytest.approx(pad.intrinsics_pixels[1, 1], rel=1e-5)
    (cw, ch), (w, h) = TEST_CANVAS, (320, 240)
    aspect = stretch.intrinsics_pixels[1, 1] / stretch.intrinsics_pixels[0, 0]
    assert aspect == pytest.approx((cw / w) / (ch / h), rel=1e-5)
    assert not np.array_equal(pad.depth, stretch.depth)
    with pytest.raises(ValueError, match="fit must be one of"):
        tiny_model(photo, fit="crop")


def test_pad_puts_gray_bars_outside_the_content(tiny_model, photo):
    from tt_moge.constants import PAD_GRAY
    from tt_moge.host.pipeline import CallOptions, prepare

    prepared = prepare(photo, TEST_CANVAS, CallOptions())
    x0, y0, x1, y1 = prepared.plan.content_box
    canvas = prepared.canvas[0]
    assert (x1 - x0) / (y1 - y0) == pytest.approx(320 / 240, rel=0.01) and (y0, y1) == (0, TEST_CANVAS[1])
    assert torch.all(canvas[:, :, :x0] == PAD_GRAY / 255) and torch.all(canvas[:, :, x1:] == PAD_GRAY / 255)


def test_fov_x(tiny_model, photo):
    out = tiny_model(photo, fov_x=63.0)
    assert out.fov_x == pytest.approx(63.0, rel=1e-5)
    assert out.intrinsics_pixels[0, 0] == pytest.approx(160 / math.tan(math.radians(31.5)), rel=1e-5)
    assert 0.05 < out.mask.mean() < 0.95
    for bad in [0, 180, -5, float("nan"), float("inf"), "60", True, 1e-300, 5e-4, 179.9995, 180 - 1e-12]:
        with pytest.raises(ValueError, match=r"fov_x.* 0\.001 < fov_x < 179\.999|fov_x must be a number"):
            tiny_model(photo, fov_x=bad)
    assert tiny_model(photo, fov_x=np.float32(63.0)).fov_x == pytest.approx(63.0, rel=1e-5)


@pytest.mark.parametrize("fov_x", [0.0011, 179.9989])
def test_fov_x_at_the_ends_of_its_range_gives_finite_geometry(tiny_model, photo, fov_x):
    """Inside the documented margin (constants.FOV_X_MARGIN) the intrinsics, points and fov_x stay finite and
    give back the fov_x asked for (issue 28: fov_x=1e-300 gave inf intrinsics and fov_x_deg 0)."""
    out = tiny_model(photo, fov_x=fov_x)
    assert np.isfinite(out.intrinsics).all() and np.isfinite(out.intrinsics_pixels).all()
    assert np.isfinite(out.points[out.mask]).all() and out.mask.any()
    assert out.fov_x == pytest.approx(fov_x, rel=1e-3) and math.isfinite(out.fov_y) and out.fov_y > 0


def test_apply_mask_and_force_projection(tiny_model, photo, photo_out):
    unmasked = tiny_model(photo, apply_mask=False)
    np.testing.assert_array_equal(unmasked.mask, photo_out.mask)
    assert np.isfinite(unmasked.depth).all() and np.isfinite(unmasked.points).all()
    v = photo_out.mask
    np.testing.assert_array_equal(unmasked.depth[v], photo_out.depth[v])
    assert (np.linalg.norm(unmasked.normal[~v], axis=-1) > 0.99).all()
    raw_points = tiny_model(photo, force_projection=False)
    np.testing.assert_array_equal(raw_points.depth, photo_out.depth)
    assert not np.allclose(raw_points.points[v], photo_out.points[v])
    for name in ("apply_mask", "force_projection"):
        with pytest.raises(ValueError, match=name):
            tiny_model(photo, **{name: "yes"})


def test_float_images_off_canvas_go_through_8_bit(tiny_model, photo):
    noisy = np.clip(photo / 255.0 + 0.001, 0, 1)  # not on the 1/255 grid
    assert_same(tiny_model(noisy), tiny_model(np.rint(noisy * 255).astype(np.uint8)))


def test_float_canvas_images_are_not_quantised(tiny_model):
    from tt_moge.host.pipeline import CallOptions, prepare

    canvas = np.random.default_rng(0).random((TEST_CANVAS[1], TEST_CANVAS[0], 3), dtype=np.float32)
    prepared = prepare(canvas, TEST_CANVAS, CallOptions())
    assert torch.equal(prepared.canvas[0], torch.from_numpy(canvas).permute(2, 0, 1))


def test_exif_orientation_is_not_applied(tiny_model, photo, tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rotated.jpg"
    Image.fromarray(photo).save(path, exif=exif, quality=95)
    out = tiny_model(str(path))
    assert out.depth.shape == (240, 320)  # stored orientation, not the displayed (320x240 -> 240x320)
    assert_same(out, tiny_model(np.asarray(Image.open(path).convert("RGB"))))


# ------------------------------------------------------------------------------------ other methods
def test_predict_many_equals_single_calls(tiny_model, photo, tmp_path):
    images = [photo, synthetic_photo((200, 300), seed=5), synthetic_photo((64, 64), seed=6)]
    png = tmp_path / "a.png"
    Image.fromarray(images[1]).save(png)
    outs = tiny_model.predict_many([images[0], str(png), images[2]], fov_x=70.0)
    for image, out in zip(images, outs):
        assert_same(out, tiny_model(image, fov_x=70.0))
    assert tiny_model.predict_many([]) == []
    with pytest.raises(TypeError, match="unexpected option"):
        tiny_model.predict_many([photo], fov=3)
    with pytest.raises(ValueError, match=r"images\[1\]"):
        tiny_model.predict_many([photo, np.zeros((4, 4, 3), np.uint8)])
    with pytest.raises(FileNotFoundError, match=r"images\[1\]: no such file"):
        tiny_model.predict_many([photo, "/nonexistent/photo.png"])


def test_predict_many_finishes_the_previous_image_while_the_device_runs_the_next(tiny_model, monkeypatch):
    """With a runner whose forward returns only when done (CPU, Tenstorrent), image i-1's finish starts before
    image i's forward ends (it used to wait for image i+1's), and the results are those of single calls."""
    import time

    from tt_moge import service as service_module

    images = [synthetic_photo((48, 64 + 16 * i), seed=i) for i in range(4)]  # their sizes name them
    service = tiny_model.service.replaying(
        tiny_model.service.forward_raw(tiny_model.service.prepare(images[0], CallOptions()).canvas)
    )
    runner, forward_ends, finish_starts = service.runner, [], {}
    plain_forward = runner.forward

    def slow_forward(canvas):
        time.sleep(0.2)  # the device's time
        maps = plain_forward(canvas)
        forward_ends.append(time.perf_counter())
        return maps

    def recorded(raw, plan, options, *args, **kwargs):
        finish_starts[tuple(plan.image_size)] = time.perf_counter()
        return plain_postprocess(raw, plan, options, *args, **kwargs)

    plain_postprocess = service_module.postprocess
    monkeypatch.setattr(runner, "forward", slow_forward)
    monkeypatch.setattr(runner, "submit", lambda canvas: PendingMaps(slow_forward(canvas)))
    monkeypatch.setattr(service_module, "postprocess", recorded)
    outs = service.predict_many(images, CallOptions())
    assert len(forward_ends) == 4 and len(finish_starts) == 4
    for i in range(1, 4):
        h, w = images[i - 1].shape[:2]
        assert finish_starts[(w, h)] < forward_ends[i], f"image {i - 1} waited for the forward of image {i}"
    monkeypatch.setattr(service_module, "postprocess", plain_postprocess)
    for image, out in zip(images, outs):
        assert_same(out, service.predict(image, CallOptions()))


def test_infer_is_a_drop_in(tiny_model, photo):
    chw = torch.from_numpy(photo).permute(2, 0, 1).float() / 255
    out = tiny_model.infer(chw)
    assert sorted(out) == sorted(INFER_KEYS)
    assert (
        out["points"].shape == (240, 320, 3) and out["intrinsics"].shape == (3, 3) and out["mask"].dtype == torch.bool
    )
    single = tiny_model(chw).to_torch()
    assert all(torch.equal(out[k], single[k]) for k in out)
    other = torch.from_numpy(synthetic_photo((320, 240), seed=9)).permute(2, 0, 1).float() / 255
    batch = tiny_model.infer(
        torch.stack([chw, other]), fov_x=torch.tensor([60.0, 75.0]), use_fp16=True, resolution_level=3
    )
    assert batch["depth"].shape == (2, 240, 320) and batch["intrinsics"].shape == (2, 3, 3)
    for i, (img, fov) in enumerate([(chw, 60.0), (other, 75.0)]):
        ref = tiny_model(img, fov_x=fov).to_torch()
        assert all(torch.equal(batch[k][i], ref[k]) for k in ref)
    assert tiny_model.infer(chw, num_tokens=TEST_TOKENS)["depth"].shape == (240, 320)
    with pytest.raises(ValueError, match="num_tokens"):
        tiny_model.infer(chw, num_tokens=2000)


def test_forward_is_raw_and_canvas_sized(tiny_model):
    canvas = synthetic_photo(TEST_CANVAS, seed=2)
    raw = tiny_model.forward(canvas)
    w, h = TEST_CANVAS
    assert raw["points"].shape == (1, h, w, 3) and raw["normal"].shape == (1, h, w, 3)
    assert raw["mask"].shape == (1, h, w) and raw["metric_scale"].shape == (1,)
    assert 0 <= raw["mask"].min() and raw["mask"].max() <= 1 and (raw["points"][..., 2] > 0).all()
    as_float = tiny_model.forward(torch.from_numpy(canvas).permute(2, 0, 1)[None].float() / 255)
    assert torch.equal(as_float["points"], raw["points"])
    with pytest.raises(ValueError, match="canvas-sized"):
        tiny_model.forward(synthetic_photo((320, 240)))


def test_calls_are_thread_safe(tiny_model):
    images = [synthetic_photo((96 + 16 * i, 80), seed=i) for i in range(3)]
    expected = [tiny_model(img) for img in images]
    results: dict = {}

    def work(i):
        results[i] = tiny_model(images[i % 3], fit="pad")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        assert_same(results[i], expected[i % 3])


def test_close_and_with_block(checkpoint, photo):
    with load(checkpoint("tiny-vits-normal")) as m:
        m(photo)
    for call in (
        lambda: m(photo),
        lambda: m.forward(photo),
        lambda: m.infer(torch.zeros(3, 64, 64)),
        lambda: m.predict_many([photo]),
        lambda: m.warmup(),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    m.close()  # idempotent
    assert "closed" in repr(m)


# ------------------------------------------------------------------------------------ bad input
BAD_IMAGES = [
    (np.zeros((4, 4, 3), np.uint8), ValueError, "minimum size"),
    (np.zeros((32, 32, 4), np.uint8), ValueError, "4-channel"),
    (np.zeros((1, 1, 3, 32, 32), np.float32), ValueError, "5-D"),
    (np.full((32, 32, 3), np.nan, np.float32), ValueError, "NaN"),
    (np.full((32, 32, 3), 200.0, np.float32), ValueError, r"\[0, 1\]"),
    (np.zeros((32, 32, 3), np.int64), ValueError, "dtype"),
    ("/nonexistent/photo.png", FileNotFoundError, "no such file"),
    (b"not an image at all", ValueError, "not a decodable image"),
    (torch.zeros(2, 3, 32, 32), ValueError, "B=2"),
    ({"image": 1}, TypeError, "unsupported type"),
    (None, ValueError, "None"),
]


@pytest.mark.parametrize("image,exc,match", BAD_IMAGES, ids=[m for _, _, m in BAD_IMAGES])
def test_bad_images_raise_clear_errors_and_the_model_keeps_working(tiny_model, photo, photo_out, image, exc, match):
    with pytest.raises(exc, match=match) as info:
        tiny_model(image)
    assert str(info.value).startswith("image")  # the message names the argument
    assert_same(tiny_model(photo), photo_out)


def test_truncated_files(tiny_model, photo, photo_out, tmp_path):
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        Image.fromarray(photo).save(buf, format=fmt)
        path = tmp_path / f"cut.{fmt.lower()}"
        path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
        with pytest.raises(InputError, match="corrupt or truncated|not a decodable"):
            tiny_model(str(path))
    assert_same(tiny_model(photo), photo_out)


def test_a_load_that_fails_in_warm_up_closes_its_runner(checkpoint, monkeypatch):
    """A failure after the runner exists (here: a host warm-up variant) releases the runner before it propagates."""
    from tt_moge import model as model_mod

    closed = []
    real_make_runner = model_mod.make_runner

    def tracking_make_runner(*args, **kwargs):
        runner = real_make_runner(*args, **kwargs)
        real_close = runner.close
        runner.close = lambda: (closed.append(runner), real_close())
        return runner

    def broken_variant(self, key, photos=None):
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(model_mod, "make_runner", tracking_make_runner)
    monkeypatch.setattr(MoGeModel, "_warm_variant", broken_variant)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        load(checkpoint("tiny-vits-normal"), warmup_variants="minimal")
    assert len(closed) == 1


def test_bad_load_arguments_leave_no_model_half_open(checkpoint):
    with pytest.raises(ValueError):
        load(checkpoint("tiny-vits-normal"), warmup_variants={"input": "tiff"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with load(checkpoint("tiny-vits-normal")) as m:
            assert m.info()["canvas"] == list(TEST_CANVAS)
