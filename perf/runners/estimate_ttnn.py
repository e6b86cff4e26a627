"""Tenstorrent without a chip: the estimated latency of `model(array)` at the spec case (ViT-L, 1920x1080 canvas,
1800 tokens, a 1920x1080 uint8 array), part estimated, part measured on this machine.

The whole call runs on the chip but for the host stages every runner shares: the device forward (the spec's
`forward`: the canvas's resize and unfold, the network, interleave, resize to the canvas and activations, all in
one trace) is the cost model's; what remains on the host is measured here.

* device forward: the cost model's estimate (`tt_moge.ttnn_tools.cost`) of the graph the mock P150 ran
  (`scripts/tt-mock-check --json`: `--report`, or a fresh mock check when the mock is set up; `--grid CxR` is
  passed to it and checked against the report's grid);
* PCIe: the canvas up (uint8 planes: a photo's canvas is 8-bit, `Runner.takes_uint8`) and the raw maps down
  (rows in each head's read-back format, `post.READBACK`: the points and the mask float32, the normals bfloat16)
  with the class token, at tt-metal's measured Blackhole rates (`cost.Link`: the read into pinned memory, which
  ttnn uses for the runner's preallocated host tensors; the unpinned rate beside it);
* ttnn host, measured in the mock's Python (when it is set up): the canvas into a host tensor, the read maps lent
  as numpy views of recycled host tensors (`post.DeviceOutput.read`: no copy, no fresh pages per call);
* runner host, measured here: the raw maps as (H, W, 3) views and the scale MLP (`runner.device_raw_maps`);
* shared host, measured here (medians of --runs): decode, canvas fit (to uint8 planes, as for the Tenstorrent
  runner), solve, finish (`PredictionService` replaying raw maps of a real forward laid out as the device returns
  them, channels-first, so that the mask and the solve see a photo-like scene and the finish reads the same
  strides).

The host steps do not depend on the backbone, only on the canvas and the token grid, so a tiny random network at
the spec's canvas and token budget gives their shapes. Prints a table, the total beside the spec's p150
`model(array)` median (25.6 ms) and the issue's goal (25 ms), the CPU, and the command to rerun it.

Throughput (`throughput_per_s`): the steady-state images per second of `predict_many` on 1920x1080 photo arrays
(issue 46). The runner keeps two calls in flight (`pipeline.DevicePipeline`), so the chip's period per image is
  one command queue (ETH dispatch, the P150 at 12x10):    upload + trace + read-back (one queue runs them in order)
  two command queues (worker dispatch, 11x10 on a P150):  max(trace, upload + read-back) (the link's queue beside)
and the host's, on N cores, is the larger of the stages one thread runs in turn (decode + canvas fit on the
prepare thread; the canvas into a host tensor, the read maps' views and the scale MLP on the calling thread) and
all the host's work per image (each step timed here on one thread: its core-milliseconds) spread over N cores: an
upper bound for N beyond this machine's cores (perfect scaling of the multithreaded solve and finish assumed; the
spec's host measured solve + finish at 16 threads at about 5 ms an image, a bound of 200 images/s for that stage).
The images per second are 1000 / max(the chip's period, the host's). `--host-cores` sets the N reported (default
16, the spec's host, and 2); `--queues` the chip's configuration (default: one queue at 12x10 and 13x10, two at
11x10, as a P150 runs them).

    python -m perf.runners.estimate_ttnn --report /tmp/vitl.json --runs 20 --grid 12x10 --json out.json
    python -m perf.runners.estimate_ttnn --grid 12x10 --json F     # a fresh mock check; total_ms, throughput_per_s
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from perf import common

SPEC_MS = 25.6  # the spec's p150 median of model(uint8 array 1920x1080)
SIZE, TOKENS = (1920, 1080), 1800

# ttnn's host side, timed in the mock's Python: the canvas (uint8 planes, what the runner uploads for a photo;
# float32 for the record) into a host tensor (what pre.DeviceInput.host_tensor does), the read maps lent as numpy
# views of recycled host tensors (what post.DeviceOutput.read does after copy_device_to_host_tensor: host_view and
# lend; the pages were touched when the set was made, so a call pays no page faults) and, for the record, what it
# no longer pays: to_numpy's copy and the first touch of a fresh host tensor's pages (from_device's, per call).
_TTNN_HOST = r"""
import json, sys, time, numpy as np, ttnn
from tt_moge.runners.ttnn.post import READBACK, host_view, lend
height, width, planes, runs = (int(v) for v in sys.argv[1:5])
canvas8 = (np.random.rand(1, 3, height, width) * 255).astype(np.uint8)
canvas = np.random.rand(1, 3, height, width).astype(np.float32)
heads = (("points", 3), ("normal", 3), ("mask", 1)) if planes == 7 else (("points", 3), ("mask", 1))
sizes = [n for _, n in heads]
bf16 = [READBACK[name] == "bfloat16" for name, _ in heads]  # each map in its read-back format
maps = [ttnn.Tensor(np.random.rand(1, n, height, width).astype(np.float32), getattr(ttnn, READBACK[name]), None,
                    ttnn.ROW_MAJOR_LAYOUT) for name, n in heads]
