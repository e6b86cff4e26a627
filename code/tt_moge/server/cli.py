"""Command line of the server: `tt-moge serve ...` and `python -m tt_moge.server ...` share these two functions.

    add_arguments(parser)   the flags (model options of from_pretrained, then server limits)
    run(args) -> int        bind, start uvicorn, load the model in the background, serve until Ctrl-C / SIGTERM
"""
from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import warnings
from typing import Any

from .. import argtypes
from ..constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS, PRECISIONS
from ..weights import DEFAULT_REPO, DEFAULT_REVISION
from .settings import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, ServerSettings

__all__ = ["add_arguments", "run"]

_DEFAULTS = ServerSettings()
_MB = 1024 * 1024


def _warmup_variants(text: str) -> Any:
    """A preset name, a comma-separated list of presets, or JSON (a variant dict or a list)."""
    if text.lstrip().startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    names = [part.strip() for part in text.split(",") if part.strip()]
    return names[0] if len(names) == 1 else names


EXIT_CODES = """exit codes:
  0  stopped cleanly (Ctrl-C / SIGTERM)
  1  the model failed to load (the reason is in the log)
  2  bad flags (checked before the port is bound)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (as MoGeModel.from_pretrained)")
    model.add_argument("--weights", default=DEFAULT_REPO, metavar="PATH_OR_REPO",
                       help="a Hugging Face repo id, a directory holding model.pt, or a model.pt path "
                            f"($MOGE_WEIGHTS_DIR overrides a repo id) (default: {DEFAULT_REPO})")
    model.add_argument("--revision", default=DEFAULT_REVISION, help="weights revision on the Hub (default: the pinned one)")
    model.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if present, else the CPU)")
    model.add_argument("--device-id", type=int, default=0, help="device index when --device is not given (default: 0)")
    model.add_argument("--resolution", type=argtypes.canvas, default=DEFAULT_CANVAS, metavar="WxH",
                       help=f"the canvas every image is fitted onto (default: {DEFAULT_CANVAS[0]}x{DEFAULT_CANVAS[1]})")
    model.add_argument("--num-tokens", type=argtypes.token_budget, default=DEFAULT_NUM_TOKENS, help=f"ViT token budget (default: {DEFAULT_NUM_TOKENS})")
    model.add_argument("--precision", default="auto", choices=PRECISIONS,
                       help="arithmetic of the forward (default auto: bf16 on CPUs with bfloat16 instructions, else fp32; fp16 on CUDA)")
    model.add_argument("--warmup", type=int, default=2, help="device forwards at load (default: 2)")
    model.add_argument("--warmup-variants", type=_warmup_variants, default="default", metavar="SPEC",
                       help="host warm-up: a preset (default, all, minimal, none), presets separated by commas, or JSON "
                            "such as '[\"default\", {\"input\": \"jpeg\", \"size\": [4032, 3024]}]' (default: default)")
    model.add_argument("--dispatch", default="eth", choices=["eth", "worker"], help="Tenstorrent dispatch (ignored by CPU/CUDA)")
    model.add_argument("--num-command-queues", type=int, default=None, choices=[1, 2], help="Tenstorrent command queues")
    model.add_argument("--verbose", action="store_true", help="progress lines while loading")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST}, this machine only)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port; 0 = any free port (default: {DEFAULT_PORT})")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /predict and /info (default: ${API_KEY_ENV}, "
                             "else no key; prefer the variable: a flag shows in the process list)")
    server.add_argument("--max-body-mb", type=float, default=_DEFAULTS.max_body_bytes / _MB,
                        help=f"largest request body in MiB (default: {_DEFAULTS.max_body_bytes / _MB:g})")
    server.add_argument("--max-pixels", type=int, default=_DEFAULTS.max_pixels,
                        help=f"largest image, width*height, checked before decoding (default: {_DEFAULTS.max_pixels})")
    server.add_argument("--queue-size", type=int, default=_DEFAULTS.queue_size,
                        help=f"requests admitted at once; one more gets 503 + Retry-After (default: {_DEFAULTS.queue_size})")
    server.add_argument("--host-threads", type=int, default=_DEFAULTS.host_threads,
                        help=f"threads that decode / post-process / encode admitted requests (default: {_DEFAULTS.host_threads})")
    server.add_argument("--max-connections", type=int, default=_DEFAULTS.max_connections,
                        help=f"open connections before uvicorn answers 503 (default: {_DEFAULTS.max_connections})")
    server.add_argument("--read-timeout", type=float, default=_DEFAULTS.read_timeout_s,
                        help=f"seconds for a request body to arrive, else 408 (default: {_DEFAULTS.read_timeout_s:g})")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--no-access-log", action="store_true", help="do not log one line per request")


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted. Returns 0 after a clean stop, 1 if the model failed to load, 2 for bad flags."""
    import uvicorn
    from PIL import Image

    from ..model import MoGeModel, check_load_options
    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="[tt_moge] %(levelname)s %(message)s", stream=sys.stderr)
    try:
        settings = ServerSettings(
            max_body_bytes=int(args.max_body_mb * _MB), max_pixels=args.max_pixels, queue_size=args.queue_size,
            host_threads=args.host_threads, max_connections=args.max_connections, read_timeout_s=args.read_timeout,
            api_key=args.api_key or ServerSettings.api_key_from_env())
        with warnings.catch_warnings():  # the load repeats the check, and its device warning
            warnings.simplefilter("ignore")
            resolution, *_ = check_load_options(  # bad model options fail now (exit 2), not after binding
                resolution=args.resolution, num_tokens=args.num_tokens, dispatch=args.dispatch,
                num_command_queues=args.num_command_queues, warmup=args.warmup, warmup_variants=args.warmup_variants,
                device=args.device, device_id=args.device_id, precision=args.precision)
        sock = _bind(args.host, args.port)
    except (ValueError, TypeError, OSError) as exc:
        print(f"tt-moge serve: error: {exc}", file=sys.stderr)
        return 2
    # Our own header check (--max-pixels) is the decompression-bomb limit; Pillow's must not be lower.
    if Image.MAX_IMAGE_PIXELS is not None:
        Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS, settings.max_pixels)

    def load() -> MoGeModel:
        return MoGeModel.from_pretrained(
            args.weights, device=args.device, device_id=args.device_id, revision=args.revision, resolution=resolution,
            num_tokens=args.num_tokens, precision=args.precision, dispatch=args.dispatch, num_command_queues=args.num_command_queues,
            warmup=args.warmup, warmup_variants=args.warmup_variants, verbose=args.verbose)

    server: Any = None
    app = create_app(load, settings, on_load_error=lambda exc: setattr(server, "should_exit", True))
    config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log, lifespan="on",
                            limit_concurrency=settings.max_connections, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"[tt_moge] serving on http://{url_host}:{port} (loading {args.weights}; GET /ready answers 200 when it can serve)",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 1 if app.state.serving.load_error else 0
