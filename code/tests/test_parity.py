"""Our whole pipeline against upstream `MoGeModel.infer(..., use_fp16=False)` on canvas-sized images.

Two levels, so that a difference is attributed to the right part:
  1. our finish fed with upstream's own (focal, shift): must match upstream tightly (float32 round-off);
  2. our full pipeline with our solver: upstream solves with scipy LM at ftol=1e-3, i.e. it stops once a step
     improves the cost by less than 0.1 %, so its camera is approximate. Ours must reach an objective value at
     least as low on upstream's own objective, and the camera and maps agree to 1e-3 (relative), the scale of
     upstream's own stopping tolerance.
Every comparison first checks that what it compares is not trivial (a share of valid pixels well inside
(0, 1), finite depths where valid, a positive focal).
"""

from __future__ import annotations

from contextlib import contextmanager

import moge.utils.geometry_numpy as upstream_np  # the oracle (PyPI dlr-moge)
import moge.utils.geometry_torch as upstream_geo
import numpy as np
import pytest
import torch

from tt_moge import MoGeModel, native
from tt_moge.host.canvas import plan_canvas
from tt_moge.host.finish import finish
from tt_moge.host.solve import native_solve, objective, solve_focal_shift, solve_samples, solve_shift
from tt_moge.runners.base import PendingMaps, RawMaps, Runner
from tt_moge.testing import calibration_image

CANVAS = (448, 252)
TOKENS = 1200
OPTIONS = [
    {},
    {"fov_x": 70.0},
    {"apply_mask": False},
    {"force_projection": False},
    {"apply_mask": False, "force_projection": False, "fov_x": 95.0},
]


@contextmanager
def memoised_forward(model, image, tokens):
    """Upstream's forward once; inside the block its infer reuses clones of the result (infer edits them in
    place). The model is shared by other tests (session cache): its own forward comes back afterwards."""
    with torch.inference_mode():
        cached = model.forward(image[None], num_tokens=tokens)
    model.forward = lambda _image, num_tokens: {k: v.clone() for k, v in cached.items()}
    try:
        yield cached
    finally:
        del model.forward


def _upstream_camera(raw: dict, fov_x):
    mask = raw["mask"] > 0.5
    if fov_x is None:
        focal, shift = upstream_geo.recover_focal_shift(raw["points"], mask)
    else:
        h, w = raw["points"].shape[1:3]
        aspect = w / h
        focal = torch.tensor([aspect / (1 + aspect**2) ** 0.5 / np.tan(np.deg2rad(fov_x) / 2)], dtype=torch.float32)
        _, shift = upstream_geo.recover_focal_shift(raw["points"], mask, focal=focal)
    return float(focal), float(shift)


def _check_nontrivial(ref: dict) -> None:
    valid = ref["mask"].float().mean().item()
    assert 0.05 < valid < 0.95, f"valid share {valid:.3f}: the comparison would be trivial"
    assert torch.isfinite(ref["depth"][ref["mask"]]).all() and (ref["depth"][ref["mask"]] > 0).all()
    assert ref["intrinsics"][0, 0] > 0


def _compare(ours: dict, ref: dict, rtol: float) -> None:
    assert sorted(ours) == sorted(ref)
    assert torch.equal(ours["mask"], ref["mask"])
    for key in ("points", "depth", "normal", "intrinsics"):
        if key not in ref:
            continue
        a, b = ours[key].float(), ref[key].float()
        assert a.shape == b.shape, key
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{key}: inf pattern differs"
        fin = torch.isfinite(b)
        # allclose with atol = rtol * the map's scale (x and y cross zero at the principal point)
        scale = b[fin].abs().max().item()
        err = ((a - b).abs()[fin] / (b.abs()[fin] + scale)).max().item()
        assert err <= rtol, f"{key}: max error {err:.3g} > {rtol} (relative to |value| + map scale)"


