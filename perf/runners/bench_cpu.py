"""CPU: our `model(array)` beside upstream MoGe-2 `infer(use_fp16=False)`, same weights, same image, calls alternated.

Both run ViT-L on a 1920x1080 photo with 1800 tokens (by default a random-weight, full-size checkpoint from
`tt_moge.testing`, written once to ~/.cache/tt_moge/bench). Calls alternate (ours, upstream, ours, ...) so that
a machine's changing load hits both alike; the script prints per-call medians, the ratio and the command to
rerun it. Ours runs in this process, as `import tt_moge` sets it up (OpenMP's wait policy passive:
`tt_moge.openmp`); upstream runs in a process of its own with the environment this script was started with, as
its users run it. Upstream's default `infer(use_fp16=True)` is far too slow on CPU to repeat:
`--upstream-fp16-cap S` runs it once in a subprocess and reports its time or that it did not finish within S s.

    python -m perf.runners.bench_cpu --repeats 5
    python -m perf.runners.bench_cpu --precision bf16,int8 --threads 1   # steadier on a shared machine
    python -m perf.runners.bench_cpu --busy --repeats 3                  # quiet, then busy, side by side
    python -m perf.runners.bench_cpu --kernels vit_linear=aten vit_linear=onednn   # two kernel choices, alternated

`--busy` runs the same alternation twice: on the machine as it is ("quiet"), then with two CPU-bound processes
per usable core beside it (`while True: pass`, started and stopped by this script: "busy"). In both phases it
also times our first precision's model with its thread count pinned at 1 and at torch's count (the same model:
`ThreadGovernor.pinned`), so the table shows whether fewer threads would have been faster. With
`MOGE_CPU_THREADS=auto` in the environment, "ours" is the per-forward thread governor (`runners/cpu_threads.py`)
instead of the default fixed count. Each phase prints the load average before and after it: a "quiet" phase is
only as quiet as the machine's other jobs let it be.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

from perf import common
from tt_moge import openmp

# upstream's side: torch before anything of tt_moge (which would set OpenMP's wait policy), one warm call, then
# one timed call per line on stdin; each answer is one JSON line on stdout, after "@@"
_UPSTREAM_WORKER = r"""
import json, os, sys, warnings
import torch
from perf import common
from tt_moge.openmp import USER_VARIABLES

warnings.filterwarnings("ignore", message="In CPU autocast")  # upstream's float32 autocast, once per call

path = sys.argv[1]
width, height, tokens, threads, fp16 = (int(v) for v in sys.argv[2:7])
if threads:
    torch.set_num_threads(threads)
model = common.load_upstream(path)
x = torch.from_numpy(common.photo((width, height))).permute(2, 0, 1).float().div(255)


def call():
    with torch.inference_mode():
        model.infer(x, num_tokens=tokens, use_fp16=bool(fp16))


warm = common.timed(call)
openmp = {k: os.environ[k] for k in USER_VARIABLES if k in os.environ}
info = {"warm_s": warm, "threads": torch.get_num_threads(), "openmp": openmp or "default"}
print("@@" + json.dumps(info), flush=True)
for _ in sys.stdin:
    print("@@" + json.dumps(common.timed_both(call)), flush=True)
"""


def _upstream_command(path, size: tuple, tokens: int, threads: int, fp16: bool) -> list:
    return [sys.executable, "-c", _UPSTREAM_WORKER, str(path), *(str(v) for v in (*size, tokens, threads, int(fp16)))]


def _answer(lines) -> "dict | None":
    """The worker's next answer among its stdout lines."""
    for line in lines:
        if line.startswith("@@"):
            return json.loads(line[2:])
    return None


class UpstreamProcess:
    """Upstream's `infer(use_fp16=False)` in a process of its own, started with the environment as it was before
    `import tt_moge` set OpenMP's wait policy: upstream as its users run it (a wait policy is per process; in
    ours it would get our setting). `__call__` runs one call there and returns (wall s, CPU s) measured there."""

    def __init__(self, path, size: tuple, tokens: int, threads: int):
        self.proc = subprocess.Popen(
            _upstream_command(path, size, tokens, threads, fp16=False),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=common.ROOT,
            env=openmp.environment_before(),
        )
        self.info = self._answer()

    def _answer(self):
        answer = _answer(self.proc.stdout)
        if answer is None:
            raise RuntimeError(f"upstream's process ended (exit code {self.proc.wait()}); its error is above")
        return answer

    def __call__(self, timing=None) -> tuple:
        self.proc.stdin.write("call\n")
        self.proc.stdin.flush()
        return tuple(self._answer())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _upstream_fp16_capped(path, size, tokens, threads: int, cap_s: float) -> str:
    """Upstream's default `infer(use_fp16=True)`: the worker's first call only (no stdin: it ends after it)."""
    t = time.perf_counter()
    try:
        out = subprocess.run(
            _upstream_command(path, size, tokens, threads, fp16=True),
            input="",
            capture_output=True,
            text=True,
            timeout=cap_s,
            cwd=common.ROOT,
            env=openmp.environment_before(),
        )
    except subprocess.TimeoutExpired:
        return f"did not finish in {cap_s:.0f} s (stopped; load + call)"
    if out.returncode != 0:
        return f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    seconds = _answer(out.stdout.splitlines())["warm_s"]
    return f"{seconds:.1f} s for one call ({time.perf_counter() - t:.0f} s with loading)"


