"""Host geometry against exact ground truth: the ray-cast demo scene (tt_moge.scene).

The raw forward output is replaced by what a perfect network would predict for the canvas: the true canvas
point map made affine (an unknown scale s and z-shift t: s * (X, Y, Z + t)), the true normals, a mask that is
1 on the scene and 0 on sky and letterbox bars, and metric_scale = 1 / s. Solve + finish must then recover the
true depth, points, normals, mask and intrinsics of the input image.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import ndimage

from tt_moge.host.canvas import plan_canvas
from tt_moge.host.pipeline import CallOptions, postprocess
from tt_moge.runners.base import RawMaps
from tt_moge.scene import intrinsics_for, render

CANVAS = (960, 540)
SCALE, SHIFT = 0.37, 0.9  # the unknown affine of the "network" output


def perfect_raw(plan, k_in: np.ndarray) -> RawMaps:
    """The canvas maps a perfect MoGe-2 would return for an input of camera k_in fitted by `plan`."""
    (w, h), (x0, y0, x1, y1) = plan.image_size, plan.content_box
    sx, sy = (x1 - x0) / w, (y1 - y0) / h
    k_canvas = np.array(
        [[k_in[0, 0] * sx, 0, x0 + k_in[0, 2] * sx], [0, k_in[1, 1] * sy, y0 + k_in[1, 2] * sy], [0, 0, 1]]
    )
    truth = render(*plan.canvas_size, intrinsics=k_canvas)
    inside = np.zeros(truth.mask.shape, bool)
    inside[y0:y1, x0:x1] = True
    valid = truth.mask & inside
    points = SCALE * (truth.points + np.array([0.0, 0.0, SHIFT]))
    points[~valid] = (0.0, 0.0, 1.0)  # whatever the network says there is masked out
    return RawMaps(
        torch.from_numpy(points.astype(np.float32)),
        torch.from_numpy(truth.normal.astype(np.float32)),
        torch.from_numpy(valid.astype(np.float32)),
        1.0 / SCALE,
    )


def smooth_interior(truth) -> np.ndarray:
    """Pixels whose 5x5 neighbourhood sees one smooth surface: away from sky, silhouettes and box edges
    (where any resize must mix surfaces)."""
    s = truth.surface
    same = (ndimage.maximum_filter(s, 5) == s) & (ndimage.minimum_filter(s, 5) == s)
    return same & truth.mask


CASES = [
    # (input size, fit, pixel aspect of the input camera): identity, pad (4:3 into 16:9), pad enlarging,
    # stretch of a canvas-aspect image, stretch of a 4:3 image whose camera is square on the canvas.
    ((960, 540), "pad", 1.0),
    ((640, 480), "pad", 1.0),
    ((400, 300), "pad", 1.0),
    ((480, 270), "stretch", 1.0),
    ((640, 480), "stretch", (640 / 480) / (960 / 540)),
]


@pytest.mark.parametrize("fov_given", [False, True])
@pytest.mark.parametrize("size,fit,pixel_aspect", CASES)
def test_solve_and_finish_recover_the_true_geometry(size, fit, pixel_aspect, fov_given):
    w, h = size
    k_in = intrinsics_for(w, h, pixel_aspect=pixel_aspect)
    truth = render(w, h, intrinsics=k_in)
    plan = plan_canvas(size, CANVAS, fit)
    fov_x = math.degrees(2 * math.atan(w / 2 / k_in[0, 0])) if fov_given else None
    out = postprocess(perfect_raw(plan, k_in), plan, CallOptions.make(fit=fit, fov_x=fov_x))

    expected_k = k_in / np.array([[w], [h], [1]])
    np.testing.assert_allclose(out.intrinsics, expected_k, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out.intrinsics_pixels, k_in, rtol=1e-4, atol=1e-3)
    assert out.fov_x == pytest.approx(math.degrees(2 * math.atan(w / 2 / k_in[0, 0])), rel=1e-4)
    assert out.metric_scale == pytest.approx(1 / SCALE)

    interior = smooth_interior(truth)
    assert interior.sum() > 0.6 * truth.mask.sum()  # the check covers most of the scene
    assert out.mask[interior].all() and not out.mask[~ndimage.binary_dilation(truth.mask, np.ones((5, 5)))].any()
    rel = np.abs(out.depth[interior] - truth.depth[interior]) / truth.depth[interior]
    assert rel.max() < 1e-3, f"depth: max relative error {rel.max():.2e}"
    err = np.linalg.norm(out.points[interior] - truth.points[interior], axis=-1) / truth.depth[interior]
    assert err.max() < 1e-3, f"points: max error / depth {err.max():.2e}"
    cos = (out.normal[interior] * truth.normal[interior]).sum(-1)
    assert np.degrees(np.arccos(np.clip(cos, -1, 1))).max() < 1.0
    assert np.isinf(out.depth[~out.mask]).all() and (out.normal[~out.mask] == 0).all()


def test_wrong_shift_would_be_caught():
    """The checks above are sharp: a shift off by 0.005 (0.4 % of the nearest raw depth) fails the depth bound."""
    from tt_moge.host.finish import finish
    from tt_moge.host.solve import recover_camera

    size = (640, 480)
    k_in = intrinsics_for(*size)
    truth = render(*size, intrinsics=k_in)
    plan = plan_canvas(size, CANVAS, "pad")
    raw = perfect_raw(plan, k_in)
    focal, shift = recover_camera(raw.points, raw.mask > 0.5, plan)
    assert shift == pytest.approx(-SCALE * SHIFT, rel=1e-5)
    off = finish(raw, plan, focal, shift - 0.005)
    interior = smooth_interior(truth)
    rel = np.abs(off.depth[interior] - truth.depth[interior]) / truth.depth[interior]
    assert rel.max() > 1e-3


def test_demo_image_is_the_rendered_scene():
    """media/source.png is the scene's 1920x1080 render (so its ground truth is known exactly)."""
    from PIL import Image

    path = Path(__file__).resolve().parents[2] / "media" / "source.png"
    shipped = np.asarray(Image.open(path).convert("RGB")).astype(int)
    rendered = render(1920, 1080).image.astype(int)
    assert shipped.shape == rendered.shape == (1080, 1920, 3)
    diff = np.abs(shipped - rendered)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3  # libm differences may move a rounding by one level


