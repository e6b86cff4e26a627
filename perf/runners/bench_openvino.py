"""CPU: our raw forward beside OpenVINO running the same graph (our ONNX export), quiet and busy, with the error of
each against our float32 reference network (issue 30's "ahead of OpenVINO").

The graph is the one `tt-moge export onnx` writes (`tt_moge.onnx_export`: the fixed-shape forward in float32,
PyTorch SDPA attention), exported once per checkpoint, canvas and token budget next to the checkpoint. OpenVINO
compiles it for the CPU with each `--ov-precision` as its inference precision hint (`bf16`: OpenVINO converts
the matrix work to bfloat16 where the CPU has bfloat16 instructions; `f32`: none), with the latency hint and as
many threads as torch uses. Ours is `MoGeModel.from_pretrained(device="cpu")` at each `--precision`, timed on
the same canvas through the runner's forward (no decode, no solve, no finish: the same work as OpenVINO's
call). Calls are alternated (a change of load hits every side alike); medians of `--repeats` calls, wall and
CPU seconds (OpenVINO's and torch's worker threads are this process's, so CPU seconds count both).

Errors are against `MoGe2Network` in float32 on the same canvas: raw points relative to the map's scale (p50,
p99, max), normal angle, mask agreement at 0.5, metric scale (`perf.runners.accuracy.raw_errors`).

    pip install openvino        # a benchmark dependency only, not one of tt_moge's
    python -m perf.runners.bench_openvino --repeats 3
    python -m perf.runners.bench_openvino --repeats 3 --busy   # then with two CPU-bound processes per core
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from perf import common
from perf.runners.accuracy import raw_errors
from perf.runners.bench_cpu import run_phase, stop_on_sigterm


def _onnx_file(checkpoint: Path, network, size: tuple, tokens: int) -> Path:
    """The exported graph for this checkpoint, canvas and token budget, and for the code that builds the graph
    (its name carries a hash of the exporter's, the graph's and the network's sources): exported again when the
    checkpoint is newer than the file or the graph's code changed, so OpenVINO always runs the graph ours runs.
    Exports of other code versions are removed."""
    import tt_moge
    from tt_moge.onnx_export import export_onnx

    root = Path(tt_moge.__file__).parent
    sources = [
        root / "onnx_export.py",
        *sorted((root / "runners").glob("*.py")),
        *sorted((root / "network").glob("*.py")),
    ]
    code = hashlib.sha1(b"".join(f.read_bytes() for f in sources)).hexdigest()[:12]
    folder = checkpoint.parent / "onnx"
    path = folder / f"{size[0]}x{size[1]}-{tokens}-{code}.onnx"
    if not path.exists() or path.stat().st_mtime < checkpoint.stat().st_mtime:
        for old in folder.glob(f"{size[0]}x{size[1]}-{tokens}*.onnx"):  # 1.4 GB each at full size
            old.unlink()
        t = time.perf_counter()
        export_onnx(network, path, size, tokens)
        print(f"exported {path} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def _error_line(errors: dict) -> str:
    keys = ("raw points rel p50", "raw points rel p99", "raw points rel max", "raw normal deg p99")
    text = ", ".join(f"{k[4:]} {errors[k]:.2e}" for k in keys if k in errors)
    if "raw mask agreement" in errors:
        text += f", mask agreement {errors['raw mask agreement']:.4f}"
    if "raw metric scale rel" in errors:
        text += f", metric scale rel {errors['raw metric scale rel']:.1e}"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a MoGe-2 model.pt (default: the cached random full-size ViT-L)")
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"), help="canvas size")
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls of each side (after one warm call each)")
    ap.add_argument("--precision", default="auto", help="ours, comma-separated: auto | bf16 | int8 | fp32")
    ap.add_argument("--ov-precision", default="bf16,f32", help="OpenVINO's inference precision hints, comma-separated")
    ap.add_argument("--busy", action="store_true", help="then again with --busy-per-core CPU-bound processes per core")
    ap.add_argument("--busy-per-core", type=int, default=2, metavar="N")
    ap.add_argument("--json", help="write the numbers to this file")
    args = ap.parse_args()
    stop_on_sigterm()
    try:
        import openvino as ov
    except ImportError:
        sys.exit("this benchmark needs OpenVINO: pip install openvino")
    import torch

    from tt_moge import MoGeModel
    from tt_moge.host import CallOptions, prepare
    from tt_moge.onnx_export import INPUT_NAME, raw_maps
    from tt_moge.runners.base import RawMaps
    from tt_moge.weights import load_network

    size, tokens, threads = tuple(args.size), args.tokens, torch.get_num_threads()
    checkpoint = common.full_size_checkpoint(args.checkpoint)
    network, _ = load_network(str(checkpoint))
    network = network.float().eval()
    onnx_path = _onnx_file(checkpoint, network, size, tokens)
    photo = common.photo(size)
    canvas = prepare(photo, size, CallOptions()).canvas  # (1, 3, H, W) float32 in [0, 1]
    with torch.inference_mode():
        reference = RawMaps.from_outputs(network(canvas, tokens))
    del network

    calls, errors, describe = {}, {}, {}
    models = []
    for precision in args.precision.split(","):
        model = MoGeModel.from_pretrained(
            str(checkpoint), device="cpu", resolution=size, num_tokens=tokens, warmup=1, precision=precision
        )
        models.append(model)
        name = f"ours {model.info()['precision']}"
        service = model.service
        ours_canvas = service.prepare(photo, CallOptions()).canvas  # the canvas as this runner takes it
        calls[name] = lambda timing, s=service, c=ours_canvas: common.timed_both(lambda: s.forward_raw(c))
        errors[name] = raw_errors(service.forward_raw(ours_canvas), reference)
        describe[name] = common.kernel_line(model.info()["runner"])
    core = ov.Core()
    image = canvas.numpy()
    for hint in args.ov_precision.split(","):
        t = time.perf_counter()
        compiled = core.compile_model(
            str(onnx_path),
            "CPU",
            {"INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads},
        )
        request = compiled.create_infer_request()
        name = f"OpenVINO {hint}"

        def run(request=request, compiled=compiled) -> dict:
            request.infer({INPUT_NAME: image})
            return {out.get_any_name(): request.get_tensor(out).data for out in compiled.outputs}

        outputs = run()  # the warm call
        errors[name] = raw_errors(raw_maps(outputs), reference)
        describe[name] = (
            f"compiled in {time.perf_counter() - t:.1f} s; inference precision "
            f"{compiled.get_property('INFERENCE_PRECISION_HINT')}, {compiled.get_property('INFERENCE_NUM_THREADS')} "
            "threads"
        )
        calls[name] = lambda timing, run=run: common.timed_both(run)

    print(f"{common.cpu_line()}; torch {torch.__version__}, OpenVINO {ov.__version__}, {threads} threads")
    print(f"{size[0]}x{size[1]}, {tokens} tokens, {checkpoint}")
    result: dict = {"cpu": common.cpu_line(), "torch": torch.__version__, "openvino": ov.__version__, "errors": {}}
    for name in calls:
        print(f"  {name:16s} {describe[name]}")
        print(f"  {'':16s} against fp32: {_error_line(errors[name])}")
        result["errors"][name] = {k: float(v) for k, v in errors[name].items()}
    first = next(iter(calls))
    for phase in ["quiet", "busy"] if args.busy else ["quiet"]:
        report, medians, _, _ = run_phase(calls, args.repeats, phase, args.busy_per_core)
        print(
            f"{phase}: median wall s / CPU s, and the ratio to {first} ({report['load_before']} before, "
            f"{report['load_after']} after)"
        )
        for name, (wall, cpu) in medians.items():
            ratio = wall / medians[first][0]
            report[name] = {"median_s": wall, "median_cpu_s": cpu, "ratio_to_first": ratio}
            print(f"  {name:16s} {wall:.2f} s / {cpu:.1f} CPU s  {ratio:.3f}")
        result[phase] = report
    for model in models:
        model.close()
    common.finish_report(result, args.json)


if __name__ == "__main__":
    main()
