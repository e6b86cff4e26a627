#!/usr/bin/env python3
"""Images/s of `tt-moge batch` with 1 and with 2 (or --replicas) model replicas, on the same folder of photos.

Each run is what `tt-moge batch PHOTOS -o OUT --replicas N --npz` does (tt_moge.batch.run_batch): a local Ray
starts (not timed), the replicas start and load the model, the photos are read, predicted and written. Two
rates per run: job (done / job seconds, replica start-up included: what a user waits for) and steady (after
the first result: the throughput of a long job). Prints medians over --runs and the ratio to the first replica
count.

    python -m perf.batch.replicas_bench                        # 40 photos 640x480, random tiny weights, CPU
    python -m perf.batch.replicas_bench --images 16 --runs 1   # a quick check
    python -m perf.batch.replicas_bench --weights /models/moge-2 --resolution 1920x1080 --num-tokens 1800 \\
        --device cuda --replicas 1,2,4 --gpus-per-replica 0.25

Without --weights a random-weight tiny-vits-normal checkpoint is written to a temporary folder: the geometry is
meaningless, the work per image is that of the tiny network on the chosen canvas. On CPU, N replicas split the
cores (each takes cores / N CPUs and torch threads, as tt-moge batch does by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from perf import common
from tt_moge.cli.argtypes import wxh  # noqa: E402


def make_photos(folder: Path, count: int, size: tuple) -> None:
    import numpy as np
    from PIL import Image

    from tt_moge.testing import calibration_image

    folder.mkdir(parents=True)
    w, h = size
    for i in range(count):
        rgb = (calibration_image(w, h, seed=i)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"photo{i:04d}.jpg", quality=90)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=40, help="photos in the folder (default 40)")
    parser.add_argument("--size", type=wxh, default=(640, 480), help="photo size WxH (default 640x480)")
    parser.add_argument("--weights", help="checkpoint (default: a random-weight tiny-vits-normal in a temp folder)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--resolution", type=wxh, default=(448, 252), help="canvas WxH (default 448x252)")
    parser.add_argument("--num-tokens", type=int, default=1200, help="token budget (default 1200)")
    parser.add_argument("--replicas", default="1,2", help="replica counts to compare, comma-separated (default 1,2)")
    parser.add_argument("--cpus-per-replica", type=float, default=None, help="as tt-moge batch (default: its default)")
    parser.add_argument("--gpus-per-replica", type=float, default=None, help="as tt-moge batch (default: its default)")
    parser.add_argument("--batch-size", type=int, default=4, help="images per replica call (default 4)")
    parser.add_argument("--runs", type=int, default=3, help="runs per replica count; medians are reported (default 3)")
    parser.add_argument("--address", default=None, help="a Ray cluster instead of a local Ray per run")
    args = parser.parse_args(argv)

    from tt_moge.batch import BatchJob, run_batch

    counts = [int(c) for c in args.replicas.split(",")]
    resolution, size = args.resolution, args.size
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tt_moge-replicas-bench-") as tmp:
        weights = args.weights
        if weights is None:
            from tt_moge.testing import make_checkpoint

            weights = str(make_checkpoint(Path(tmp) / "weights", "tiny-vits-normal"))
        photos = Path(tmp) / "photos"
        make_photos(photos, args.images, size)
        for run in range(args.runs):
            for n in counts:  # interleaved, so that a change in the machine's load hits every count alike
                t = time.perf_counter()
                model = {
                    "pretrained_model_name_or_path": weights,
                    "device": args.device,
                    "resolution": resolution,
                    "num_tokens": args.num_tokens,
                }
                summary = run_batch(
                    BatchJob(
                        [photos],
                        Path(tmp) / f"out-{n}-{run}",
                        model=model,
                        formats=["npz"],
                        replicas=n,
                        cpus_per_replica=args.cpus_per_replica,
                        gpus_per_replica=args.gpus_per_replica,
                        batch_size=args.batch_size,
                        address=args.address,
                        quiet=True,
                    )
                )
                if summary.done != args.images:
                    raise SystemExit(f"run with {n} replicas: {summary.line()}")
                results.setdefault(n, []).append(summary)
                print(
                    f"run {run + 1}/{args.runs}, {n} replica(s): {summary.images_per_second:.2f} images/s job, "
                    f"{summary.steady_images_per_second:.2f} steady ({summary.seconds:.1f} s job, Ray start "
                    f"{summary.ray_start_seconds:.1f} s, {time.perf_counter() - t:.1f} s in all)",
                    flush=True,
                )

    print(
        f"\n{args.images} photos {args.size[0]}x{args.size[1]}, canvas "
        f"{args.resolution[0]}x{args.resolution[1]}, {args.num_tokens} tokens, device {args.device}, "
        f"medians of {args.runs} run(s):"
    )
    base_job = base_steady = None
    for n in counts:
        job = statistics.median(s.images_per_second for s in results[n])
        steady = statistics.median(s.steady_images_per_second for s in results[n])
        base_job, base_steady = base_job or job, base_steady or steady
        print(
            f"  {n} replica(s): {job:6.2f} images/s job ({job / base_job:.2f}x)   "
            f"{steady:6.2f} images/s steady ({steady / base_steady:.2f}x)"
        )
    print(f"\nrerun: {common.rerun_command()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
