#!/usr/bin/env python3
"""Time the per-image file writing of `tt-moge predict` (tt_moge.export.write_outputs), format by format.

One model call makes a MoGeOutput for the image; then each format group is written `--runs` times into a
temporary folder. Prints the median and minimum per group, the file sizes, the model call time and the ratio
(all formats / model call): above 1 / --writers, file writing, not the model, limits `tt-moge predict`.

    python -m perf.cli.export_bench                                   # media/source.png, random weights
    python -m perf.cli.export_bench --weights /models/moge-2 --image photo.jpg --runs 10 --device cuda

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

from perf import common
from perf.common import ROOT

from tt_moge.cli.argtypes import wxh  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default=str(ROOT / "media" / "source.png"), help="the image (default media/source.png)")
    parser.add_argument("--weights", help="checkpoint (default: a random-weight tiny-vits-normal in a temp folder)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--resolution", type=wxh, default=(448, 252), help="canvas WxH (default 448x252: the model call is not what is timed)")
    parser.add_argument("--num-tokens", type=int, default=1200, help="token budget (default 1200)")
    parser.add_argument("--runs", type=int, default=5, help="writes per format group (default 5)")
    args = parser.parse_args(argv)

    from tt_moge import MoGeModel
    from tt_moge.export import FORMATS, kept_pixels, write_outputs
    from tt_moge.host import to_rgb_array

    with tempfile.TemporaryDirectory(prefix="tt_moge-export-bench-") as tmp:
        weights = args.weights
        if weights is None:
            from tt_moge.testing import make_checkpoint

            weights = str(make_checkpoint(Path(tmp) / "weights", "tiny-vits-normal"))
        model = MoGeModel.from_pretrained(weights, device=args.device, resolution=args.resolution, num_tokens=args.num_tokens,
                                          warmup=1, warmup_variants="none")
        rgb = to_rgb_array(args.image)
        model.predict(rgb)
        call_times = []
        for _ in range(3):
            t = time.perf_counter()
            output = model.predict(rgb)
            call_times.append(time.perf_counter() - t)
        model.close()
        call = statistics.median(call_times)
        print(f"image {args.image} ({output.size[0]}x{output.size[1]}), valid {output.valid_fraction:.1%}, "
              f"kept for 3D {kept_pixels(output).mean():.1%}; model call median {call * 1e3:.0f} ms "
              f"({args.resolution[0]}x{args.resolution[1]}, {args.num_tokens} tokens, {args.device})")
        print(f"{'formats':<22}{'median ms':>10}{'min ms':>9}   files (MB)")
        groups = [(f,) for f in FORMATS] + [tuple(FORMATS)]
        totals = {}
        for group in groups:
            out = Path(tmp) / "_".join(group)
            times = []
            for _ in range(args.runs):
                t = time.perf_counter()
                write_outputs(output, rgb, out, group)
                times.append(time.perf_counter() - t)
            totals[group] = statistics.median(times)
            sizes = ", ".join(f"{p.name} {p.stat().st_size / 1e6:.1f}" for p in sorted(out.iterdir()) if p.name != "result.json")
            print(f"{'+'.join(group):<22}{totals[group] * 1e3:>10.0f}{min(times) * 1e3:>9.0f}   {sizes}")
        print(f"all formats / model call: {totals[tuple(FORMATS)] / call:.2f}")
    print(f"rerun: {common.rerun_command(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
