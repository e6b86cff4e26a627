"""Latency of each call kind of the spec's Speed table, warm, batch 1: median and min per call (ms).

Rows: model.forward(float32 canvas); model(uint8 array) at the canvas size and at 800x600; model(PNG path);
predict_many of PNG paths and of arrays (per image). The image is media/source.png when the repo has it,
else a synthetic photo-like PNG of the canvas size.

    python -m perf.api.api_bench --weights path/to/model.pt --runs 30
    python -m perf.api.api_bench --random-weights tiny-vits-normal --resolution 448x252 --num-tokens 1200 --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from perf import common

BATCH = 4  # images per predict_many call


def main(argv=None) -> int:
    from tt_moge.cli.bench import add_bench_model_arguments, default_image, load_bench_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_model_arguments(parser, warmup_variants="all")  # it times every call kind, each one warm
    parser.add_argument("--image", help="PNG file (default: media/source.png or a synthetic PNG)")
    parser.add_argument("--runs", type=int, default=30, help="timed calls per row (default %(default)s)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from PIL import Image

    from tt_moge import native

    with tempfile.TemporaryDirectory(prefix="tt_moge-api-bench-") as scratch:
        png = args.image or default_image(args.resolution, scratch)
        with Image.open(png) as img:
            rgb = np.array(img.convert("RGB"))
        canvas_rgb = (
            rgb if rgb.shape[1::-1] == args.resolution else np.asarray(Image.fromarray(rgb).resize(args.resolution))
        )
        small = np.asarray(Image.fromarray(rgb).resize((800, 600)))
        canvas_float = torch.from_numpy(canvas_rgb).permute(2, 0, 1)[None].float().div(255)
        paths = []
        for k in range(BATCH):  # distinct files with the same pixels
            p = Path(scratch) / f"batch{k}.png"
            p.write_bytes(Path(png).read_bytes())
            paths.append(str(p))
        arrays = [canvas_rgb.copy() for _ in range(BATCH)]

        with load_bench_model(args, scratch) as model:
            rows = [
                ("model.forward(image), float32 canvas", lambda: model.forward(canvas_float), 1),
                (f"model(array), uint8 {canvas_rgb.shape[1]}x{canvas_rgb.shape[0]}", lambda: model(canvas_rgb), 1),
                ("model(array), uint8 800x600", lambda: model(small), 1),
                (f"model({Path(png).name!r}) (adds the PNG decode)", lambda: model(png), 1),
                (f"model.predict_many(paths), per image ({BATCH} per call)", lambda: model.predict_many(paths), BATCH),
                (
                    f"model.predict_many(arrays), per image ({BATCH} per call)",
                    lambda: model.predict_many(arrays),
                    BATCH,
                ),
            ]
            print(
                f"image {png}; canvas {args.resolution[0]}x{args.resolution[1]}, {args.num_tokens} tokens, "
                f"device {model.device}, host path {native.host_path()} ({native.threads()} threads)"
            )
            print(f"{'call':62s} {'median ms':>10s} {'min ms':>9s}")
            for name, fn, per in rows:
                fn()
                times = []
                for _ in range(args.runs):
                    t = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t) * 1e3 / per)
                print(f"{name:62s} {statistics.median(times):10.2f} {min(times):9.2f}")
    print(f"rerun: {common.rerun_command(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
