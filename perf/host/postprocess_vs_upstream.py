"""Host post-processing: tt_moge's solve + finish vs upstream MoGe's, on the same raw maps, in one process.

Upstream's post-processing is what `moge.model.v2.MoGeModel.infer` does after its forward: recover_focal_shift,
the intrinsics, the shift, depth_map_to_point_map, the metric scale and the masking. It is timed by running
upstream's own `infer` with its `forward` replaced by a function that hands back a fresh copy of the raw maps
(copies made before the clock starts; infer edits them in place). Ours is `postprocess` (solve + finish) on
the same maps, with the native host library and with the torch path. The runs alternate between the two so
that load changes on a shared machine hit both alike.

    python -m perf.host.postprocess_vs_upstream                      # random-weight checkpoint, 1920x1080
    python -m perf.host.postprocess_vs_upstream --weights model.pt --runs 50

Needs the upstream oracle (pip install --no-deps dlr-moge==2.0.0 dlr-utils3d==1.3).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from perf import common
from tt_moge.cli.argtypes import wxh  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", help="a model.pt (default: a random-weight tiny-vits-normal checkpoint)")
    parser.add_argument("--resolution", type=wxh, default=(1920, 1080), help="canvas and image size WxH")
    parser.add_argument("--num-tokens", type=int, default=1800)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, help="native host threads (default: $MOGE_SERVE_THREADS or the cores)")
    args = parser.parse_args(argv)

    import warnings

    import moge.model.v2 as upstream_v2
    import torch

    warnings.filterwarnings("ignore", message="In CPU autocast")  # upstream's fp32 autocast block on the CPU

    from tt_moge import MoGeModel, native
    from tt_moge.host import CallOptions, plan_canvas, postprocess
    from tt_moge.runners.base import RawMaps
    from tt_moge.testing import calibration_image, make_checkpoint
    from tt_moge.weights import read_checkpoint

    torch.set_grad_enabled(False)
    tmp = tempfile.TemporaryDirectory(prefix="tt_moge-perf-")
    weights = args.weights or str(make_checkpoint(tmp.name, "tiny-vits-normal"))
    size = args.resolution
    image = calibration_image(*size, seed=3)[0]
    with MoGeModel.from_pretrained(
        weights, device="cpu", resolution=size, num_tokens=args.num_tokens, warmup=0, warmup_variants="none"
    ) as model:
        raw_dict = {k: v.clone() for k, v in model.forward(image[None]).items()}
    raw = RawMaps(
        raw_dict["points"][0],
        raw_dict.get("normal", [None])[0],
        raw_dict["mask"][0],
        float(raw_dict["metric_scale"][0]),
    )
    plan = plan_canvas(size, size, "pad")
    options = CallOptions()

    theirs = upstream_v2.MoGeModel.from_pretrained(weights).eval()
    theirs.load_state_dict(read_checkpoint(weights)[1], strict=False)
    copies: list = []
    theirs.forward = lambda _image, num_tokens=None: copies.pop()

    def upstream_run() -> float:
        copies.append({k: v.clone() for k, v in raw_dict.items()})
        t = time.perf_counter()
        theirs.infer(image, num_tokens=args.num_tokens, use_fp16=False)
        return (time.perf_counter() - t) * 1e3

    def ours_run(path: str) -> dict:
        native.set_host_path(path)
        timing: dict = {}
        postprocess(raw, plan, options, timing)
        return timing

    native.set_host_path("native")
    if args.threads:
        native.set_threads(args.threads)
    if native.host_path() != "native":
        print("the native host library is unavailable: only the torch path is measured")
    paths = ["native", "torch"] if native.host_path() == "native" else ["torch"]

    # warm every path once (lazy imports, first-touch memory), and check that the answers agree
    copies.append({k: v.clone() for k, v in raw_dict.items()})
    ref = theirs.infer(image, num_tokens=args.num_tokens, use_fp16=False)
    for path in paths:
        native.set_host_path(path)
        out = postprocess(raw, plan, options).to_torch()
        valid = ref["mask"].float().mean().item()
        same_mask = torch.equal(out["mask"], ref["mask"])
        rel = ((out["depth"] - ref["depth"]).abs()[ref["mask"]] / ref["depth"][ref["mask"]]).max().item()
        print(
            f"check {path}: mask identical to upstream={same_mask} (valid {valid:.1%}), max relative depth "
            f"difference {rel:.2e} (upstream's solver stops at ftol 1e-3)"
        )

    up, ours = [], {p: [] for p in paths}
    for _ in range(args.runs):
        up.append(upstream_run())
        for path in paths:
            ours[path].append(ours_run(path))
    native.set_host_path(None)

    up_ms = statistics.median(up)
    print(f"\n{size[0]}x{size[1]}, {args.runs} runs each, medians (min):")
    print(f"  upstream post-processing (infer after forward)  {up_ms:8.2f} ms ({min(up):.2f})")
    for path in paths:
        solve = statistics.median(t["solve"] for t in ours[path])
        fin = statistics.median(t["finish"] for t in ours[path])
        total = statistics.median(t["solve"] + t["finish"] for t in ours[path])
        extra = f", {native.threads()} threads" if path == "native" else ""
        print(
            f"  tt_moge {path:6s} solve {solve:6.2f} + finish {fin:6.2f} = {total:8.2f} ms "
            f"({min(t['solve'] + t['finish'] for t in ours[path]):.2f}){extra}   ratio to upstream {total / up_ms:.3f} "
            f"(1/{up_ms / total:.1f})"
        )
    print(f"rerun: {common.rerun_command(argv)}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
