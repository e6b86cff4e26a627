"""Run the whole ttnn graph on a (mock) Tenstorrent device and report what ran and the peak L1 per core.

    python -m tt_moge.ttnn_tools.mock_check --prepared vitl-1920x1080-1800.npz
    python code/tt_moge/ttnn_tools/mock_check.py --prepared FILE.npz            # from a checkout, no torch
    python code/tt_moge/ttnn_tools/mock_check.py --prepared FILE.npz --oversize --expect-refusal

numpy + ttnn only (the mock P150 runs in a Python with ttnn and without torch). Run by path, the file loads
`tt_moge.runners.ttnn` and `tt_moge.ttnn_tools` without executing `tt_moge/__init__.py` (which imports torch):
see `_package_shim`.

Steps: open the device, `TtnnGraph.load()` (weights up, one forward on a zero input so the conv weights are
prepared) and the input / output sides' constants (`pre.DeviceInput`, `post.DeviceOutput`), one steady-state
forward of a synthetic canvas as the runner runs it (canvas -> patch matrix, the graph, finest maps -> raw maps
at the canvas) under ttnn's graph capture (NORMAL mode: the ops really run, and the capture records every
buffer and circular-buffer allocation), read back the raw maps and the class token.

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
import json
import sys
import time
import types
from pathlib import Path

# What ttnn says when an op's circular buffers or L1 buffers do not fit (the negative check must see one of these).
REFUSAL_SIGNS = ("beyond max L1 size", "clash with L1 buffers", "Out of Memory", "out of memory")


def _package_shim() -> None:
    """Make `tt_moge.runners.ttnn` and `tt_moge.ttnn_tools` importable without running `tt_moge/__init__.py`
    and `tt_moge/runners/__init__.py` (both import torch): register those two packages as empty modules whose
    `__path__` is their folder. Only used when this file is run by path."""
    here = Path(__file__).resolve().parent
    if sys.path and Path(sys.path[0]).resolve() == here:
        sys.path.pop(0)  # this folder's cost.py / mock_check.py must not shadow top-level modules
    root = here.parents[1]  # the folder holding tt_moge/
    for name, folder in (("tt_moge", root / "tt_moge"), ("tt_moge.runners", root / "tt_moge" / "runners")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(folder)]
            sys.modules[name] = module


if __package__ in (None, ""):
    _package_shim()
    from tt_moge.runners.ttnn.graph import CONFIGS, FORMATS, L1_BYTES, TtnnGraph
    from tt_moge.runners.ttnn.pipeline import DevicePipeline
    from tt_moge.runners.ttnn.post import DeviceOutput, widen
    from tt_moge.runners.ttnn.pre import DeviceInput
    from tt_moge.runners.ttnn.prepare import Prepared
    from tt_moge.ttnn_tools import calibration
    from tt_moge.ttnn_tools.cost import BLACKHOLE_P150, OpRecorder, estimate, ops_to_json
else:
    from ..runners.ttnn.graph import CONFIGS, FORMATS, L1_BYTES, TtnnGraph
    from ..runners.ttnn.pipeline import DevicePipeline
    from ..runners.ttnn.post import DeviceOutput, widen
    from ..runners.ttnn.pre import DeviceInput
    from ..runners.ttnn.prepare import Prepared
    from . import calibration
    from .cost import BLACKHOLE_P150, OpRecorder, estimate, ops_to_json


def synthetic_canvas(width: int, height: int):
    """A smooth photo-like (H, W, 3) float32 canvas in [0, 1] (numpy only)."""
    import numpy as np

    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    channels = [
        0.5 + 0.3 * np.sin(2 * np.pi * (f * x + g * y) + p) for f, g, p in ((3, 2, 0.0), (5, 1, 1.0), (2, 4, 2.0))
    ]
    return np.clip(np.stack(channels, axis=-1), 0.0, 1.0).astype(np.float32)


def _short(error: BaseException) -> str:
    text = "\n".join([*getattr(error, "__notes__", ()), str(error)])  # notes first: they say where it failed
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(" ---")]
    return " | ".join(lines[:6])[:1500]


def _note(error: BaseException, note: str) -> None:
    """Add `note` to the error's message (its `add_note` where there is one: Python 3.11 on), keeping its type and
    traceback."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.args = (f"{note}: {error}",) + tuple(error.args[1:])


