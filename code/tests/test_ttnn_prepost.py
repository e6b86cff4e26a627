"""The Tenstorrent runner's input and output sides on the device (`runners/ttnn/pre.py`, `post.py`) against the
host functions they replace (`runner.patch_matrix`, `runner.raw_maps`: the torch resize, unfold, interleave and
activations the CPU path runs), through the ttnn emulator: exact in float32 emulation, and within bfloat16's
rounding (input) or about 16 bits (output) with the device's formats and fidelities. Canvases that are not whole
tiles, an odd token grid, photo-like input and random (non-smooth) phase maps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ttnn_emulator import EmulatedDevice, TtnnEmulator, round_bf16
from tt_moge.runners.ttnn.post import DeviceOutput, widen
from tt_moge.runners.ttnn.pre import DeviceInput, resize_matrix, split_bf16
from tt_moge.runners.ttnn.prepare import prepare_weights, resize_antialiased, resize_bilinear
from tt_moge.runners.ttnn.runner import patch_matrix, raw_maps
from tt_moge.testing import calibration_image, make_network

FLOAT32_READBACK = {"normal": "float32", "mask": "float32"}  # every head read back in float32

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


def _post(prep, phases: np.ndarray, exact: bool, readback=None) -> dict:
    """The device output side's maps, float32 (bfloat16 heads widened)."""
    T = TtnnEmulator(exact=exact)
    dev = T.open_device()
    post = DeviceOutput(T, dev, prep, readback)
    post.load()
    x = T.Tensor(phases[None, None], T.float32, dev, T.TILE_LAYOUT)
    return {name: widen(a) for name, a in post.read(post.forward(x)).items()}


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


def _angle_deg(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.degrees(2 * np.arcsin(np.minimum(np.linalg.norm(a - b, axis=-1) / 2, 1)))


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
    exp remap, normalisation, sigmoid): the host's `raw_maps` to the split matrices' 16 bits in float32 emulation;
    with the device's formats and fidelities the points to about 16 bits (relative depth error <= 1e-4, far inside
    the 1e-3 bound: the split resize), the normals and the mask to about bfloat16's (resizes without the split): on
    these random, non-smooth maps a mean angle of ~0.05 degree, p99 ~0.2 (the maximum, a few degrees, is where a
    random normal vector is nearly zero and normalising amplifies), mask probability within 3e-3. All in float32
    read-back formats (the arithmetic); `test_normals_and_mask_are_read_back_in_bfloat16` adds the rounding."""
    prep = prepared[case]
    readback = _phases(prep, seed=case[1])
    ref = raw_maps(prep, readback)
    width, height = case[0]
    for exact in (True, False):
        out = _post(prep, readback["finest"], exact, FLOAT32_READBACK)
        assert set(out) == {"points", "normal", "mask"}
        assert out["points"].shape == (3, height, width) and out["mask"].shape == (1, height, width)
        points, normal = out["points"].transpose(1, 2, 0), out["normal"].transpose(1, 2, 0)
        depth_tol = 3e-5 if exact else 1e-4
        depth_ref = ref.points[..., 2].numpy()
        assert np.abs(points[..., 2] / depth_ref - 1).max() <= depth_tol
        scale = np.abs(ref.points.numpy()).max(axis=(0, 1))
        assert (np.abs(points - ref.points.numpy()).max(axis=(0, 1)) <= depth_tol * scale).all()
        angle = _angle_deg(normal, ref.normal.numpy())
        mask = np.abs(out["mask"][0] - ref.mask.numpy()).max()
        if exact:
            assert angle.max() <= 0.01 and mask <= 2e-5
        else:
            assert angle.mean() <= 0.1 and np.quantile(angle, 0.99) <= 0.3 and mask <= 3e-3
            assert angle.mean() >= 0.01, "the normals' bfloat16 resize: the emulator should see its rounding"
        assert np.allclose(np.linalg.norm(normal, axis=-1), 1, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_normals_are_read_back_in_bfloat16(prepared, case):
    """The default read-back (`post.READBACK`): the points and the mask float32, the normals bfloat16, handed on as
    their bits (uint16); the mask too in bfloat16 when asked. Each bfloat16 map is the float32 result rounded once
    to nearest (the last op's output format, nothing earlier in bfloat16), and against the host's raw maps in the
    device formats: normals' mean angle under 0.1 degree (p99 ~0.23: bfloat16's half ulp is 2^-8 of a component);
    a bfloat16 mask's probability within 3.4e-3 and its 0.5 threshold kept on all but the pixels in (0.5, 0.502]
    (bfloat16 reads them as 0.5: why the default keeps the mask in float32)."""
    prep = prepared[case]
    readback = _phases(prep, seed=case[1])
    ref = raw_maps(prep, readback)
    wide = _post(prep, readback["finest"], False, FLOAT32_READBACK)
    T = TtnnEmulator()
    dev = T.open_device()
    default = DeviceOutput(T, dev, prep)
    assert default.readback == {"points": "float32", "normal": "bfloat16", "mask": "float32"}
    post = DeviceOutput(T, dev, prep, {"mask": "bfloat16"})
    for side, narrow in ((default, ("normal",)), (post, ("normal", "mask"))):
        side.load()
        maps = side.forward(T.Tensor(readback["finest"][None, None], T.float32, dev, T.TILE_LAYOUT))
        got = side.read(maps)
        for name in ("points", "normal", "mask"):
            assert maps[name].dtype == (T.bfloat16 if name in narrow else T.float32), name
            if name in narrow:  # one rounding, at the end
                assert got[name].dtype == np.uint16, name
                rounded = torch.from_numpy(wide[name]).to(torch.bfloat16).float().numpy()
                assert np.array_equal(widen(got[name]), rounded), name
            else:
                assert got[name].dtype == np.float32 and np.array_equal(got[name], wide[name]), name
    normal = widen(got["normal"]).transpose(1, 2, 0)
    angle = _angle_deg(normal, ref.normal.numpy())
    assert angle.mean() <= 0.1 and np.quantile(angle, 0.99) <= 0.3
    assert np.allclose(np.linalg.norm(normal, axis=-1), 1, atol=4e-3)
    mask, mask_ref = widen(got["mask"])[0], ref.mask.numpy()
    assert np.abs(mask - mask_ref).max() <= 4e-3
    assert ((mask > 0.5) == (mask_ref > 0.5)).mean() >= 0.998
    flipped = (mask > 0.5) != (wide["mask"][0] > 0.5)  # what the rounding alone flipped
    assert flipped.any() and (wide["mask"][0][flipped] > 0.5).all() and (wide["mask"][0][flipped] <= 0.5 + 2**-9).all()


def test_readback_formats_are_checked(prepared):
    prep = prepared[CASES[0]]
    for bad in ({"points": "bfloat16"}, {"normal": "bfloat8_b"}):
        with pytest.raises(ValueError, match="readback"):
            DeviceOutput(TtnnEmulator(), None, prep, bad)


def test_device_output_resizes_each_head_in_two_batched_matmuls(prepared):
    """One column and one row matmul per head, every channel of the head a batch of the same matmul (no per-channel
    slices of the maps), and each head's maps untilized once."""
    prep = prepared[CASES[0]]
    T = TtnnEmulator()
    dev = T.open_device()
    post = DeviceOutput(T, dev, prep)
    post.load()
    x = T.Tensor(_phases(prep, 1)["finest"][None, None], T.float32, dev, T.TILE_LAYOUT)
    T.op_counts.clear()
    post.forward(x)
    heads = len(prep.plan["heads"])
    assert T.op_counts["matmul"] + T.op_counts["linear"] == 2 * heads
    assert T.op_counts["to_layout"] == 2 + heads  # the phase maps' untilize, the interleaved map's tilize, the heads


