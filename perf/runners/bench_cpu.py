"""CPU: our `model(array)` beside upstream MoGe-2 `infer(use_fp16=False)`, same weights, same image, one process.

Both run ViT-L on a 1920x1080 photo with 1800 tokens (by default a random-weight, full-size checkpoint from
`tt_moge.testing`, written once to ~/.cache/tt_moge/bench). Calls alternate (ours, upstream, ours, ...) so that
a machine's changing load hits both alike; the script prints per-call medians, the ratio and the command to
rerun it. Upstream's default `infer(use_fp16=True)` is far too slow on CPU to repeat: `--upstream-fp16-cap S`
runs it once in a subprocess and reports its time or that it did not finish within S seconds.

    python -m perf.runners.bench_cpu --repeats 5
    python -m perf.runners.bench_cpu --precision bf16,int8 --threads 1   # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from perf import common


def _upstream_fp16_capped(path, size, tokens, cap_s: float) -> str:
    code = (
        "import time, torch; from perf import common; "
        "m = common.load_upstream(%r); a = common.photo(%r); "
        "x = torch.from_numpy(a).permute(2, 0, 1).float() / 255; t = time.perf_counter(); "
        "m.infer(x, num_tokens=%d); print(time.perf_counter() - t)"
    ) % (str(path), tuple(size), tokens)
    t = time.perf_counter()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=cap_s, cwd=common.ROOT
        )
    except subprocess.TimeoutExpired:
        return f"did not finish in {cap_s:.0f} s (stopped; load + call)"
    if out.returncode != 0:
        return f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    return (
        f"{float(out.stdout.strip().splitlines()[-1]):.1f} s for "
        f"one call ({time.perf_counter() - t:.0f} s with loading)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a MoGe-2 model.pt (default: the cached random full-size ViT-L)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls of each side (after one warm call each)")
    ap.add_argument(
        "--precision",
        default="auto",
        help="ours, comma-separated to time several in one run: auto | bf16 | int8 | fp32 (default auto)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both sides (default: torch's choice)")
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"), help="image and canvas size")
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--no-upstream", action="store_true", help="time ours only")
    ap.add_argument(
        "--upstream-fp16-cap",
        type=float,
        default=0,
        metavar="S",
        help="also run upstream's default fp16 infer once, stopped after S seconds (0: skip)",
    )
    ap.add_argument("--json", help="write the numbers to this file")
    args = ap.parse_args()

    import torch

    from tt_moge import MoGeModel

    if args.threads:
        torch.set_num_threads(args.threads)
    path = common.full_size_checkpoint(args.checkpoint)
    size = tuple(args.size)
    image = common.photo(size)
    models = {}
    for precision in args.precision.split(","):
        t = time.perf_counter()
        model = MoGeModel.from_pretrained(
            path,
            device="cpu",
            resolution=size,
            num_tokens=args.tokens,
            warmup=1,
            warmup_variants="minimal",
            precision=precision,
        )
        models[f"ours {model.info()['precision']}"] = model
        print(
            f"ours, precision={precision}: {common.kernel_line(model.info()['runner'])}; loaded + warmed in "
            f"{time.perf_counter() - t:.1f} s",
            flush=True,
        )
    print(f"{common.cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    calls = {
        name: (lambda m: lambda timing: m.predict(image, timing=timing))(m) for name, m in models.items()
    }  # = model(array)
    if not args.no_upstream:
        upstream = common.load_upstream(path)
        x = torch.from_numpy(image).permute(2, 0, 1).float().div(255)

        def run_upstream(timing):
            with torch.inference_mode():
                upstream.infer(x, num_tokens=args.tokens, use_fp16=False)

        print(f"upstream warm call: {common.timed(lambda: run_upstream(None)):.2f} s", flush=True)
        calls["upstream fp32"] = run_upstream

    times: dict = {name: [] for name in calls}
    stages: dict = {name: [] for name in calls}
    for i in range(args.repeats):  # alternate, so that a change of load hits every side alike
        line = []
        for name, call in calls.items():
            timing: dict = {}
            times[name].append(common.timed_both(lambda: call(timing)))
            stages[name].append(timing)
            line.append(f"{name} {times[name][-1][0]:.2f} s ({times[name][-1][1]:.1f} CPU s)")
        print(f"[{i + 1}/{args.repeats}] " + "   ".join(line), flush=True)

    arch = next(iter(models.values())).info()["architecture"]
    print(
        f"\n{arch}, {size[0]}x{size[1]}, {args.tokens} tokens, "
        f"{args.repeats} calls each, {torch.get_num_threads()} threads: "
        f"median wall s / CPU s"
    )
    result: dict = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": common.cpu_line(),
        "kernels": {name: m.info()["runner"] for name, m in models.items()},
    }
    for name in calls:
        wall, cpu = (common.median([t[k] for t in times[name]]) for k in (0, 1))
        result[name] = {"median_s": wall, "median_cpu_s": cpu}
        extra = ""
        if stages[name][0]:
            result[name]["stage_median_ms"] = {
                k: round(common.median([s[k] for s in stages[name]]), 1) for k in stages[name][0]
            }
            extra = f"  (stages, ms: {result[name]['stage_median_ms']})"
        print(
            f"  {name:14s} {'model(array)' if name.startswith('ours') else 'infer(use_fp16=False)'}: "
            f"{wall:.2f} s / {cpu:.1f} CPU s{extra}"
        )
    if "upstream fp32" in calls:
        up = result["upstream fp32"]
        for name in models:
            result[name]["ratio"] = result[name]["median_s"] / up["median_s"]
            result[name]["ratio_cpu"] = result[name]["median_cpu_s"] / up["median_cpu_s"]
            print(
                f"ratio {name} / upstream fp32: {result[name]['ratio']:.3f} "
                f"wall, {result[name]['ratio_cpu']:.3f} CPU time"
            )
        del upstream
    if args.upstream_fp16_cap > 0:
        result["upstream_fp16_capped"] = _upstream_fp16_capped(path, size, args.tokens, args.upstream_fp16_cap)
        print(f"upstream infer(use_fp16=True), one call: {result['upstream_fp16_capped']}")
    for model in models.values():
        model.close()
    common.finish_report(result, args.json)


if __name__ == "__main__":
    main()
