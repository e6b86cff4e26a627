"""CUDA: our `forward` and `model(array)` beside upstream MoGe-2 `infer(use_fp16=True)` on the same GPU.

ViT-L, 1920x1080, 1800 tokens, the same weights (by default a random-weight full-size checkpoint from
`tt_moge.testing`) and the same photo-like image. Ours: the CUDA-graph runner at --precision (default auto =
fp16); `forward` returns the raw maps on the host, `model(array)` the finished MoGeOutput (numpy, on the host).
Upstream: `infer` on a GPU tensor, its outputs left on the GPU (timed to a `torch.cuda.synchronize()`), and its
bare `forward` under fp16 autocast. Prints per-call medians, the ratios and the command to rerun it.

NOT YET RUN: this session had no GPU. The script needs CUDA and says so without it.

    python -m perf.runners.bench_cuda --calls 50
"""

from __future__ import annotations

import argparse
import sys

from perf import common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a MoGe-2 model.pt (default: the cached random full-size ViT-L)")
    ap.add_argument("--calls", type=int, default=50, help="timed calls per row (after one warm call)")
    ap.add_argument("--precision", default="auto", help="ours: auto (fp16) | fp16 | bf16 | fp32")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"))
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--json", help="write the numbers to this file")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit(
            f"perf.runners.bench_cuda needs a CUDA GPU; torch {torch.__version__} "
            "sees none. CPU: python -m perf.runners.bench_cpu"
        )
    from tt_moge import MoGeModel

    device = torch.device(args.device)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    path = common.full_size_checkpoint(args.checkpoint)
    size = tuple(args.size)
    image = common.photo(size)
    canvas = torch.from_numpy(image).permute(2, 0, 1)[None].float().div(255)
    ours = MoGeModel.from_pretrained(
        path, device=device, resolution=size, num_tokens=args.tokens, precision=args.precision
    )
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; ours: {ours.info()['runner']}", flush=True)
    rows = {
        "ours forward (canvas -> raw maps on the host)": common.median_min_ms(
            lambda: ours.forward(canvas), args.calls, sync
        ),
        "ours model(array) (-> MoGeOutput on the host)": common.median_min_ms(lambda: ours(image), args.calls, sync),
    }
    if not args.no_upstream:
        upstream = common.load_upstream(path).to(device)
        x = canvas[0].to(device)
        with torch.inference_mode():
            rows["upstream infer(use_fp16=True), outputs on the GPU"] = common.median_min_ms(
                lambda: upstream.infer(x, num_tokens=args.tokens, use_fp16=True), args.calls, sync
            )
            with torch.autocast("cuda", dtype=torch.float16):
                rows["upstream forward, fp16 autocast"] = common.median_min_ms(
                    lambda: upstream.forward(x[None], num_tokens=args.tokens), args.calls, sync
                )
    print(f"\nViT-L {size[0]}x{size[1]}, {args.tokens} tokens, {args.calls} calls per row (median / min, ms)")
    for name, (med, low) in rows.items():
        print(f"  {name}: {med:.2f} / {low:.2f}")
    result = {name: {"median_ms": med, "min_ms": low} for name, (med, low) in rows.items()}
    up = rows.get("upstream infer(use_fp16=True), outputs on the GPU")
    if up:
        for name in list(rows)[:2]:
            print(f"ratio {name.split(' (')[0]} / upstream infer: {rows[name][0] / up[0]:.3f}")
    ours.close()
    common.finish_report(result, args.json)


if __name__ == "__main__":
    main()
