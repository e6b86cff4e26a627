"""Run the whole ttnn graph on a (mock) Tenstorrent device and report what ran and the peak L1 per core.

    python -m tt_moge.runners.ttnn.mock_check --prepared vitl-1920x1080-1800.npz
    python code/tt_moge/runners/ttnn/mock_check.py --prepared FILE.npz            # from a checkout, no torch
    python code/tt_moge/runners/ttnn/mock_check.py --prepared FILE.npz --oversize --expect-refusal

numpy + ttnn only (the mock P150 runs in a Python with ttnn and without torch). Run by path, the file loads
`tt_moge.runners.ttnn` without executing `tt_moge/__init__.py` (which imports torch): see `_package_shim`.

Steps: open the device, `TtnnGraph.load()` (weights up, one forward on a zero input so the conv weights are
prepared), one steady-state forward of a synthetic canvas under ttnn's graph capture (NORMAL mode: the ops
really run, and the capture records every buffer and circular-buffer allocation), read back, host_output.

Reported: the ttnn calls of the steady-state forward by op name (counted by a proxy around the ttnn module),
the device operations the capture recorded by name, wall times, and the peak L1 per core.

Peak L1 per core: ttnn's graph capture records L1 buffers but not the circular buffers (dataflow buffers) of
most programs in 0.81 (matmul, layer norm, ... create theirs through program descriptors the capture does not
see), so its peak understates what an op needs. What is measured instead is the headroom, with the allocator
and the program-creation checks themselves: a blocking L1 buffer of k x 2 KiB per bank (an interleaved L1
tensor of k tiles per bank) is allocated before a forward, and the forward fails as soon as one op's circular
buffers plus its L1 buffers would overlap it ("Statically allocated dataflow buffers ... clash with L1
buffers"). Bisecting k gives the largest reservation under which the whole forward still runs; the peak L1
per core is the L1 bank size (what the allocator can hand out per core) minus that reservation, to 2 KiB. The
op that fails just above it (and its error, which says where its circular buffers end) is reported as the
peak op. The capture's own L1-buffer peak is reported alongside. On the mock every read-back is zeros, so the
outputs are checked for shape and finiteness only.

Exit status: 0 when everything ran; 1 with the ttnn error otherwise. With --expect-refusal the sense is
inverted for the negative check: 0 only when ttnn refused the run (the error is printed), 1 if it ran.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import types
from pathlib import Path


# What ttnn says when an op's circular buffers or L1 buffers do not fit (the negative check must see one of these).
REFUSAL_SIGNS = ("beyond max L1 size", "clash with L1 buffers", "Out of Memory", "out of memory")


def _package_shim() -> None:
    """Make `tt_moge.runners.ttnn` importable without running `tt_moge/__init__.py` and
    `tt_moge/runners/__init__.py` (both import torch): register those two packages as empty modules whose
    `__path__` is their folder. Only used when this file is run by path."""
    here = Path(__file__).resolve().parent
    if sys.path and Path(sys.path[0]).resolve() == here:
        sys.path.pop(0)  # this folder's graph.py / prepare.py must not shadow top-level modules
    root = here.parents[2]  # the folder holding tt_moge/
    for name, folder in (("tt_moge", root / "tt_moge"), ("tt_moge.runners", root / "tt_moge" / "runners")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(folder)]
            sys.modules[name] = module


if __package__ in (None, ""):
    _package_shim()
    from tt_moge.runners.ttnn.graph import FORMATS, L1_BYTES, TtnnGraph
    from tt_moge.runners.ttnn.prepare import Prepared, host_input, host_output
else:
    from .graph import FORMATS, L1_BYTES, TtnnGraph
    from .prepare import Prepared, host_input, host_output

_NOT_OPS = {"init_device_compute_kernel_config"}


class OpCounter:
    """A proxy for the ttnn module that counts calls of its functions (classes and config helpers pass through)
    and remembers the last one called (`last`)."""

    def __init__(self, module, prefix: str = "", root: "OpCounter" = None):
        self._module = module
        self._prefix = prefix
        self._root = root or self
        self.counts = collections.Counter() if root is None else root.counts
        self.last = None

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if isinstance(attr, types.ModuleType):
            return OpCounter(attr, f"{self._prefix}{name}.", self._root)
        if callable(attr) and not isinstance(attr, type) and name not in _NOT_OPS:
            key = self._prefix + name
            root = self._root

            def counted(*args, **kwargs):
                root.counts[key] += 1
                root.last = key
                return attr(*args, **kwargs)

            return counted
        return attr


def synthetic_canvas(width: int, height: int):
    """A smooth photo-like (H, W, 3) float32 canvas in [0, 1] (numpy only)."""
    import numpy as np

    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    channels = [0.5 + 0.3 * np.sin(2 * np.pi * (f * x + g * y) + p) for f, g, p in ((3, 2, 0.0), (5, 1, 1.0), (2, 4, 2.0))]
    return np.clip(np.stack(channels, axis=-1), 0.0, 1.0).astype(np.float32)


def _short(error: BaseException) -> str:
    lines = [ln for ln in str(error).splitlines() if ln.strip() and not ln.startswith(" ---")]
    return " | ".join(lines[:6])[:1500]


def _forward_fits(ttnn, device, graph, x, counter, pages: int, banks: int):
    """Run one forward with a blocking L1 reservation of `pages` 2 KiB pages per bank. -> (ran, failing op, error)."""
    blocker = None
    if pages:
        blocker = ttnn.empty((1, 1, 32, 32 * banks * pages), ttnn.bfloat16, ttnn.TILE_LAYOUT, device,
                             ttnn.L1_MEMORY_CONFIG)
    try:
        out = graph.forward(x)
        ttnn.synchronize_device(device)
        for t in out.values():
            ttnn.deallocate(t)
        return True, None, None
    except Exception as error:  # the first op that no longer fits
        return False, counter.last, _short(error)
    finally:
        if blocker is not None:
            ttnn.deallocate(blocker)


def l1_peak(ttnn, device, graph, x, counter) -> dict:
    """The peak L1 per core of one forward, by bisecting the largest blocking L1 reservation it survives."""
    view = ttnn.get_memory_view(device, ttnn.BufferType.L1)
    banks, bank_bytes = view.num_banks, view.total_bytes_per_bank
    page = 2048
    free_pages = view.largest_contiguous_bytes_free_per_bank // page
    lo, hi = 0, free_pages + 1  # the forward runs with lo pages reserved; hi is unknown or fails
    failure = (None, None)
    tries = []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ran, op, error = _forward_fits(ttnn, device, graph, x, counter, mid, banks)
        tries.append([mid, ran])
        if ran:
            lo = mid
        else:
            hi, failure = mid, (op, error)
    return {"peak_bytes": bank_bytes - lo * page, "headroom_bytes": lo * page, "l1_bank_bytes": bank_bytes,
            "l1_bytes": L1_BYTES, "resolution_bytes": page, "banks": banks,
            "peak_op": failure[0], "peak_op_error": failure[1], "tries_pages_ran": tries}


def run(args) -> dict:
    import numpy as np
    import ttnn
    from ttnn._ttnn import graph as ttnn_graph

    report: dict = {"prepared": str(args.prepared), "formats": args.formats, "oversize": args.oversize}
    t0 = time.perf_counter()
    prepared = Prepared.load(args.prepared)
    plan = prepared.plan
    report.update(backbone=plan["backbone"], canvas=plan["canvas"], num_tokens=plan["num_tokens"],
                  token_grid=[plan["rows"], plan["cols"]], seq_len=plan["seq_len"])
    report["read_prepared_s"] = round(time.perf_counter() - t0, 2)
    device = ttnn.open_device(device_id=0, l1_small_size=args.l1_small_size)
    try:
        grid = device.compute_with_storage_grid_size()
        report["grid"] = [grid.x, grid.y]
        counter = OpCounter(ttnn)
        graph = TtnnGraph(counter, device, prepared, formats=args.formats, math_fidelity=args.math_fidelity,
                          oversize=args.oversize)
        t = time.perf_counter()
        graph.load()
        report["load_s"] = round(time.perf_counter() - t, 2)
        patches = host_input(plan, synthetic_canvas(*plan["canvas"]))
        x = graph.upload(patches, into=graph.allocate_input())  # the persistent-input path a trace would use
        counter.counts.clear()
        t = time.perf_counter()
        if args.capture:
            ttnn_graph.begin_graph_capture(ttnn_graph.RunMode.NORMAL)
        try:
            out = graph.forward(x)
            ttnn.synchronize_device(device)
        finally:
            captured = ttnn_graph.end_graph_capture() if args.capture else None
        report["forward_s"] = round(time.perf_counter() - t, 2)
        report["ttnn_calls"] = dict(sorted(counter.counts.items()))
        report["ttnn_calls_total"] = sum(counter.counts.values())
        if captured is not None:
            ops = collections.Counter(n["params"].get("name", "?") for n in captured
                                      if n.get("node_type") == "function_start" and n.get("stacking_level") == 1)
            report["device_operations"] = dict(sorted(ops.items()))
            report["device_operations_total"] = sum(ops.values())
            usage = ttnn_graph.extract_resource_usage_per_core(captured)
            report["capture_peak_per_core"] = {"l1_buffers": usage.peak_l1, "circular_buffers_seen": usage.peak_cb,
                                               "total_seen": usage.peak_total}
        if args.l1_headroom:
            t = time.perf_counter()
            report["peak_l1_per_core"] = l1_peak(ttnn, device, graph, x, counter)
            report["l1_bisection_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        readback = graph.read(out)
        raw = host_output(prepared, readback)
        report["read_and_host_s"] = round(time.perf_counter() - t, 2)
        shapes = {k: list(np.shape(v)) for k, v in raw.items() if v is not None and k != "metric_scale"}
        finite = all(bool(np.isfinite(v).all()) for k, v in raw.items() if v is not None and k != "metric_scale")
        report["outputs"] = {"shapes": shapes, "finite": finite,
                             "finest_readback": list(readback["finest"].shape)}
        if not finite:
            raise RuntimeError("non-finite host outputs")
    finally:
        ttnn.close_device(device)
    report["total_s"] = round(time.perf_counter() - t0, 2)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", required=True, help=".npz written by Prepared.save (prepare_weights)")
    ap.add_argument("--formats", default="bf16", choices=sorted(FORMATS))
    ap.add_argument("--math-fidelity", default="hifi4", choices=["hifi4", "hifi2", "lofi"])
    ap.add_argument("--oversize", action="store_true",
                    help="the negative check: an FFN matmul config whose circular buffers cannot fit in L1")
    ap.add_argument("--expect-refusal", action="store_true",
                    help="exit 0 only if ttnn refuses the run (use with --oversize)")
    ap.add_argument("--no-capture", dest="capture", action="store_false",
                    help="skip the graph capture (no device-operation counts)")
    ap.add_argument("--no-l1-headroom", dest="l1_headroom", action="store_false",
                    help="skip the L1 bisection (no peak L1 per core)")
    ap.add_argument("--l1-small-size", type=int, default=32768)
    ap.add_argument("--json", help="also write the report to this file")
    args = ap.parse_args(argv)
    try:
        report = run(args)
    except Exception as error:  # a ttnn refusal (TT_FATAL / TT_THROW) or any other failure
        message = f"{type(error).__name__}: {_short(error)}"
        print(f"FAILED: {message}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"failed": message}, indent=1))
        if args.expect_refusal:
            if not any(sign in message for sign in REFUSAL_SIGNS):
                print("FAILED: the run failed, but not with the L1 / circular-buffer refusal the negative check expects")
                return 1
            print("the run was refused for its L1 use, as expected")
            return 0
        return 1
    print(json.dumps(report, indent=1), flush=True)
    peak = report.get("peak_l1_per_core") or {}
    print(f"OK: {report['backbone']} at {report['canvas'][0]}x{report['canvas'][1]}, {report['num_tokens']} tokens, "
          f"{args.formats}: {report['ttnn_calls_total']} ttnn calls ({report.get('device_operations_total', '?')} device "
          f"operations) ran; peak L1 per core {peak.get('peak_bytes', '?')} B of {peak.get('l1_bank_bytes', '?')} B "
          f"({peak.get('peak_op', '?')})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.expect_refusal:
        print("FAILED: expected ttnn to refuse this run, it ran")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
