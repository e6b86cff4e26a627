#!/usr/bin/env python3
"""Render the demo image media/source.png (1920x1080) from tt_moge.scene, optionally with its ground truth.

    python media/make_source.py                      # writes media/source.png
    python media/make_source.py --truth truth.npz    # also the exact depth, points, normal, mask, intrinsics

The scene is analytic and ray cast by our own code, so the image is ours to ship and its geometry is exact.
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "code"))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from tt_moge.scene import render  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(HERE / "source.png"), help="PNG to write (default: media/source.png)")
    parser.add_argument("--size", default="1920x1080", help="WIDTHxHEIGHT (default 1920x1080)")
    parser.add_argument("--truth", help="also write the ground truth to this .npz")
    args = parser.parse_args()
    w, h = (int(v) for v in args.size.lower().split("x"))
    scene = render(w, h)
    Image.fromarray(scene.image).save(args.out, optimize=True)
    print(f"wrote {args.out}")
    if args.truth:
        np.savez_compressed(
            args.truth,
            depth=scene.depth.astype(np.float32),
            points=scene.points.astype(np.float32),
            normal=scene.normal.astype(np.float32),
            mask=scene.mask,
            intrinsics=scene.intrinsics,
        )
        print(f"wrote {args.truth}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
