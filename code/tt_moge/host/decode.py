"""Decode: any supported image input -> an RGB numpy array (H, W, 3), uint8 or float32 in [0, 1].

Accepted inputs (the spec's list, plus encoded bytes, which the server uses):
  * a file path (str / os.PathLike) or encoded bytes of a PNG, JPEG (or anything Pillow reads);
  * a PIL image (any mode; alpha is dropped);
  * a numpy array (H, W, 3) / (3, H, W) / (H, W), uint8 or float in [0, 1];
  * a torch tensor (3, H, W) / (1, 3, H, W) float in [0, 1], or (H, W, 3) uint8.
EXIF orientation is not applied by default (as upstream MoGe reads pixels: in stored order); `exif=True` applies
it (`apply_orientation`), as image viewers do: the CLI and the server ask for it, the Python API when its caller
does (`tt_moge.load_image(path, exif=True)`).

Encoded PNG and JPEG data take a fast path when it applies (see `python -m perf.host.decode_bench` for the
measurements behind the choice), and Pillow otherwise; both give the same pixels:
  * PNG, 8-bit gray / gray+alpha / RGB / RGBA, not interlaced: the IDAT stream is inflated with ISA-L
    (`isal`, faster than zlib; zlib without it) and unfiltered by the native host library, straight
    into the RGB output (alpha dropped, gray replicated, as Pillow's convert("RGB")). Bit-exact: PNG is
    lossless. Palette, 16-bit, low-bit-depth and interlaced PNGs go to Pillow.
  * JPEG with 1 or 3 components: libjpeg-turbo through `simplejpeg` when it is installed (the `fast` extra),
    else OpenCV's (IMREAD_IGNORE_ORIENTATION: no EXIF rotation); the same library and settings (accurate
    integer IDCT, fancy upsampling) as Pillow's, so the same pixels. Data that does not end with the EOI
    marker (truncated) and CMYK/YCCK files go to Pillow, which reports the error or converts.
    Truncated data: libjpeg-turbo only warns when the entropy-coded data ends early (a file cut short, with or
    without an EOI marker after the cut) and fills the rest of the image with gray, and so do Pillow and OpenCV.
    simplejpeg's strict mode turns that warning into an error, so such data is an InputError here, never a
    gray-filled image at the declared size (without simplejpeg, only data that lacks its EOI marker is caught).
"""

from __future__ import annotations

import ctypes
import io
import os
import struct
from typing import Any, Optional

import numpy as np

from ..constants import MIN_IMAGE_SIDE

__all__ = [
    "InputError",
    "ImageNotFoundError",
    "to_rgb_array",
    "decode_bytes",
    "decode_with_pillow",
    "read_image_file",
    "read_image_header",
    "float_to_uint8",
    "apply_orientation",
    "EXIF_ORIENTATION_TAG",
]

EXIF_ORIENTATION_TAG = 0x0112  # 1-8: how the stored pixels must be turned to be shown upright


class InputError(ValueError):
    """A user-supplied image or option is not what the API accepts; the message says what was expected."""


class ImageNotFoundError(InputError, FileNotFoundError):
    """An image path that does not exist (a ValueError and a FileNotFoundError)."""


def decode_bytes(data: bytes, name: str = "image", exif: bool = False) -> np.ndarray:
    """Encoded image bytes -> (H, W, 3) uint8 RGB; with `exif=True` turned by its EXIF orientation tag (the
    displayed order), else in stored order."""
    if not data:
        raise InputError(f"{name}: empty image data")
    orientation = _check_header(data, name, exif)
    arr = None
    if data.startswith(_PNG_SIGNATURE):
        arr = _decode_png_fast(data, name)
    elif data.startswith(b"\xff\xd8\xff"):
        arr = _decode_jpeg_fast(data, name)
    if arr is None:
        arr = decode_with_pillow(data, name)
    return apply_orientation(arr, orientation)


def _check_header(data: bytes, name: str, exif: bool) -> int:
    """Pillow's decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`) for every decoder, checked from the header
    before anything is inflated or allocated (the fast decoders would otherwise skip it). Returns the EXIF
    orientation (1-8) when `exif`, else 1."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return _orientation_of(img.info.get("exif")) if exif else 1
    except Image.DecompressionBombError as exc:
        raise InputError(f"{name}: {exc}") from None
    except Exception:  # noqa: BLE001 - damaged or unknown data: the decoders below name the error
        return 1


def _orientation_of(raw: Any) -> int:
    """The orientation tag of raw EXIF data (a JPEG's APP1 payload, a PNG's eXIf chunk), 1 when there is none.
    Read from the header alone: Pillow's `getexif()` would decode a whole PNG to look for a late eXIf chunk."""
    if not raw:
        return 1
    from PIL import Image

    try:
        exif = Image.Exif()
        exif.load(raw)
        value = int(exif.get(EXIF_ORIENTATION_TAG, 1))
    except Exception:  # noqa: BLE001 - unreadable EXIF: the pixels are still the image, in stored order
        return 1
    return value if 1 <= value <= 8 else 1


