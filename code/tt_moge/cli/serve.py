"""`tt-moge serve` (and `python -m tt_moge.server`, the same parser): the HTTP server's command line.

    add_arguments(parser)   the flags (the shared model flags, then the server's limits)
    run(args) -> int        resolve the model options, bind, start uvicorn, load the model in the background,
                            serve until Ctrl-C / SIGTERM

Stopping: the first SIGTERM or SIGINT stops accepting connections and admitting requests (503
shutting_down), lets what is admitted finish and slow clients read for up to --shutdown-grace seconds, then
cuts what is left and exits 0. A second signal exits at once, with 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

from ..server.settings import ACCEPT_BACKLOG, DEFAULT_HOST, DEFAULT_PORT, ServerSettings, fd_limit
from . import argtypes
from .commands import summary as command_summary
from .common import EXIT_START, Formatter, add_model_arguments, add_options, model_kwargs, option_values, say

__all__ = ["add_parser", "build_parser", "add_arguments", "run", "EXIT_CODES"]

DESCRIPTION = "Serve MoGe-2 over HTTP (POST /predict); one model, loaded at start-up."

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODES = """stopping:
  The first SIGTERM or Ctrl-C (SIGINT) stops accepting connections and admitting requests (503
  shutting_down); admitted requests finish and clients get --shutdown-grace seconds to read their answers;
  then what is left is cut and the server exits 0. A second signal exits at once.

exit codes:
  0    stopped by SIGTERM / SIGINT (within the grace period, or cut at its end)
  1    the model failed to load (the reason is in the log)
  2    bad flags (checked before the port is bound)
  130  a second SIGINT during the grace period: exited at once (143 for a second SIGTERM)"""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "serve",
        formatter_class=Formatter,
        help=command_summary("serve"),
        description=DESCRIPTION,
        epilog=EXIT_CODES,
    )
    add_arguments(parser)
    return parser


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of `python -m tt_moge.server` (the flags of `tt-moge serve`)."""
    parser = argparse.ArgumentParser(prog=prog, formatter_class=Formatter, description=DESCRIPTION, epilog=EXIT_CODES)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model flags (LoadOptions), then the server's: where to listen, one flag per field of `ServerSettings`
    (generated), logging and the web page."""
    add_model_arguments(parser, warmup=2, warmup_variants="default")

    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST}, this machine only)"
    )
    server.add_argument(
        "--port", type=argtypes.port, default=DEFAULT_PORT, help=f"port; 0 = any free port (default: {DEFAULT_PORT})"
    )
    add_options(server, ServerSettings)  # one flag per setting, as its definition says
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    server.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the web page (GET / and /ui: drop a photo, see depth, normals and the 3D view)",
    )


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.set_inheritable(True)
    return sock


class QuietProbesWhileLoading(logging.Filter):
    """The access log without the 503 answers of /ready and /health while the model loads: a client waiting for
    /ready (the README's loop, an orchestrator) polls every few seconds, and each poll logged a line for a minute.
    What the server itself says ("serving on ...", "model ready in ...") tells the same once; a probe's 503 while
    the server stops, and every other line, stay."""

    def __init__(self, serving: Any, probe_paths: Iterable[str]) -> None:
        super().__init__()
        self.serving, self.probe_paths = serving, frozenset(probe_paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5) or self.serving.status() != "loading":
            return True
        _, method, path, _, status = args  # uvicorn's access line: client, method, path, HTTP version, status
        return not (status == 503 and method in ("GET", "HEAD") and str(path).split("?")[0] in self.probe_paths)


def _make_server(uvicorn: Any, config: Any, on_stop: Callable[[int], None]) -> Any:
    """uvicorn.Server with the stopping of `tt-moge serve` (see the module docstring).

    uvicorn's own handling re-raises the signal after a graceful stop, so the process ends "killed by
    SIGTERM" (exit 143) or with KeyboardInterrupt (130), and only a second SIGINT forces it: here the first
    signal starts the graceful stop (bounded by the config's timeout_graceful_shutdown) and the process then
    returns normally; a second one of either kind exits at once.
    """

    class Server(uvicorn.Server):
        stop_signal = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.stop_signal is not None:
                print(f"[tt_moge] {signal.Signals(sig).name} again: exiting now", file=sys.stderr, flush=True)
                os._exit(128 + sig)
            self.stop_signal = sig
            self.should_exit = True
            on_stop(sig)

    return Server(config)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted. Returns 0 after a clean stop, 1 if the model failed to load, 2 for bad flags,
    3 when the server's libraries are not installed."""
    try:
        import uvicorn

        from ..server.app import create_app
        from ..server.protocol import PROBE_PATHS, JsonH11Protocol
    except ImportError as exc:
        say(f'serve: the server\'s libraries are not installed ({exc}): pip install -e "code/[server]"')
        return EXIT_START
    from PIL import Image

    from ..model import MoGeModel
    from ..options import LoadOptions
    from ..weights import describe_source

    logging.basicConfig(level=args.log_level.upper(), format="[tt_moge] %(levelname)s %(message)s", stream=sys.stderr)
    try:
        settings = ServerSettings.from_arguments(**option_values(args, ServerSettings))
        options = LoadOptions.resolve(**model_kwargs(args))  # bad model options fail now (exit 2), not after binding
        sock = _bind(args.host, args.port)
    except (ValueError, TypeError, OSError) as exc:
        print(f"tt-moge serve: error: {exc}", file=sys.stderr)
        return 2
    settings, lowered = settings.within_fd_limit(fd_limit())  # so that accept() never fails with EMFILE
    if lowered:
        logging.getLogger("tt_moge.server").warning("%s", lowered)
    # Our own header check (--max-pixels) is the decompression-bomb limit; Pillow's must not be lower.
    if Image.MAX_IMAGE_PIXELS is not None:
        Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS, settings.max_pixels)

    def load() -> MoGeModel:
        return MoGeModel.load(options)

    server: Any = None
    app = create_app(load, settings, on_load_error=lambda exc: setattr(server, "should_exit", True))
    serving = app.serving

    def on_stop(sig: int) -> None:
        serving.drain()
        print(
            f"[tt_moge] {signal.Signals(sig).name}: stopping; {serving.in_flight} request(s) in progress get up to "
            f"{settings.shutdown_grace_s:g} s (--shutdown-grace); a second signal exits at once",
            file=sys.stderr,
            flush=True,
        )

    if not args.no_ui:
        from ..server.ui import mount_ui

        mount_ui(app)
    config = uvicorn.Config(
        app,
        http=JsonH11Protocol,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        lifespan="on",
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.idle_timeout_s,  # JsonH11Protocol: also before a connection's first request
        backlog=ACCEPT_BACKLOG,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    server = _make_server(uvicorn, config, on_stop)
    logging.getLogger("uvicorn.access").addFilter(QuietProbesWhileLoading(serving, PROBE_PATHS))
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    page = "" if args.no_ui else f"; the web page: http://{url_host}:{port}/"
    print(
        f"[tt_moge] serving on http://{url_host}:{port} (loading {describe_source(options.weights, options.revision)}; "
        f"GET /ready answers 200 when it can serve{page})",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])
    return 1 if serving.load_error else 0
