"""The npz writer: a valid zip that np.load reads back exactly, deflated where it pays, no pickles."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from tt_moge.npzio import MIN_DEFLATE_BYTES, npz_bytes


def sample_arrays() -> dict:
    rng = np.random.default_rng(0)
    return {
        "points": rng.normal(size=(60, 80, 3)).astype(np.float32).cumsum(axis=1),
        "normal": rng.normal(size=(60, 80, 3)).astype(np.float16),
        "mask": (rng.random((60, 80)) > 0.3).astype(np.uint8),
        "flags": rng.random((30, 30)) > 0.5,
        "fortran": np.asfortranarray(rng.random((40, 50))),
        "strided": rng.random((100, 90))[::2, ::3],
        "scalar": np.float32(3.25),
        "empty": np.zeros((0, 3), np.float32),
        "depth_inf": np.where(rng.random((20, 20)) > 0.5, np.inf, 1.5).astype(np.float32),
    }


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_is_exact_and_the_zip_is_valid(compress):
    arrays = sample_arrays()
    data = npz_bytes(arrays, compress=compress)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.testzip() is None  # every CRC matches
        methods = {info.filename: info.compress_type for info in archive.infolist()}
    assert list(methods) == [f"{name}.npy" for name in arrays]
    with np.load(io.BytesIO(data), allow_pickle=False) as loaded:
        for name, value in arrays.items():
            value = np.asarray(value)
            assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape, name
            assert np.array_equal(loaded[name], value), name
    big = {name for name, value in arrays.items() if np.asarray(value).nbytes + 128 >= MIN_DEFLATE_BYTES}
    for name, method in methods.items():
        deflated = compress and name[:-4] in big
        assert method == (zipfile.ZIP_DEFLATED if deflated else zipfile.ZIP_STORED), name


def test_deflate_shrinks_the_maps_and_equal_arrays_give_equal_bytes():
    arrays = sample_arrays()
    assert len(npz_bytes(arrays, compress=True)) < len(npz_bytes(arrays, compress=False))
    with zipfile.ZipFile(io.BytesIO(npz_bytes(arrays, compress=True))) as archive:
        mask = archive.getinfo("mask.npy")
        assert mask.compress_size < 0.5 * mask.file_size  # a 0/1 map deflates well
    assert npz_bytes(arrays) == npz_bytes({k: np.copy(v) for k, v in arrays.items()})


def test_object_arrays_are_refused():
    with pytest.raises(ValueError, match="pickle"):
        npz_bytes({"bad": np.array([{"a": 1}], dtype=object)})


def test_moge_output_npz_uses_it(tiny_model):
    from tt_moge.synthetic import synthetic_photo

    out = tiny_model(synthetic_photo((96, 64)))
    for compress in (False, True):
        back = type(out).from_npz(out.to_npz_bytes(compress=compress))
        assert np.array_equal(back.depth, out.depth) and np.array_equal(back.mask, out.mask)
        assert np.array_equal(back.normal, out.normal.astype(np.float16).astype(np.float32))
        assert out.to_npz_bytes(compress=compress) == npz_bytes(out.npz_arrays(), compress=compress)


def test_from_npz_refuses_what_is_not_our_npz(tmp_path):
    from tt_moge import MoGeOutput

    buf = io.BytesIO()
    np.save(buf, np.zeros(3))
    for bad, reason in [
        (b"not a zip at all", "not a tt_moge npz"),
        (buf.getvalue(), "single .npy"),
        (npz_bytes({"points": np.zeros(3)}), "not a tt_moge npz"),
    ]:
        with pytest.raises(ValueError, match=reason):
            MoGeOutput.from_npz(bad)
    with pytest.raises(FileNotFoundError):
        MoGeOutput.from_npz(tmp_path / "missing.npz")
