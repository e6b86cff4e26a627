"""Server benchmarks: npz encoding choices, and HTTP /predict against the in-process API on the same image.

    python -m perf.server.server_bench encode                      # npz writers on one 1920x1080 result
    python -m perf.server.server_bench serve --weights DIR_OR_REPO  # API vs HTTP latency, then concurrent clients

Without --weights a random-weight tiny checkpoint is written to a temporary directory (the timings then show the
server's overhead on a fast-forward model, not MoGe-2's speed). Medians over --repeats calls; the command that
reproduces a run is printed first. The API and the server run one after the other (a device is opened once).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from perf import common
from tt_moge.cli import argtypes


def _weights(args: argparse.Namespace, tmp: str) -> str:
    if args.weights:
        return args.weights
    from tt_moge.testing import make_checkpoint

    return str(make_checkpoint(tmp, "tiny-vits-normal"))


def _load(args: argparse.Namespace, weights: str):
    from tt_moge import MoGeModel

    return MoGeModel.from_pretrained(
        weights,
        device=args.device,
        resolution=args.resolution,
        num_tokens=args.num_tokens,
        warmup=1,
        warmup_variants="minimal",
    )


def _image(args: argparse.Namespace) -> bytes:
    if args.image:
        return Path(args.image).read_bytes()
    from PIL import Image

    from tt_moge.synthetic import synthetic_photo

    buf = io.BytesIO()
    Image.fromarray(synthetic_photo(tuple(args.image_size))).save(buf, format="PNG")
    return buf.getvalue()


def bench_encode(args: argparse.Namespace) -> None:
    from tt_moge.npzio import DEFLATE_BACKEND, npz_bytes

    with tempfile.TemporaryDirectory() as tmp, _load(args, _weights(args, tmp)) as model:
        out = model(_image(args))
    arrays = out.npz_arrays()
    w, h = out.size
    rows = {
        "tt_moge npz, stored": lambda: npz_bytes(arrays, compress=False),
        f"tt_moge npz, deflate ({DEFLATE_BACKEND})": lambda: npz_bytes(arrays, compress=True),
        "np.savez (stored)": lambda: _savez(np.savez, arrays),
        "np.savez_compressed (zlib 6)": lambda: _savez(np.savez_compressed, arrays),
    }
    print(f"npz of one {w}x{h} result ({len(arrays)} arrays), median of {args.repeats}:")
    base = None
    for name, fn in rows.items():
        size = len(fn())
        ms = common.median_min_ms(fn, args.repeats)[0]
        base = base or ms
        print(f"  {name:36s} {size / 1e6:8.2f} MB  {ms:8.1f} ms  ({ms / base:.2f}x the stored writer)")


def _savez(writer, arrays: dict) -> bytes:
    buf = io.BytesIO()
    writer(buf, **arrays)
    return buf.getvalue()


def bench_serve(args: argparse.Namespace) -> None:
    import httpx

    data = _image(args)
    with tempfile.TemporaryDirectory() as tmp:
        weights = _weights(args, tmp)
        with _load(args, weights) as model:
            model(data)
            api_ms = common.median_min_ms(lambda: model(data), args.repeats)[0]
        print(f"API   model(<PNG bytes>)                      median {api_ms:8.1f} ms")
        cmd = [
            sys.executable,
            "-m",
            "tt_moge.server",
            "--weights",
            weights,
            "--port",
            "0",
            "--log-level",
            "warning",
            "--no-access-log",
            "--resolution",
            f"{args.resolution[0]}x{args.resolution[1]}",
            "--num-tokens",
            str(args.num_tokens),
            "--warmup",
            "1",
            "--warmup-variants",
            "minimal",
        ]
        cmd += ["--device", args.device] if args.device else []
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        env.pop("MOGE_API_KEY", None)
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        try:
            url = None
            for line in proc.stderr:
                if "serving on " in line:
                    url = line.split("serving on ")[1].split()[0]
                    break
            if url is None:
                raise SystemExit(f"the server did not start (exit code {proc.wait()})")
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            with httpx.Client(base_url=url, timeout=600) as http:
                while http.get("/ready").status_code != 200:
                    time.sleep(0.2)
                for compress in ("true", "false"):

                    def post() -> None:  # the client's whole cost: request, response, reading every array
                        r = http.post(
                            "/predict",
                            content=data,
                            headers={"Content-Type": "image/png"},
                            params={"compress": compress},
                        )
                        r.raise_for_status()
                        with np.load(io.BytesIO(r.content)) as npz:
                            sizes[compress] = len(r.content), {k: npz[k] for k in npz.files}

                    sizes: dict = {}
                    post()
                    ms = common.median_min_ms(post, args.repeats)[0]
                    print(
                        f"HTTP  POST /predict?compress={compress:5s} + np.load median {ms:8.1f} ms  "
                        f"({ms / api_ms:.2f}x the API, +{ms - api_ms:.1f} ms), {sizes[compress][0] / 1e6:.1f} MB"
                    )

                def summary() -> None:
                    http.post(
                        "/predict/summary", content=data, headers={"Content-Type": "image/png"}
                    ).raise_for_status()

                ms = common.median_min_ms(summary, args.repeats)[0]
                print(
                    f"HTTP  POST /predict/summary                   median {ms:8.1f} ms  ({ms / api_ms:.2f}x the API)"
                )
                _concurrent(url, data, args, api_ms)
        finally:
            proc.terminate()
            proc.wait(30)


def _concurrent(url: str, data: bytes, args: argparse.Namespace, api_ms: float) -> None:
    import httpx

    counts = {"ok": 0, "busy": 0}
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            for _ in range(args.repeats):
                r = http.post("/predict", content=data, headers={"Content-Type": "image/png"})
                with lock:
                    counts["ok" if r.status_code == 200 else "busy"] += 1
                if r.status_code == 503:
                    time.sleep(0.05)

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t
    print(
        f"HTTP  {args.clients} clients x {args.repeats} requests: "
        f"{counts['ok']} ok, {counts['busy']} 503 in {seconds:.1f} s "
        f"= {counts['ok'] / seconds:.2f} images/s (one-at-a-time API: {1e3 / api_ms:.2f} images/s)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m perf.server.server_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("what", choices=["encode", "serve", "all"])
    parser.add_argument("--weights", help="checkpoint (default: a random tiny one in a temporary directory)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument(
        "--resolution",
        type=argtypes.wxh,
        default=(448, 252),
        metavar="WxH",
        help="canvas (default: 448x252; use 1920x1080 with real weights)",
    )
    parser.add_argument("--num-tokens", type=int, default=1200)
    parser.add_argument("--image", help="a PNG/JPEG file (default: a synthetic photo of --image-size)")
    parser.add_argument("--image-size", type=argtypes.wxh, default=(1920, 1080), metavar="WxH")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients in the serve run (default: 4)")
    args = parser.parse_args(argv)
    print(f"rerun: {common.rerun_command(argv)}")
    if args.what in ("encode", "all"):
        bench_encode(args)
    if args.what in ("serve", "all"):
        bench_serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
