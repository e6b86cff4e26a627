"""The Tenstorrent runner's input and output sides on the device (`runners/ttnn/pre.py`, `post.py`) against the
host functions they replace (`runner.patch_matrix`, `runner.raw_maps`: the torch resize, unfold, interleave and
activations the CPU path runs), through the ttnn emulator: exact in float32 emulation, and within bfloat16's
rounding (input) or about 16 bits (output) with the device's formats and fidelities. Canvases that are not whole
tiles, an odd token grid, photo-like input and random (non-smooth) phase maps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ttnn_emulator import TtnnEmulator, round_bf16
from tt_moge.runners.ttnn.post import DeviceOutput
from tt_moge.runners.ttnn.pre import DeviceInput, resize_matrix, split_bf16
from tt_moge.runners.ttnn.prepare import prepare_weights, resize_antialiased, resize_bilinear
from tt_moge.runners.ttnn.runner import patch_matrix, raw_maps
from tt_moge.testing import calibration_image, make_network

# neither of the first two canvases is whole tiles (20x26 and 22x40 token grids); the third's finest maps are whole
# tiles (the output side's pad is one of nothing, which hands back its input)
CASES = [((500, 380), 600), ((640, 360), 900), ((224, 224), 256)]


@pytest.fixture(scope="module")
def prepared():
    net = make_network("tiny-vits-normal")
    return {case: prepare_weights(net, *case) for case in CASES}


def _pre(prep, canvas: torch.Tensor, exact: bool) -> np.ndarray:
    T = TtnnEmulator(exact=exact)
    dev = T.open_device()
    pre = DeviceInput(T, dev, prep)
    pre.load()
    out = pre.forward(pre.upload(canvas.numpy()))
    assert out.shape == (1, 1, prep.plan["seq_len"], prep.plan["patch_k_padded"]) and out.layout == T.TILE_LAYOUT
    return out.data.numpy()[0, 0]


def _post(prep, phases: np.ndarray, exact: bool) -> dict:
    T = TtnnEmulator(exact=exact)
    dev = T.open_device()
    post = DeviceOutput(T, dev, prep)
    post.load()
    x = T.Tensor(phases[None, None], T.float32, dev, T.TILE_LAYOUT)
    return post.read(post.forward(x))


def _phases(prep, seed: int) -> dict:
    fin = prep.plan["finest"]
    gen = np.random.default_rng(seed)
    return {
        "finest": gen.normal(0.0, 0.7, (fin["in_height"] * fin["in_width"], fin["phase_channels"])).astype(np.float32),
        "cls_token": gen.normal(0.0, 1.0, prep.plan["dim"]).astype(np.float32),
    }


def test_resize_matrices_are_the_reference_resizes():
    """The fixed matrices the device multiplies by are PyTorch's resizes (antialiased down, bilinear up)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 37, 53, generator=gen).numpy()
    down = resize_matrix(37, 17) @ x[0] @ resize_matrix(53, 23).T
    np.testing.assert_allclose(down, resize_antialiased(x, 17, 23)[0], atol=2e-6)
    up = resize_matrix(37, 80, "bilinear") @ x[1] @ resize_matrix(53, 101, "bilinear").T
    np.testing.assert_allclose(up, resize_bilinear(x, 80, 101)[1], atol=2e-6)


def test_split_bf16_parts_are_bfloat16_and_sum_to_the_value():
    x = np.random.default_rng(1).normal(0, 3, 10000).astype(np.float32)
    hi, lo = split_bf16(x)
    t = torch.from_numpy
    assert torch.equal(round_bf16(t(hi)), t(hi)) and torch.equal(round_bf16(t(lo)), t(lo))
    assert np.abs(hi + lo - x).max() <= np.abs(x).max() * 2.0**-16