def med(fn):
    fn(); ts = []
    for _ in range(runs):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3
up8 = med(lambda: ttnn.Tensor(canvas8, ttnn.uint8, None, ttnn.ROW_MAJOR_LAYOUT))
up = med(lambda: ttnn.Tensor(canvas, ttnn.float32, None, ttnn.ROW_MAJOR_LAYOUT))
down = med(lambda: lend([host_view(ttnn, m, b)[0] for m, b in zip(maps, bf16)], lambda: None))
copied = med(lambda: [np.asarray(ttnn.to_dtype(m, ttnn.float32).to_numpy() if b else m.to_numpy(), dtype=np.float32)
                      for m, b in zip(maps, bf16)])
def first_touch():  # the pages of a fresh host tensor for the maps, touched once (what from_device's fill paid)
    fresh = np.empty(sum(sizes) * height * width * 4, np.uint8)
    fresh[::4096] = 1
fresh = med(first_touch)
print(json.dumps({"canvas_to_host_tensor_ms": up8, "float_canvas_to_host_tensor_ms": up, "maps_to_numpy_ms": down,
                  "maps_copied_ms": copied, "fresh_pages_ms": fresh}))
"""

# tt_moge.runners.ttnn importable without tt_moge's and tt_moge.runners' __init__ (torch), as mock_check does it
_IMPORTS = f"""
import sys, types
for name, folder in (("tt_moge", {str(common.ROOT / "code" / "tt_moge")!r}),
                     ("tt_moge.runners", {str(common.ROOT / "code" / "tt_moge" / "runners")!r})):
    module = types.ModuleType(name)
    module.__path__ = [folder]
    sys.modules[name] = module