@pytest.mark.parametrize("preset", ["tiny-vits-normal", "tiny-vits"])
def test_infer_matches_upstream(checkpoint, upstream, preset):
    path = checkpoint(preset)
    theirs = upstream(path)
    image = calibration_image(*CANVAS, seed=5)[0]
    plan = plan_canvas(CANVAS, CANVAS, "pad")
    with (
        memoised_forward(theirs, image, TOKENS) as raw,
        MoGeModel.from_pretrained(
            path, device="cpu", resolution=CANVAS, num_tokens=TOKENS, warmup=0, warmup_variants="none", precision="fp32"
        ) as ours,
    ):  # parity is the exact path (the CPU default is bf16)
        for options in OPTIONS:
            ref = theirs.infer(image, num_tokens=TOKENS, use_fp16=False, **options)
            _check_nontrivial(ref)
            # 1. our finish with upstream's camera: float32 round-off only
            focal, shift = _upstream_camera(raw, options.get("fov_x"))
            maps = RawMaps(
                raw["points"][0], raw.get("normal", [None])[0], raw["mask"][0], float(raw["metric_scale"][0])
            )
            mine = finish(
                maps,
                plan,
                focal,
                shift,
                apply_mask=options.get("apply_mask", True),
                force_projection=options.get("force_projection", True),
            ).to_torch()
            _compare(mine, ref, rtol=2e-5)
            # 2. our whole pipeline, our solver
            _compare(ours.infer(image, **options), ref, rtol=1e-3)


def test_solver_matches_upstream_sampling_and_is_at_least_as_good(checkpoint, upstream):
    """On real raw maps and on noisy ones: same samples as upstream, and an objective at least as low."""
    theirs = upstream(checkpoint("tiny-vits-normal"))
    image = calibration_image(*CANVAS, seed=7)[0]
    with torch.inference_mode():
        raw = theirs.forward(image[None], num_tokens=TOKENS)
    rng = np.random.default_rng(0)
    for trial in range(6):
        points = raw["points"][0].clone()
        if trial:
            points *= torch.from_numpy(1 + 0.05 * trial * rng.standard_normal(points.shape[:2]).astype(np.float32))[
                ..., None
            ]
        mask = raw["mask"][0] > 0.5
        uv, xyz = solve_samples(points, mask, (0, 0) + CANVAS)
        # upstream's own sampling: 64x64 nearest of points, uv and mask
        pts_lr = torch.nn.functional.interpolate(points.permute(2, 0, 1)[None], (64, 64), mode="nearest")[0].permute(
            1, 2, 0
        )
        m_lr = torch.nn.functional.interpolate(mask[None, None].float(), (64, 64), mode="nearest")[0, 0] > 0
        uv_full = upstream_geo.normalized_view_plane_uv(CANVAS[0], CANVAS[1])
        uv_lr = torch.nn.functional.interpolate(uv_full.permute(2, 0, 1)[None], (64, 64), mode="nearest")[0].permute(
            1, 2, 0
        )
        np.testing.assert_array_equal(xyz, pts_lr[m_lr].numpy().astype(np.float64))
        np.testing.assert_allclose(uv, uv_lr[m_lr].numpy(), rtol=0, atol=1e-7)
        assert 500 < len(uv) < 64 * 64

        their_shift, their_focal = upstream_np.solve_optimal_focal_shift(uv.astype(np.float32), xyz.astype(np.float32))
        focal, shift = solve_focal_shift(uv, xyz)
        assert focal > 0
        ours_cost = objective(uv, xyz, shift, focal)
        their_cost = objective(uv, xyz, float(their_shift), float(their_focal))
        assert ours_cost <= their_cost * (1 + 1e-9), (trial, ours_cost, their_cost)
        assert abs(focal - their_focal) <= 1e-3 * abs(their_focal)

        their_shift_only = upstream_np.solve_optimal_shift(uv.astype(np.float32), xyz.astype(np.float32), 0.9)
        shift_only = solve_shift(uv, xyz, 0.9)
        assert objective(uv, xyz, shift_only, 0.9) <= objective(uv, xyz, float(their_shift_only), 0.9) * (1 + 1e-9)


