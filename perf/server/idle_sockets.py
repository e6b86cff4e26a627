"""Idle sockets against `tt-moge serve` under a low file-descriptor limit (issue 28, docs/server-limits.md).

    python -m perf.server.idle_sockets                          # ulimit -n 1024, 1100 idle sockets
    python -m perf.server.idle_sockets --fd-limit 4096 --sockets 5000 --max-connections 100000

Starts `python -m tt_moge.server` (a random-weight tiny checkpoint) with RLIMIT_NOFILE set to --fd-limit, opens
--sockets connections that send nothing, then for --seconds polls GET /health on a fresh connection every
0.3 s. Prints the server's open descriptors at rest and at their peak, each /health status and latency, and how
much the server logged. The command that reproduces a run is printed first.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from perf import common


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m perf.server.idle_sockets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fd-limit", type=int, default=1024, help="the server's ulimit -n (default: 1024)")
    parser.add_argument("--sockets", type=int, default=1100, help="idle connections to open (default: 1100)")
    parser.add_argument("--max-connections", type=int, default=2000, help="asked of the server (default: 2000)")
    parser.add_argument("--idle-timeout", type=float, default=5.0, help="the server's --idle-timeout (default: 5)")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long /health is polled (default: 8)")
    args = parser.parse_args(argv)
    print(f"rerun: {common.rerun_command(argv)}")
    print(common.cpu_line())
    import httpx

    from tt_moge.testing import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        weights = make_checkpoint(tmp, "tiny-vits-normal")
        cmd = [sys.executable, "-m", "tt_moge.server", "--weights", str(weights), "--device", "cpu"]
        cmd += ["--resolution", "448x252", "--num-tokens", "1200", "--warmup", "1", "--warmup-variants", "none"]
        cmd += ["--port", "0", "--no-access-log", "--max-connections", str(args.max_connections)]
        cmd += ["--idle-timeout", str(args.idle_timeout)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "code")}
        env.pop("MOGE_API_KEY", None)
        limit = args.fd_limit
        proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
        )
        lines: list = []
        socks: list = []
        try:
            url = None
            for line in proc.stderr:
                lines.append(line)
                if "serving on " in line:
                    url = line.split("serving on ")[1].split()[0]
                    break
            if url is None:
                raise SystemExit(f"the server did not start (exit code {proc.wait()}):\n{''.join(lines)}")
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
            while httpx.get(url + "/ready", timeout=30).status_code != 200:
                time.sleep(0.2)
            fd_dir = f"/proc/{proc.pid}/fd"
            at_rest, logged_before = len(os.listdir(fd_dir)), sum(map(len, lines))
            host, port = url.split("//")[1].rsplit(":", 1)
            socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(args.sockets)]
            peak, health = at_rest, []
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                peak = max(peak, len(os.listdir(fd_dir)))
                t = time.perf_counter()
                try:
                    status = httpx.get(url + "/health", timeout=5).status_code
                except httpx.TransportError as exc:
                    status = type(exc).__name__
                health.append(f"{status} {1e3 * (time.perf_counter() - t):.0f} ms")
                time.sleep(0.3)
            limits = httpx.get(url + "/info", timeout=30).json()["server"]["limits"]
        finally:
            for s in socks:
                s.close()
            proc.terminate()
            proc.wait(30)
    print(
        f"ulimit -n {limit}; asked --max-connections {args.max_connections}, running at {limits['max_connections']} "
        f"(fd_limit {limits['fd_limit']}); {args.sockets} idle sockets"
    )
    print(f"server descriptors: {at_rest} at rest, {peak} at the peak")
    print(f"GET /health every 0.3 s for {args.seconds:g} s: {', '.join(health)}")
    print(f"logged while the sockets were open: {sum(map(len, lines)) - logged_before} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