"""

GOAL_MS = 25.0  # issue 27's model(array) goal at 12x10 (moonshot 20)


def _mock_dir() -> Path:
    """Where scripts/tt-mock/setup.sh put the mock P150 (the folder tt-mock-check uses)."""
    from tt_moge import env

    return Path(env.get("MOGE_MOCK_DIR") or Path.home() / ".cache" / "tt_moge" / "tt-mock")


def _mock_report(path: str, grid: str) -> dict:
    if path:
        report = json.loads(Path(path).read_text())
        ran = report.get("grid")
        ran = "x".join(map(str, ran)) if isinstance(ran, list) else ran
        if grid and ran != grid:
            sys.exit(f"--report ran on a {ran} grid, not the --grid {grid} asked for")
        return report
    mock = _mock_dir()
    if not (mock / "env.sh").is_file():
        sys.exit(
            "no --report and no mock P150 set up (bash scripts/tt-mock/setup.sh): nothing to take the "
            "forward's estimate from"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        subprocess.run(
            [
                str(common.ROOT / "scripts" / "tt-mock-check"),
                "--random",
                "vitl-normal",
                "--resolution",
                f"{SIZE[0]}x{SIZE[1]}",
                "--num-tokens",
                str(TOKENS),
                "--no-calibration",
                "--no-l1-headroom",
                "--json",
                str(out),
                *(["--grid", grid] if grid else []),
            ],
            check=True,
            env={**os.environ, "PYTHON": sys.executable},
        )
        return json.loads(out.read_text())


def _ttnn_host(plan: dict, runs: int) -> dict:
    mock = _mock_dir()
    if not (mock / "env.sh").is_file():
        return {}
    width, height = plan["canvas"]
    args = [str(height), str(width), str(sum(h["channels"] for h in plan["heads"])), str(runs)]
    # in the mock's environment, as tt-mock-check runs it (env.sh: its venv, cluster description, caches, logs);
    # post.py imported as mock_check imports it (tt_moge's package __init__ files import torch, absent there)
    command = ["bash", "-c", '. ./env.sh && exec python -c "$0" "$@"', _IMPORTS + _TTNN_HOST, *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=mock)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}


def _device_layout(raw):
    """RawMaps as the Tenstorrent runner returns them: (H, W, 3) views of channels-first planes, each in its read-back
    format (`post.READBACK`: bfloat16 maps as their bits, which the runner views as torch bfloat16)."""
    import torch

    from tt_moge.runners.ttnn.post import READBACK
    from tt_moge.runners.ttnn.runner import device_raw_maps

    def planes(name, t):
        if READBACK[name] == "bfloat16":
            return t.contiguous().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return t.contiguous().numpy()

    maps = {"points": planes("points", raw.points.permute(2, 0, 1))}
    if raw.normal is not None:
        maps["normal"] = planes("normal", raw.normal.permute(2, 0, 1))
    if raw.mask is not None:
        maps["mask"] = planes("mask", raw.mask[None])
    view = device_raw_maps(_PREPARED[0], maps, np.zeros(_PREPARED[0].plan["dim"], np.float32))
    view.metric_scale = raw.metric_scale
    return view


_PREPARED: list = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", default="", help="a scripts/tt-mock-check --json report of ViT-L at the spec case")
    ap.add_argument("--grid", default="", help="CxR: the compute grid to estimate on (passed to tt-mock-check)")
    ap.add_argument("--runs", type=int, default=20, help="timed calls per host step")
    ap.add_argument("--json", help="also write the numbers to this file (total_ms and each part)")
    ap.add_argument(
        "--host-cores",
        default="16,2",
        help="host cores N to report the throughput for, comma-separated (default 16 (the spec's host), 2)",
    )
    ap.add_argument(
        "--queues",
        type=int,
        choices=(1, 2),
        help="command queues of the chip (default: 1 at 12x10 / 13x10 (ETH dispatch), 2 at 11x10 (worker))",
    )
    args = ap.parse_args()

    import torch

    from tt_moge import MoGeModel, native
    from tt_moge.host import CallOptions
    from tt_moge.runners.ttnn.post import READBACK
    from tt_moge.runners.ttnn.prepare import prepare_weights
    from tt_moge.runners.ttnn.runner import device_raw_maps
    from tt_moge.testing import make_checkpoint, make_network
    from tt_moge.ttnn_tools.cost import PCIE

    torch.set_num_threads(os.cpu_count() or 1)
    report = _mock_report(args.report, args.grid)
    forward_ms = float(report["estimate_ms"]["total"])
    if report.get("canvas") != list(SIZE) or report.get("num_tokens") != TOKENS:
        sys.exit(f"--report is of {report.get('canvas')} / {report.get('num_tokens')} tokens, not the spec case")
    grid = report.get("grid")
    grid = "x".join(map(str, grid)) if isinstance(grid, list) else str(grid)

    prepared = prepare_weights(make_network("tiny-vits-normal"), SIZE, TOKENS)
    _PREPARED.append(prepared)
    plan = prepared.plan
    image = common.photo(SIZE)
    canvas = torch.from_numpy(image).permute(2, 0, 1)[None].float().div(255)
    ttnn_host = _ttnn_host(plan, args.runs)

    up_bytes = SIZE[0] * SIZE[1] * 3  # the canvas, uint8 planes
    # the raw maps, rows in each head's read-back format (post.READBACK); the class token
    width = {"float32": 4, "bfloat16": 2}
    down_bytes = sum(SIZE[0] * SIZE[1] * h["channels"] * width[READBACK[h["name"]]] for h in plan["heads"])
    down_bytes += plan["dim"] * 4
    formats = ", ".join(f"{h['name']} {READBACK[h['name']]}" for h in plan["heads"])
    up_ms = up_bytes / PCIE.h2d * 1e3
    down_ms = {"pinned": down_bytes / PCIE.d2h_pinned * 1e3, "unpinned": down_bytes / PCIE.d2h_unpinned * 1e3}
    pcie_ms = up_ms + down_ms["pinned"]

    with tempfile.TemporaryDirectory() as tmp:  # the shared host stages, on raw maps of a real forward
        make_checkpoint(tmp, "tiny-vits-normal")
        with MoGeModel.from_pretrained(
            tmp, device="cpu", resolution=SIZE, num_tokens=TOKENS, warmup=0, warmup_variants=()
        ) as model:
            service = model.service
            raw = _device_layout(service.forward_raw(canvas))
            maps = {"points": raw.points.permute(2, 0, 1).numpy(), "mask": raw.mask[None].numpy()}
            if raw.normal is not None:  # as read back (bfloat16 bits where post.READBACK says so)
                normal = raw.normal.permute(2, 0, 1)
                bf16 = normal.dtype == torch.bfloat16
                maps["normal"] = normal.view(torch.int16).numpy().view(np.uint16) if bf16 else normal.numpy()
            cls_token = np.random.rand(plan["dim"]).astype(np.float32)
            views_ms = common.median_min_ms(lambda: device_raw_maps(prepared, maps, cls_token), args.runs)[0]
            replay = service.replaying(raw)
            replay.runner.takes_uint8 = True  # the canvas fit the Tenstorrent runner's service runs

            def host_stages() -> dict:  # medians of each shared host stage, ms; "cpu_share": CPU time / wall time
                stages: dict = {}
                for _ in range(args.runs + 1):
                    timing: dict = {}
                    wall, cpu = time.perf_counter(), time.process_time()
                    replay.predict(image, CallOptions(), timing)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    for k, v in timing.items():
                        stages.setdefault(k, []).append(v)
                    stages.setdefault("cpu_share", []).append(min(1.0, cpu / wall))
                return {k: common.median(v[1:]) for k, v in stages.items() if k not in ("device", "device_wait")}

            shared = host_stages()
            shared.pop("cpu_share")
            threads = torch.get_num_threads(), native.threads()
            torch.set_num_threads(1)  # one thread: each step's core-milliseconds, for the throughput on N cores
            if threads[1]:
                native.set_threads(1)
            try:  # on one thread, CPU time / wall time is the share of the wall the thread ran (a busy machine
                # takes the core away): each stage's wall times that share is its core-milliseconds
                one_thread = host_stages()
                share = one_thread.pop("cpu_share")
                one_thread = {k: v * share for k, v in one_thread.items()}
                views_core_ms = common.median_min_ms(lambda: device_raw_maps(prepared, maps, cls_token), args.runs)[0]
            finally:
                torch.set_num_threads(threads[0])
                if threads[1]:
                    native.set_threads(threads[1])

    rows = [
        ("device forward (cost model, mock P150 op list)", forward_ms, "estimated"),
        (f"PCIe: canvas up (uint8), raw maps down ({formats}), pinned", pcie_ms, "estimated"),
    ]
    if ttnn_host:
        rows += [
            (
                "ttnn host: the canvas (uint8) into a host tensor",
                ttnn_host["canvas_to_host_tensor_ms"],
                "measured (mock's Python)",
            ),
            (
                "ttnn host: the read maps lent as numpy views",
                ttnn_host["maps_to_numpy_ms"],
                "measured (mock's Python)",
            ),
        ]
        print(
            f"(no longer paid: a float32 canvas into a host tensor {ttnn_host['float_canvas_to_host_tensor_ms']:.2f}"
            f" ms, fresh pages for each read {ttnn_host['fresh_pages_ms']:.2f} ms, to_numpy's copy of the maps "
            f"{ttnn_host['maps_copied_ms']:.2f} ms)"
        )
    rows += [("runner host: (H, W, 3) views, scale MLP", views_ms, "measured")]
    rows += [(f"shared host: {k}", v, "measured") for k, v in shared.items()]
    total = sum(v for _, v, _ in rows)
    cpu = common.cpu_line()
    print(
        f"model(uint8 array {SIZE[0]}x{SIZE[1]}) on a Blackhole P150 ({grid} grid), ViT-L, {TOKENS} tokens; "
        f"host {cpu}; {torch.get_num_threads()} threads; medians of {args.runs}"
    )
    for name, value, how in rows:
        print(f"  {name:58s} {value:8.2f} ms   {how}")
    print(
        f"  {'model(array)':58s} {total:8.2f} ms   (goal {GOAL_MS} ms; the spec's p150: {SPEC_MS} ms, "
        f"ratio {total / SPEC_MS:.2f})"
    )
    parts = {name: round(value, 3) for name, value, _ in rows}

    # ---- throughput of predict_many (see the module docstring)
    queues = args.queues or (2 if grid == "11x10" else 1)
    ttnn_canvas = ttnn_host.get("canvas_to_host_tensor_ms", 0.0)  # one thread's work already (a copy)
    ttnn_views = ttnn_host.get("maps_to_numpy_ms", 0.0)
    prepare_ms = one_thread.get("decode", 0.0) + one_thread["canvas"]  # the prepare thread
    calling_ms = ttnn_canvas + ttnn_views + views_core_ms  # predict_many's own thread: submit, views, scale MLP
    core_ms = prepare_ms + calling_ms + one_thread["solve"] + one_thread["finish"]
    host_cores = [int(n) for n in args.host_cores.split(",") if n.strip()]
    throughput = {}
    for read in ("pinned", "unpinned"):
        serial = up_ms + forward_ms + down_ms[read]
        chip_ms = serial if queues == 1 else max(forward_ms, up_ms + down_ms[read])
        copy_ms = down_ms[read] if read == "unpinned" else 0.0  # ttnn's copy out of the completion queue
        for n in host_cores:
            host_ms = max(prepare_ms, calling_ms, copy_ms, (core_ms + copy_ms) / n)
            throughput[f"{read}, {n} host cores"] = {
                "chip_period_ms": round(chip_ms, 3),
                "host_period_ms": round(host_ms, 3),
                "images_per_s": round(1000.0 / max(chip_ms, host_ms), 1),
                "bound": "chip" if chip_ms >= host_ms else "host",
            }
    headline = throughput[f"pinned, {host_cores[0]} host cores"]
    print(
        f"predict_many throughput, {queues} command queue{'s' if queues == 2 else ''} on the {grid} grid "
        f"(the chip's period {'upload + trace + read' if queues == 1 else 'max(trace, upload + read)'}; the host's "
        f"on N cores: max(prepare thread {prepare_ms:.2f}, calling thread {calling_ms:.2f}, {core_ms:.2f} core-ms / N))"
    )
    print(
        f"  link: canvas up {up_ms:.2f} ms, maps down {down_ms['pinned']:.2f} ms pinned / "
        f"{down_ms['unpinned']:.2f} ms unpinned (cost.Link: tt-metal issue 27846, PR 25791)"
    )
    for name, t in throughput.items():
        print(
            f"  {name:28s} chip {t['chip_period_ms']:6.2f} ms, host {t['host_period_ms']:6.2f} ms -> "
            f"{t['images_per_s']:6.1f} images/s ({t['bound']}-bound)"
        )
    common.finish_report(
        {
            "rows": rows,
            "parts_ms": parts,
            "total_ms": total,
            "grid": grid,
            "goal_ms": GOAL_MS,
            "host": cpu,
            "throughput_per_s": headline["images_per_s"],
            "throughput": {
                "queues": queues,
                "forward_ms": forward_ms,
                "upload_ms": up_ms,
                "readback_ms": down_ms,
                "load_average": os.getloadavg()[0],
                "cpu_share_one_thread": share,
                "host_core_ms": {
                    "prepare (decode + canvas fit)": prepare_ms,
                    "calling thread (canvas to host tensor, views, scale MLP)": calling_ms,
                    "solve": one_thread["solve"],
                    "finish": one_thread["finish"],
                    "total": core_ms,
                },
                "by_read_and_cores": throughput,
            },
        },
        args.json,
    )


if __name__ == "__main__":
    main()
