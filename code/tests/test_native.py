"""The native host library against the torch/numpy reference path, its build cache and its fallback.

The native finish follows the reference op for op (ATen's fused multiply-adds included), so without a resize
the maps agree bit for bit; when resizing, ATen's bilinear kernel orders its arithmetic differently with the
number of stacked channels, and the perspective-correct resize (reciprocals before and after) can turn that
into a few ulp. The promise we test is: masks identical, floats within a few ulp (ULP_LIMIT), on raw maps of a
real forward of a well-posed random-weight model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tt_moge import native
from tt_moge.host import CallOptions, buffers, plan_canvas, postprocess
from tt_moge.host.finish import finish
from tt_moge.host.solve import native_solve, objective, recover_camera, solve_focal_shift, solve_samples, solve_shift
from tt_moge.runners.base import RawMaps
from tt_moge.testing import calibration_image
from tt_moge.testing.compare import ULP_LIMIT, max_ulps

CODE_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_host_path():
    previous = native.set_host_path(None)
    yield
    native.set_host_path(previous)


@pytest.fixture(scope="module")
def raw(tiny_model) -> RawMaps:
    maps = tiny_model._runner.forward(calibration_image(*tiny_model.resolution, seed=2))
    valid = (maps.mask > 0.5).float().mean().item()
    assert 0.1 < valid < 0.9 and maps.normal is not None
    return maps


def _both_paths(fn):
    out = {}
    for path in ("torch", "native"):
        native.set_host_path(path)
        assert native.host_path() == path
        out[path] = fn()
    return out["torch"], out["native"]


def _assert_same_output(ref, got, ulp_limit: int = ULP_LIMIT, all_valid: bool = False) -> None:
    assert np.array_equal(ref.mask, got.mask)
    if all_valid:  # no mask map: every pixel in front of the camera is valid
        assert ref.mask.all()
    else:
        assert 0.05 < ref.mask.mean() < 0.98, f"valid share {ref.mask.mean():.3f}: comparison would be trivial"
    for key in ("points", "depth", "normal"):
        a, b = getattr(ref, key), getattr(got, key)
        if a is None:
            assert b is None
            continue
        assert max_ulps(a, b) <= ulp_limit, key
    np.testing.assert_array_equal(ref.intrinsics, got.intrinsics)
    assert ref.metric_scale == got.metric_scale and ref.fov_x == pytest.approx(got.fov_x, rel=1e-12)


def _ulp_limit(plan) -> int:
    """Without a resize (identity, crop only) the native pass is bit-identical to the reference."""
    return 0 if plan.content_size == plan.image_size else ULP_LIMIT


# (input size, fit, options): identity, letterbox crop only, down- and upsampling, stretch, the options
CASES = [
    ((448, 252), "pad", {}),
    ((448, 200), "pad", {}),
    ((200, 150), "pad", {}),
    ((1000, 900), "pad", {"fov_x": 70.0}),
    ((640, 200), "stretch", {}),
    ((300, 300), "pad", {"apply_mask": False}),
    ((300, 300), "pad", {"force_projection": False}),
    ((333, 517), "stretch", {"apply_mask": False, "force_projection": False, "fov_x": 95.0}),
]


@pytest.mark.parametrize("size,fit,options", CASES)
def test_finish_native_equals_torch_for_the_same_camera(raw, size, fit, options):
    plan = plan_canvas(size, (448, 252), fit)
    focal, shift = recover_camera(raw.points, raw.mask, plan, options.get("fov_x"))
    kwargs = {k: v for k, v in options.items() if k != "fov_x"}
    ref, got = _both_paths(lambda: finish(raw, plan, focal, shift, **kwargs))
    _assert_same_output(ref, got, _ulp_limit(plan))


@pytest.mark.parametrize("size,fit,options", CASES)
def test_postprocess_native_equals_torch(raw, size, fit, options):
    plan = plan_canvas(size, (448, 252), fit)
    opts = CallOptions.make(fit, **options)
    ref, got = _both_paths(lambda: postprocess(raw, plan, opts))
    _assert_same_output(ref, got, _ulp_limit(plan))


def test_native_path_uses_the_shared_mask_threshold(raw, monkeypatch):
    """The native solve and finish take MASK_THRESHOLD from Python: change it and both paths still agree (and
    the mask does change)."""
    from tt_moge.host import finish as finish_mod
    from tt_moge.host import solve as solve_mod

    plan = plan_canvas((300, 300), (448, 252), "pad")
    default, _ = _both_paths(lambda: postprocess(raw, plan, CallOptions()))
    threshold = float(np.quantile(raw.mask.numpy(), 0.6))  # moves the valid share a lot from the 0.5 default
    monkeypatch.setattr(finish_mod, "MASK_THRESHOLD", threshold)
    monkeypatch.setattr(solve_mod, "MASK_THRESHOLD", threshold)
    ref, got = _both_paths(lambda: postprocess(raw, plan, CallOptions()))
    assert not np.array_equal(ref.mask, default.mask)
    _assert_same_output(ref, got)


@pytest.mark.parametrize("layout", ["contiguous", "no-normal", "no-mask"])
def test_finish_native_handles_layouts_and_missing_maps(raw, layout):
    normal, mask = raw.normal, raw.mask
    if layout == "contiguous":
        normal = normal.contiguous()
    elif layout == "no-normal":
        normal = None
    else:
        mask = None
    maps = RawMaps(raw.points, normal, mask, raw.metric_scale)
    for size in ((448, 252), (300, 400)):
        plan = plan_canvas(size, (448, 252), "pad")
        ref, got = _both_paths(lambda: postprocess(maps, plan, CallOptions()))
        _assert_same_output(ref, got, all_valid=mask is None)


@pytest.mark.parametrize("heads", [("normal", "mask"), ("mask",)])
@pytest.mark.parametrize("size", [(448, 252), (448, 200), (300, 400)])
def test_bfloat16_normal_and_mask_are_read_as_they_are(raw, heads, size):
    """The Tenstorrent runner's read-back: channels-first planes, the normal and the mask in bfloat16. The native
    solve and finish read the bfloat16 bits directly (no float32 copy); the torch path converts first. Widening
    bfloat16 is exact, so both paths agree as they do on float32 maps, and the solve sees the same samples."""

    def planar(t, bf16):  # (H, W, C) strided view of (C, H, W) planes, as runner.device_raw_maps hands them on
        t = t.permute(2, 0, 1).contiguous().permute(1, 2, 0)
        return t.to(torch.bfloat16) if bf16 else t

    normal = planar(raw.normal, "normal" in heads)
    mask = raw.mask.contiguous().to(torch.bfloat16)
    maps = RawMaps(planar(raw.points, False), normal, mask, raw.metric_scale)
    assert maps.mask.dtype == torch.bfloat16 and maps.normal.dtype == (
        torch.bfloat16 if "normal" in heads else torch.float32
    )
    plan = plan_canvas(size, (448, 252), "pad")
    ref, got = _both_paths(lambda: postprocess(maps, plan, CallOptions()))
    _assert_same_output(ref, got, ULP_LIMIT)  # bfloat16 normals are normalised (ATen's kernel: a few ulp)
    widened = RawMaps(maps.points, maps.normal.float(), maps.mask.float(), maps.metric_scale)
    native.set_host_path("native")
    want = postprocess(widened, plan, CallOptions())  # the same as its float32 widening, the normals unit again
    if "normal" in heads and plan.content_size == plan.image_size:
        norm = np.linalg.norm(want.normal[want.mask], axis=-1)
        assert np.abs(norm - 1).max() > 1e-3, "bfloat16 normals are off unit length before the finish"
        want.normal[want.mask] /= norm[:, None]
        assert max_ulps(want.normal, got.normal) <= 4
        want.normal = got.normal
    _assert_same_output(want, got, 0)
    assert np.abs(np.linalg.norm(got.normal[got.mask], axis=-1) - 1).max() <= 1e-6


def test_native_threads_do_not_change_results(raw):
    native.set_host_path("native")
    plan = plan_canvas((900, 700), (448, 252), "pad")
    before = native.threads()
    try:
        outs = []
        for count in (1, 3):
            assert native.set_threads(count) == count
            outs.append(postprocess(raw, plan, CallOptions()))
    finally:
        native.set_threads(before)
    for key in ("points", "depth", "normal", "mask"):
        assert np.array_equal(getattr(outs[0], key), getattr(outs[1], key), equal_nan=key != "mask")


def test_native_solver_matches_numpy_and_beats_upstream(raw):
    import moge.utils.geometry_numpy as upstream_np  # the oracle (PyPI dlr-moge)

    rng = np.random.default_rng(0)
    mask = raw.mask > 0.5
    native.set_host_path("native")
    for trial in range(5):
        points = raw.points.clone()
        if trial:
            noise = 1 + 0.05 * trial * rng.standard_normal(points.shape[:2]).astype(np.float32)
            points *= torch.from_numpy(noise)[..., None]
        uv, xyz = solve_samples(points, mask, (0, 0, 448, 252))
        assert 500 < len(uv) < 64 * 64
        focal, shift = native_solve(uv, xyz)
        assert focal > 0
        py_focal, py_shift = solve_focal_shift(uv, xyz)
        # the same algorithm: equal to far below the cost's resolution of the shift (~1e-8: see solve._newton)
        assert abs(focal - py_focal) <= 1e-11 * abs(py_focal) and abs(shift - py_shift) <= 1e-11 * (1 + abs(py_shift))
        their_shift, their_focal = upstream_np.solve_optimal_focal_shift(uv.astype(np.float32), xyz.astype(np.float32))
        assert objective(uv, xyz, shift, focal) <= objective(uv, xyz, float(their_shift), float(their_focal)) * (
            1 + 1e-9
        )
        _, shift_only = native_solve(uv, xyz, 0.9)
        assert abs(shift_only - solve_shift(uv, xyz, 0.9)) <= 1e-11 * (1 + abs(shift_only))
        their_shift_only = upstream_np.solve_optimal_shift(uv.astype(np.float32), xyz.astype(np.float32), 0.9)
        assert objective(uv, xyz, shift_only, 0.9) <= objective(uv, xyz, float(their_shift_only), 0.9) * (1 + 1e-9)
        # the native sampling (from the probability or the bool mask) is upstream's sampling
        plan = plan_canvas((448, 252), (448, 252), "pad")
        for m in (raw.mask, mask):
            got = recover_camera(points, m, plan)
            assert got[0] == pytest.approx(focal, rel=1e-12) and got[1] == pytest.approx(shift, rel=1e-12, abs=1e-12)


def test_output_buffers_are_reused_only_after_release():
    buffers.clear()
    a = buffers.empty((512, 512, 3), np.float32)
    view = a[10:20]
    address = a.ctypes.data
    del a
    assert buffers.free_bytes() == 0  # a view still uses the block
    b = buffers.empty((512, 512, 3), np.float32)
    assert b.ctypes.data != address
    del view
    assert buffers.free_bytes() == 512 * 512 * 3 * 4
    c = buffers.empty((512, 512, 3), np.float32)
    assert c.ctypes.data == address and buffers.free_bytes() == 0
    t = torch.from_numpy(c)
    del c
    assert buffers.free_bytes() == 0  # the tensor keeps it
    del t, b
    assert buffers.free_bytes() == 2 * 512 * 512 * 3 * 4
    assert buffers.empty((10, 10), np.float32).base is None  # small arrays: plain numpy


def test_a_release_on_a_thread_that_holds_the_pools_lock_does_not_wait():
    """A pooled array's release is a finalizer, and a finalizer runs wherever a garbage collection starts: also
    inside `buffers.empty` while its thread holds the pool's lock (an allocation there collects a lease left in a
    reference cycle). It used to wait for that lock, held by its own thread: CI hung in
    test_api.py::test_calls_are_thread_safe with one thread in `_release` under `empty`. Here the last reference
    goes while the lock is held (the finalizer runs at once); the block reaches the pool when the lock is free."""
    buffers.clear()
    size = (1 << 20,)
    a = buffers.empty(size, np.uint8)
    address = a.ctypes.data
    arrays = [a]
    del a

    def inside_the_lock():
        with buffers._lock:
            arrays.clear()  # the lease's finalizer runs here, on this thread, under the lock

    thread = threading.Thread(target=inside_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the release waited for the lock its own thread holds"
    assert buffers.free_bytes() == size[0]  # pooled once the lock was free
    assert buffers.empty(size, np.uint8).ctypes.data == address
    buffers.clear()


def test_output_buffer_pool_keeps_the_newest_sizes(monkeypatch):
    """Over its budget the pool drops the blocks released longest ago: a new size is pooled, not refused."""
    buffers.clear()
    mib = 1 << 20
    monkeypatch.setattr(buffers, "MAX_FREE_BYTES", 3 * mib)
    old = [buffers.empty((mib,), np.uint8) for _ in range(3)]
    old_addresses = {a.ctypes.data for a in old}
    del old
    assert buffers.free_bytes() == 3 * mib
    new = buffers.empty((2 * mib,), np.uint8)  # a size the pool has not seen
    new_address = new.ctypes.data
    del new
    assert buffers.free_bytes() == 3 * mib  # two old blocks made room for it
    again = buffers.empty((2 * mib,), np.uint8)
    assert again.ctypes.data == new_address and buffers.free_bytes() == mib  # taken from the pool
    del again
    survivor = buffers.empty((mib,), np.uint8)
    assert survivor.ctypes.data in old_addresses  # the newest old block is still there
    buffers.clear()


def test_invalid_settings_are_named(monkeypatch):
    with pytest.raises(ValueError, match="host path"):
        native.set_host_path("gpu")
    monkeypatch.setenv("MOGE_HOST", "fast")
    with pytest.raises(ValueError, match="MOGE_HOST"):
        native.host_path()
    monkeypatch.delenv("MOGE_HOST")
    monkeypatch.setenv("MOGE_SERVE_THREADS", "many")
    with pytest.raises(ValueError, match="MOGE_SERVE_THREADS"):
        native.default_threads()
    monkeypatch.setenv("MOGE_SERVE_THREADS", "3")
    assert native.default_threads() == 3
    with pytest.raises(ValueError, match="positive int"):
        native.set_threads(0)


def test_missing_compiler_falls_back_to_torch_with_a_warning(monkeypatch, tmp_path, raw):
    monkeypatch.setenv("MOGE_CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("MOGE_NATIVE_CACHE", str(tmp_path / "cache"))
    native.reset()
    try:
        native.set_host_path("native")
        with pytest.raises(native.NativeBuildError, match="no-such-g"):
            native.library()
        native.set_host_path(None)
        with pytest.warns(RuntimeWarning, match="torch host path"):
            assert native.host_path() == "torch"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not on every call
            out = postprocess(raw, plan_canvas((448, 252), (448, 252), "pad"), CallOptions())
        assert 0.05 < out.mask.mean() < 0.95
    finally:
        monkeypatch.undo()
        native.reset()
    assert native.host_path() == "native"


def test_concurrent_builds_share_one_cached_library(tmp_path):
    """Three fresh processes build into an empty cache at once: one compiles, all load the same file."""
    compiles = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"  # g++ that counts the compilations (not the version queries)
    wrapper.write_text(
        f'#!/bin/sh\ncase "$*" in *-dumpversion*) ;; *) echo compile >> "{compiles}" ;; esac\nexec g++ "$@"\n'
    )
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    env = dict(
        os.environ,
        MOGE_NATIVE_CACHE=str(cache),
        MOGE_HOST="native",
        MOGE_CXX=str(wrapper),
        PYTHONPATH=str(CODE_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    code = "from tt_moge import native; lib = native.library(); print(lib._name)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    names = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        names.append(out.strip())
    assert len(set(names)) == 1
    assert compiles.read_text().splitlines() == ["compile"]  # the lock: one process compiled, two waited
    files = sorted(f.name for f in cache.iterdir())
    libs = [f for f in files if f.endswith(".so")]
    assert len(libs) == 1 and libs[0].startswith("libmoge_host-") and Path(names[0]).name == libs[0]
    assert not [f for f in files if "partial" in f]


@pytest.mark.parametrize(
    "size,fit",
    [((448, 252), "pad"), ((300, 120), "pad"), ((120, 300), "pad"), ((640, 480), "stretch"), ((448, 200), "pad")],
)
def test_canvas_native_is_bit_identical(size, fit):
    from tt_moge.host.canvas import fit_to_canvas
    from tt_moge.synthetic import synthetic_photo

    plan = plan_canvas(size, (448, 252), fit)
    photo = synthetic_photo(size, seed=3)
    planar = np.ascontiguousarray(photo.transpose(2, 0, 1)).transpose(1, 2, 0)  # (H, W, 3) view, strided
    for rgb in (photo, planar):
        ref, got = _both_paths(lambda: fit_to_canvas(rgb, plan))
        assert ref.shape == got.shape == (1, 3, 252, 448) and torch.equal(ref, got)
        if rgb is photo:  # (to_rgb_array hands over C-contiguous uint8 arrays only)
            assert ref.stride() == got.stride()
        assert 0.2 < float(got.mean()) < 0.8


@pytest.mark.parametrize(
    "size,fit", [((448, 252), "pad"), ((300, 120), "pad"), ((120, 300), "pad"), ((640, 480), "stretch")]
)
def test_8_bit_canvas_is_the_float_canvas_times_255_on_both_paths(size, fit):
    """fit_to_canvas(..., uint8=True), the canvas a runner that takes 8 bits uploads: contiguous (1, 3, H, W) uint8
    planes holding exactly 255 x the float canvas (bars, resized content, identity), native and numpy alike, from
    C-contiguous and strided images; a float image of the canvas size has no 8-bit form and stays float32."""
    from tt_moge.host.canvas import fit_to_canvas
    from tt_moge.synthetic import synthetic_photo

    plan = plan_canvas(size, (448, 252), fit)
    photo = synthetic_photo(size, seed=4)
    planar = np.ascontiguousarray(photo.transpose(2, 0, 1)).transpose(1, 2, 0)  # (H, W, 3) view, strided
    for rgb in (photo, planar):
        unit = fit_to_canvas(rgb, plan)
        for got in _both_paths(lambda: fit_to_canvas(rgb, plan, uint8=True)):
            assert got.dtype == torch.uint8 and got.shape == (1, 3, 252, 448) and got.is_contiguous()
            assert torch.equal(got.float() / 255, unit)
    if plan.is_identity:
        image = photo.astype(np.float32) / 255 + np.float32(1e-3)  # between 8-bit levels
        got = fit_to_canvas(image, plan, uint8=True)
        assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(image).permute(2, 0, 1)[None])