def capture_calibration(path: str) -> dict:
    """Run tt-metal's demo models of the calibration (`calibration.capture_runs`) on the device and write their op
    lists to `path` (the stored runs: `calibration.RUNS_FILE`). The mock must give the full 13x10 grid."""
    import ttnn
    from ttnn._ttnn import graph as ttnn_graph

    device = ttnn.open_device(device_id=0, l1_small_size=32768)
    try:
        parts = calibration.capture_runs(ttnn, ttnn_graph, device, parts=True)
    finally:
        ttnn.close_device(device)
    calibration.save_runs(parts, Path(path))
    return {k: len(p["input"]) + len(p["body"]) * p["repeat"] for k, p in parts.items()}


def graph_config(name: str, changes: list):
    """CONFIGS[name] with `changes` ("field=value" strings, e.g. mlp_fidelity=hifi2) applied."""
    import dataclasses

    config = CONFIGS[name]
    fields = {f.name: f.type for f in dataclasses.fields(config)}
    values = {}
    for change in changes or ():
        key, _, value = change.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {change}: GraphConfig has no field {key!r} (fields: {', '.join(fields)})")
        old = getattr(config, key)
        values[key] = (value.lower() in ("1", "true", "yes")) if isinstance(old, bool) else type(old)(value)
    return dataclasses.replace(config, **values)


def staged_forward(graph, recorder, x, pre=None, post=None, slot=None) -> dict:
    """The device forward with the recorder's stage set to "input" (`pre`: canvas -> patch matrix, when given),
    "encoder", "decoder", then "output" (`post`: finest maps -> raw maps, when given), for the estimate's groups.
    x: the canvas input with `pre`, else the patch matrix. `slot`: (outputs, class token) of a
    `pipeline.DevicePipeline` slot, which the maps and the class token are copied into, as the runner's trace does
    (`DevicePipeline.forward_ops`); returned with "persistent": True."""
    if pre is not None:
        recorder.stage = "input"
        x = pre.forward(x)
    recorder.stage = "encoder"
    level0, cls_token = graph.encode(x)
    recorder.stage = "decoder"
    finest = graph.decode(level0)
    out = {"finest": finest, "cls_token": cls_token}
    if post is not None:
        recorder.stage = "output"
        if slot is None:
            out = {"maps": post.forward(finest), "cls_token": cls_token}
        else:
            maps, cls_out = slot
            post.forward(finest, into=maps)
            recorder.copy(cls_token, cls_out)
            recorder.deallocate(cls_token)
            out = {"maps": maps, "cls_token": cls_out, "persistent": True}
    recorder.stage = ""
    return out


