"""Ray for a batch job: importing it, starting the embedded local Ray or joining a cluster, checking that the
job fits in it, and Ray Data's own output. Nothing here knows the model."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = [
    "RayMissingError",
    "RAY_INSTALL_HINT",
    "READER_CPUS",
    "DEFAULT_OBJECT_STORE_MB",
    "MIN_OBJECT_STORE_MB",
    "import_ray",
    "local_ray_cpus",
    "init_local_ray",
    "check_ray_address",
    "ray_session",
    "check_resources",
    "ray_data_output",
    "FORWARDED_ENV",
    "replica_runtime_env",
    "TT_RESOURCE",
    "chip_request",
    "keeping_signal_handlers",
    "ray_noise_filtered",
    "RAY_NATIVE_LOG_LINE",
]

# A line of Ray's C++ logging ("[2026-12-07 01:49:21,965 E 8740 8740] core_worker.cc:2465: Actor with class name:
# ... has constructor arguments in the object store and max_restarts > 0 ..."), written by the driver's core
# worker straight to file descriptor 2, past Python and `logging_level`
RAY_NATIVE_LOG_LINE = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\] ")

DEFAULT_OBJECT_STORE_MB = 200  # the embedded local Ray's shared-memory object store (the machine may be shared)
MIN_OBJECT_STORE_MB = 80  # Ray refuses a smaller object store
READER_CPUS = 1  # logical CPUs one read task asks for (see local_ray_cpus)
# Passed on to the replicas (they may run on other machines, where the driver's environment is not inherited).
FORWARDED_ENV = ("MOGE_WEIGHTS_DIR", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE")
# Ray's resource for one Tenstorrent chip (its TTNPU accelerator: Ray sets TT_VISIBLE_DEVICES to the chip it gives
# an actor, which then sees that chip as its chip 0)
TT_RESOURCE = "TTNPU"
RAY_INSTALL_HINT = 'from a clone of the repository: pip install -e "code/[ray]" (or: pip install "ray[data]>=2.9")'


class RayMissingError(ImportError):
    """Ray Data is not installed."""


def import_ray() -> Any:
    """The ray module, with Ray Data; RayMissingError (saying how to install it) without them."""
    try:
        import ray
        import ray.data  # noqa: F401  (ray without the data extra lacks it)
    except ImportError as exc:
        raise RayMissingError(f"batch jobs need Ray Data, which is not installed ({exc}): {RAY_INSTALL_HINT}") from None
    return ray


def local_ray_cpus(replicas: int, cpus_per_replica: float) -> int:
    """Logical CPUs of the embedded local Ray: the cores of this machine, but at least enough for every replica
    plus one read task. Replicas hold their CPUs for the whole job; with no CPU left over the read tasks never
    run and the job waits forever (seen here: 2 replicas x 1 CPU on a 2-CPU Ray). The extra logical CPU
    oversubscribes the cores a little: decoding a photo is short next to the model's forward."""
    return max(os.cpu_count() or 1, math.ceil(replicas * cpus_per_replica) + READER_CPUS)


def _log_options(quiet: bool) -> dict:
    return dict(logging_level="WARNING" if quiet else "INFO", log_to_driver=not quiet)


# Ray (>= 2.5x) logs a WARNING that token authentication is on each time it starts a local Ray: what we want (it
# keeps other hosts out), and no news to the user of a job that works
_AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def _without_auth_notice(quiet: bool) -> Iterator[None]:
    """Ray's token-authentication notice left out while a local Ray starts, when quiet (its logger's level
    raised for the block; with -v it shows)."""
    import logging

    logger = logging.getLogger(_AUTH_NOTICE_LOGGER)
    saved = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)


