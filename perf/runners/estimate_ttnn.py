"""Tenstorrent without a chip: the estimated latency of `model(array)` at the spec case (ViT-L, 1920x1080 canvas,
1800 tokens, a 1920x1080 uint8 array), part estimated, part measured on this machine.

* device forward: the cost model's estimate (`tt_moge.ttnn_tools.cost`) of the graph the mock P150 ran, read
  from a `scripts/tt-mock-check --json` report (`--report`), or from a fresh mock check when the mock is set up;
* PCIe: the patch matrix up and the finest maps down, in the bytes the graph moves, at the cost model's link rate;
* host, measured here (medians of --runs): the Tenstorrent runner's own steps (`runner.patch_matrix`: the
  antialiased resize and patch unfold; `runner.raw_maps`: phase interleave, resize to the canvas, activations),
  ttnn's host-side tilize of the input and read of the rows (in the mock's Python, when it is set up), and the
  pipeline every runner shares (decode, canvas fit, solve, finish: `PredictionService` replaying raw maps of a
  real forward, so that the mask and the solve see a photo-like scene).

The host steps do not depend on the backbone, only on the canvas and the token grid, so a tiny random network at
the spec's canvas and token budget gives their shapes. Prints a table, the total beside the spec's p150
`model(array)` median (25.6 ms), the CPU, and the command to rerun it.

    python -m perf.runners.estimate_ttnn --report /tmp/vitl.json --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from perf import common

SPEC_MS = 25.6  # the spec's p150 median of model(uint8 array 1920x1080)
SIZE, TOKENS = (1920, 1080), 1800

# ttnn's host side, timed in the mock's Python: the input's tilize to bfloat16 tiles (what graph.host_tensor does)
# and reading row-major float32 rows into numpy (what graph.to_host does with the untilized output).
_TTNN_HOST = r"""
import json, sys, time, numpy as np, ttnn
seq, k, rows, cols, runs = (int(v) for v in sys.argv[1:6])
patches = np.random.rand(1, 1, seq, k).astype(np.float32)
out = np.random.rand(rows, cols).astype(np.float32)
def med(fn):
    fn(); ts = []
    for _ in range(runs):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3
