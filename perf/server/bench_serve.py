"""Requests/s and latency of `tt-moge serve` on one device, on a pool of device replicas (`--devices`) and on Ray
Serve (`--ray --replicas N`), each a real server process on this machine, at 1, 4 and 16 concurrent clients.

    python -m perf.server.bench_serve                       # plain (1 thread), --devices cpu,cpu, --ray --replicas 2
    python -m perf.server.bench_serve --layouts plain pool  # some of them
    python -m perf.server.bench_serve --preset vitl-normal --resolution 1920x1080 --tokens 1800 --requests 8

The CPU replicas run one torch thread each (`OMP_NUM_THREADS=1` for the plain server, two replicas of one thread
for the pool and Ray), so "two replicas" against "one" is the scaling of the layout, not of torch's threads. The
model is a random-weight checkpoint of `tt_moge.testing` (default: the tiny ViT-S on a 640x360 canvas, so a run
takes minutes on two cores); every request is `POST /predict/summary` of one photo-like 640x480 PNG. Prints a
table (requests/s, p50 and p99 latency in ms) per layout and concurrency for each round (`--rounds`: every
layout is started and measured in turn, then again), their medians, the ratio of each layout's requests/s
to the plain server's, the machine and the load average before and after.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from perf.common import ROOT, cpu_line, rerun_command

LAYOUTS = {
    "plain": [],
    "pool": ["--devices", "cpu,cpu"],
    "ray": ["--ray", "--replicas", "2", "--threads-per-replica", "1"],
}
THREADS = {"plain": "1", "pool": "2", "ray": "1"}  # torch threads of the server process (the pool splits its 2)


def start(layout: str, weights: Path, args: argparse.Namespace) -> tuple:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": THREADS[layout],
        "PYTHONPATH": str(ROOT / "code"),
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "tt_moge.server", "--weights", str(weights), "--device", "cpu"]
    if layout != "plain":
        cmd = cmd[:-2]  # --devices / --ray name the devices
    cmd += ["--resolution", args.resolution, "--num-tokens", str(args.tokens), "--warmup", "1"]
    cmd += ["--warmup-variants", "none", "--port", "0", "--log-level", "warning", "--no-access-log"]
    cmd += ["--queue-size", "32", *LAYOUTS[layout]]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    port = threading.Event()
    found: dict = {}

    def read() -> None:
        for line in proc.stderr:
            match = re.search(r"serving on http://[^:]+:(\d+)", line)
            if match and "port" not in found:
                found["port"] = int(match.group(1))
                port.set()
        port.set()

    threading.Thread(target=read, daemon=True).start()
    if not port.wait(300) or "port" not in found:
        proc.kill()
        raise RuntimeError(f"{layout}: the server did not start")
    url = f"http://127.0.0.1:{found['port']}"
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{layout}: not ready in 600 s")


def load(url: str, body: bytes, clients: int, requests: int) -> tuple:
    """(requests/s, p50 ms, p99 ms, non-200 count) of `requests` posts from `clients` threads."""
    import httpx

    latencies: list = []
    failed = [0]

    def one(_: int) -> None:
        t = time.perf_counter()
        r = httpx.post(url + "/predict/summary", content=body, headers={"Content-Type": "image/png"}, timeout=600)
        latencies.append((time.perf_counter() - t) * 1e3)
        if r.status_code != 200:
            failed[0] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return requests / wall, statistics.median(latencies), p99, failed[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--preset", default="tiny-vits-normal", help="tt_moge.testing preset of the random checkpoint")
    parser.add_argument("--resolution", default="640x360")
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level (default 32)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="times each layout is started and measured, in turn (plain, pool, ray, plain, ...); medians are "
        "reported, so that a change of load during the run falls on every layout (default 2)",
    )
    args = parser.parse_args()

    from PIL import Image

    from tt_moge.synthetic import synthetic_photo
    from tt_moge.testing import make_checkpoint

    buf = io.BytesIO()
    Image.fromarray(synthetic_photo((640, 480), seed=3)).save(buf, format="PNG")
    body = buf.getvalue()
    folder = Path(tempfile.mkdtemp(prefix="tt_moge-bench-serve-"))
    weights = make_checkpoint(folder, args.preset)
    print(f"{cpu_line()}; load average before: {os.getloadavg()}")
    print(f"model: random {args.preset}, canvas {args.resolution}, {args.tokens} tokens; image 640x480 PNG")
    runs: dict = {}
    for round_ in range(args.rounds):
        for layout in args.layouts:
            proc, url = start(layout, weights, args)
            try:
                load(url, body, 2, 4)  # warm: every replica has run
                for clients in args.concurrency:
                    row = load(url, body, clients, max(args.requests, clients))
                    runs.setdefault((layout, clients), []).append(row)
                    rps, p50, p99, failed = row
                    print(
                        f"round {round_ + 1} {layout:6s} c={clients:2d}: {rps:6.2f} req/s  p50 {p50:8.0f} ms  "
                        f"p99 {p99:8.0f} ms" + (f"  ({failed} not 200)" if failed else ""),
                        flush=True,
                    )
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    rows = {key: tuple(statistics.median(r[i] for r in found) for i in range(4)) for key, found in runs.items()}
    print(f"medians of {args.rounds} round(s):")
    for (layout, clients), (rps, p50, p99, _) in rows.items():
        print(f"{layout:6s} c={clients:2d}: {rps:6.2f} req/s  p50 {p50:8.0f} ms  p99 {p99:8.0f} ms")
    print(f"load average after: {os.getloadavg()}")
    if "plain" in args.layouts:
        for layout in args.layouts:
            if layout == "plain":
                continue
            ratios = [rows[(layout, c)][0] / rows[("plain", c)][0] for c in args.concurrency]
            text = ", ".join(f"c={c}: {r:.2f}x" for c, r in zip(args.concurrency, ratios))
            print(f"{layout} / plain requests/s: {text}")
    print(f"rerun: {rerun_command()}")


if __name__ == "__main__":
    main()
