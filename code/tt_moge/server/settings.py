"""Server limits and defaults: the one place their values are set (the CLI flags and docs/server.md read them)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["ServerSettings", "API_KEY_ENV", "DEFAULT_HOST", "DEFAULT_PORT"]

API_KEY_ENV = "MOGE_API_KEY"  # the bearer token clients must send, when set
DEFAULT_HOST = "127.0.0.1"  # loopback only unless asked otherwise
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServerSettings:
    """What one server process accepts and how much work it admits at once.

    max_body_bytes: largest request body (raw image or multipart), else 413.
    max_pixels: largest decoded image, width * height, checked from the image header before decoding (413).
      25 MP covers 6000x4000 photos; one 25 MP result holds about 550 MB of float maps.
    queue_size: requests admitted at once (decoding, waiting for or on the device, post-processing, encoding);
      one more gets 503 with Retry-After. Bounds the memory and the latency of a burst.
    host_threads: threads that run admitted requests (decode, post-process and encode in parallel while the
      device runs one canvas at a time). More than queue_size would never be used.
    max_connections: open connections (uvicorn's limit_concurrency) beyond which uvicorn answers 503 itself;
      bounds the bodies being received at once (slow uploads).
    read_timeout_s: a request body must arrive within this many seconds, else 408 (slow or stalled clients).
    retry_after_s: the Retry-After of a 503.
    api_key: when set, /predict, /predict/summary and /info need `Authorization: Bearer <api_key>`.
    """

    max_body_bytes: int = 64 * 1024 * 1024
    max_pixels: int = 25_000_000
    queue_size: int = 16
    host_threads: int = 4
    max_connections: int = 128
    read_timeout_s: float = 60.0
    retry_after_s: int = 1
    api_key: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_pixels", "queue_size", "host_threads", "max_connections", "retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (isinstance(self.read_timeout_s, (int, float)) and self.read_timeout_s > 0):
            raise ValueError(f"read_timeout_s must be a positive number of seconds, got {self.read_timeout_s!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string or None")

    @staticmethod
    def api_key_from_env() -> Optional[str]:
        return os.environ.get(API_KEY_ENV) or None
