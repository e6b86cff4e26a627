"""Server limits and defaults: the one place their values are set (the CLI flags and docs/server.md read them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .. import env

__all__ = [
    "ServerSettings",
    "API_KEY_ENV",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "BYTES_PER_PIXEL",
    "CLIP_BYTES_PER_PIXEL",
    "CLIP_FRAMES_IN_FLIGHT",
    "ACCEPT_BACKLOG",
    "FD_RESERVE",
    "OVER_LIMIT_SLOTS",
    "fd_limit",
    "connections_within",
]

API_KEY_ENV = "MOGE_API_KEY"  # the bearer token clients must send, when set
DEFAULT_HOST = "127.0.0.1"  # loopback only unless asked otherwise
DEFAULT_PORT = 8000
# What one admitted request may hold per pixel of its image, at its peak: the decoded image, the full-resolution
# maps of the result (float32 points, depth and normal, the mask), the npz views of them (float16 normal, uint8
# mask) and their deflated copy when the answer is compressed. A rounded-up bound of what was measured
# (docs/performance.md, "Server memory per request"); the memory budget counts every admitted request at this rate.
BYTES_PER_PIXEL = 64
# A clip (POST /predict/video): every frame's answer is kept until the end, its depth (float32) and mask (uint8);
# besides, the calibration frames and at most CLIP_FRAMES_IN_FLIGHT more are being worked on at once, each at
# BYTES_PER_PIXEL (the reader's decoded frames, the model's chunks, the frame being registered).
CLIP_BYTES_PER_PIXEL = 5
CLIP_FRAMES_IN_FLIGHT = 16
# File descriptors. Every open connection is one; the process needs others too. So the connection limit is kept
# below the process's limit (RLIMIT_NOFILE, read at start) by:
ACCEPT_BACKLOG = 128  # the listen backlog, which is also the most connections accepted in one go (before the
# protocol can close idle ones to make room), and as many again that are closing after such a burst
FD_RESERVE = 128  # everything but connections: the listening socket, the event loop, the model's and the page's
# files, pipes, logs, the libraries' own
OVER_LIMIT_SLOTS = 16  # connections beyond max_connections kept long enough to read their JSON 503; more are cut


def fd_limit() -> Optional[int]:
    """The process's file-descriptor limit (the soft RLIMIT_NOFILE), or None where there is none or it cannot be
    read."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return None
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


def connections_within(limit: Optional[int]) -> Optional[int]:
    """The most connections a process with `limit` file descriptors can hold open without accept() ever failing
    with EMFILE: the limit less FD_RESERVE, twice ACCEPT_BACKLOG and OVER_LIMIT_SLOTS (at least 1)."""
    if limit is None:
        return None
    return max(1, limit - FD_RESERVE - 2 * ACCEPT_BACKLOG - OVER_LIMIT_SLOTS)