@contextlib.contextmanager
def busy_machine(per_core: int):
    """`per_core` CPU-bound processes per usable core (`while True: pass`) for the duration of the block."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], **quiet) for _ in range(per_core * cores)]
    try:
        time.sleep(1.0)  # let the scheduler spread them
        yield len(procs)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def alternate(calls: dict, repeats: int, label: str = "") -> tuple:
    """Each call `repeats` times, alternating (a change of load hits every side alike): ({name: [(wall s, CPU
    s)]}, {name: [stage timings]})."""
    times: dict = {name: [] for name in calls}
    stages: dict = {name: [] for name in calls}
    for i in range(repeats):
        line = []
        for name, call in calls.items():
            timing: dict = {}
            times[name].append(call(timing))
            stages[name].append(timing)
            line.append(f"{name} {times[name][-1][0]:.2f} s ({times[name][-1][1]:.1f} CPU s)")
        print(f"{label}[{i + 1}/{repeats}] " + "   ".join(line), flush=True)
    return times, stages


def run_phase(calls: dict, repeats: int, phase: str, busy_per_core: int) -> tuple:
    """One phase of a quiet/busy benchmark: the calls alternated `repeats` times, beside `busy_per_core`
    CPU-bound processes per core when `phase` is "busy" -> (report {busy_processes, load_before, load_after},
    {name: (median wall s, median CPU s)}, {name: [(wall s, CPU s)]}, {name: [stage timings]})."""
    with busy_machine(busy_per_core) if phase == "busy" else contextlib.nullcontext(0) as extra:
        before = load_line()
        print(f"\n{phase}: {extra} busy processes; {before}", flush=True)
        times, stages = alternate(calls, repeats, f"{phase} ")
        after = load_line()
    medians = {name: tuple(common.median([t[k] for t in times[name]]) for k in (0, 1)) for name in calls}
    return {"busy_processes": extra, "load_before": before, "load_after": after}, medians, times, stages


def stop_on_sigterm() -> None:
    """Exit through Python on SIGTERM, so that a killed benchmark still stops its busy processes."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


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
    ap.add_argument(
        "--busy",
        action="store_true",
        help="time everything twice: as the machine is, then with --busy-per-core CPU-bound processes per core",
    )
    ap.add_argument("--busy-per-core", type=int, default=2, metavar="N", help="busy processes per core (default 2)")
    ap.add_argument(
        "--fixed-threads",
        default=None,
        metavar="N,M",
        help="also time ours (first precision) with the thread count pinned at each of these "
        "(default with --busy: 1 and torch's count; 'none' for none)",
    )
    ap.add_argument(
        "--kernels",
        nargs="+",
        metavar="POINT=KERNEL[,...]",
        help="ours once per setting, each loaded with that $MOGE_CPU_KERNELS (kernel choices forced), alternated",
    )
    ap.add_argument("--json", help="write the numbers to this file")
    args = ap.parse_args()
    stop_on_sigterm()

    import torch

    from tt_moge import MoGeModel
    from tt_moge.runners.kernel_choice import forcing

    if args.threads:
        torch.set_num_threads(args.threads)

    path = common.full_size_checkpoint(args.checkpoint)
    size = tuple(args.size)
    image = common.photo(size)
    precisions = args.precision.split(",")
    fixed = args.fixed_threads or (f"1,{torch.get_num_threads()}" if args.busy else "none")
    models = {}
    for precision in precisions:
        for kernels in args.kernels or [None]:
            t = time.perf_counter()
            with forcing(kernels):
                model = MoGeModel.from_pretrained(
                    path,
                    device="cpu",
                    resolution=size,
                    num_tokens=args.tokens,
                    warmup=2,  # the second warm-up forward makes the thread governor's first choice (where it is on)
                    warmup_variants="minimal",
                    precision=precision,
                )
            models[f"ours {model.info()['precision']}" + (f" [{kernels}]" if kernels else "")] = model
            print(
                f"ours, precision={precision}: {common.kernel_line(model.info()['runner'])}; loaded + warmed in "
                f"{time.perf_counter() - t:.1f} s",
                flush=True,
            )
    first_name, first = next(iter(models.items()))
    pinned = [int(n) for n in fixed.split(",") if n.strip()] if fixed != "none" else []
    print(f"{common.cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    calls = {  # name -> call(timing dict) -> (wall s, CPU s), measured where it runs
        name: (lambda m: lambda timing: common.timed_both(lambda: m.predict(image, timing=timing)))(m)
        for name, m in models.items()
    }  # = model(array)
    for n in pinned:  # the same model, its thread governor pinned to n threads for these calls (not recorded)

        def pinned_call(timing, n=n):
            with first.service.runner.threads.pinned(n):
                return common.timed_both(lambda: first.predict(image, timing=timing))

        calls[f"{first_name} {n}t"] = pinned_call
    if not args.no_upstream:
        upstream = UpstreamProcess(path, size, args.tokens, args.threads)
        print(
            f"upstream (its own process, OpenMP {upstream.info['openmp']}, {upstream.info['threads']} threads) warm "
            f"call: {upstream.info['warm_s']:.2f} s; ours: OpenMP {openmp.describe()}",
            flush=True,
        )
        calls["upstream fp32"] = upstream

    phases = ["quiet", "busy"] if args.busy else ["quiet"]
    arch = next(iter(models.values())).info()["architecture"]
    result: dict = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": common.cpu_line(),
        "kernels": {name: m.info()["runner"] for name, m in models.items()},
        "openmp_wait": {"ours": openmp.describe(), "upstream": None if args.no_upstream else upstream.info["openmp"]},
    }
    for phase in phases:
        report, medians, times, stages = run_phase(calls, args.repeats, phase, args.busy_per_core)
        print(
            f"\n{phase} ({report['busy_processes']} busy processes; {report['load_before']} before, "
            f"{report['load_after']} after): {arch}, {size[0]}x{size[1]}, "
            f"{args.tokens} tokens, {args.repeats} calls each, torch threads {torch.get_num_threads()}: "
            "median wall s / CPU s"
        )
        for name, (wall, cpu) in medians.items():
            report[name] = {"median_s": wall, "median_cpu_s": cpu, "calls_s": [round(t[0], 3) for t in times[name]]}
            extra_text = ""
            if stages[name][0]:
                report[name]["stage_median_ms"] = {
                    k: round(common.median([st[k] for st in stages[name]]), 1) for k in stages[name][0]
                }
                extra_text = f"  (stages, ms: {report[name]['stage_median_ms']})"
            if name in models:
                report[name]["threads"] = models[name].info()["runner"].get("threads")
            elif name.startswith("ours"):
                report[name]["threads"] = f"{name.rsplit(' ', 1)[1][:-1]} (pinned)"
            print(
                f"  {name:16s} {'model(array)' if name.startswith('ours') else 'infer(use_fp16=False)'}: "
                f"{wall:.2f} s / {cpu:.1f} CPU s{extra_text}"
            )
        if "upstream fp32" in calls:
            up = report["upstream fp32"]
            for name in (n for n in calls if n.startswith("ours")):
                report[name]["ratio"] = report[name]["median_s"] / up["median_s"]
                report[name]["ratio_cpu"] = report[name]["median_cpu_s"] / up["median_cpu_s"]
                print(
                    f"ratio {name} / upstream fp32 ({phase}): {report[name]['ratio']:.3f} "
                    f"wall, {report[name]['ratio_cpu']:.3f} CPU time; threads: {report[name].get('threads')}"
                )
        result[phase] = report
    if len(phases) == 2 and "upstream fp32" in calls:
        print("\nside by side, ratio to upstream's median wall time in the same phase (quiet / busy):")
        for name in (n for n in calls if n.startswith("ours")):
            print(f"  {name:16s} {result['quiet'][name]['ratio']:.3f} / {result['busy'][name]['ratio']:.3f}")
    if "upstream fp32" in calls:
        upstream.close()
    if args.upstream_fp16_cap > 0:
        result["upstream_fp16_capped"] = _upstream_fp16_capped(
            path, size, args.tokens, args.threads, args.upstream_fp16_cap
        )
        print(f"upstream infer(use_fp16=True), one call: {result['upstream_fp16_capped']}")
    for model in models.values():
        model.close()
    common.finish_report(result, args.json)


if __name__ == "__main__":
    main()