@pytest.mark.parametrize("force_projection", [True, False])
@pytest.mark.parametrize("size", [(640, 480), (400, 300)])
def test_flat_surfaces_stay_exact_through_the_resize(size, force_projection):
    """finish resamples inverse depth and ray directions, which are linear across a plane: on the ground and the
    facade the depth and the points come back to float round-off (resampling z or x, y would bend them by ~1e-3)."""
    k_in = intrinsics_for(*size)
    truth = render(*size, intrinsics=k_in)
    plan = plan_canvas(size, CANVAS, "pad")
    assert plan.content_size != size  # the maps are resized
    out = postprocess(perfect_raw(plan, k_in), plan, CallOptions.make(force_projection=force_projection))
    flat = smooth_interior(truth) & np.isin(truth.surface, (0, 1))  # the ground plane and the building facade
    assert flat.sum() > 0.3 * truth.mask.sum()
    depth = truth.depth[flat]
    assert (np.abs(out.depth[flat] - depth) / depth).max() < 2e-5
    assert (np.linalg.norm(out.points[flat] - truth.points[flat], axis=-1) / depth).max() < 2e-5


# Known intrinsics (the call option `intrinsics`): an off-centre principal point and fx != fy, which the free
# solve cannot represent (it assumes a centred principal point and square canvas pixels).
INTRINSICS_CASES = [
    # (input size, fit, principal point offset from the centre in pixels, pixel aspect fx / fy)
    ((960, 540), "pad", (0.0, 0.0), 1.0),
    ((640, 480), "pad", (41.0, -27.0), 1.0),
    ((400, 300), "pad", (-23.5, 18.0), 1.08),
    ((480, 270), "stretch", (30.0, 12.0), 1.0),
    ((640, 480), "stretch", (-35.0, -20.0), 0.93),
]