@dataclass(frozen=True)
class ServerSettings:
    """What one server process accepts and how much work it admits at once.

    max_body_bytes: largest request body (raw image or multipart), else 413.
    max_pixels: largest decoded image, width * height, checked from the image header before decoding (413).
      25 MP covers 6000x4000 photos; each pixel of a result holds 29 bytes of maps (float32 depth, points and
      normal, a bool mask).
    queue_size: requests admitted at once (decoding, waiting for or on the device, post-processing, encoding);
      one more gets 503 with Retry-After. Bounds the memory and the latency of a burst.
    host_threads: threads that run admitted requests (decode, post-process and encode in parallel while the
      device runs one canvas at a time). More than queue_size would never be used.
    max_connections: open connections at most. A new connection beyond it closes the connection that has been
      idle the longest (see idle_timeout_s); when none is idle it is answered 503 too_many_connections (JSON).
      Bounds the bodies being received at once (slow uploads) and the file descriptors: kept below the
      process's limit (`within_fd_limit`), so accept() never fails with EMFILE.
    idle_timeout_s: a connection with no request in progress (nothing sent yet, an incomplete request line and
      headers, a keep-alive connection between requests) is closed after this many seconds. So idle
      connections cannot hold the server's connections (a request whose body is arriving has read_timeout_s).
    read_timeout_s: a request body must arrive within this many seconds, else 408 (slow or stalled clients).
    send_timeout_s: an answer being sent must make progress (the client reads) within this many seconds, else
      the connection is cut and its queue slot and memory are freed (clients that stop reading).
    memory_budget_bytes: the bytes that request bodies being received and admitted requests may hold together:
      a body as it arrives (twice while a multipart form is taken apart), an admitted request as
      request_cost() until its answer is encoded, then as the answer's size until it is sent. A request that
      would go over it gets 503 with Retry-After. It has to hold one request of max_pixels and max_body_bytes.
    shutdown_grace_s: on SIGTERM / SIGINT, how long admitted requests and slow clients get to finish before the
      server cuts them and exits.
    retry_after_s: the Retry-After of a 503.
    api_key: when set, /predict, /predict/summary and /info need `Authorization: Bearer <api_key>`.
    max_video_frames: the most frames (after the request's stride and max_frames) a clip sent to /predict/video
      may have (413); its frames count against max_pixels each, and its cost (`clip_cost`) against the memory
      budget (413 when it could never fit, else 503 while it does not fit now).
    """

    max_body_bytes: int = 64 * 1024 * 1024
    max_pixels: int = 25_000_000
    queue_size: int = 16
    host_threads: int = 4
    max_connections: int = 128
    idle_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    send_timeout_s: float = 30.0
    memory_budget_bytes: int = 4096 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    retry_after_s: int = 1
    api_key: Optional[str] = None
    max_video_frames: int = 300

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_pixels",
            "queue_size",
            "host_threads",
            "max_connections",
            "retry_after_s",
            "memory_budget_bytes",
            "max_video_frames",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("read_timeout_s", "send_timeout_s", "shutdown_grace_s", "idle_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        largest = self.request_cost(self.max_pixels, self.max_body_bytes) + self.max_body_bytes  # + a multipart copy
        if largest > self.memory_budget_bytes:
            raise ValueError(
                f"memory_budget_bytes ({self.memory_budget_bytes}, --memory-budget-mb) cannot hold one "
                f"request of max_pixels ({self.max_pixels}, --max-pixels) and max_body_bytes "
                f"({self.max_body_bytes}, --max-body-mb): it needs {largest} bytes ({BYTES_PER_PIXEL} per "
                f"pixel + the body, twice for a multipart form)"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string or None")

    def within_fd_limit(self, limit: Optional[int]) -> tuple:
        """(settings, warning): these settings with max_connections lowered to what `limit` file descriptors
        allow (`connections_within`), and a warning naming both numbers when it had to be lowered (else None)."""
        cap = connections_within(limit)
        if cap is None or self.max_connections <= cap:
            return self, None
        warning = (
            f"--max-connections {self.max_connections} lowered to {cap}: the process may open {limit} files "
            f"(ulimit -n), and keeps {limit - cap} of them for its own files and for connections being accepted "
            "or closed; raise ulimit -n to allow more connections"
        )
        return dataclasses.replace(self, max_connections=cap), warning

    @staticmethod
    def request_cost(pixels: int, body_bytes: int) -> int:
        """The bytes an admitted request is counted for until its answer is being sent: BYTES_PER_PIXEL per
        pixel of its image, plus the encoded image it was sent."""
        return BYTES_PER_PIXEL * pixels + body_bytes

    @staticmethod
    def clip_cost(frames: int, pixels: int, body_bytes: int, calibration_frames: int) -> int:
        """The bytes an admitted clip is counted for: CLIP_BYTES_PER_PIXEL per pixel of each of its frames (the
        answer), BYTES_PER_PIXEL per pixel of its calibration frames and CLIP_FRAMES_IN_FLIGHT more (the work),
        and the body."""
        working = min(calibration_frames, frames) + CLIP_FRAMES_IN_FLIGHT
        return pixels * (CLIP_BYTES_PER_PIXEL * frames + BYTES_PER_PIXEL * working) + body_bytes

    @staticmethod
    def api_key_from_env() -> Optional[str]:
        return env.get(API_KEY_ENV) or None
