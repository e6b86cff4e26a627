"""PNG and JPEG decoders side by side: median ms per decode of the same bytes, and whether each is exact.

Candidates (each only if importable): Pillow (the reference), OpenCV, pyspng (libspng), simplejpeg and
PyTurboJPEG (libjpeg-turbo), and tt_moge's decoder (PNG: ISA-L inflate + native unfilter; JPEG: libjpeg-turbo
through simplejpeg when installed, else OpenCV).
"exact" = the same (H, W, 3) uint8 pixels as Pillow's `convert("RGB")`.

    python -m perf.host.decode_bench                       # media/source.png if present, else a synthetic photo
    python -m perf.host.decode_bench --image photo.png --runs 30
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from perf import common
from perf.common import ROOT


def pillow(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def opencv(data: bytes) -> np.ndarray:
    import cv2

    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)


def candidates(kind: str) -> dict:
    out = {"pillow": pillow, "opencv": opencv}
    from tt_moge.host.decode import decode_bytes

    out["tt_moge"] = decode_bytes
    if kind == "png":
        try:
            import pyspng

            out["pyspng"] = lambda d: pyspng.load(d)
        except ImportError:
            pass
    else:
        try:
            import simplejpeg

            out["simplejpeg"] = lambda d: simplejpeg.decode_jpeg(d, colorspace="RGB")
        except ImportError:
            pass
        try:
            from turbojpeg import TJPF_RGB, TurboJPEG

            tj = TurboJPEG()
            out["pyturbojpeg"] = lambda d: tj.decode(d, pixel_format=TJPF_RGB)
        except Exception:  # not installed, or no libturbojpeg on this machine
            pass
    return out


def inflate_only(data: bytes) -> dict:
    """The zlib-stream part of a PNG decode alone, per inflater (the PNG decode is mostly inflate)."""
    import struct
    import zlib

    view, pos, idat = memoryview(data), 8, []
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", view[pos : pos + 8])
        if kind == b"IDAT":
            idat.append(view[pos + 8 : pos + 8 + length])
        pos += 12 + length
    stream = b"".join(idat)
    out = {"zlib": lambda: zlib.decompress(stream)}
    try:
        from isal import isal_zlib

        out["isal"] = lambda: isal_zlib.decompress(stream)
    except ImportError:
        pass
    return out


def median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", help="a PNG file (a JPEG of the same pixels is made from it)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--jpeg-quality", type=int, default=90)
    args = parser.parse_args(argv)
    from PIL import Image

    if args.image:
        png = Path(args.image).read_bytes()
        source = args.image
    elif (ROOT / "media" / "source.png").exists():
        png = (ROOT / "media" / "source.png").read_bytes()
        source = "media/source.png"
    else:
        from tt_moge.synthetic import synthetic_photo

        buf = io.BytesIO()
        Image.fromarray(synthetic_photo((1920, 1080))).save(buf, format="PNG")
        png, source = buf.getvalue(), "synthetic 1920x1080 photo (no media/source.png)"
    rgb = pillow(png)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=args.jpeg_quality)
    jpeg = buf.getvalue()
    print(
        f"image: {source}, {rgb.shape[1]}x{rgb.shape[0]}; PNG {len(png) / 1e6:.2f} "
        f"MB, JPEG q{args.jpeg_quality} {len(jpeg) / 1e6:.2f} MB"
    )
    for kind, data in (("png", png), ("jpeg", jpeg)):
        ref = pillow(data)
        results = {}
        for name, fn in candidates(kind).items():
            try:
                exact = bool(np.array_equal(fn(data), ref))
            except Exception as exc:  # a candidate that cannot read this file
                print(f"  {kind} {name}: failed ({exc})")
                continue
            results[name] = (median_ms(lambda: fn(data), args.runs), exact)
        base = results["pillow"][0]
        for name, (ms, exact) in sorted(results.items(), key=lambda kv: kv[1][0]):
            print(f"  {kind:4s} {name:12s} {ms:7.2f} ms  x{base / ms:4.2f} vs Pillow  exact={exact}")
        if kind == "png":
            for name, fn in inflate_only(data).items():
                print(f"  png  inflate-only {name:6s} {median_ms(fn, args.runs):7.2f} ms")
    print(f"rerun: {common.rerun_command(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
