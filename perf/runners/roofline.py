"""How far the CPU forward is from this machine's matrix-multiply rate: the roofline of the CPU runner.

Counts the multiply-accumulates of the fixed-shape graph (ViT linear layers and patch embedding, attention,
the conv decoder) at the canvas and token budget, measures the best GEMM rate this CPU reaches in float32,
bfloat16 (`F.linear`, and oneDNN's linear on weights packed once: the CPU runner's `vit_linear=onednn`) and int8
on the FFN's shape (one ViT-L fc1: tokens x 1024 @ 1024 x 4096), and prints the time the
forward would take at those rates, to set beside `python -m perf.runners.bench_cpu`'s measured forward.

    python -m perf.runners.roofline                 # ViT-L, 1920x1080, 1800 tokens, torch's thread count
    python -m perf.runners.roofline --threads 2
"""

from __future__ import annotations

import argparse
import time

from perf import common


def _rate(fn, macs: float, calls: int = 10) -> float:
    """Multiply-accumulates per second of `fn`: its fastest of `calls` after a warm call (the rate the CPU can
    reach; on a shared machine the fastest call is the one least slowed by the other jobs)."""
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return macs / min(times)


def theoretical_peak() -> tuple | None:
    """(fp32 multiply-accumulates per second, how it was reckoned) of this process's cores: two FMA pipes of the
    widest vector (16 fp32 lanes with AVX-512 on Intel, 8 with AVX2 and on AMD's Zen 4, whose AVX-512 runs on
    256-bit pipes) at the clock /proc/cpuinfo reports now (turbo may run higher); None where it cannot be read."""
    import os

    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    mhz = [float(line.split(":")[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
    flags = next((line.split(":")[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    vendor = next((line.split(":")[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")
    if not mhz or "fma" not in flags:
        return None
    lanes = 16 if "avx512f" in flags and vendor == "GenuineIntel" else 8
    cores = len(os.sched_getaffinity(0))
    ghz = max(mhz) / 1e3
    return cores * 2 * lanes * ghz * 1e9, f"{cores} cores x 2 FMA pipes x {lanes} fp32 lanes x {ghz:.2f} GHz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a MoGe-2 model.pt (default: the cached random full-size ViT-L)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"))
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--json", help="write the numbers to this file")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from tt_moge.runners.cpu import keep_freed_memory
    from tt_moge.runners.fixed_graph import FixedShapeMoGe2
    from tt_moge.runners.precision import cpu_has_int8_dot, cpu_has_native_bf16
    from tt_moge.runners.vit_kernels import OnednnLinear
    from tt_moge.weights import load_network

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the CPU runner: no page faults of fresh output buffers in the timed calls
    network, _ = load_network(common.full_size_checkpoint(args.checkpoint), None)
    graph = FixedShapeMoGe2(network, tuple(args.size), args.tokens, torch.bfloat16, attention="heads").eval()
    canvas = torch.rand(1, 3, args.size[1], args.size[0])
    with torch.inference_mode():
        with FlopCounterMode(display=False) as counter:  # matmuls and convs (the head-by-head attention's bmm too)
            level0, _ = graph.encode(canvas)
        encoder = counter.get_total_flops() / 2
        with FlopCounterMode(display=False) as counter:
            graph.decode(level0)
        decoder = counter.get_total_flops() / 2
    tokens, dim = graph.rows * graph.cols + graph.num_prefix, graph.blocks[0].qkv.in_features
    x = torch.randn(tokens, dim).bfloat16()
    w = torch.randn(4 * dim, dim).bfloat16()
    x8 = torch.randint(-127, 128, (tokens, dim), dtype=torch.int8)
    w8 = torch.randint(-127, 128, (dim, 4 * dim), dtype=torch.int8)
    macs = tokens * dim * 4 * dim
    xf, wf = x.float(), w.float()
    packed32 = OnednnLinear(wf, torch.zeros(4 * dim), torch.float32, batch_size=tokens)
    square = torch.randn(4096, 4096)
    rates = {
        "fp32": _rate(lambda: F.linear(xf, wf), macs),
        "fp32_packed": _rate(lambda: packed32(xf), macs),  # oneDNN on weights packed once (vit_linear=onednn)
        "fp32_square_4096": _rate(lambda: square @ square, 4096**3, calls=5),  # the best this CPU's GEMM gets
    }
    if cpu_has_native_bf16():  # else PyTorch emulates bfloat16 (several times slower) and oneDNN cannot pack it
        packed = OnednnLinear(w, torch.zeros(4 * dim), torch.bfloat16, batch_size=tokens)
        rates["bf16"] = _rate(lambda: F.linear(x, w), macs)
        rates["bf16_packed"] = _rate(lambda: packed(x), macs)
    if cpu_has_int8_dot():  # else torch._int_mm is PyTorch's reference loop: minutes for this shape
        rates["int8"] = _rate(lambda: torch._int_mm(x8, w8), macs)
    print(common.cpu_line())
    peak = theoretical_peak()
    if peak is not None:
        print(f"theoretical fp32 peak: {peak[0] / 1e12:.3f} TMAC/s ({peak[1]})")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.size[0]}x{args.size[1]}, {args.tokens} "
        f"tokens ({tokens} in the ViT)"
    )
    print(
        f"multiply-accumulates: encoder {encoder / 1e9:.0f} G (linear layers, patch embedding, attention), "
        f"decoder {decoder / 1e9:.0f} G"
    )
    result = {
        "cpu": common.cpu_line(),
        "threads": torch.get_num_threads(),
        "encoder_gmac": encoder / 1e9,
        "decoder_gmac": decoder / 1e9,
        "gemm_tmac_per_s": {k: v / 1e12 for k, v in rates.items()},
        "theoretical_fp32_tmac_per_s": None if peak is None else peak[0] / 1e12,
    }
    for name, rate in rates.items():
        bound = (encoder + decoder) / rate
        result[f"forward_at_{name}_rate_s"] = bound
        print(f"  {name} GEMM rate {rate / 1e12:.3f} TMAC/s: the whole forward at that rate {bound:.2f} s")
    common.finish_report(result, args.json)


if __name__ == "__main__":
    main()