def init_local_ray(
    ray: Any,
    num_cpus: int,
    object_store_mb: int = DEFAULT_OBJECT_STORE_MB,
    quiet: bool = False,
    num_gpus: Optional[int] = None,
) -> Optional[Any]:
    """Start the embedded local Ray: always a new one (address "local", never another user's Ray on this
    machine), no dashboard, `object_store_mb` of shared memory, the node advertised on 127.0.0.1.
    Ray's servers still listen on every interface (Ray has no option against it); Ray's token authentication,
    on by default for a local Ray since 2.5x, is what keeps other hosts out.

    Its processes do not outlive this process for long, however it ends (`ray_reaper`): first, whatever an
    earlier driver that died left is ended; then a watcher starts. Returns the watcher (None where it cannot
    run): call its release() after ray.shutdown(), or let this process's end release it."""
    from ..ray_reaper import Watcher, sweep_dead

    for driver, pids in sweep_dead():
        print(
            f"tt-moge batch: ended {len(pids)} Ray process(es) left by an earlier run whose driver (pid {driver}) died",
            file=sys.stderr,
        )
    with _without_auth_notice(quiet):
        context = ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_mb * 2**20,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            **_log_options(quiet),
        )
    session_dir = (getattr(context, "address_info", None) or {}).get("session_dir", "")
    try:
        return Watcher.start(ray.get_runtime_context().get_node_id(), session_dir)
    except OSError as exc:  # no temp dir to write the record to: run without it
        print(
            f"tt-moge batch: warning: cannot watch the local Ray ({exc}); if this process is killed, its Ray "
            f"processes may outlive it",
            file=sys.stderr,
        )
        return None


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """A ValueError naming `address` when nothing answers at its host:port (Ray itself would retry for minutes).
    "auto", "local" and addresses without a port are left to Ray."""
    import socket

    target = address[len("ray://") :] if address.startswith("ray://") else address
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ValueError(
            f"address={address!r}: nothing answers at {host}:{port} ({exc.strerror or exc}); start the Ray "
            "head there, or fix --address / $RAY_ADDRESS"
        ) from None


