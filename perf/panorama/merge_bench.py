"""The panorama merge: ours (`tt_moge.panorama.merge_distance_maps`) against upstream MoGe's
`moge.utils.panorama.merge_panorama_depth` on the same 12 view maps, in one process, calls alternated.

The view maps (--views):
  room   the exact distance maps of the room of planes (`tt_moge.testing.room`) seen by the 12 views, each
         distorted as a network would (its own scale, a tilt, a ripple) and with a hole in its mask, so that
         the views disagree and the least-squares fit has work to do (default);
  model  the views of a random-weight checkpoint (tiny-vits-normal, a 224x224 canvas) on a textured
         1024x512 panorama: views that disagree strongly (the input of issue #23).
Prints the median seconds of each and the ratio (wall, and CPU seconds of the process, which move less with
other jobs' load on a shared machine); our solve's iterations, final relative residual and
whether it converged; the objective |A x - b|^2 on upstream's own equations (the A and b its last lsmr call
is given) at our answer, at upstream's and at the minimiser (ours solved to a relative residual of 1e-10;
tests/test_panorama.py checks such solves against a sparse direct solve); and how far each answer's log
distance is from the minimiser's after removing the free global scale.

    python -m perf.panorama.merge_bench                          # room views, 1920x960, 3 calls each
    python -m perf.panorama.merge_bench --views model --size 1024x512
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile

import numpy as np

from ..common import finish_report, median, timed_both


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def perturbed_room_views(seed: int = 1, size: int = 512) -> tuple:
    """(distance maps, masks): the room's exact view distances, each with its own scale, tilt and ripple (a
    few per cent), and a disc-shaped hole in each mask."""
    from tt_moge.panorama import view_cameras
    from tt_moge.testing.room import render_view

    rng = np.random.default_rng(seed)
    t = (np.arange(size) + 0.5) / (size / 2) - 1
    u, v = np.meshgrid(t, t)
    maps, masks = [], []
    for camera in view_cameras():
        a, b, s = rng.normal(0, 0.05, 3)
        maps.append(
            (render_view(camera, size) * np.exp(s + a * u + b * v + 0.02 * np.sin(3 * u + 2 * v + 10 * a))).astype(
                np.float32
            )
        )
        cx, cy = rng.uniform(-1, 1, 2)
        masks.append((u - cx) ** 2 + (v - cy) ** 2 > 0.3**2)
    return maps, masks


def textured_panorama(seed: int = 0) -> np.ndarray:
    """A (512, 1024, 3) uint8 texture: random colours on a 128x64 grid, upsampled (cubic), plus pixel noise."""
    import cv2

    rng = np.random.default_rng(seed)
    image = cv2.resize(rng.integers(0, 256, (64, 128, 3), dtype=np.uint8), (1024, 512), interpolation=cv2.INTER_CUBIC)
    return np.clip(image.astype(int) + rng.integers(-30, 30, image.shape), 0, 255).astype(np.uint8)


def model_views(seed: int = 0) -> tuple:
    """(distance maps, masks): the 12 views of a random-weight tiny checkpoint on a textured 1024x512
    panorama (distance = |points|; invalid pixels keep a finite distance, as predict_panorama hands them on)."""
    from tt_moge import MoGeModel
    from tt_moge.testing import make_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        weights = make_checkpoint(folder, "tiny-vits-normal", seed=seed)
        with MoGeModel.from_pretrained(
            weights,
            device="cpu",
            resolution=(224, 224),
            num_tokens=1200,
            warmup=0,
            warmup_variants="none",
            precision="fp32",
        ) as model:
            out = model.predict_panorama(textured_panorama(seed), return_views=True)
    maps, masks = [], []
    for view in out.views:
        distance = np.linalg.norm(view.points, axis=-1)
        usable = np.isfinite(distance) & (distance > 0)
        maps.append(np.where(usable, distance, 1.0).astype(np.float32))
        masks.append(view.mask & usable)
    return maps, masks


def log_error(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> tuple:
    """(p50, p99) of |log a - log b| over mask after removing the median (the free global scale)."""
    r = np.log(a[mask]) - np.log(b[mask])
    r = np.abs(r - np.median(r))
    return float(np.percentile(r, 50)), float(np.percentile(r, 99))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m perf.panorama.merge_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", default="1920x960", help="the merge grid WxH (default 1920x960, upstream's largest)")
    parser.add_argument("--views", choices=["room", "model"], default="room", help="the view maps (default room)")
    parser.add_argument("--repeats", type=int, default=3, help="calls of each, alternated (default 3)")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))

    import moge.utils.panorama as upstream  # the oracle

    from tt_moge.panorama import merge as ours
    from tt_moge.panorama import view_cameras
    from tt_moge.testing import recording_upstream_lsmr

    maps, masks = perturbed_room_views() if args.views == "room" else model_views()
    cameras = view_cameras()
    up_extrinsics, up_intrinsics = upstream.get_panorama_cameras()
    results: dict = {}

    def run_upstream():
        results["upstream"] = upstream.merge_panorama_depth(width, height, maps, masks, up_extrinsics, up_intrinsics)

    def run_ours():
        results["ours"] = ours.merge_distance_maps(maps, masks, cameras, width, height)

    times, cpu = {"upstream": [], "ours": []}, {"upstream": [], "ours": []}
    with recording_upstream_lsmr() as equations:  # keeps upstream's last (full-size) least squares
        for _ in range(args.repeats):
            for name, run in (("upstream", run_upstream), ("ours", run_ours)):
                wall, seconds = timed_both(run)
                times[name].append(wall)
                cpu[name].append(seconds)
    up_t, our_t = median(times["upstream"]), median(times["ours"])
    up_c, our_c = median(cpu["upstream"]), median(cpu["ours"])
    mine, (theirs, their_mask) = results["ours"], results["upstream"]
    reference = ours.merge_distance_maps(maps, masks, cameras, width, height, rtol=1e-10)
    a, b = equations["a"].tocsr(), np.asarray(equations["b"], np.float64)

    def objective(distance: np.ndarray) -> float:
        return float(np.sum((a @ np.log(distance).ravel().astype(np.float64) - b) ** 2))

    f_ours, f_up, f_min = objective(mine.distance), objective(theirs), objective(reference.distance)
    mask = mine.mask & their_mask
    ours_err, up_err = log_error(mine.distance, reference.distance, mask), log_error(theirs, reference.distance, mask)
    print(
        f"CPU: {cpu_name()} ({platform.machine()}); {args.views} views; merge grid {width}x{height}; "
        f"{args.repeats} calls each, alternated"
    )
    print(f"upstream merge_panorama_depth: median {up_t:.2f} s  {[round(t, 2) for t in times['upstream']]}")
    print(
        f"ours merge_distance_maps:      median {our_t:.2f} s  {[round(t, 2) for t in times['ours']]}  (last call: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in mine.seconds.items())
        + ")"
    )
    print(
        f"ratio ours / upstream: {our_t / up_t:.3f} (CPU seconds of the process: ours {our_c:.2f}, upstream "
        f"{up_c:.2f}, ratio {our_c / up_c:.3f})"
    )
    print(
        f"our solve: {mine.iterations} CG iterations, relative residual {mine.residual:.1e}, "
        f"converged {mine.converged} "
        f"(the minimiser: {reference.iterations} iterations to {reference.residual:.1e})"
    )
    print(
        f"objective on upstream's equations: ours {f_ours:.6g}, upstream {f_up:.6g}, minimiser {f_min:.6g} "
        f"(above the minimiser: ours {(f_ours - f_min) / f_min:.1e}, upstream {(f_up - f_min) / f_min:.1e} relative)"
    )
    print(
        f"|log distance - minimiser| after the global scale, p50 / p99: ours {ours_err[0]:.1e} / {ours_err[1]:.1e}; "
        f"upstream {up_err[0]:.1e} / {up_err[1]:.1e}"
    )
    print(f"mask agreement with upstream: {100 * float((mine.mask == their_mask).mean()):.3f} %")
    finish_report(
        {
            "cpu": cpu_name(),
            "views": args.views,
            "size": [width, height],
            "upstream_s": times["upstream"],
            "ours_s": times["ours"],
            "ratio": our_t / up_t,
            "upstream_cpu_s": cpu["upstream"],
            "ours_cpu_s": cpu["ours"],
            "cpu_ratio": our_c / up_c,
            "iterations": mine.iterations,
            "residual": mine.residual,
            "converged": mine.converged,
            "objective": {"ours": f_ours, "upstream": f_up, "minimiser": f_min},
            "ours_log_error_p50_p99": ours_err,
            "upstream_log_error_p50_p99": up_err,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
