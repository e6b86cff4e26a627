"""Receiving an image upload safely: content type, body size and time limits, multipart, header-only checks.

Everything here runs before a request is admitted to the model, so a bad upload costs no queue slot. The
image header (PNG IHDR, JPEG SOF) is read without decoding the pixels, so a decompression bomb (a small file
that declares a huge image) is refused before any large allocation.
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass
from typing import Callable

from fastapi import Query
from starlette.requests import ClientDisconnect, Request

from ..constants import MIN_IMAGE_SIDE
from .errors import ApiError
from .settings import BODY_RATE_GRACE_S, ServerSettings

__all__ = [
    "IMAGE_MEDIA_TYPES",
    "MULTIPART_FIELD",
    "EXIF_QUERY",
    "exif_query",
    "ImageUpload",
    "receive_image",
    "read_body",
    "media_type",
]

# Content-Type of a raw body -> the image format its bytes must have. image/jpg is a common misspelling.
IMAGE_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}
MULTIPART = "multipart/form-data"
MULTIPART_FIELD = "image"  # the form field that carries the file
EXIF_QUERY = "exif"  # the query parameter: apply the upload's EXIF orientation (default true)
_EXIF_HELP = (
    "Turn the image by its EXIF orientation tag first, as image viewers show it (a phone photo taken upright is "
    "stored sideways); the results then have the displayed width and height. false: the stored pixel order, "
    "as the Python API reads images by default"
)


def exif_query(exif: bool = Query(True, description=_EXIF_HELP)) -> bool:
    """A FastAPI dependency: the `exif` query parameter of the routes that take an image upload."""
    return exif


_MAGIC = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8\xff"}
_HEADER_EXPECTED = {
    "PNG": "an IHDR chunk of 13 bytes with a sound CRC and a width and height of at least 1 right after the signature",
    "JPEG": "a frame header (SOF marker) with the image size before the compressed data",
}


@dataclass(frozen=True)
class ImageUpload:
    data: bytes  # the encoded image, exactly as sent
    format: str  # "PNG" or "JPEG"
    size: tuple  # (width, height) from the header
    read_ms: float  # time spent receiving the body
    exif: bool = False  # decode it turned by its EXIF orientation (the query parameter `exif`, EXIF_QUERY)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def check_media_type(request: Request) -> str:
    kind = media_type(request)
    if kind not in IMAGE_MEDIA_TYPES and kind != MULTIPART:
        got = f"Content-Type {kind!r}" if kind else "no Content-Type"
        raise ApiError(
            415,
            "unsupported_media_type",
            f"got {got}; send the image as the body with Content-Type image/png or image/jpeg, "
            f"or as the file field {MULTIPART_FIELD!r} of multipart/form-data",
        )
    return kind


async def read_body(request: Request, settings: ServerSettings, reserve: Callable[[int], None]) -> bytes:
    """The whole body, within max_body_bytes (413), read_timeout_s and the min_body_rate floor (408), each chunk
    reserved as it arrives. The floor: once BODY_RATE_GRACE_S seconds have passed, the bytes received must keep up
    with min_body_rate per second since the headers arrived; a body that falls behind is cut at that moment."""
    limit, rate = settings.max_body_bytes, settings.min_body_rate
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "bad_request", f"Content-Length must be a byte count, got {declared!r}")
        if int(declared) > limit:
            raise ApiError(
                413, "body_too_large", f"body of {int(declared)} bytes; the limit is {limit} bytes (--max-body-mb)"
            )
    chunks: list = []
    received = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + settings.read_timeout_s
    stream = request.stream().__aiter__()
    try:
        while True:
            # the next chunk must come before the body falls below the floor (or the read timeout ends)
            behind = start + BODY_RATE_GRACE_S + (received + 1) / rate if rate else deadline
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, min(behind, deadline) - loop.time()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                elapsed = loop.time() - start
                if behind < deadline:
                    raise ApiError(
                        408,
                        "too_slow",
                        f"the body arrived at {received / elapsed:.0f} bytes/s ({received} bytes in {elapsed:.1f} s); "
                        f"the floor is {rate} bytes/s after the first {BODY_RATE_GRACE_S:g} s (--min-body-rate)",
                    ) from None
                raise ApiError(
                    408,
                    "timeout",
                    f"the body did not arrive within {settings.read_timeout_s:g} s ({received} bytes received)",
                ) from None
            received += len(chunk)
            if received > limit:
                raise ApiError(413, "body_too_large", f"body larger than the limit of {limit} bytes (--max-body-mb)")
            reserve(len(chunk))  # counted against the memory budget as it arrives (503 when it is spent)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(
            400, "client_disconnected", "the client closed the connection before the body was complete"
        ) from None
    return b"".join(chunks)


async def _multipart_file(request: Request, body: bytes) -> bytes:
    """The bytes of the `image` file field of a multipart body that has already been received (and size-checked)."""

    async def replay() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    form = await Request(request.scope, receive=replay).form(max_files=1, max_fields=16)
    try:
        part = form.get(MULTIPART_FIELD)
        if part is None:
            raise ApiError(
                400,
                "missing_field",
                f"multipart/form-data without a file field {MULTIPART_FIELD!r} (got fields {sorted(form.keys())})",
            )
        if isinstance(part, str):
            raise ApiError(
                400, "missing_field", f"multipart field {MULTIPART_FIELD!r} must be a file upload, got a text value"
            )
        return await part.read()
    finally:
        await form.close()


def _declared_size(data: bytes, fmt: str) -> tuple:
    """(width, height) from the header, read by Pillow's format plugin directly, without the decompression-bomb
    check of `Image.open` (whose limit is Pillow's, not this server's: the caller compares with --max-pixels)."""
    from PIL import JpegImagePlugin, PngImagePlugin

    plugin = {"PNG": PngImagePlugin.PngImageFile, "JPEG": JpegImagePlugin.JpegImageFile}[fmt]
    with plugin(io.BytesIO(data)) as img:
        return img.size


def inspect_image(data: bytes, declared_format: str, settings: ServerSettings) -> tuple:
    """(format, (width, height)) from the header of PNG/JPEG bytes; the pixels are not decoded.

    declared_format: the format the Content-Type names, or "" for a multipart file (any of PNG/JPEG).
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ApiError(400, "empty_body", "the image is empty (0 bytes)")
    found = next((fmt for fmt, magic in _MAGIC.items() if data.startswith(magic)), None)
    if found is None:
        raise ApiError(415, "unsupported_image", f"the data is not a PNG or JPEG image (it starts with {data[:8]!r})")
    if declared_format and found != declared_format:
        raise ApiError(415, "unsupported_image", f"Content-Type says {declared_format} but the data is {found}")
    try:
        with Image.open(io.BytesIO(data), formats=[found]) as img:
            width, height = img.size
    except Image.DecompressionBombError:  # Pillow's own limit; the answer quotes the server's (--max-pixels)
        width, height = _declared_size(data, found)
    except UnidentifiedImageError:  # Pillow's message names only its stream object
        raise ApiError(
            400,
            "bad_image",
            f"corrupt or truncated {found} data: its header cannot be read (expected {_HEADER_EXPECTED[found]})",
        ) from None
    except Exception as exc:  # untrusted bytes: any parser failure means a corrupt header
        raise ApiError(400, "bad_image", f"corrupt or truncated {found} data ({type(exc).__name__}: {exc})") from None
    if width * height > settings.max_pixels:
        raise ApiError(
            413,
            "too_many_pixels",
            f"the image is {width}x{height} = {width * height} pixels; "
            f"the limit is {settings.max_pixels} (--max-pixels)",
        )
    if width < MIN_IMAGE_SIDE or height < MIN_IMAGE_SIDE:
        raise ApiError(
            422, "image_too_small", f"the image is {width}x{height}; the minimum is {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}"
        )
    return found, (width, height)


async def receive_image(
    request: Request, settings: ServerSettings, reserve: Callable[[int], None], exif: bool = False
) -> ImageUpload:
    """Read and check the image of a /predict request (raw body or multipart), or raise ApiError (4xx).

    reserve(n): called before n more bytes are kept (body chunks as they arrive; the body once more while a
    multipart form is taken apart); it raises ApiError (503) when the server's memory budget cannot hold them.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    kind = check_media_type(request)
    body = await read_body(request, settings, reserve)
    if kind == MULTIPART:
        reserve(len(body))  # the file's bytes, copied out of the form
        data = await _multipart_file(request, body)
    else:
        data = body
    read_ms = (loop.time() - start) * 1e3
    fmt, size = inspect_image(data, IMAGE_MEDIA_TYPES.get(kind, ""), settings)
    return ImageUpload(data, fmt, size, read_ms, exif)