class QueueLog:
    """A proxy for the ttnn module (or an `OpRecorder`) that logs the command-queue steps of
    `pipeline.DevicePipeline` in the order the host enqueues them: uploads, traces, reads (naming the pipeline's
    buffers), events recorded and waited for, the host's waits, and, between them, how many ttnn calls ran (the
    eager forward's ops, on queue 0). `wait_for_event` is logged, not run: it crashes the mock device (tt-metal's
    queue waits need a chip; docs/tenstorrent.md)."""

    def __init__(self, module, names: dict, run_waits: bool = False):
        self._module, self._names, self._run_waits = module, names, run_waits
        self.log: list = []
        self._ops = 0
        self._events: list = []

    def _flush(self) -> None:
        if self._ops:
            self.log.append(f"ops cq0: {self._ops} ttnn calls")
            self._ops = 0

    def _name(self, tensor) -> str:
        return next((name for obj, name in self._names.items() if obj is tensor), "?")

    def _event(self, event) -> str:
        for known, name in self._events:  # kept alive here: an id() of a freed event could come back
            if known is event:
                return name
        self._events.append((event, f"e{len(self._events) + 1}"))
        return self._events[-1][1]

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if not callable(attr) or isinstance(attr, type):
            return attr
        log = self

        def call(*args, **kwargs):
            if name == "copy_host_to_device_tensor":
                log._flush()
                log.log.append(f"write cq{kwargs.get('cq_id', 0)}: {log._name(args[1])}")
            elif name == "copy_device_to_host_tensor":
                log._flush()
                log.log.append(f"read cq{kwargs.get('cq_id', 0)}: {log._name(args[0])}")
            elif name == "record_event":
                log._flush()
                event = attr(*args, **kwargs)
                log.log.append(f"record cq{args[1]}: {log._event(event)}")
                return event
            elif name == "wait_for_event":
                log._flush()
                log.log.append(f"wait cq{args[0]}: {log._event(args[1])}" + ("" if log._run_waits else " (logged)"))
                return attr(*args, **kwargs) if log._run_waits else None
            elif name == "event_synchronize":
                log._flush()
                log.log.append(f"host waits: {log._event(args[0])}")
            elif name == "execute_trace":
                log._flush()
                log.log.append(f"trace cq{kwargs.get('cq_id', 0)}: {args[1]}")
            elif name not in ("deallocate", "Shape", "allocate_tensor_on_device", "to_layout", "to_dtype", "Tensor"):
                log._ops += 1
            return attr(*args, **kwargs)

        return call


def pipeline_calls(ttnn, device, graph, recorder, pre, post, pipeline, canvases: list) -> dict:
    """The runner's device calls back to back on the device: every canvas submitted before any is waited for
    (`DevicePipeline.submit` / `wait`, trace off: the mock cannot capture one), through `QueueLog`. -> the queue
    order, the ttnn calls of each call's forward by op name, and the maps' shapes."""
    names = {t: f"input[{kind},{slot}]" for (kind, slot), t in pipeline.inputs.items()}
    for slot, outputs in enumerate(pipeline.outputs):
        names.update({t: f"outputs[{slot}].{head}" for head, t in outputs.items()})
        names[pipeline.cls[slot]] = f"cls[{slot}]"
    log = QueueLog(recorder, names)
    parts = (pipeline, graph, pre, post)
    for part in parts:
        part.ttnn = log
    per_call = []
    try:
        calls = []
        for canvas in canvases:
            before = dict(recorder.counts)
            calls.append(pipeline.submit(canvas))
            ttnn.synchronize_device(device)
            per_call.append({k: v - before.get(k, 0) for k, v in recorder.counts.items() if v != before.get(k, 0)})
        results = [pipeline.wait(call) for call in calls]
    finally:
        for part in parts:
            part.ttnn = recorder
    queue_steps = ("copy_host_to_device_tensor", "copy_device_to_host_tensor", "record_event", "wait_for_event")
    forward_calls = [{k: v for k, v in c.items() if k not in queue_steps} for c in per_call]
    return {
        "queues": pipeline.queues,
        "order": log.log,
        "ttnn_calls_per_call": forward_calls,
        "same_ops_every_call": all(c == forward_calls[0] for c in forward_calls),
        "maps": [{k: list(v.shape) for k, v in maps.items()} for maps, _ in results],
        "cls_token": [list(cls.shape) for _, cls in results],
    }


def _forward_fits(ttnn, device, forward, x, recorder, pages: int, banks: int):
    """Run one forward with a blocking L1 reservation of `pages` 2 KiB pages per bank. -> (ran, failing op, error)."""
    blocker = None
    if pages:
        blocker = ttnn.empty(
            (1, 1, 32, 32 * banks * pages), ttnn.bfloat16, ttnn.TILE_LAYOUT, device, ttnn.L1_MEMORY_CONFIG
        )
    try:
        out = forward(x)
        ttnn.synchronize_device(device)
        if not out.get("persistent"):
            for t in list(out["maps"].values()) + [out["cls_token"]]:
                ttnn.deallocate(t)
        return True, None, None
    except Exception as error:  # the first op that no longer fits
        return False, recorder.last, _short(error)
    finally:
        if blocker is not None:
            ttnn.deallocate(blocker)