def apply_orientation(arr: np.ndarray, orientation: int) -> np.ndarray:
    """(H, W, C) pixels in stored order -> as shown upright, for an EXIF orientation 1-8 (the same turns as
    `PIL.ImageOps.exif_transpose`); 6 and 8 (a phone held upright) swap width and height."""
    turned = {
        1: lambda a: a,
        2: lambda a: a[:, ::-1],  # mirrored
        3: lambda a: a[::-1, ::-1],  # upside down
        4: lambda a: a[::-1],  # mirrored vertically
        5: lambda a: a.transpose(1, 0, 2),  # transposed
        6: lambda a: a[::-1].transpose(1, 0, 2),  # turn 90 degrees clockwise to show
        7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # transversed
        8: lambda a: a[:, ::-1].transpose(1, 0, 2),  # turn 90 degrees counter-clockwise to show
    }.get(orientation)
    if turned is None:
        raise ValueError(f"orientation must be an EXIF orientation 1-8, got {orientation!r}")
    return arr if orientation == 1 else np.ascontiguousarray(turned(arr))


def decode_with_pillow(data: bytes, name: str = "image") -> np.ndarray:
    """The reference decoder: Pillow, any format it reads -> (H, W, 3) uint8 RGB."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return _pil_to_array(img, name)
    except UnidentifiedImageError:
        raise InputError(f"{name}: not a decodable image (expected PNG or JPEG data, got {data[:8]!r}...)") from None
    except (OSError, SyntaxError, ValueError) as exc:  # truncated / corrupt streams
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{name}: corrupt or truncated image data ({exc})") from None


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> samples per pixel (8-bit fast path)
_inflate = None


def _inflater():
    global _inflate
    if _inflate is None:
        try:
            from isal import isal_zlib

            _inflate = isal_zlib.decompress, isal_zlib.error
        except ImportError:
            import zlib

            _inflate = zlib.decompress, zlib.error
    return _inflate


def _decode_png_fast(data: bytes, name: str) -> Optional[np.ndarray]:
    """8-bit non-interlaced gray/RGB/RGBA PNG -> (H, W, 3) uint8, or None when Pillow must decode it."""
    from .. import native
    from . import buffers

    lib = native.library()
    if lib is None or len(data) < 33 or data[12:16] != b"IHDR":
        return None
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", data[16:29])
    channels = _PNG_CHANNELS.get(colour)
    if (
        depth != 8
        or channels is None
        or interlace
        or compression
        or filtering
        or not (0 < width < 1 << 24)
        or not (0 < height < 1 << 24)
    ):
        return None
    view = memoryview(data)
    idat, pos, end = [], 8, len(data)
    while True:
        if pos + 8 > end:
            raise InputError(f"{name}: corrupt or truncated PNG data (no IEND chunk)")
        length, kind = struct.unpack(">I4s", view[pos : pos + 8])
        if pos + 12 + length > end:
            raise InputError(f"{name}: corrupt or truncated PNG data (chunk {kind!r} runs past the end)")
        if kind == b"IDAT":
            idat.append(view[pos + 8 : pos + 8 + length])
        elif kind == b"IEND":
            break
        pos += 12 + length
    expected = height * (1 + width * channels)
    decompress, error = _inflater()
    try:
        raw = decompress(b"".join(idat), 15, expected)
    except error as exc:
        raise InputError(f"{name}: corrupt or truncated PNG data ({exc})") from None
    if len(raw) < expected:
        raise InputError(f"{name}: corrupt or truncated PNG data ({len(raw)} of {expected} pixel bytes)")
    out = buffers.empty((height, width, 3), np.uint8)
    bad_row = ctypes.c_int64(-1)
    status = lib.moge_png_unfilter(raw, len(raw), width, height, channels, out.ctypes.data, ctypes.byref(bad_row))
    if status != 0:
        raise InputError(f"{name}: corrupt PNG data (unknown filter type in row {bad_row.value})")
    return out


def _jpeg_components(data: bytes) -> int:
    """The number of colour components in the frame header (SOFn) of a JPEG, 0 if not found."""
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return 0
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return data[pos + 9] if pos + 10 <= end else 0
        if marker == 0xDA:  # start of scan before any frame header
            return 0
        pos += 2 + length
    return 0


def _jpeg_decoder():
    global _simplejpeg
    if _simplejpeg is None:
        try:
            import simplejpeg

            _simplejpeg = simplejpeg.decode_jpeg
        except ImportError:
            _simplejpeg = False
    return _simplejpeg


_simplejpeg = None


_JPEG_TRUNCATED = ("premature end",)  # libjpeg's warnings when the data ends before the image it declares


def _decode_jpeg_fast(data: bytes, name: str = "image") -> Optional[np.ndarray]:
    """1- or 3-component complete JPEG -> (H, W, 3) uint8 (libjpeg-turbo), or None when Pillow must decode it.
    Truncated data is an InputError (with simplejpeg; see the module docstring)."""
    components = _jpeg_components(data)
    decode = _jpeg_decoder()
    if decode:
        try:  # strict: libjpeg's warnings are errors; CMYK/YCCK data is decoded once only to check it
            arr = decode(data, colorspace="CMYK" if components == 4 else "RGB")
        except ValueError as exc:
            if any(sign in str(exc).lower() for sign in _JPEG_TRUNCATED):
                raise InputError(
                    f"{name}: corrupt or truncated JPEG data ({exc}): the data ends before the image it declares"
                ) from None
            return None  # another complaint (e.g. extraneous bytes) or unsupported: Pillow decodes it or says why
        return arr if components in (1, 3) else None  # CMYK/YCCK: Pillow's conversion is the reference
    # EOI in the last bytes (0xFF 0xD9 cannot occur inside entropy-coded data, where 0xFF is stuffed)
    if data.rfind(b"\xff\xd9", max(0, len(data) - 64)) < 0 or components not in (1, 3):
        return None  # truncated (Pillow raises the error) or CMYK/YCCK (Pillow's conversion is the reference)
    import cv2

    flags = getattr(cv2, "IMREAD_COLOR_RGB", None)
    arr = cv2.imdecode(
        np.frombuffer(data, np.uint8),
        (flags if flags is not None else cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION,
    )
    if arr is None:
        return None
    return arr if flags is not None else cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)


def read_image_file(path: "str | os.PathLike", name: str = "image", exif: bool = False) -> np.ndarray:
    """The decoded file (turned by its EXIF orientation when `exif`); errors begin with `name` (the argument,
    e.g. "images[3]" in predict_many)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ImageNotFoundError(f"{name}: no such file {os.fspath(path)!r}") from None
    except IsADirectoryError:
        raise InputError(f"{name}: {os.fspath(path)!r} is a directory, expected an image file") from None
    return decode_bytes(data, name=f"{name} file {os.fspath(path)!r}", exif=exif)


