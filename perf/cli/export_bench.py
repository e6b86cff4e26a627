#!/usr/bin/env python3
"""Time the per-image file writing of `tt-moge predict` (tt_moge.export.write_outputs), format by format.

One model call makes a MoGeOutput for the image; then each format group is written `--runs` times into a
temporary folder: each group alone (mesh.glb at the default --mesh-step and at 1), the default formats of
`tt-moge predict`, and all formats. Prints the median and minimum per group, the file sizes (MB = 10^6 bytes),
the model call time and the ratio (all formats / model call): above 1 / --writers, file writing, not the
model, limits `tt-moge predict`.

    python -m perf.cli.export_bench                                   # media/source.png, random weights
    python -m perf.cli.export_bench --image synthetic                 # a 1920x1080 photo-like image
    python -m perf.cli.export_bench --image noise --all-valid         # the largest files: worst texture, no mask
    python -m perf.cli.export_bench --weights /models/moge-2 --image photo.jpg --runs 10 --device cuda

`--image synthetic` is `tt_moge.synthetic.synthetic_photo((1920, 1080), seed=1)`: gradients, a horizon and mild
noise, so that the texture inside mesh.glb weighs what a photo's does (media/source.png, a rendered scene,
compresses far better). The sizes in `tt-moge predict --help` come from this image. `--image noise` is uniform
random RGB (a texture that does not compress) and `--all-valid` makes the random checkpoint mask no pixel:
together, the largest files a 1920x1080 photo can give.

Without --weights a random-weight tiny checkpoint is written to a temporary folder (the geometry is then
meaningless, but the file sizes and times are those of a real image of that size; random weights mask about a
quarter of the pixels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from perf import common
from perf.common import ROOT
from tt_moge.cli.argtypes import wxh  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--image",
        default=str(ROOT / "media" / "source.png"),
        help="the image, or 'synthetic' (a 1920x1080 photo-like one) or 'noise' (1920x1080 random RGB) "
        "(default media/source.png)",
    )
    parser.add_argument(
        "--all-valid",
        action="store_true",
        help="the random checkpoint masks no pixel (default: about a quarter; not with --weights)",
    )
    parser.add_argument("--weights", help="checkpoint (default: a random-weight tiny-vits-normal in a temp folder)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--resolution",
        type=wxh,
        default=(448, 252),
        help="canvas WxH (default 448x252: the model call is not what is timed)",
    )
    parser.add_argument("--num-tokens", type=int, default=1200, help="token budget (default 1200)")
    parser.add_argument("--runs", type=int, default=5, help="writes per format group (default 5)")
    args = parser.parse_args(argv)

    from tt_moge import MoGeModel
    from tt_moge.export import DEFAULT_FORMATS, DEFAULT_MESH_STEP, FORMATS, kept_pixels, write_outputs
    from tt_moge.host import to_rgb_array
    from tt_moge.synthetic import synthetic_photo

    with tempfile.TemporaryDirectory(prefix="tt_moge-export-bench-") as tmp:
        weights = args.weights
        if weights is None:
            from tt_moge.testing import make_checkpoint

            weights = str(
                make_checkpoint(
                    Path(tmp) / "weights", "tiny-vits-normal", **({"invalid_share": 0.0} if args.all_valid else {})
                )
            )
        model = MoGeModel.from_pretrained(
            weights,
            device=args.device,
            resolution=args.resolution,
            num_tokens=args.num_tokens,
            warmup=1,
            warmup_variants="none",
        )
        if args.image == "synthetic":
            rgb = synthetic_photo((1920, 1080), seed=1)
        elif args.image == "noise":
            rgb = np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
        else:
            rgb = to_rgb_array(args.image)
        model.predict(rgb)
        call_times = []
        for _ in range(3):
            t = time.perf_counter()
            output = model.predict(rgb)
            call_times.append(time.perf_counter() - t)
        model.close()
        call = statistics.median(call_times)
        print(
            f"image {args.image} ({output.size[0]}x{output.size[1]}), valid {output.valid_fraction:.1%}, "
            f"kept for 3D {kept_pixels(output).mean():.1%}; model call median {call * 1e3:.0f} ms "
            f"({args.resolution[0]}x{args.resolution[1]}, {args.num_tokens} tokens, {args.device})"
        )
        print(f"{'formats':<36}{'median ms':>10}{'min ms':>9}{'MB':>7}   files (MB)")
        groups = [((f,), DEFAULT_MESH_STEP) for f in FORMATS] + [
            (("glb",), 1),
            (DEFAULT_FORMATS, DEFAULT_MESH_STEP),
            (tuple(FORMATS), DEFAULT_MESH_STEP),
        ]
        totals = {}
        for group, step in groups:
            label = "+".join(group) + (f" (mesh step {step})" if "glb" in group else "")
            label += " = default" if group == DEFAULT_FORMATS else ""
            out = Path(tmp) / f"{'_'.join(group)}_{step}"
            times = []
            for _ in range(args.runs):
                t = time.perf_counter()
                write_outputs(output, rgb, out, group, mesh_step=step)
                times.append(time.perf_counter() - t)
            totals[group, step] = statistics.median(times)
            files = [p for p in sorted(out.iterdir()) if p.name != "result.json"]
            sizes = ", ".join(f"{p.name} {p.stat().st_size / 1e6:.1f}" for p in files)
            mb = sum(p.stat().st_size for p in files) / 1e6
            print(f"{label:<36}{totals[group, step] * 1e3:>10.0f}{min(times) * 1e3:>9.0f}{mb:>7.1f}   {sizes}")
        print(f"all formats / model call: {totals[tuple(FORMATS), DEFAULT_MESH_STEP] / call:.2f}")
    print(f"rerun: {common.rerun_command(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
