"""`tt-moge serve` (and `python -m tt_moge.server`, the same parser): the HTTP server's command line.

    add_arguments(parser)   the flags (the shared model flags, then the server's limits)
    run(args) -> int        resolve the model options, bind, start uvicorn, load the model in the background,
                            serve until Ctrl-C / SIGTERM
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from ..server.settings import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, ServerSettings
from .common import EXIT_START, Formatter, add_model_arguments, model_kwargs, say

__all__ = ["add_parser", "build_parser", "add_arguments", "run", "EXIT_CODES"]

_DEFAULTS = ServerSettings()
_MB = 1024 * 1024
DESCRIPTION = "Serve MoGe-2 over HTTP (POST /predict); one model, loaded at start-up."

EXIT_CODES = """exit codes:
  0  stopped cleanly (Ctrl-C / SIGTERM)
  1  the model failed to load (the reason is in the log)
  2  bad flags (checked before the port is bound)"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser("serve", formatter_class=Formatter, help="the HTTP server (POST /predict)",
                                 description=DESCRIPTION, epilog=EXIT_CODES)
    add_arguments(parser)
    return parser


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of `python -m tt_moge.server` (the flags of `tt-moge serve`)."""
    parser = argparse.ArgumentParser(prog=prog, formatter_class=Formatter, description=DESCRIPTION, epilog=EXIT_CODES)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, warmup=2, warmup_variants="default")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST}, this machine only)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port; 0 = any free port (default: {DEFAULT_PORT})")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /predict, /predict/summary and /info (default: ${API_KEY_ENV}, "
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
    server.add_argument("--no-ui", action="store_true",
                        help="do not serve the web page (GET / and /ui: drop a photo, see depth, normals and the 3D view)")


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted. Returns 0 after a clean stop, 1 if the model failed to load, 2 for bad flags,
    3 when the server's libraries are not installed."""
    try:
        import uvicorn

        from ..server.app import create_app
    except ImportError as exc:
        say(f"serve: the server's libraries are not installed ({exc}): pip install -e 'code/[server]'")
        return EXIT_START
    from PIL import Image

    from ..model import MoGeModel
    from ..options import LoadOptions

    logging.basicConfig(level=args.log_level.upper(), format="[tt_moge] %(levelname)s %(message)s", stream=sys.stderr)
    try:
        settings = ServerSettings(
            max_body_bytes=int(args.max_body_mb * _MB), max_pixels=args.max_pixels, queue_size=args.queue_size,
            host_threads=args.host_threads, max_connections=args.max_connections, read_timeout_s=args.read_timeout,
            api_key=args.api_key or ServerSettings.api_key_from_env())
        options = LoadOptions.resolve(**model_kwargs(args))  # bad model options fail now (exit 2), not after binding
        sock = _bind(args.host, args.port)
    except (ValueError, TypeError, OSError) as exc:
        print(f"tt-moge serve: error: {exc}", file=sys.stderr)
        return 2
    # Our own header check (--max-pixels) is the decompression-bomb limit; Pillow's must not be lower.
    if Image.MAX_IMAGE_PIXELS is not None:
        Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS, settings.max_pixels)

    def load() -> MoGeModel:
        return MoGeModel.load(options)

    server: Any = None
    app = create_app(load, settings, on_load_error=lambda exc: setattr(server, "should_exit", True))
    if not args.no_ui:
        from ..server.ui import mount_ui

        mount_ui(app)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log, lifespan="on",
                            limit_concurrency=settings.max_connections, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    page = "" if args.no_ui else f"; the web page: http://{url_host}:{port}/"
    print(f"[tt_moge] serving on http://{url_host}:{port} (loading {options.weights}; GET /ready answers 200 when it can serve{page})",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 1 if app.state.serving.load_error else 0
