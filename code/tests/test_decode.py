"""The fast PNG/JPEG decoders give Pillow's pixels, ignore EXIF orientation unless asked (then turn like
`PIL.ImageOps.exif_transpose`) and report bad data clearly, truncated JPEGs included."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from tt_moge import native
from tt_moge.host import decode as dec
from tt_moge.host.decode import InputError, decode_bytes, decode_with_pillow, to_rgb_array
from tt_moge.synthetic import synthetic_photo


@pytest.fixture(autouse=True)
def _native_path():
    previous = native.set_host_path("native")
    yield
    native.set_host_path(previous)


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return synthetic_photo((331, 217), seed=4)  # odd sizes: no row or MCU alignment to hide behind


def _encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _png_variants(photo: np.ndarray) -> dict:
    rgb = Image.fromarray(photo)
    return {
        "RGB": _encode(rgb, "PNG"),
        "RGB-fast-filters": _encode(rgb, "PNG", compress_level=1),
        "RGBA": _encode(Image.fromarray(np.dstack([photo, photo[..., 1]])), "PNG"),
        "L": _encode(rgb.convert("L"), "PNG"),
        "LA": _encode(rgb.convert("LA"), "PNG"),
        "P": _encode(rgb.quantize(37), "PNG"),
        "I;16": _encode(Image.fromarray(photo[..., 0].astype(np.uint16) * 257 + 3), "PNG"),
        "1": _encode(rgb.convert("1"), "PNG"),
    }


FAST_PNG_MODES = {"RGB", "RGB-fast-filters", "RGBA", "L", "LA"}


def test_png_fast_path_is_bit_exact_with_pillow(photo):
    for mode, data in _png_variants(photo).items():
        got, ref = decode_bytes(data), decode_with_pillow(data)
        assert got.shape == ref.shape == (217, 331, 3) and got.dtype == np.uint8, mode
        assert np.array_equal(got, ref), mode
        fast = dec._decode_png_fast(data, "test")
        assert (fast is not None) == (mode in FAST_PNG_MODES), mode  # the fast path really ran where it should
    assert np.array_equal(decode_bytes(_png_variants(photo)["RGB"]), photo)


def test_png_16_bit_rgb_and_interlaced_go_to_pillow(photo, tmp_path):
    import cv2

    assert cv2.imwrite(str(tmp_path / "rgb16.png"), (photo.astype(np.uint16) * 257)[..., ::-1].copy())
    data16 = (tmp_path / "rgb16.png").read_bytes()
    assert dec._decode_png_fast(data16, "test") is None
    assert np.array_equal(decode_bytes(data16), decode_with_pillow(data16))
    assert np.array_equal(decode_bytes(data16), photo)  # Pillow keeps the high byte
    assert dec._decode_png_fast(_png_with_header(photo, interlace=1), "test") is None  # Adam7: Pillow's job


def test_torch_host_path_decodes_the_same(photo):
    data = _png_variants(photo)["RGBA"]
    fast = decode_bytes(data)
    native.set_host_path("torch")
    assert dec._decode_png_fast(data, "test") is None
    assert np.array_equal(decode_bytes(data), fast)


@pytest.fixture(params=["simplejpeg", "opencv"])
def jpeg_backend(request, monkeypatch):
    """Both fast JPEG decoders: simplejpeg when installed (the fast/server extras), else OpenCV."""
    if request.param == "simplejpeg":
        pytest.importorskip("simplejpeg")
    else:
        monkeypatch.setattr(dec, "_simplejpeg", False)
    return request.param


def test_jpeg_matches_pillow(photo, jpeg_backend):
    rgb = Image.fromarray(photo)
    cases = {
        "444": _encode(rgb, "JPEG", quality=95, subsampling=0),
        "422": _encode(rgb, "JPEG", quality=90, subsampling=1),
        "420": _encode(rgb, "JPEG", quality=75, subsampling=2),
        "progressive": _encode(rgb, "JPEG", quality=85, progressive=True),
        "gray": _encode(rgb.convert("L"), "JPEG", quality=90),
        "cmyk": _encode(rgb.convert("CMYK"), "JPEG", quality=90),
    }
    for name, data in cases.items():
        got, ref = decode_bytes(data), decode_with_pillow(data)
        assert got.shape == (217, 331, 3) and np.array_equal(got, ref), name
        assert (dec._decode_jpeg_fast(data) is None) == (name == "cmyk"), name
    assert (
        np.abs(decode_bytes(cases["444"]).astype(int) - photo).mean() < 6
    )  # and it is the photo (noisy: JPEG error ~3)


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    return exif.tobytes()


def test_exif_orientation_is_not_applied(photo, tmp_path):
    rgb = Image.fromarray(photo)
    for fmt, name in (("JPEG", "r.jpg"), ("PNG", "r.png")):
        path = tmp_path / name
        rgb.save(path, format=fmt, exif=_exif_rotated(), **({"quality": 95} if fmt == "JPEG" else {}))
        with Image.open(path) as check:
            assert check.getexif().get(0x0112) == 6
        got = to_rgb_array(str(path))
        assert got.shape == (217, 331, 3)  # stored order, not the 331-row display order
        assert np.array_equal(got, decode_with_pillow(path.read_bytes()))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_when_asked(photo, tmp_path, orientation):
    """exif=True turns bytes, files and PIL images as Pillow's exif_transpose does (what viewers show)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    for fmt in ("JPEG", "PNG"):
        data = _encode(Image.fromarray(photo), fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
        with Image.open(io.BytesIO(data)) as img:
            shown = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
        path = tmp_path / f"o{orientation}.{fmt.lower()}"
        path.write_bytes(data)
        with Image.open(path) as img:
            pil = to_rgb_array(img, exif=True)
        for got in (decode_bytes(data, exif=True), to_rgb_array(str(path), exif=True), pil):
            assert got.shape == shown.shape and np.array_equal(got, shown), (fmt, orientation)
        assert decode_bytes(data).shape == (217, 331, 3)  # not asked: the stored order
    with pytest.raises(TypeError, match="exif must be True or False"):
        to_rgb_array(photo, exif="yes")


def _big_jpeg(width: int = 6000, height: int = 4000, mode: str = "RGB") -> bytes:
    """A 6000x4000 photo-like JPEG (a gradient with texture: about 1 MB), quickly made."""
    y, x = np.mgrid[0:height, 0:width].astype(np.uint16)
    rgb = np.dstack([(x * 7 + y) % 256, (y * 5) % 256, ((x ^ y) & 0xFF)]).astype(np.uint8)
    return _encode(Image.fromarray(rgb).convert(mode), "JPEG", quality=90)


@pytest.mark.parametrize("jpeg_mode", ["RGB", "CMYK"])
def test_a_truncated_jpeg_is_an_input_error(tmp_path, jpeg_mode):
    """A JPEG cut to 69 KB whose header still declares 6000x4000 pixels, as is and with an end-of-image marker put
    back after the cut: libjpeg fills the missing part gray and only warns; here it is an InputError, never a
    gray 6000x4000 image (issue 28)."""
    whole = _big_jpeg(mode=jpeg_mode)
    assert len(whole) > 200_000
    cut = whole[:69_000]
    for data in (cut, cut + b"\xff\xd9", cut + b"\xff\xd9" + bytes(100)):
        with Image.open(io.BytesIO(data)) as img:
            assert img.size == (6000, 4000)  # the header is intact
        with pytest.raises(InputError, match=r"^image: .*truncated"):
            decode_bytes(data)
        path = tmp_path / "cut.jpg"
        path.write_bytes(data)
        with pytest.raises(InputError, match="cut.jpg.*truncated"):
            to_rgb_array(str(path))
    assert decode_bytes(whole).shape == (4000, 6000, 3)  # and whole data still decodes


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _png_with_header(rgb: np.ndarray, interlace: int = 0, filter_type: int = 0) -> bytes:
    """A hand-made 8-bit PNG (gray, gray+alpha, RGB or RGBA by channel count) whose every row carries
    `filter_type`; the stored bytes are the pixels, so each filter decodes them to different values."""
    h, w, channels = rgb.shape
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    rows = b"".join(bytes([filter_type]) + rgb[y].tobytes() for y in range(h))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color_type, 0, 0, interlace))
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("filter_type", [0, 1, 2, 3, 4])  # none, sub, up, average, Paeth
def test_every_png_filter_and_layout_decodes_like_pillow(photo, filter_type, channels):
    pixels = np.dstack([photo, photo[..., :1]])[..., :channels] if channels != 1 else photo[..., :1]
    data = _png_with_header(np.ascontiguousarray(pixels), filter_type=filter_type)
    fast = dec._decode_png_fast(data, "test")
    assert fast is not None  # the native unfilter ran
    assert np.array_equal(fast, decode_with_pillow(data))