def l1_peak(ttnn, device, forward, x, recorder) -> dict:
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
        ran, op, error = _forward_fits(ttnn, device, forward, x, recorder, mid, banks)
        tries.append([mid, ran])
        if ran:
            lo = mid
        else:
            hi, failure = mid, (op, error)
    return {
        "peak_bytes": bank_bytes - lo * page,
        "headroom_bytes": lo * page,
        "l1_bank_bytes": bank_bytes,
        "l1_bytes": L1_BYTES,
        "resolution_bytes": page,
        "banks": banks,
        "peak_op": failure[0],
        "peak_op_error": failure[1],
        "tries_pages_ran": tries,
    }


def run(args) -> dict:
    import numpy as np
    import ttnn
    from ttnn._ttnn import graph as ttnn_graph

    report: dict = {
        "prepared": str(args.prepared),
        "formats": args.formats,
        "config": args.config,
        "config_changes": args.set or [],
        "oversize": args.oversize,
    }
    t0 = time.perf_counter()
    prepared = Prepared.load(args.prepared)
    plan = prepared.plan
    report.update(
        backbone=plan["backbone"],
        canvas=plan["canvas"],
        num_tokens=plan["num_tokens"],
        token_grid=[plan["rows"], plan["cols"]],
        seq_len=plan["seq_len"],
    )
    report["read_prepared_s"] = round(time.perf_counter() - t0, 2)
    device = ttnn.open_device(device_id=0, l1_small_size=args.l1_small_size, num_command_queues=args.queues)
    try:
        grid = device.compute_with_storage_grid_size()
        report["grid"] = f"{grid.x}x{grid.y}"
        if args.grid and report["grid"] != args.grid:
            raise RuntimeError(
                f"--grid {args.grid}: the device reports a {report['grid']} compute grid (the mock's cluster "
                "descriptor sets it through harvest_mask: scripts/tt-mock-check --grid writes one)"
            )
        recorder = OpRecorder(ttnn, capture_api=ttnn_graph)
        graph = TtnnGraph(
            recorder,
            device,
            prepared,
            formats=args.formats,
            config=graph_config(args.config, args.set),
            oversize=args.oversize,
        )
        report["graph"] = {k: v for k, v in graph.describe().items() if k != "formats"}
        graph.finest_tiles = True  # as the runner: the output side takes the finest maps in tiles
        pre = DeviceInput(recorder, device, prepared, graph.formats.activations)
        post = DeviceOutput(recorder, device, prepared)
        t = time.perf_counter()
        try:
            graph.load()
            pre.load()
            post.load()
        except Exception as error:  # name the ttnn call that failed, keeping the error and its traceback
            _note(error, f"in ttnn.{recorder.last}")
            raise
        # the runner's slots (inputs, outputs, class tokens), allocated at load as the runner does
        pipeline = DevicePipeline(recorder, device, graph, pre, post, queues=args.queues, trace=False)
        report["load_s"] = round(time.perf_counter() - t, 2)
        # a photo's canvas as the runner uploads it: uint8 planes, into the persistent input a trace would use
        canvas = np.rint(synthetic_canvas(*plan["canvas"]) * 255).astype(np.uint8).transpose(2, 0, 1)[None]
        x = pre.upload(canvas, into=pipeline.inputs["uint8", 0])
        slot = (pipeline.outputs[0], pipeline.cls[0])
        recorder.clear()
        recorder.capture = args.capture
        t = time.perf_counter()
        out = staged_forward(graph, recorder, x, pre, post, slot)
        ttnn.synchronize_device(device)
        recorder.capture = False
        report["forward_s"] = round(time.perf_counter() - t, 2)
        report["ttnn_calls"] = dict(sorted(recorder.counts.items()))
        report["ttnn_calls_total"] = sum(recorder.counts.values())
        if args.capture and args.ops:  # the steady forward's device ops in order, to compare two trees' graphs
            Path(args.ops).write_text(json.dumps(ops_to_json(recorder.ops)))
        if args.capture:
            report["device_operations"] = dict(sorted(recorder.device_counts.items()))
            report["device_operations_total"] = sum(recorder.device_counts.values())
            chip = BLACKHOLE_P150.with_grid((grid.x, grid.y))  # the estimate on the grid that ran
            report["estimate_ms"] = estimate(recorder.ops, chip).summary(top=args.top)
        if args.l1_headroom:
            t = time.perf_counter()
            forward = lambda x: staged_forward(graph, recorder, x, pre, post, slot)  # noqa: E731
            report["peak_l1_per_core"] = l1_peak(ttnn, device, forward, x, recorder)
            report["l1_bisection_s"] = round(time.perf_counter() - t, 2)
        if args.capture and args.calibration:  # on the stored runs of the demo models (calibration.RUNS_FILE)
            t = time.perf_counter()
            runs = calibration.load_runs()
            report["calibration"] = calibration.calibration(runs)
            if args.fit:
                report["calibration_fit"] = calibration.fit(runs)
            report["calibration_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        raw = post.read(out["maps"])
        cls_token = graph.to_host(out["cls_token"], (plan["dim"],))
        report["read_and_host_s"] = round(time.perf_counter() - t, 2)
        shapes = {k: list(np.shape(v)) for k, v in raw.items()}
        finite = all(bool(np.isfinite(widen(v)).all()) for v in raw.values()) and bool(np.isfinite(cls_token).all())
        formats = ", ".join(f"{name} {fmt}" for name, fmt in post.readback.items())
        readback = f"channels-first maps ({formats}), " + ("viewed in place" if post.zero_copy else "copied (to_numpy)")
        report["outputs"] = {"shapes": shapes, "finite": finite, "readback": readback}
        if not finite:
            raise RuntimeError("non-finite host outputs")
        if args.pipeline_calls:  # the runner's calls back to back: queue order and each call's ops
            t = time.perf_counter()
            second = np.ascontiguousarray(canvas[:, :, ::-1])  # another canvas: the image mirrored top to bottom
            canvases = [canvas, second, canvas][: args.pipeline_calls]
            report["pipeline"] = pipeline_calls(ttnn, device, graph, recorder, pre, post, pipeline, canvases)
            report["pipeline_s"] = round(time.perf_counter() - t, 2)
        pipeline.close()
    finally:
        ttnn.close_device(device)
    report["total_s"] = round(time.perf_counter() - t0, 2)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--prepared", help=".npz written by Prepared.save (prepare_weights); required but with --capture-calibration"
    )
    ap.add_argument(
        "--capture-calibration",
        metavar="FILE",
        help="instead: run tt-metal's demo models of the calibration and write their op lists to FILE (the stored "
        "runs, ttnn_tools/calibration_runs.json.gz); needs the mock's full 13x10 grid",
    )
    ap.add_argument("--formats", default="bf16", choices=sorted(FORMATS))
    ap.add_argument(
        "--config",
        default="fast",
        choices=sorted(CONFIGS),
        help="the graph configuration (graph.CONFIGS): fast (the default) or safe",
    )
    ap.add_argument(
        "--oversize",
        action="store_true",
        help="the negative check: an FFN matmul config whose circular buffers cannot fit in L1",
    )
    ap.add_argument(
        "--expect-refusal", action="store_true", help="exit 0 only if ttnn refuses the run (use with --oversize)"
    )
    ap.add_argument(
        "--no-capture", dest="capture", action="store_false", help="skip the graph capture (no device-operation counts)"
    )
    ap.add_argument(
        "--no-l1-headroom", dest="l1_headroom", action="store_false", help="skip the L1 bisection (no peak L1 per core)"
    )
    ap.add_argument("--l1-small-size", type=int, default=32768)
    ap.add_argument(
        "--queues",
        type=int,
        choices=(1, 2),
        default=2,
        help="command queues the device opens with, and the runner's pipeline uses (default 2: uploads and reads on "
        "queue 1, the forward on queue 0)",
    )
    ap.add_argument(
        "--pipeline-calls",
        type=int,
        default=2,
        choices=(0, 1, 2, 3),
        help="run the runner's device calls back to back this many times (default 2; 0: skip) and report their "
        "queue / event order and ttnn calls (the trace off: the mock cannot capture one)",
    )
    ap.add_argument(
        "--grid",
        metavar="CxR",
        help="the compute grid the device must report (e.g. 12x10); the run fails when it reports another "
        "(scripts/tt-mock-check --grid sets the mock's)",
    )
    ap.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="change one field of the configuration (repeatable), e.g. --set mlp_fidelity=hifi2",
    )
    ap.add_argument("--top", type=int, default=10, help="how many of the costliest ops the estimate lists")
    ap.add_argument(
        "--no-calibration",
        dest="calibration",
        action="store_false",
        help="skip the cost model's calibration (tt-metal's published Blackhole figures: fitted and held out)",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="also refit the cost model's four fitted figures on the calibration's fitted points (calibration_fit)",
    )
    ap.add_argument("--json", help="also write the report to this file")
    ap.add_argument(
        "--ops",
        metavar="FILE",
        help="also write the steady forward's device operations, in order, with their tensors and configs "
        "(cost.ops_to_json), to compare the op lists of two trees",
    )
    args = ap.parse_args(argv)
    if args.capture_calibration:
        counts = capture_calibration(args.capture_calibration)
        print(f"wrote the op lists of {len(counts)} calibration runs to {args.capture_calibration}: {counts}")
        return 0
    if not args.prepared:
        ap.error("--prepared is required (or --capture-calibration FILE)")
    try:
        report = run(args)
    except Exception as error:  # a ttnn refusal (TT_FATAL / TT_THROW) or any other failure
        message = f"{type(error).__name__}: {_short(error)}"
        print(f"FAILED: {message}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"failed": message}, indent=1))
        if args.expect_refusal:
            if not any(sign in message for sign in REFUSAL_SIGNS):
                print(
                    "FAILED: the run failed, but not with the L1 / circular-buffer refusal the negative check expects"
                )
                return 1
            print("the run was refused for its L1 use, as expected")
            return 0
        return 1
    print(json.dumps(report, indent=1), flush=True)
    peak = report.get("peak_l1_per_core") or {}
    print(
        f"OK: {report['backbone']} at {report['canvas'][0]}x{report['canvas'][1]}, {report['num_tokens']} tokens, "
        f"{args.formats}: {report['ttnn_calls_total']} ttnn calls ({report.get('device_operations_total', '?')} device "
        f"operations) ran; peak L1 per core {peak.get('peak_bytes', '?')} B of {peak.get('l1_bank_bytes', '?')} B "
        f"({peak.get('peak_op', '?')})",
        flush=True,
    )
    est = report.get("estimate_ms")
    if est:
        print(
            f"estimate: forward {est['total']:.2f} ms on a {est['chip']} {est['grid']} (kernel {est['kernel']:.2f}, "
            f"dispatch {est['dispatch']:.2f}; "
            + ", ".join(
                f"{g} {est[g]:.2f}" for g in ("encoder", "sdpa", "norms_adds", "decoder", "transfers", "input_output")
            )
            + ")",
            flush=True,
        )
    calib = report.get("calibration")
    if calib:
        print(
            f"calibration on tt-metal's published Blackhole figures: {calib['fitted_points']} fitted (mean error "
            f"{calib['fitted_mean_abs_error']:.1%}), {calib['held_out_points']} held out: mean error "
            f"{calib['held_out_mean_abs_error']:.1%}, max {calib['held_out_max_abs_error']:.1%}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.expect_refusal:
        print("FAILED: expected ttnn to refuse this run, it ran")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
