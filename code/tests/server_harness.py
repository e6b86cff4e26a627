"""A real `python -m tt_moge.server` process on 127.0.0.1 for the server tests, plus test images.

One server process per pytest process (`shared_server`), started on first use and stopped at exit, so
test_server.py and test_server_fuzz.py share its start-up cost. It runs a "micro" checkpoint: the
tiny-vits-normal structure with one ViT block and a narrow decoder (about 4x faster per forward on 2 cores than
tiny-vits-normal; the server does not depend on the network's width). Torch runs 1 thread in the server and
in the reference model of the tests: on the CPU the float results depend on the thread count.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

CODE_DIR = Path(__file__).resolve().parents[1]  # code/, so the subprocess imports this tree's tt_moge
CANVAS = (448, 252)
TOKENS = 1200
API_KEY = "test-key-7c1d"  # given to the server through $MOGE_API_KEY
# Limits small enough to test cheaply: 2 requests admitted at once, 2 MiB bodies, 2 MP images, 3 s per body.
SERVER_FLAGS = [
    "--queue-size",
    "2",
    "--host-threads",
    "2",
    "--max-body-mb",
    "2",
    "--max-pixels",
    "2000000",
    "--read-timeout",
    "3",
]
TORCH_THREADS = 1


def micro_config() -> dict:
    """tiny-vits-normal with 1 ViT block feeding the neck, 16-channel features, no residual blocks."""
    from tt_moge.testing import model_config

    cfg = model_config("tiny-vits-normal")
    features, dims = 16, [16, 8, 8, 8, 8]
    cfg["encoder"].update(intermediate_layers=[0], dim_out=features)
    cfg["neck"].update(dim_in=[features + 2, 2, 2, 2, 2], dim_res_blocks=dims, num_res_blocks=[0] * 5)
    for head in ("points_head", "mask_head", "normal_head"):
        cfg[head].update(dim_in=dims, dim_res_blocks=dims, num_res_blocks=[0] * 5)
    cfg["scale_head"]["dims"] = [384, 8, 1]
    return cfg


def encode_image(rgb: np.ndarray, fmt: str, **save_kwargs) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A photo-like (H, W, 3) uint8 image, different for each seed."""
    from tt_moge.synthetic import synthetic_photo

    img = synthetic_photo((width, height), seed=seed)
    return np.roll(img, shift=(seed * 7) % width, axis=1)


class ServerProcess:
    """`python -m tt_moge.server` in a subprocess on 127.0.0.1 with port 0 (the OS picks a free port)."""

    def __init__(self, weights: Path, extra_args: list, env: Optional[dict] = None, preexec_fn=None):
        self.stderr_lines: list = []
        self.ready_statuses: list = []  # /ready answers seen while waiting: (status, json body, Retry-After)
        cmd = [
            sys.executable,
            "-m",
            "tt_moge.server",
            "--weights",
            str(weights),
            "--device",
            "cpu",
            "--resolution",
            f"{CANVAS[0]}x{CANVAS[1]}",
            "--num-tokens",
            str(TOKENS),
            "--warmup",
            "2",
            "--warmup-variants",
            "none",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--log-level",
            "warning",
            "--no-access-log",
            *extra_args,
        ]
        full_env = {
            **os.environ,
            "PYTHONPATH": str(CODE_DIR),
            "OMP_NUM_THREADS": str(TORCH_THREADS),
            "MKL_NUM_THREADS": str(TORCH_THREADS),
            "HF_HUB_OFFLINE": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            cmd,
            cwd=CODE_DIR,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,  # e.g. a lower file-descriptor limit (test_server_edges.py)
        )
        self._port = threading.Event()
        self.port: Optional[int] = None
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip())
            match = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if match and self.port is None:
                self.port = int(match.group(1))
                self._port.set()
        self._port.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return "\n".join(self.stderr_lines[-40:])

    @classmethod
    def started(cls, weights: Path, extra_args: list, **kwargs: Any) -> "ServerProcess":
        """A server process that is ready (`wait_ready`); stopped again when it does not get there."""
        server = cls(weights, extra_args, **kwargs)
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        return server

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        import httpx

        if not self._port.wait(60) or self.port is None:
            raise RuntimeError(f"the server did not start (exit code {self.proc.poll()}):\n{self.log()}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/ready", timeout=10)
            except httpx.TransportError:  # bound but not listening yet
                time.sleep(0.02)
                continue
            try:
                record = r.json()
            except ValueError:  # not ours: Ray Serve's proxy answers plain text until the app is deployed
                record = r.text
            self.ready_statuses.append((r.status_code, record, r.headers.get("retry-after")))
            if r.status_code == 200:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the server was not ready within {timeout_s} s:\n{self.log()}")

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.terminate()  # uvicorn shuts down gracefully on SIGTERM
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def shared_server(weights_dir: Path) -> ServerProcess:
    """The one test server of this pytest process (micro checkpoint written into weights_dir on first use)."""
    with _SHARED_LOCK:
        if "server" not in _SHARED:
            from tt_moge.testing import make_checkpoint

            weights = make_checkpoint(weights_dir, micro_config())
            server = ServerProcess.started(weights, SERVER_FLAGS, env={"MOGE_API_KEY": API_KEY})
            atexit.register(server.stop)
            _SHARED["server"] = server
            _SHARED["weights"] = weights
        return _SHARED["server"]


def shared_weights() -> Path:
    return _SHARED["weights"]


def auth_headers(**extra: str) -> dict:
    return {"Authorization": f"Bearer {API_KEY}", **extra}


def timing_record(response) -> dict:
    return json.loads(response.headers["x-timing-ms"])