def read_image_header(path: "str | os.PathLike") -> tuple:
    """(format, (width, height)) of an image file, read from its header alone (nothing is decoded), or the
    InputError that reading the file would give: a run over many files finds a file that is no image before
    the model loads. Damage after the header is found only by decoding."""
    from PIL import Image, UnidentifiedImageError

    name = f"image file {os.fspath(path)!r}"
    try:
        with Image.open(path) as img:
            return img.format, img.size
    except FileNotFoundError:
        raise ImageNotFoundError(f"image: no such file {os.fspath(path)!r}") from None
    except IsADirectoryError:
        raise InputError(f"image: {os.fspath(path)!r} is a directory, expected an image file") from None
    except UnidentifiedImageError:
        with open(path, "rb") as f:
            head = f.read(8)
        raise InputError(f"{name}: not a decodable image (expected PNG or JPEG data, got {head!r}...)") from None
    except Image.DecompressionBombError as exc:
        raise InputError(f"{name}: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"{name}: corrupt or truncated image data ({exc})") from None


def _pil_to_array(img: Any, name: str = "image") -> np.ndarray:
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: keep the top 8 bits of 16-bit data (as OpenCV does), no clipping surprises.
        arr = np.asarray(img).astype(np.uint32)
        arr = (arr >> 8).clip(0, 255).astype(np.uint8) if mode != "I" or arr.max() > 255 else arr.astype(np.uint8)
        return np.repeat(arr[..., None], 3, axis=2)
    if mode == "F":
        return float_to_uint8(_checked_float(np.asarray(img, dtype=np.float32), name))[..., None].repeat(3, axis=2)
    if mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img)


def float_to_uint8(x: np.ndarray) -> np.ndarray:
    """[0, 1] floats -> uint8 by rounding to nearest (x * 255)."""
    return np.rint(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)


