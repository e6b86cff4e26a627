"""torch.compile (inductor, freezing) on the CPU runner's fixed-shape graph: compile time, eager against compiled
(medians, alternated in one process), and how far the compiled outputs move from the eager ones (issue 30's
"torch.compile's CPU backend, where it measures better").

`--graph default`: the graph `MoGeModel.from_pretrained(device="cpu")` runs (its attention kernel chosen by
measurement, the native one where it wins), on a random checkpoint in the real format; `--graph sdpa`: the same
fixed-shape graph with PyTorch's SDPA attention (no native kernel: what inductor can compile whole).

    python -m perf.runners.compile_cpu --preset vitl-normal --size 1920x1080 --tokens 1800 --graph default
"""

from __future__ import annotations

import argparse
import time

import torch

from perf import common


def _graph(args) -> torch.nn.Module:
    width, height = (int(v) for v in args.size.lower().split("x"))
    if args.graph == "sdpa":
        from tt_moge.random_weights import make_network
        from tt_moge.runners.fixed_graph import FixedShapeMoGe2

        return FixedShapeMoGe2(make_network(args.preset), (width, height), args.tokens, torch.bfloat16).eval()
    from tt_moge import MoGeModel

    path = common.full_size_checkpoint(None, args.preset)  # written once into the cache, reused
    model = MoGeModel.from_pretrained(
        str(path), device="cpu", resolution=(width, height), num_tokens=args.tokens, warmup=0, warmup_variants="none"
    )
    runner = model.service.runner
    print(f"runner: {type(runner).__name__} {runner.precision}, choices {getattr(runner, 'choices', None)}")
    return runner.graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-vits-normal")
    ap.add_argument("--size", default="640x480", help="canvas WxH")
    ap.add_argument("--tokens", type=int, default=1200, help="token budget (MoGeModel takes 1200-3600)")
    ap.add_argument("--graph", choices=("default", "sdpa"), default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="eager / compiled alternations")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor

    inductor.freezing = True  # weights as constants: inference only
    graph = _graph(args)
    width, height = (int(v) for v in args.size.lower().split("x"))
    x = torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = graph(x)
        compiled = torch.compile(graph)
        t = time.perf_counter()
        out = compiled(x)
        print(f"compile + first call: {time.perf_counter() - t:.1f} s")
        for _ in range(args.rounds):
            e = common.median_min_ms(lambda: graph(x), args.runs)[0]
            c = common.median_min_ms(lambda: compiled(x), args.runs)[0]
            print(f"eager {e:.1f} ms, compiled {c:.1f} ms, ratio {c / e:.3f} (medians of {args.runs})")
        for key in ("points", "normal", "mask"):
            if key in eager:
                d = (out[key].float() - eager[key].float()).abs().flatten()
                p99 = d.kthvalue(max(1, int(0.99 * d.numel()))).values.item()
                print(f"{key}: compiled - eager, max abs {d.max().item():.3g}, p99 {p99:.3g}")
    print(f"{common.cpu_line()}; {args.threads} threads, torch {torch.__version__}")


if __name__ == "__main__":
    main()