@contextlib.contextmanager
def keeping_signal_handlers() -> Iterator[None]:
    """Put SIGTERM's and SIGINT's handlers back as they were after the block (`ray.init`). Ray's init replaces
    SIGTERM's with `sys.exit(15)`, and its core worker's C++ failure handler (a stack dump) takes the signal at
    the C level: a `tt-moge batch` told to stop died with exit 15 or SIGABRT and Ray's dumps, and its own
    handler (which stops the job and writes batch.json) never ran. `signal.signal` sets the C handler as well,
    so restoring it removes both. Outside the main thread (where handlers cannot be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for signum, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be put back from here
                signal.signal(signum, handler)

    try:
        yield
    except SystemExit as exc:  # Ray's handler took a SIGTERM during init: hand it to the handler it replaced
        restore()
        if exc.code == signal.SIGTERM:
            signal.raise_signal(signal.SIGTERM)  # the handler's exception (or the default: the end) comes from here
        raise
    finally:
        restore()


def _pump(source: int, sink: int, drop: "re.Pattern[bytes]") -> None:
    """Copy `source` to `sink` until EOF, without the lines that `drop` matches; a partial line is passed on at
    once (a progress bar's carriage returns) unless it may be the start of such a line ('['). Closes both."""
    pending = b""
    try:
        while True:
            chunk = os.read(source, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            out = b"".join(line + b"\n" for line in lines if not drop.match(line))
            if pending and not pending.startswith(b"["):
                out, pending = out + pending, b""
            while out:
                out = out[os.write(sink, out) :]
        if pending and not drop.match(pending):
            os.write(sink, pending)
    except OSError:
        pass
    finally:
        os.close(source)
        os.close(sink)


@contextlib.contextmanager
def ray_noise_filtered(drop: "re.Pattern[bytes]" = RAY_NATIVE_LOG_LINE) -> Iterator[None]:
    """File descriptor 2 through a pipe that drops Ray's C++ log lines (`drop`) for the block; `sys.stderr` is
    the terminal itself meanwhile (a new stream on a copy of the old fd 2), so the job's own lines, its progress
    bar and its terminal width are untouched. Only Ray's native lines, which no Python setting reaches, are
    filtered: the driver's core worker writes "Actor ... has constructor arguments in the object store" into a
    run that works. A `sys.stderr` that is not fd 2 (a caller's StringIO) is left as it is. Processes started in
    the block that inherit fd 2 keep writing into the pipe until they end; the pump then ends too. Linux/macOS,
    main thread only; elsewhere the block runs unfiltered."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(os, "pipe"):
        yield
        return
    try:
        sys.stderr.flush()
        terminal = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError, AttributeError):
        yield
        return
    pump = threading.Thread(
        target=_pump, args=(read_end, os.dup(terminal), drop), name="tt_moge-ray-stderr", daemon=True
    )
    pump.start()
    saved_stream = sys.stderr
    try:  # a sys.stderr that is not fd 2 (a caller's StringIO, a test's capture) is left as it is
        on_fd2 = saved_stream.fileno() == 2
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        on_fd2 = False
    stream = io.TextIOWrapper(io.FileIO(terminal, "w", closefd=True), write_through=True, line_buffering=True)
    os.dup2(write_end, 2)
    os.close(write_end)
    if on_fd2:
        sys.stderr = stream
    try:
        yield
    finally:
        stream.flush()
        if on_fd2:
            sys.stderr = saved_stream
        os.dup2(stream.fileno(), 2)  # fd 2 is the terminal again; the pipe ends when the last writer does
        stream.close()
        pump.join(timeout=1.0)


@contextlib.contextmanager
def ray_session(ray: Any, address: Optional[str], num_cpus: int, object_store_mb: int, quiet: bool) -> Iterator[tuple]:
    """Yield (where, seconds to start). Reuses a Ray this process already started (and leaves it running);
    else connects to `address`, or starts a local Ray (init_local_ray), and shuts it down after."""
    t0 = time.perf_counter()
    if ray.is_initialized():
        yield "the Ray of this process", 0.0
        return
    with ray_noise_filtered() if quiet else contextlib.nullcontext():  # Ray's C++ lines: only with -v
        watcher = None
        if address:
            check_ray_address(address)
            with keeping_signal_handlers():
                ray.init(address=address, include_dashboard=False, **_log_options(quiet))
            where = f"the Ray cluster at {address}"
        else:
            with keeping_signal_handlers():
                watcher = init_local_ray(ray, num_cpus, object_store_mb, quiet)
            where = f"a local Ray ({num_cpus} logical CPUs, {object_store_mb} MB object store)"
        try:
            yield where, time.perf_counter() - t0
        finally:
            ray.shutdown()
            if watcher is not None:
                watcher.release()


def check_resources(ray: Any, replicas: int, cpus: float, gpus: float, strict: bool) -> None:
    """Every replica, plus one read task, must fit in the Ray cluster, or the job waits forever: a ValueError
    (strict: a local Ray, which cannot grow) or a warning (a cluster may autoscale)."""
    have = ray.cluster_resources()
    short = [
        f"{need:g} {kind} ({replicas} replica(s) x {per:g}{' + 1 read task' * (kind == 'CPU')}), it has "
        f"{have.get(kind, 0):g}"
        for kind, per, need in (("CPU", cpus, replicas * cpus + READER_CPUS), ("GPU", gpus, replicas * gpus))
        if need > have.get(kind, 0) + 1e-9
    ]
    if not short:
        return
    message = "the job needs " + "; ".join(short)
    if strict:
        raise ValueError(f"{message}: ask for fewer replicas or fewer CPUs/GPUs per replica")
    print(f"tt-moge batch: warning: {message}; it waits until the cluster has them (autoscaling)", file=sys.stderr)


@contextlib.contextmanager
def ray_data_output(ray: Any, quiet: bool) -> Iterator[None]:
    """Ray Data's progress bars and log lines, off when quiet (also the warning that says the bars are off);
    its settings are restored afterwards."""
    import logging

    context, logger = ray.data.DataContext.get_current(), logging.getLogger("ray.data")
    progress_logger = logging.getLogger("ray.data._internal.progress")
    saved = context.enable_progress_bars, logger.level, progress_logger.level
    if quiet:
        context.enable_progress_bars = False
        logger.setLevel(logging.WARNING)
        progress_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        context.enable_progress_bars = saved[0]
        logger.setLevel(saved[1])
        progress_logger.setLevel(saved[2])


def replica_runtime_env(local: bool) -> Optional[dict]:
    """The environment of a job's Ray workers (batch replicas, Serve replicas): FORWARDED_ENV, and on a local Ray
    this driver's tt_moge on PYTHONPATH."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    if local:  # workers import the very tt_moge this driver runs, installed or not (a source tree, a script's sys.path)
        here = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            [here] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        )
    return {"env_vars": env} if env else None


def chip_request(device: str) -> tuple:
    """(the device a Ray replica opens, its extra Ray options) for `device`: a Tenstorrent chip is asked of Ray as
    one TT_RESOURCE and opened as "tt:0" (the chip Ray made visible), so that replicas get a chip each; any other
    device is opened as named, with no extra resource (CUDA GPUs are num_gpus, the caller's)."""
    if str(device).lower().startswith("tt"):
        return "tt:0", {"resources": {TT_RESOURCE: 1}}
    return device, {}
