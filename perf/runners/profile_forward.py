"""Where the CPU forward's time goes: per stage (ViT encoder, neck + heads, resize to the canvas + output
activations) and per operator (torch.profiler), for the reference network or the fixed-shape graph.

    python -m perf.runners.profile_forward --precision bf16 --threads 1
    python -m perf.runners.profile_forward --precision fp32 --threads 1     # the reference network
    python -m perf.runners.profile_forward --precision int8 --torch-glue    # int8 quantisation in torch ops
"""

from __future__ import annotations

import argparse
import time

from perf import common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a MoGe-2 model.pt (default: the cached random full-size ViT-L)")
    ap.add_argument("--precision", default="bf16", help="fp32 (the reference network) | bf16 | int8")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"))
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--rows", type=int, default=15, help="operators to list")
    ap.add_argument("--passes", type=int, default=3, help="unprofiled passes for the stage times (median)")
    ap.add_argument(
        "--torch-glue",
        action="store_true",
        help="int8: quantise/dequantise with the torch reference ops instead of the native kernels",
    )
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from tt_moge.network import token_grid
    from tt_moge.runners import make_runner
    from tt_moge.synthetic import synthetic_photo
    from tt_moge.weights import load_network

    if args.threads:
        torch.set_num_threads(args.threads)
    size = tuple(args.size)
    network, _ = load_network(common.full_size_checkpoint(args.checkpoint), None)
    runner = make_runner(network, size, args.tokens, "cpu", args.precision)
    if args.torch_glue:
        from tt_moge.runners.vit_kernels import Int8Linear

        for module in runner.graph.modules():
            if isinstance(module, Int8Linear):
                module.lib = None
    canvas = torch.from_numpy(synthetic_photo(size, seed=1)).permute(2, 0, 1)[None].float().div(255)
    if args.precision == "fp32":
        net = runner.network
        aspect = size[0] / size[1]
        rows, cols = token_grid(args.tokens, aspect)

        def stages(image):
            t0 = time.perf_counter()
            features, _ = net.encoder(image, rows, cols)
            t1 = time.perf_counter()
            uv = net.uv_planes(rows, cols, aspect, image.dtype, image.device)
            neck = net.neck([torch.cat([features, uv[0]], dim=1)] + uv[1:])
            heads = [
                getattr(net, h + "_head")(neck, last_only=True)[-1]
                for h in ("points", "normal", "mask")
                if hasattr(net, h + "_head")
            ]
            t2 = time.perf_counter()
            for y in heads:
                F.interpolate(y, (size[1], size[0]), mode="bilinear", align_corners=False)
            return t1 - t0, t2 - t1, time.perf_counter() - t2
    else:
        graph = runner.graph

        def stages(image):
            t0 = time.perf_counter()
            level0, _ = graph.encode(image)
            t1 = time.perf_counter()
            maps = graph.decode(level0)
            t2 = time.perf_counter()
            F.interpolate(maps, (size[1], size[0]), mode="bilinear", align_corners=False)
            return t1 - t0, t2 - t1, time.perf_counter() - t2

    with torch.inference_mode():
        runner.forward(canvas)  # warm
        runs = [stages(canvas) for _ in range(args.passes)]
        enc, dec, out = (common.median([r[k] for r in runs]) for k in range(3))
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.forward(canvas)
        total = time.perf_counter() - t
    glue = " (torch int8 glue)" if args.torch_glue else ""
    print(
        f"{args.precision}{glue}, {size[0]}x{size[1]}, {args.tokens} tokens, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(common.cpu_line())
    print(common.kernel_line(runner.describe()))
    print(
        f"stages (median of {args.passes} unprofiled passes): ViT encoder "
        f"{enc:.2f} s, neck + heads {dec:.2f} s, resize to canvas {out:.3f} s"
    )
    print(f"profiled forward: {total:.2f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(f"rerun: {common.rerun_command()}")


if __name__ == "__main__":
    main()