@pytest.mark.parametrize("case", CASES)
def test_device_input_is_the_host_patch_matrix(prepared, case):
    """Canvas -> patch matrix on the device: the host's antialiased resize and unfold, to the split weights'
    16 bits in float32 emulation; in the device formats within the bfloat16 rounding the host path's upload had
    (max 2 ulps at 1, rms 1.6x the rounding's)."""
    prep = prepared[case]
    canvas = calibration_image(*case[0], seed=3)
    ref = patch_matrix(prep, canvas)
    exact = _pre(prep, canvas, exact=True)
    assert np.abs(exact - ref).max() < 2e-5  # the split weights' 16 bits
    got = _pre(prep, canvas, exact=False)
    rounding = round_bf16(torch.from_numpy(ref)).numpy() - ref
    err = got - ref
    assert np.abs(err).max() <= 2 * 2.0**-8
    assert np.sqrt((err**2).mean()) <= 1.6 * np.sqrt((rounding**2).mean())
    rows = prep.plan["grid_tokens"]
    assert not got[rows:].any() and not got[:, prep.plan["patch_k"] :].any()  # prefix rows, padding columns zero


@pytest.mark.parametrize("case", CASES)
def test_device_input_of_an_8_bit_canvas_is_the_host_patch_matrix(prepared, case):
    """A photo's canvas goes up as uint8 planes, the / 255 folded into the row resize's matrix: the host patch
    matrix of the same canvas in [0, 1], to the split weights' 16 bits in float32 emulation; in the device formats
    no further off than the float32 canvas's path (bfloat16 holds 0..255 exactly: the input is not rounded)."""
    prep = prepared[case]
    canvas8 = (calibration_image(*case[0], seed=3) * 255).round().to(torch.uint8)
    unit = canvas8.float() / 255
    ref = patch_matrix(prep, unit)
    assert np.abs(_pre(prep, canvas8, exact=True) - ref).max() < 2e-5
    err8 = _pre(prep, canvas8, exact=False) - ref
    err32 = _pre(prep, unit, exact=False) - ref
    assert np.abs(err8).max() <= 2 * 2.0**-8
    assert np.sqrt((err8**2).mean()) <= np.sqrt((err32**2).mean())


@pytest.mark.parametrize("case", CASES)
def test_device_output_is_the_host_raw_maps(prepared, case):
    """Finest phase maps -> raw maps at the canvas on the device (interleave, constant map, bilinear resize,
    exp remap, normalisation, sigmoid): the host's `raw_maps` to the split matrices' 16 bits in float32 emulation, and
    to about 16 bits with bfloat16 operands at HiFi4 (relative depth error <= 1e-4, far inside the 1e-3 bound)."""
    prep = prepared[case]
    readback = _phases(prep, seed=case[1])
    ref = raw_maps(prep, readback)
    width, height = case[0]
    # normals: absolute, and larger where a random map's normal vector is short (normalising amplifies)
    for exact, depth_tol, normal_tol, mask_tol in ((True, 3e-5, 1e-4, 2e-5), (False, 1e-4, 3e-4, 5e-5)):
        out = _post(prep, readback["finest"], exact)
        assert set(out) == {"points", "normal", "mask"}
        assert out["points"].shape == (3, height, width) and out["mask"].shape == (1, height, width)
        points, normal = out["points"].transpose(1, 2, 0), out["normal"].transpose(1, 2, 0)
        depth_ref = ref.points[..., 2].numpy()
        assert np.abs(points[..., 2] / depth_ref - 1).max() <= depth_tol
        scale = np.abs(ref.points.numpy()).max(axis=(0, 1))
        assert (np.abs(points - ref.points.numpy()).max(axis=(0, 1)) <= depth_tol * scale).all()
        assert np.abs(normal - ref.normal.numpy()).max() <= normal_tol
        assert np.abs(out["mask"][0] - ref.mask.numpy()).max() <= mask_tol


def test_device_output_refuses_an_unsupported_remap(prepared):
    prep = prepared[CASES[0]]
    plan = {**prep.plan, "remap": "sinh"}
    with pytest.raises(ValueError, match="remap"):
        DeviceOutput(TtnnEmulator(), None, type(prep)(plan, prep.arrays))