@pytest.mark.parametrize("solver", ["numpy", "native"])
def test_solver_recovers_a_known_camera(solver):
    """Exact synthetic samples: a pinhole camera of focal 1.3 and an affine shift of 0.7 come back to 1e-8 (the
    solvers' own stopping tolerance is below that), from the numpy solver and from the native one."""
    rng = np.random.default_rng(1)
    uv = rng.uniform(-0.8, 0.8, (2000, 2))
    depth = rng.uniform(2.0, 9.0, 2000)
    xyz = np.concatenate([uv * depth[:, None] / 1.3, (depth - 0.7)[:, None]], axis=1)
    if solver == "native":
        both, shift_only = native_solve, (lambda uv, xyz, f: native_solve(uv, xyz, f)[1])
    else:
        both, shift_only = solve_focal_shift, solve_shift
    previous = native.set_host_path("native")  # native_solve needs the library; the numpy solver ignores this
    try:
        focal, shift = both(uv, xyz)
        assert abs(focal - 1.3) < 1e-8 and abs(shift - 0.7) < 1e-8
        assert abs(shift_only(uv, xyz, 1.3) - 0.7) < 1e-8
        assert both(uv[:1], xyz[:1]) == (1.0, 0.0)  # too few samples: upstream's fallback
    finally:
        native.set_host_path(previous)


class _Recorder(Runner):
    """Wraps a runner: keeps the canvas and raw maps of each forward, so one ViT-L forward serves both the
    `infer` and the raw `forward` comparisons."""

    def __init__(self, runner: Runner):
        self.runner, self.device, self.precision = runner, runner.device, runner.precision
        self.calls: list = []

    def submit(self, canvas: torch.Tensor) -> PendingMaps:
        maps = self.runner.submit(canvas).result()
        copy = [None if t is None else t.clone() for t in (maps.points, maps.normal, maps.mask)]
        self.calls.append((canvas.clone(), RawMaps(*copy, maps.metric_scale)))  # as they left the runner
        return PendingMaps(maps)


class _Replay(Runner):
    """Hands back recorded raw maps, only for the very canvas they were computed from."""

    def __init__(self, canvas: torch.Tensor, maps: RawMaps, like: Runner):
        self.canvas, self.maps, self.device, self.precision = canvas, maps, like.device, like.precision

    def submit(self, canvas: torch.Tensor) -> PendingMaps:
        assert torch.equal(canvas, self.canvas), "forward(image) would run another canvas than infer(image) ran"
        return PendingMaps(self.maps)


def _infer_and_forward(model, image) -> tuple:
    """(`model.infer(image)`, `model.forward(image)`) for the cost of one device forward: infer runs on the real
    runner (recorded); forward (its canvas check and conversion run for real) gets the recorded raw maps, only if
    it asks for the very canvas infer ran (the runner is deterministic: same canvas, same maps)."""
    real = model.service.runner
    recorder = model.service.runner = _Recorder(real)
    try:
        out = model.infer(image)
        (canvas, maps), *more = recorder.calls
        assert not more, "infer ran more than one forward"
        model.service.runner = _Replay(canvas, maps, like=real)
        raw = model.forward(image)
    finally:
        model.service.runner = real
    return out, raw


@pytest.mark.full_size
def test_full_size_vitl_normal_matches_upstream(checkpoint, upstream):
    """The published shape: ViT-L with normal head, 1920x1080 canvas, 1800 tokens."""
    path = checkpoint("vitl-normal")
    theirs = upstream(path)
    canvas = (1920, 1080)
    image = calibration_image(*canvas, seed=11)[0]
    with (
        memoised_forward(theirs, image, 1800) as raw_ref,
        MoGeModel.from_pretrained(
            path, device="cpu", resolution=canvas, num_tokens=1800, warmup=0, warmup_variants="none", precision="fp32"
        ) as ours,
    ):  # parity is the exact path (the CPU default is bf16)
        out, raw = _infer_and_forward(ours, image)  # one ViT-L forward of ours for both
        for key in raw_ref:
            err = (raw[key] - raw_ref[key]).abs().max().item()
            assert err <= 2e-5 * max(1.0, raw_ref[key].abs().max().item()), (key, err)
        ref = theirs.infer(image, num_tokens=1800, use_fp16=False)
        _check_nontrivial(ref)
        _compare(out, ref, rtol=1e-3)