@pytest.mark.parametrize("grid", [(13, 10), (1, 1)])
def test_device_output_keeps_its_maps_in_l1_when_they_fit(prepared, grid):
    """The intermediates go to L1 when a head's float32 canvas maps fit `pre.L1_MAP_BUDGET` per core (a 500x380 canvas
    on 130 cores), else DRAM (one core); the outputs are DRAM either way, with the same values."""
    prep = prepared[CASES[0]]
    T = TtnnEmulator()
    dev = EmulatedDevice(grid=grid)
    post = DeviceOutput(T, dev, prep)
    post.load()
    assert post.mem is (T.L1_MEMORY_CONFIG if grid == (13, 10) else T.DRAM_MEMORY_CONFIG)
    x = T.Tensor(_phases(prep, 2)["finest"][None, None], T.float32, dev, T.TILE_LAYOUT)
    out = post.forward(x)
    assert all(t.mem is T.DRAM_MEMORY_CONFIG for t in out.values())
    ref = _post(prep, _phases(prep, 2)["finest"], exact=False)
    for name, got in post.read(out).items():
        assert np.array_equal(widen(got), ref[name]), name


def test_device_output_runs_the_linear_remap(prepared):
    """A checkpoint whose points are not remapped ("linear"): the resized points as they are (no exp), the other
    heads as with "exp"."""
    prep = prepared[CASES[2]]
    linear = type(prep)({**prep.plan, "remap": "linear"}, prep.arrays)
    readback = _phases(linear, seed=5)
    ref = raw_maps(linear, readback)
    out = _post(linear, readback["finest"], exact=True, readback=FLOAT32_READBACK)
    points = out["points"].transpose(1, 2, 0)
    scale = np.abs(ref.points.numpy()).max()
    assert np.abs(points - ref.points.numpy()).max() <= 3e-5 * scale
    assert np.abs(out["mask"][0] - ref.mask.numpy()).max() <= 2e-5


def test_device_output_refuses_an_unsupported_remap(prepared):
    prep = prepared[CASES[0]]
    plan = {**prep.plan, "remap": "sinh"}
    with pytest.raises(ValueError, match="remap"):
        DeviceOutput(TtnnEmulator(), None, type(prep)(plan, prep.arrays))
