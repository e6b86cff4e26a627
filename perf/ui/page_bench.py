"""The web page against POST /predict on the same server and image: how much later the 3D view is on screen than
POST /predict's answer, and how many bytes the browser fetches for the view.

    python -m perf.ui.page_bench                          # MoGe-2 ViT-L size (random weights), media/source.png
    python -m perf.ui.page_bench --weights tiny           # a tiny random model: the page's own overhead, quickly

A `tt-moge serve` process (the page on) and headless Chromium (Debian chromium + chromium-driver, selenium; WebGL
in software, SwiftShader) on this machine. Each repeat, alternating: POST /predict with the image (client wall time,
the npz read), then the page: the file chosen in the page -> the 3D view drawn (window.ttMoge marks of app.js:
upload, model, maps and view made on the server, view.glb fetched, parsed, uploaded to WebGL and drawn twice).
Medians over --repeats. Without --weights the full-size random ViT-L checkpoint of perf/common.py is used (written
once, 1.3 GB) on the default canvas (1920x1080, 1800 tokens): the forward costs what MoGe-2's does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from perf import common
from tt_moge.cli import argtypes


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def _start_server(weights: str, args: argparse.Namespace) -> tuple:
    cmd = [
        sys.executable,
        "-m",
        "tt_moge.server",
        "--weights",
        weights,
        "--device",
        "cpu",
        "--port",
        "0",
        "--log-level",
        "warning",
        "--no-access-log",
        "--warmup",
        "1",
        "--warmup-variants",
        "minimal",
    ]
    if args.resolution:
        cmd += ["--resolution", f"{args.resolution[0]}x{args.resolution[1]}"]
    if args.num_tokens:
        cmd += ["--num-tokens", str(args.num_tokens)]
    env = {**os.environ, "PYTHONPATH": str(common.ROOT / "code")}
    env.pop("MOGE_API_KEY", None)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:
        if "serving on " in line:
            url = line.split("serving on ")[1].split()[0]
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, url
    raise SystemExit(f"the server did not start (exit code {proc.wait()})")


def _page_run(browser, image: Path) -> dict:
    """Choose the image in the page; wait for the 3D view -> the marks of that run (ms) and the bytes fetched."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    runs = browser.execute_script("performance.clearResourceTimings(); return window.ttMoge.runs")
    browser.find_element(By.ID, "file").send_keys(str(image))
    WebDriverWait(browser, 1800, poll_frequency=0.05).until(
        lambda b: b.execute_script("return window.ttMoge.runs") > runs
    )
    marks = browser.execute_script("return window.ttMoge.last")
    if "view" not in marks:
        raise SystemExit(f"the page did not show a 3D view: {browser.find_element(By.ID, 'error').text}")
    WebDriverWait(browser, 60).until(
        lambda b: b.execute_script(
            "return ['depth', 'normal', 'mask'].every(id => document.getElementById(id).complete)"
        )
    )
    fetched = browser.execute_script(
        "return performance.getEntriesByType('resource').filter(e => e.name.includes('/ui/results/'))"
        ".map(e => [e.name.split('/').pop(), e.encodedBodySize])"
    )
    marks["fetched"] = dict(fetched)
    return marks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m perf.ui.page_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--weights",
        help="a checkpoint, or 'tiny' for a random tiny one (default: the random full-size ViT-L of perf/common.py)",
    )
    parser.add_argument(
        "--image", default=str(common.DEMO_IMAGE), help="PNG/JPEG (default: media/source.png, 1920x1080)"
    )
    parser.add_argument(
        "--resolution", type=argtypes.wxh, metavar="WxH", help="canvas (default: the model's; 448x252 with tiny)"
    )
    parser.add_argument("--num-tokens", type=int, help="(default: the model's; 1200 with tiny)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    print(f"rerun: {common.rerun_command(argv)}")
    print(f"CPU: {_cpu()}")
    import httpx

    from tt_moge.testing.browser import start_chromium

    image = Path(args.image).resolve()
    data = image.read_bytes()
    kind = "image/png" if data.startswith(b"\x89PNG") else "image/jpeg"
    with tempfile.TemporaryDirectory() as tmp:
        if args.weights == "tiny":
            from tt_moge.testing import make_checkpoint

            weights = str(make_checkpoint(tmp, "tiny-vits-normal", well_posed=True))
            args.resolution, args.num_tokens = args.resolution or (448, 252), args.num_tokens or 1200
        else:
            weights = str(common.full_size_checkpoint(args.weights))
        proc, url = _start_server(weights, args)
        browser = None
        try:
            with httpx.Client(base_url=url, timeout=1800) as http:
                while http.get("/ready").status_code != 200:
                    if proc.poll() is not None:
                        raise SystemExit(f"the server exited with code {proc.returncode}")
                    time.sleep(0.5)
                browser = start_chromium(Path(tmp), size=(1400, 1000))
                browser.get(url + "/")

                def predict() -> tuple:
                    t = time.perf_counter()
                    r = http.post("/predict", content=data, headers={"Content-Type": kind})
                    r.raise_for_status()
                    return (time.perf_counter() - t) * 1e3, json.loads(r.headers["x-timing-ms"])

                predict()  # first calls: page caches, allocator
                _page_run(browser, image)
                rows = []
                for i in range(args.repeats):
                    api_ms, api_timing = predict()
                    marks = _page_run(browser, image)
                    page_timing = marks["server"]["timing_ms"]
                    # The forward is the same work in both and the noisiest part on a shared machine: the
                    # difference without it is what the page itself adds.
                    rows.append(
                        {
                            "predict_ms": api_ms,
                            "page_view_ms": marks["view"] - marks["start"],
                            "predict_wo_forward_ms": api_ms - api_timing["device"] - api_timing["device_wait"],
                            "page_view_wo_forward_ms": marks["view"]
                            - marks["start"]
                            - page_timing["device"]
                            - page_timing["device_wait"],
                            "predict_timing_ms": api_timing,
                            "page_timing_ms": page_timing,
                            "page_response_ms": marks["response"] - marks["start"],
                            "browser_view_ms": marks["view"] - marks["response"],
                            "server_page_ms": marks["server"]["page_ms"],
                            "view_bytes": marks["viewBytes"],
                            "fetched": marks["fetched"],
                            "view": marks["server"]["view"],
                        }
                    )
                    r = rows[-1]
                    print(
                        f"  run {i + 1}: POST /predict {api_ms:8.0f} ms | "
                        f"page: 3D view after {r['page_view_ms']:8.0f} ms "
                        f"(answer {r['page_response_ms']:.0f} ms, then {r['browser_view_ms']:.0f} ms in the browser) "
                        f"-> {r['page_view_ms'] - api_ms:+.0f} ms; without the forward (device) "
                        f"{r['predict_wo_forward_ms']:.0f} vs {r['page_view_wo_forward_ms']:.0f} ms "
                        f"-> {r['page_view_wo_forward_ms'] - r['predict_wo_forward_ms']:+.0f} ms"
                    )
        finally:
            if browser is not None:
                browser.quit()
            proc.terminate()
            proc.wait(60)
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in (
            "predict_ms",
            "page_view_ms",
            "page_response_ms",
            "browser_view_ms",
            "predict_wo_forward_ms",
            "page_view_wo_forward_ms",
        )
    }
    med["added_ms"] = statistics.median(r["page_view_ms"] - r["predict_ms"] for r in rows)
    med["added_wo_forward_ms"] = statistics.median(
        r["page_view_wo_forward_ms"] - r["predict_wo_forward_ms"] for r in rows
    )
    server_page = {k: statistics.median(r["server_page_ms"][k] for r in rows) for k in rows[0]["server_page_ms"]}
    fetched = rows[-1]["fetched"]
    view = rows[-1]["view"]
    print(f"image {image.name}, median of {args.repeats}:")
    print(f"  POST /predict (npz, loopback)          {med['predict_ms']:8.0f} ms")
    print(
        f"  page: file chosen -> 3D view drawn     {med['page_view_ms']:8.0f} ms  (median of the pairs' differences "
        f"{med['added_ms']:+.0f} ms)"
    )
    print(
        f"  the same without the forward (device): POST /predict {med['predict_wo_forward_ms']:.0f} ms, page "
        f"{med['page_view_wo_forward_ms']:.0f} ms (median of the differences {med['added_wo_forward_ms']:+.0f} ms)"
    )
    print(
        f"    server answer (model + page files)   {med['page_response_ms']:8.0f} ms; server-side page files: "
        + ", ".join(f"{k} {v:.0f} ms" for k, v in server_page.items())
    )
    print(f"    browser: fetch, parse, draw the view {med['browser_view_ms']:8.0f} ms")
    print(
        f"  view.glb: {view['bytes'] / 1e6:.2f} MB ({view['vertices']} vertices, {view['faces']} triangles, a vertex "
        f"per {view['step']}x{view['step']} pixels, texture {view['texture'][0]}x{view['texture'][1]} JPEG)"
    )
    print(
        "  fetched for the result: "
        + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(fetched.items()))
        + f" = {sum(fetched.values()) / 1e6:.2f} MB"
    )
    common.finish_report(
        {"cpu": _cpu(), "image": str(image), "runs": rows, "median": med, "server_page_ms": server_page}, args.json
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