def test_bad_data_raises_input_error(photo, tmp_path):
    png = _png_variants(photo)["RGB"]
    jpeg = _encode(Image.fromarray(photo), "JPEG")
    idat = png.index(b"IDAT")
    flipped = bytearray(png)
    flipped[idat + 200 : idat + 260] = bytes(60)  # zeroed deflate data: the stream or its checksum breaks
    bad = {
        "empty": b"",
        "garbage": b"not an image at all",
        "png cut in IDAT": png[: idat + 1000],
        "png cut before IEND": png[:-12],
        "png corrupt IDAT": bytes(flipped),
        "png unknown filter": _png_with_header(photo, filter_type=9),
        "jpeg cut": jpeg[: len(jpeg) // 2],
        "jpeg header only": jpeg[:300],
    }
    for data in bad.values():
        with pytest.raises(InputError, match="image"):
            decode_bytes(data)
        path = tmp_path / "bad.bin"
        path.write_bytes(data)
        with pytest.raises(InputError, match="bad.bin"):
            to_rgb_array(str(path))
    assert np.array_equal(decode_bytes(png), photo)  # the decoder keeps working afterwards


def test_a_decompression_bomb_is_refused_before_decoding():
    """A header that claims 30000 x 30000 pixels (above Pillow's MAX_IMAGE_PIXELS limit) is an InputError on the
    fast native PNG path too, before anything is inflated or allocated."""
    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + _chunk(b"IEND", b"")
    )
    with pytest.raises(InputError, match=r"^image: .*exceeds limit"):
        decode_bytes(data)
