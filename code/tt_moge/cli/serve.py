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
from typing import Any, Callable, Iterable, Iterator, Union

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
    server.add_argument(
        "--devices",
        metavar="LIST",
        help="serve one model replica per device: tt:0,tt:1 / cuda:0,cuda:1 / cpu,cpu (CPU replicas share the "
        "threads) / all (every chip or GPU this process sees); a request goes to the least busy replica, and one "
        "whose device fails is taken out of service. Instead of --device (default: one model on --device)",
    )
    ray = parser.add_argument_group("Ray Serve (past one machine; docs/server.md, Scaling out)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve: replicas of the model (each on its own device, asked of Ray as a resource) "
        "behind one HTTP entry on --host/--port; a local Ray is started unless --address is given; no web page",
    )
    ray.add_argument("--address", help="with --ray: join the Ray cluster at this address (ray://HEAD:10001)")
    ray.add_argument(
        "--replicas",
        type=_replicas,
        default=1,
        metavar="N|auto",
        help="with --ray: model replicas, or auto (1 to --max-replicas, scaled on ongoing requests) (default: 1)",
    )
    ray.add_argument(
        "--max-replicas",
        type=argtypes.positive_int,
        default=None,
        metavar="M",
        help="with --replicas auto (default: 2)",
    )
    ray.add_argument(
        "--threads-per-replica",
        type=argtypes.positive_int,
        default=None,
        metavar="T",
        help="with --ray on the CPU: each replica's torch threads and Ray CPUs (default: the cores / replicas)",
    )
    add_options(server, ServerSettings)  # one flag per setting, as its definition says
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    server.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the web page (GET / and /ui: drop a photo, see depth, normals and the 3D view)",
    )


def _replicas(text: str) -> Union[int, str]:
    if text.strip().lower() == "auto":
        return "auto"
    return argtypes.positive_int(text)


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
    from ..pool import ModelPool, parse_devices
    from ..weights import describe_source

    logging.basicConfig(level=args.log_level.upper(), format="[tt_moge] %(levelname)s %(message)s", stream=sys.stderr)
    try:
        settings = ServerSettings.from_arguments(**option_values(args, ServerSettings))
        kwargs = model_kwargs(args)
        devices = None
        if args.devices is not None:
            if kwargs.get("device") is not None:
                raise ValueError("give --devices or --device, not both")
            devices = parse_devices(args.devices)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "device_id")}
            kwargs["device"] = devices[0]  # checked now (exit 2) as each replica's device will be
            for name in devices[1:]:
                LoadOptions.resolve(**{**kwargs, "device": name})
        if args.ray:
            if devices is not None:
                raise ValueError("--devices is for one machine; with --ray, give --replicas (and --device)")
            return _run_ray(args, settings, kwargs)
        if args.address is not None or args.replicas != 1 or args.max_replicas or args.threads_per_replica:
            raise ValueError("--address, --replicas, --max-replicas and --threads-per-replica go with --ray")
        options = LoadOptions.resolve(**kwargs)  # bad model options fail now (exit 2), not after binding
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

    def load() -> Union[MoGeModel, ModelPool]:
        if devices is None:
            return MoGeModel.load(options)
        return ModelPool.from_pretrained(devices=devices, **{k: v for k, v in kwargs.items() if k != "device"})

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


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _run_ray(args: argparse.Namespace, settings: ServerSettings, kwargs: dict) -> int:
    """`tt-moge serve --ray`: the model's replicas and the HTTP entry on Ray Serve (`server.ray_serve`), on a
    local Ray started here (and ended with this process) or the cluster at --address, until SIGTERM / SIGINT.
    Returns 0 after a stop, 1 when the replicas could not start, 3 without Ray Serve."""
    from ..batch.session import check_ray_address, init_local_ray, keeping_signal_handlers, replica_runtime_env

    try:
        import ray
        from ray import serve
    except ImportError as exc:
        say(f"serve --ray: Ray Serve is not installed ({exc}): pip install -e 'code/[ray]'")
        return EXIT_START
    from ..server.ray_serve import ray_app

    if args.address is not None:
        check_ray_address(args.address)
    local = args.address is None
    count = (args.max_replicas or 2) if args.replicas == "auto" else args.replicas
    cores = os.cpu_count() or 1
    threads = args.threads_per_replica or max(1, cores // count)
    port = args.port or _free_port(args.host)
    load = {k: v for k, v in kwargs.items() if k != "device_id"}
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    quiet = args.log_level not in ("info", "debug")
    watcher = None
    try:
        with keeping_signal_handlers():  # ray.init installs its own SIGTERM handler (a stack dump, then abort)
            if local:
                watcher = init_local_ray(ray, max(cores, count * threads), quiet=quiet)
            else:
                ray.init(address=args.address, include_dashboard=False, logging_level="WARNING")
        where = "a local Ray" if local else f"the Ray cluster at {args.address}"
        print(
            f"[tt_moge] serving on http://{args.host}:{port} (Ray Serve on {where}: {args.replicas} replica(s) of "
            f"{load.get('device') or 'cpu'}; GET /ready answers 200 when a replica serves)",
            file=sys.stderr,
            flush=True,
        )
        serve.start(http_options={"host": args.host, "port": port})
        app = ray_app(
            replicas=args.replicas,
            max_replicas=args.max_replicas,
            settings=settings,
            threads=threads,
            runtime_env=replica_runtime_env(local),
            **load,
        )
        try:
            serve.run(app, name="moge", route_prefix="/", blocking=False)
        except Exception as exc:  # a replica that cannot load (bad weights, no such device)
            print(f"tt-moge serve: the replicas did not start: {exc}", file=sys.stderr, flush=True)
            return 1
        stop.wait()
        print("[tt_moge] stopping: Ray Serve shuts down", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if watcher is not None:
            watcher.release()
