"""CPU: our `model(array)` beside upstream MoGe-2 `infer(use_fp16=False)`, same weights, same image, one process.

Both run ViT-L on a 1920x1080 photo with 1800 tokens (by default a random-weight, full-size checkpoint from
`tt_moge.testing`, written once to ~/.cache/tt_moge/bench). Calls alternate (ours, upstream, ours, ...) so that
a machine's changing load hits both alike; the script prints per-call medians, the ratio and the command to
rerun it. Upstream's default `infer(use_fp16=True)` is far too slow on CPU to repeat: `--upstream-fp16-cap S`
runs it once in a subprocess and reports its time or that it did not finish within S seconds.

    python perf/runners/bench_cpu.py --repeats 5
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import common


def _upstream_fp16_capped(path, size, tokens, cap_s: float) -> str:
    code = (
        "import sys, time, torch; sys.path.insert(0, %r); import common; "
        "m = common.load_upstream(%r); a = common.photo(%r); "
        "x = torch.from_numpy(a).permute(2, 0, 1).float() / 255; t = time.perf_counter(); "
        "m.infer(x, num_tokens=%d); print(time.perf_counter() - t)"
    ) % (str(common.HERE), str(path), tuple(size), tokens)
    t = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=cap_s)
    except subprocess.TimeoutExpired:
        return f"did not finish in {cap_s:.0f} s (stopped; load + call)"
    if out.returncode != 0:
        return f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    return f"{float(out.stdout.strip().splitlines()[-1]):.1f} s for one call ({time.perf_counter() - t:.0f} s with loading)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a MoGe-2 model.pt (default: the cached random full-size ViT-L)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls of each side (after one warm call each)")
    ap.add_argument("--precision", default="auto", help="our precision: auto | bf16 | fp32 (default auto)")
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"), help="image and canvas size")
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--no-upstream", action="store_true", help="time ours only")
    ap.add_argument("--upstream-fp16-cap", type=float, default=0, metavar="S",
                    help="also run upstream's default fp16 infer once, stopped after S seconds (0: skip)")
    ap.add_argument("--json", help="write the numbers to this file")
    args = ap.parse_args()

    import torch

    from tt_moge import MoGeModel

    path = common.full_size_checkpoint(args.checkpoint)
    size = tuple(args.size)
    image = common.photo(size)
    t = time.perf_counter()
    ours = MoGeModel.from_pretrained(path, device="cpu", resolution=size, num_tokens=args.tokens, warmup=1,
                                     warmup_variants="minimal", precision=args.precision)
    load_ours = time.perf_counter() - t
    print(f"ours: {ours.info()['runner']}, loaded + warmed in {load_ours:.1f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    upstream = None
    if not args.no_upstream:
        upstream = common.load_upstream(path)
        x = torch.from_numpy(image).permute(2, 0, 1).float().div(255)
        run_upstream = lambda: upstream.infer(x, num_tokens=args.tokens, use_fp16=False)  # noqa: E731
        with torch.inference_mode():
            print(f"upstream warm call: {common.timed(run_upstream):.2f} s", flush=True)

    ours_s, up_s, stages = [], [], []
    for i in range(args.repeats):
        timing: dict = {}
        ours_s.append(common.timed_both(lambda: ours.predict(image, timing=timing)))  # = model(array), with stages
        stages.append(timing)
        line = f"[{i + 1}/{args.repeats}] ours {ours_s[-1][0]:.2f} s ({ours_s[-1][1]:.1f} CPU s)"
        if upstream is not None:
            with torch.inference_mode():
                up_s.append(common.timed_both(run_upstream))
            line += f"   upstream fp32 {up_s[-1][0]:.2f} s ({up_s[-1][1]:.1f} CPU s)"
        print(line, flush=True)

    med = lambda pairs, i: common.median([p[i] for p in pairs])  # noqa: E731
    result = {"ours_median_s": med(ours_s, 0), "ours_median_cpu_s": med(ours_s, 1), "ours_runner": ours.info()["runner"],
              "ours_stage_median_ms": {k: round(common.median([s[k] for s in stages]), 1) for k in stages[0]}}
    print(f"\nViT-L {size[0]}x{size[1]}, {args.tokens} tokens, {args.repeats} calls each (wall / CPU seconds)")
    print(f"ours model(array) median: {result['ours_median_s']:.2f} s / {result['ours_median_cpu_s']:.1f} CPU s  "
          f"(stages, ms: {result['ours_stage_median_ms']})")
    if up_s:
        result.update(upstream_fp32_median_s=med(up_s, 0), upstream_fp32_median_cpu_s=med(up_s, 1))
        result["ratio"] = result["ours_median_s"] / result["upstream_fp32_median_s"]
        result["ratio_cpu"] = result["ours_median_cpu_s"] / result["upstream_fp32_median_cpu_s"]
        print(f"upstream infer(use_fp16=False) median: {result['upstream_fp32_median_s']:.2f} s / "
              f"{result['upstream_fp32_median_cpu_s']:.1f} CPU s")
        print(f"ratio ours / upstream fp32: {result['ratio']:.3f} wall, {result['ratio_cpu']:.3f} CPU time")
    if args.upstream_fp16_cap > 0:
        del upstream
        result["upstream_fp16_capped"] = _upstream_fp16_capped(path, size, args.tokens, args.upstream_fp16_cap)
        print(f"upstream infer(use_fp16=True), one call: {result['upstream_fp16_capped']}")
    print(f"rerun: {common.rerun_command()}")
    ours.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
