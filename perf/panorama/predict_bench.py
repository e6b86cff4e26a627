"""The whole panorama call: our `MoGeModel.predict_panorama` against upstream's `moge infer_panorama` steps on
the same panorama and the same checkpoint, in one process, calls alternated.

Upstream's script (`moge/scripts/infer_panorama.py`) loads a MoGe-1 model; for the same checkpoint we run its
steps with upstream's MoGe-2 model: `split_panorama_image` -> `model.infer` on batches of 4 views with
fov_x = 90 and apply_mask=False -> `merge_panorama_depth` at min(1920, W) x min(960, H) -> resize -> points.
Ours: `predict_panorama` on a model loaded with the square 512x512 canvas (PANORAMA_CANVAS). The input is the
room of planes (`tt_moge.testing.room`) rendered at --size.

    python -m perf.panorama.predict_bench                          # tiny random checkpoint, 1024x512
    python -m perf.panorama.predict_bench --preset vitl-normal --size 1920x960 --repeats 1
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

from ..common import finish_report, load_upstream, median, timed
from .merge_bench import cpu_name


def upstream_panorama(model, image: np.ndarray, num_tokens: int) -> np.ndarray:
    """infer_panorama.py's steps with upstream's model: the panorama distance map."""
    import cv2
    import torch
    import utils3d
    from moge.utils.panorama import get_panorama_cameras, merge_panorama_depth, split_panorama_image

    height, width = image.shape[:2]
    extrinsics, intrinsics = get_panorama_cameras()
    views = split_panorama_image(image, extrinsics, intrinsics, 512)
    distances, masks = [], []
    for i in range(0, len(views), 4):
        batch = torch.tensor(np.stack(views[i : i + 4]) / 255, dtype=torch.float32).permute(0, 3, 1, 2)
        fov_x, _ = np.rad2deg(utils3d.np.intrinsics_to_fov(np.array(intrinsics[i : i + 4])))
        with torch.inference_mode():
            out = model.infer(
                batch,
                num_tokens=num_tokens,
                fov_x=torch.tensor(fov_x, dtype=torch.float32),
                apply_mask=False,
                use_fp16=False,
            )
        distances += list(out["points"].norm(dim=-1).numpy())
        masks += list(out["mask"].numpy())
    depth, mask = merge_panorama_depth(min(1920, width), min(960, height), distances, masks, extrinsics, intrinsics)
    return cv2.resize(depth.astype(np.float32), (width, height), interpolation=cv2.INTER_LINEAR)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m perf.panorama.predict_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset", default="tiny-vits-normal", help="random checkpoint preset (default tiny-vits-normal)"
    )
    parser.add_argument("--weights", help="a model.pt to use instead of a random checkpoint")
    parser.add_argument("--size", default="1024x512", help="panorama WxH (default 1024x512)")
    parser.add_argument(
        "--num-tokens", type=int, default=1800, help="the token budget per view, both sides (default 1800)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="calls of each, alternated (default 2)")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))

    import torch

    from tt_moge import MoGeModel
    from tt_moge.panorama import PANORAMA_CANVAS
    from tt_moge.testing import make_checkpoint
    from tt_moge.testing.room import render_panorama

    torch.set_grad_enabled(False)
    scratch = tempfile.TemporaryDirectory()
    weights = args.weights or str(make_checkpoint(scratch.name, args.preset))
    image = render_panorama(width, height).image
    upstream = load_upstream(weights)
    ours = MoGeModel.from_pretrained(
        weights,
        device="cpu",
        resolution=PANORAMA_CANVAS,
        num_tokens=args.num_tokens,
        precision="fp32",
        warmup=1,
        warmup_variants="none",
    )
    results: dict = {}
    times = {"upstream": [], "ours": []}
    for _ in range(args.repeats):
        times["upstream"].append(
            timed(lambda: results.__setitem__("upstream", upstream_panorama(upstream, image, args.num_tokens)))
        )
        times["ours"].append(timed(lambda: results.__setitem__("ours", ours.predict_panorama(image))))
    ours.close()
    up_t, our_t = median(times["upstream"]), median(times["ours"])
    print(
        f"CPU: {cpu_name()}; {args.weights or args.preset}; panorama {width}x{height}; fp32; "
        f"{args.repeats} calls each, alternated"
    )
    print(
        f"upstream infer_panorama steps (MoGe-2 infer, batches of 4): median {up_t:.1f} s  "
        f"{[round(t, 1) for t in times['upstream']]}"
    )
    print(
        f"ours predict_panorama ({PANORAMA_CANVAS[0]}x{PANORAMA_CANVAS[1]} canvas, {args.num_tokens} tokens): "
        f"median {our_t:.1f} s  {[round(t, 1) for t in times['ours']]}"
    )
    print("ours, last call: " + ", ".join(f"{k} {v:.2f} s" for k, v in results["ours"].seconds.items()))
    print(f"ratio ours / upstream: {our_t / up_t:.3f}")
    finish_report(
        {
            "cpu": cpu_name(),
            "size": [width, height],
            "preset": args.weights or args.preset,
            "upstream_s": times["upstream"],
            "ours_s": times["ours"],
            "ratio": our_t / up_t,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
