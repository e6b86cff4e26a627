"""The panorama merge: ours (`tt_moge.panorama.merge_distance_maps`) against upstream MoGe's
`moge.utils.panorama.merge_panorama_depth` on the same 12 view maps, in one process, calls alternated.

The view maps: the exact distance maps of the room of planes (`tt_moge.testing.room`) seen by the 12 views,
each distorted as a network would (its own scale, a tilt, a ripple) and with a hole in its mask, so that the
views disagree and the least-squares fit has work to do. Prints the median seconds of each, the ratio, and how
far each answer is from the objective's minimiser (ours solved to a relative residual of 1e-7), after removing
the free global scale.

    python -m perf.panorama.merge_bench                 # 1920x960, 3 calls each
    python -m perf.panorama.merge_bench --size 960x480 --repeats 5
"""
from __future__ import annotations

import argparse
import platform
import subprocess

import numpy as np

from ..common import finish_report, median, timed


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def perturbed_room_views(seed: int = 1, size: int = 512) -> tuple:
    """(distance maps, masks, our cameras): the room's exact view distances, each with its own scale, tilt and
    ripple (a few per cent), and a disc-shaped hole in each mask."""
    from tt_moge.panorama import view_cameras
    from tt_moge.testing.room import render_view

    rng = np.random.default_rng(seed)
    t = (np.arange(size) + 0.5) / (size / 2) - 1
    u, v = np.meshgrid(t, t)
    cameras = view_cameras()
    maps, masks = [], []
    for camera in cameras:
        a, b, s = rng.normal(0, 0.05, 3)
        maps.append((render_view(camera, size) * np.exp(s + a * u + b * v + 0.02 * np.sin(3 * u + 2 * v + 10 * a))).astype(np.float32))
        cx, cy = rng.uniform(-1, 1, 2)
        masks.append((u - cx) ** 2 + (v - cy) ** 2 > 0.3 ** 2)
    return maps, masks, cameras


def log_error(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> tuple:
    """(p50, p99) of |log a - log b| over mask after removing the median (the free global scale)."""
    r = np.log(a[mask]) - np.log(b[mask])
    r = np.abs(r - np.median(r))
    return float(np.percentile(r, 50)), float(np.percentile(r, 99))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m perf.panorama.merge_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1920x960", help="the merge grid WxH (default 1920x960, upstream's largest)")
    parser.add_argument("--repeats", type=int, default=3, help="calls of each, alternated (default 3)")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))

    from moge.utils.panorama import get_panorama_cameras, merge_panorama_depth  # the oracle

    from tt_moge.panorama import merge as ours

    maps, masks, cameras = perturbed_room_views()
    up_extrinsics, up_intrinsics = get_panorama_cameras()
    results: dict = {}

    def run_upstream():
        results["upstream"] = merge_panorama_depth(width, height, maps, masks, up_extrinsics, up_intrinsics)

    def run_ours():
        results["ours"] = ours.merge_distance_maps(maps, masks, cameras, width, height)

    times = {"upstream": [], "ours": []}
    for _ in range(args.repeats):
        times["upstream"].append(timed(run_upstream))
        times["ours"].append(timed(run_ours))
    up_t, our_t = median(times["upstream"]), median(times["ours"])
    mine = results["ours"]
    reference = ours.merge_distance_maps(maps, masks, cameras, width, height, rtol=1e-7).distance
    mask = mine.mask & results["upstream"][1]
    ours_err = log_error(mine.distance, reference, mask)
    up_err = log_error(results["upstream"][0], reference, mask)
    print(f"CPU: {cpu_name()} ({platform.machine()}); merge grid {width}x{height}; {args.repeats} calls each, alternated")
    print(f"upstream merge_panorama_depth: median {up_t:.2f} s  {[round(t, 2) for t in times['upstream']]}")
    print(f"ours merge_distance_maps:      median {our_t:.2f} s  {[round(t, 2) for t in times['ours']]}  "
          f"({mine.iterations} CG iterations; last call: " + ", ".join(f"{k} {v:.2f} s" for k, v in mine.seconds.items()) + ")")
    print(f"ratio ours / upstream: {our_t / up_t:.3f}")
    print(f"|log distance - minimiser| after the global scale, p50 / p99: ours {ours_err[0]:.1e} / {ours_err[1]:.1e}; "
          f"upstream {up_err[0]:.1e} / {up_err[1]:.1e}")
    print(f"mask agreement with upstream: {100 * float((mine.mask == results['upstream'][1]).mean()):.3f} %")
    finish_report({"cpu": cpu_name(), "size": [width, height], "upstream_s": times["upstream"], "ours_s": times["ours"],
                   "ratio": our_t / up_t, "ours_log_error_p50_p99": ours_err, "upstream_log_error_p50_p99": up_err,
                   "iterations": mine.iterations}, args.json)


if __name__ == "__main__":
    main()