def _camera(size, offset, pixel_aspect) -> np.ndarray:
    k = intrinsics_for(*size, pixel_aspect=pixel_aspect)
    k[0, 2] += offset[0]
    k[1, 2] += offset[1]
    return k


@pytest.mark.parametrize("unit", ["pixels", "normalised"])
@pytest.mark.parametrize("size,fit,offset,pixel_aspect", INTRINSICS_CASES)
def test_given_intrinsics_give_the_true_geometry_and_exactly_those_intrinsics(size, fit, offset, pixel_aspect, unit):
    """With the camera's intrinsics given, only the shift is solved: the depth and points are the truth, and the
    output's intrinsics are the given numbers exactly (float32 of them), in the unit they were given in."""
    from tt_moge.host.intrinsics import Intrinsics

    w, h = size
    k_in = _camera(size, offset, pixel_aspect)
    truth = render(w, h, intrinsics=k_in)
    plan = plan_canvas(size, CANVAS, fit)
    k_n = k_in / np.array([[w], [h], [1]])
    given = k_in if unit == "pixels" else Intrinsics.from_matrix(k_n, normalised=True)
    out = postprocess(perfect_raw(plan, k_in), plan, CallOptions.make(fit=fit, intrinsics=given))

    if unit == "pixels":
        assert np.array_equal(out.intrinsics_pixels, k_in.astype(np.float32))
        np.testing.assert_allclose(out.intrinsics, k_n, rtol=1e-6)
    else:
        assert np.array_equal(out.intrinsics, k_n.astype(np.float32))
        np.testing.assert_allclose(out.intrinsics_pixels, k_in, rtol=1e-6)
    assert out.fov_x == pytest.approx(math.degrees(2 * math.atan(0.5 / k_n[0, 0])), rel=1e-6)

    interior = smooth_interior(truth)
    assert interior.sum() > 0.6 * truth.mask.sum()
    assert out.mask[interior].all()
    rel = np.abs(out.depth[interior] - truth.depth[interior]) / truth.depth[interior]
    assert rel.max() < 1e-3, f"depth: max relative error {rel.max():.2e}"
    err = np.linalg.norm(out.points[interior] - truth.points[interior], axis=-1) / truth.depth[interior]
    assert err.max() < 1e-3, f"points: max error / depth {err.max():.2e}"


def test_given_intrinsics_matter_where_the_free_solve_cannot_follow():
    """The checks above are sharp: on the off-centre camera, the free solve, or the shift solved with the
    principal point wrongly at the centre, misses the depth bound; the solve with the true camera meets it."""
    from tt_moge.host.intrinsics import Intrinsics
    from tt_moge.host.solve import recover_shift

    size = (640, 480)
    k_in = _camera(size, (41.0, -27.0), 1.0)
    truth = render(*size, intrinsics=k_in)
    plan = plan_canvas(size, CANVAS, "pad")
    raw = perfect_raw(plan, k_in)
    interior = smooth_interior(truth)

    def worst(out) -> float:
        return float((np.abs(out.depth[interior] - truth.depth[interior]) / truth.depth[interior]).max())

    assert worst(postprocess(raw, plan, CallOptions())) > 1e-3
    centred = k_in.copy()
    centred[:2, 2] = (size[0] / 2, size[1] / 2)
    assert worst(postprocess(raw, plan, CallOptions.make(intrinsics=centred))) > 1e-3
    k_n = Intrinsics.from_matrix(k_in).normalised_matrix(size)
    assert recover_shift(raw.points, raw.mask, plan, k_n) == pytest.approx(-SCALE * SHIFT, rel=1e-5)
