"""What reduced precision costs: our bf16 (or fp16) runner against the float32 reference, full pipeline.

For each checkpoint (by default two random-weight full-size ViT-L checkpoints from `tt_moge.testing`: one
plain random, one "well-posed" with a known camera) and each test image, one forward per precision; then the
same host steps on both raw maps. Prints a markdown table: raw-map errors at the canvas (points relative to
the map's scale, normal angle, mask probability, metric scale) and output errors at the image's resolution
(depth relative error over pixels valid in both, mask agreement, normal angle, fov_x, metric scale).
A plain random checkpoint has degenerate geometry (its mask is often all invalid), so its output rows may
say "n/a"; the raw rows still compare.

    python -m perf.runners.accuracy                      # bf16 vs fp32, 2 checkpoints x 2 images
    python -m perf.runners.accuracy --precision fp16     # on a CUDA machine: --device cuda
    python -m perf.runners.accuracy --precision bf16,int8 --outliers   # networks with outlier channels
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from perf import common


def _angle_deg(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.degrees(2 * np.arcsin(np.minimum(np.linalg.norm(a - b, axis=-1) / 2, 1)))


def _q(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if values.size else float("nan")


def raw_errors(ours, ref) -> dict:
    p, q = ours.points.numpy(), ref.points.numpy()
    rel = np.abs(p - q) / (np.abs(q) + np.abs(q).max())
    out = {"raw points rel max": rel.max(), "raw points rel p50": np.median(rel), "raw points rel p99": _q(rel, 0.99)}
    if ref.normal is not None:
        ang = _angle_deg(ours.normal.numpy(), ref.normal.numpy())
        out.update(
            {"raw normal deg p50": np.median(ang), "raw normal deg p99": _q(ang, 0.99), "raw normal deg max": ang.max()}
        )
    if ref.mask is not None:
        out["raw mask prob max abs"] = float(np.abs(ours.mask.numpy() - ref.mask.numpy()).max())
        out["raw mask agreement"] = float(((ours.mask.numpy() > 0.5) == (ref.mask.numpy() > 0.5)).mean())
    if ref.metric_scale is not None:
        out["raw metric scale rel"] = abs(ours.metric_scale / ref.metric_scale - 1)
    return out


def output_errors(ours, ref, same_camera) -> dict:
    """`same_camera`: our raw maps finished with the fp32 run's focal and shift, which separates the maps' own
    error from the camera solve's sensitivity (large on random, degenerate geometry)."""
    out = {"valid share (fp32)": ref.valid_fraction, "mask agreement": float((ours.mask == ref.mask).mean())}
    both = ours.mask & ref.mask & np.isfinite(ref.depth) & (ref.depth > 0)
    if both.mean() < 0.01:
        return out
    rel = np.abs(ours.depth[both] - ref.depth[both]) / ref.depth[both]
    out.update({"depth rel p50": np.median(rel), "depth rel p99": _q(rel, 0.99), "depth rel max": rel.max()})
    both_same = same_camera.mask & ref.mask & np.isfinite(ref.depth) & (ref.depth > 0)
    rel = np.abs(same_camera.depth[both_same] - ref.depth[both_same]) / ref.depth[both_same]
    out.update({"depth rel p50, fp32 camera": np.median(rel), "depth rel max, fp32 camera": rel.max()})
    if ref.normal is not None:
        ang = _angle_deg(ours.normal[both], ref.normal[both])
        out.update({"normal deg p50": np.median(ang), "normal deg p99": _q(ang, 0.99), "normal deg max": ang.max()})
    out["fov_x abs deg"] = abs(ours.fov_x - ref.fov_x)
    out["metric scale rel"] = abs(ours.metric_scale / ref.metric_scale - 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--checkpoint", action="append", help="model.pt to compare on (repeatable; default: 2 random ViT-L)"
    )
    ap.add_argument(
        "--precision", default="bf16", help="the precision(s) compared with fp32, comma-separated (default bf16)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"))
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--images", type=int, default=2, help="test images per checkpoint (photo-like, different seeds)")
    ap.add_argument("--json", help="write the numbers to this file")
    ap.add_argument(
        "--outliers",
        action="store_true",
        help="give every checkpoint's ViT the outlier channels of trained ViTs first "
        "(tt_moge.testing.add_outlier_channels): what the int8 smoothing is for",
    )
    args = ap.parse_args()

    import torch

    from tt_moge.constants import MASK_THRESHOLD
    from tt_moge.host import CallOptions, postprocess, prepare
    from tt_moge.host.finish import finish
    from tt_moge.host.solve import recover_camera
    from tt_moge.runners import make_runner
    from tt_moge.synthetic import synthetic_photo
    from tt_moge.testing import add_outlier_channels, make_checkpoint
    from tt_moge.weights import load_network

    if args.checkpoint:
        checkpoints = [(p, p) for p in args.checkpoint]
    else:
        plain = common.DEFAULT_CACHE / "vitl-normal-plain" / "model.pt"
        if not plain.is_file():
            print(f"writing a plain random vitl-normal checkpoint to {plain} (once)", flush=True)
            make_checkpoint(plain, "vitl-normal", well_posed=False)
        checkpoints = [("ViT-L random", plain), ("ViT-L well-posed", common.full_size_checkpoint(None))]
    size = tuple(args.size)
    images = [synthetic_photo(size, seed=10 + i) for i in range(args.images)]
    options = CallOptions()
    compared = args.precision.split(",")
    rows = {p: [] for p in compared}
    for label, path in checkpoints:
        results = {}
        for precision in ["fp32"] + compared:
            network, _ = load_network(path, None)
            if args.outliers:
                add_outlier_channels(network)
            runner = make_runner(network, size, args.tokens, args.device, precision)
            del network
            outs = []
            for image in images:
                prepared = prepare(image, size, options)
                t = time.perf_counter()
                raw = runner.forward(prepared.canvas)
                outs.append((raw, postprocess(raw, prepared.plan, options), prepared.plan))
                print(f"{label}, {precision}: forward {time.perf_counter() - t:.1f} s", flush=True)
            results[precision] = outs
            runner.close()
        for precision in compared:
            for i, ((raw_ref, out_ref, plan), (raw, out, _)) in enumerate(zip(results["fp32"], results[precision])):
                focal, shift = recover_camera(raw_ref.points, raw_ref.mask > MASK_THRESHOLD, plan, None)
                same_camera = finish(raw, plan, focal, shift, apply_mask=True, force_projection=True)
                rows[precision].append(
                    (
                        f"{label}, image {i + 1}",
                        {**raw_errors(raw, raw_ref), **output_errors(out, out_ref, same_camera)},
                    )
                )

    for precision, table in rows.items():
        keys = list(dict.fromkeys(k for _, r in table for k in r))
        extra = ", ViT with outlier channels" if args.outliers else ""
        print(
            f"\n{precision} vs fp32{extra}, {size[0]}x{size[1]}, {args.tokens} "
            f"tokens, device {args.device}, torch {torch.__version__}\n"
        )
        print("| metric | " + " | ".join(name for name, _ in table) + " |")
        print("|---|" + "---:|" * len(table))
        for k in keys:
            cells = ["n/a" if r.get(k) is None else f"{r[k]:.3g}" for _, r in table]
            print(f"| {k} | " + " | ".join(cells) + " |")
    print()
    common.finish_report(
        {p: {name: {k: float(v) for k, v in r.items()} for name, r in table} for p, table in rows.items()}, args.json
    )


if __name__ == "__main__":
    main()