def _checked_float(arr: np.ndarray, name: str) -> np.ndarray:
    if not np.isfinite(arr).all():
        raise InputError(f"{name}: float image contains NaN or inf values; expected finite values in [0, 1]")
    lo, hi = float(arr.min()), float(arr.max())
    if lo < 0.0 or hi > 1.0:
        hint = " (divide 0-255 data by 255)" if hi <= 255.0 and lo >= 0.0 else ""
        raise InputError(f"{name}: float image values must be in [0, 1], got [{lo:.4g}, {hi:.4g}]{hint}")
    return arr


def _from_numpy(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.ndim == 2:
        arr = arr[..., None].repeat(3, axis=2)
    elif arr.ndim == 3:
        if arr.shape[-1] == 3:
            pass
        elif arr.shape[0] == 3:
            arr = arr.transpose(1, 2, 0)
        elif arr.shape[-1] == 1:
            arr = arr.repeat(3, axis=2)
        elif arr.shape[0] == 1:
            arr = arr[0][..., None].repeat(3, axis=2)
        elif 4 in (arr.shape[-1], arr.shape[0]):
            raise InputError(
                f"{name}: 4-channel arrays are not accepted (shape "
                f"{arr.shape}); drop the alpha channel, e.g. image[..., :3]"
            )
        else:
            raise InputError(f"{name}: expected (H, W, 3), (3, H, W) or (H, W); got shape {arr.shape}")
    else:
        raise InputError(
            f"{name}: expected a 2-D or 3-D array ((H, W, 3), (3, H, W) or (H, W)); got {arr.ndim}-D shape {arr.shape}"
        )
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    if np.issubdtype(arr.dtype, np.floating):
        return np.ascontiguousarray(_checked_float(arr, name), dtype=np.float32)
    raise InputError(f"{name}: array dtype {arr.dtype} not supported; expected uint8 (0-255) or float in [0, 1]")


def _from_torch(t: Any, name: str) -> np.ndarray:
    import torch

    t = t.detach()
    if t.ndim == 4:
        if t.shape[0] != 1:
            raise InputError(
                f"{name}: a (B, 3, H, W) tensor with B={t.shape[0]} > 1; "
                "pass a list of images or use model.infer for batches"
            )
        t = t[0]
    if t.ndim == 3 and t.shape[0] == 3 and t.is_floating_point():
        arr = t.to("cpu", torch.float32).numpy()
        return _from_numpy(arr, name)
    if t.ndim == 3 and t.shape[-1] == 3 and t.dtype == torch.uint8:
        return np.ascontiguousarray(t.cpu().numpy())
    if t.ndim in (2, 3) and (t.dtype == torch.uint8 or t.is_floating_point()):
        return _from_numpy(t.cpu().float().numpy() if t.is_floating_point() else t.cpu().numpy(), name)
    raise InputError(
        f"{name}: tensor of shape {tuple(t.shape)} and dtype {t.dtype} not supported; "
        "expected (3, H, W) or (1, 3, H, W) float in [0, 1], or (H, W, 3) uint8"
    )


def to_rgb_array(image: Any, name: str = "image", min_side: int = MIN_IMAGE_SIDE, *, exif: bool = False) -> np.ndarray:
    """Any supported input -> (H, W, 3) RGB array: uint8, or float32 in [0, 1] for float inputs. Smaller than
    `min_side` on a side is an InputError (a caller with its own size rule, as panoramas, passes 1).

    exif: turn a file, encoded bytes or PIL image by its EXIF orientation tag, as image viewers show it (a phone
      photo taken upright has its width and height swapped in storage). Off by default, as the spec says: the
      model reads the stored pixel order, as upstream MoGe does. Arrays and tensors carry no EXIF."""
    if not isinstance(exif, bool):
        raise TypeError(f"exif must be True or False, got {exif!r}")
    if isinstance(image, (str, os.PathLike)):
        arr = read_image_file(image, name, exif=exif)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        arr = decode_bytes(bytes(image), name, exif=exif)
    elif isinstance(image, np.ndarray):
        arr = _from_numpy(image, name)
    elif type(image).__module__.startswith("torch") and hasattr(image, "detach"):
        arr = _from_torch(image, name)
    elif hasattr(image, "mode") and hasattr(image, "convert") and hasattr(image, "size"):
        arr = _pil_to_array(image, name)
        if exif:
            arr = apply_orientation(arr, _orientation_of(image.info.get("exif")))
    elif image is None:
        raise InputError(f"{name}: got None; expected a file path, PIL image, numpy array or torch tensor")
    else:
        raise TypeError(
            f"{name}: unsupported type {type(image).__name__}; expected a file "
            "path, encoded bytes, PIL image, numpy array or torch tensor"
        )
    h, w = arr.shape[:2]
    if h < min_side or w < min_side:
        raise InputError(f"{name}: image is {w}x{h}; the minimum size is {min_side}x{min_side}")
    return arr