up = med(lambda: ttnn.Tensor(patches, ttnn.bfloat16, None, ttnn.TILE_LAYOUT))
host = ttnn.Tensor(out, ttnn.float32, None, ttnn.ROW_MAJOR_LAYOUT)
down = med(lambda: np.asarray(host.to_numpy(), dtype=np.float32))
print(json.dumps({"tilize_input_ms": up, "rows_to_numpy_ms": down}))
"""


def _mock_dir() -> Path:
    """Where scripts/tt-mock/setup.sh put the mock P150 (the folder tt-mock-check uses)."""
    from tt_moge import env

    return Path(env.get("MOGE_MOCK_DIR") or Path.home() / ".cache" / "tt_moge" / "tt-mock")


def _mock_report(path: str) -> dict:
    if path:
        return json.loads(Path(path).read_text())
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
            ],
            check=True,
            env={**os.environ, "PYTHON": sys.executable},
        )
        return json.loads(out.read_text())


def _ttnn_host(plan: dict, runs: int) -> dict:
    mock = _mock_dir()
    if not (mock / "env.sh").is_file():
        return {}
    fin = plan["finest"]
    args = [
        str(plan["seq_len"]),
        str(plan["patch_k_padded"]),
        str(fin["in_height"] * fin["in_width"]),
        str(fin["phase_channels"]),
        str(runs),
    ]
    # in the mock's environment, as tt-mock-check runs it (env.sh: its venv, cluster description, caches, logs)
    command = ["bash", "-c", '. ./env.sh && exec python -c "$0" "$@"', _TTNN_HOST, *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=mock)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", default="", help="a scripts/tt-mock-check --json report of ViT-L at the spec case")
    ap.add_argument("--runs", type=int, default=20, help="timed calls per host step")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()

    import torch

    from tt_moge import MoGeModel
    from tt_moge.host import CallOptions
    from tt_moge.runners.ttnn.prepare import prepare_weights
    from tt_moge.runners.ttnn.runner import patch_matrix, raw_maps
    from tt_moge.testing import make_checkpoint, make_network
    from tt_moge.ttnn_tools.cost import BLACKHOLE_P150

    torch.set_num_threads(os.cpu_count() or 1)
    report = _mock_report(args.report)
    forward_ms = float(report["estimate_ms"]["total"])
    if report.get("canvas") != list(SIZE) or report.get("num_tokens") != TOKENS:
        sys.exit(f"--report is of {report.get('canvas')} / {report.get('num_tokens')} tokens, not the spec case")

    prepared = prepare_weights(make_network("tiny-vits-normal"), SIZE, TOKENS)
    plan = prepared.plan
    fin = plan["finest"]
    image = common.photo(SIZE)
    canvas = torch.from_numpy(image).permute(2, 0, 1)[None].float().div(255)
    readback = {
        "finest": np.random.rand(fin["in_height"] * fin["in_width"], fin["phase_channels"]).astype(np.float32),
        "cls_token": np.random.rand(plan["dim"]).astype(np.float32),
    }
    patches_ms = common.median_min_ms(lambda: patch_matrix(prepared, canvas), args.runs)[0]
    raw_ms = common.median_min_ms(lambda: raw_maps(prepared, readback), args.runs)[0]
    ttnn_host = _ttnn_host(plan, args.runs)

    seq_tiles = -(-plan["seq_len"] // 32) * 32
    up_bytes = seq_tiles * plan["patch_k_padded"] * 2  # bfloat16 tiles
    down_bytes = fin["in_height"] * fin["in_width"] * fin["phase_channels"] * 4 + plan["dim"] * 4  # float32 rows
    pcie_ms = (up_bytes + down_bytes) / BLACKHOLE_P150.pcie_bytes_per_s * 1e3

    with tempfile.TemporaryDirectory() as tmp:  # the shared host stages, on raw maps of a real forward
        make_checkpoint(tmp, "tiny-vits-normal")
        with MoGeModel.from_pretrained(
            tmp, device="cpu", resolution=SIZE, num_tokens=TOKENS, warmup=0, warmup_variants=()
        ) as model:
            service = model.service
            raw = service.forward_raw(canvas)
            replay = service.replaying(raw)
            stages: dict = {}
            for _ in range(args.runs + 1):
                timing: dict = {}
                replay.predict(image, CallOptions(), timing)
                for k, v in timing.items():
                    stages.setdefault(k, []).append(v)
    shared = {k: common.median(v[1:]) for k, v in stages.items() if k not in ("device", "device_wait")}

    rows = [
        ("device forward (cost model, mock P150 op list)", forward_ms, "estimated"),
        ("PCIe: patch matrix up, finest maps down", pcie_ms, "estimated"),
        ("runner host: patch_matrix (resize + unfold)", patches_ms, "measured"),
        ("runner host: raw_maps (interleave, resize, activations)", raw_ms, "measured"),
    ]
    if ttnn_host:
        rows += [
            ("ttnn host: tilize the input", ttnn_host["tilize_input_ms"], "measured (mock's Python)"),
            ("ttnn host: read the rows into numpy", ttnn_host["rows_to_numpy_ms"], "measured (mock's Python)"),
        ]
    rows += [(f"shared host: {k}", v, "measured") for k, v in shared.items()]
    total = sum(v for _, v, _ in rows)
    cpu = common.cpu_line()
    print(
        f"model(uint8 array {SIZE[0]}x{SIZE[1]}) on a Blackhole P150, ViT-L, {TOKENS} tokens; host {cpu}; "
        f"{torch.get_num_threads()} threads; medians of {args.runs}"
    )
    for name, value, how in rows:
        print(f"  {name:58s} {value:8.2f} ms   {how}")
    print(f"  {'total':58s} {total:8.2f} ms   (the spec's p150: {SPEC_MS} ms; ratio {total / SPEC_MS:.2f})")
    common.finish_report({"rows": rows, "total_ms": total, "host": cpu}, args.json)


if __name__ == "__main__":
    main()
