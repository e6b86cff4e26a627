"""Finding, opening and closing a Tenstorrent chip through ttnn (no torch here: the mock check imports it too).

* `import_ttnn(verbose)` imports ttnn; unless `verbose`, first sets TT_LOGGER_LEVEL=error and
  LOGURU_LEVEL=WARNING (a value the user set wins), so tt-metal's info and debug lines stay quiet.
* `device_count(ttnn)`: the chips ttnn can open here (0 when it cannot tell); `chips_here()` the same without a
  ttnn module in hand, and 0 without importing ttnn when TT_VISIBLE_DEVICES=none (a host-only run).
* `open_chip(...)`: ETH dispatch (the p150 configuration, one command queue) or worker dispatch (opt-in, the only
  one that allows two command queues); when the ETH open fails, a RuntimeWarning and worker dispatch.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Optional

__all__ = [
    "TtnnUnavailableError",
    "import_ttnn",
    "device_count",
    "chips_here",
    "chips_hidden",
    "is_ttnn_device",
    "open_chip",
    "close_chip",
    "VISIBLE_ENV",
    "L1_SMALL_SIZE",
    "TRACE_REGION_SIZE",
]

# Device-wide reservations made when the chip opens: conv2d's small L1 buffers, and the DRAM region that holds
# the captured traces of the whole forward (two per canvas dtype, one per slot of pipeline.DevicePipeline: the
# uint8 canvas's and, once a float canvas-sized image comes, the float32 canvas's; 64 MB each, what one was given
# before there were several).
VISIBLE_ENV = "TT_VISIBLE_DEVICES"  # tt-metal's chip filter; "none" hides every chip from tt_moge too
L1_SMALL_SIZE = 32768
TRACE_REGION_SIZE = 256 << 20


class TtnnUnavailableError(ImportError):
    """ttnn is not installed (or does not import) in this Python."""


def import_ttnn(verbose: bool = False) -> Any:
    """The ttnn module, imported quietly unless `verbose`. Raises TtnnUnavailableError with the reason."""
    import importlib.util

    if "ttnn" not in sys.modules and importlib.util.find_spec("ttnn") is None:
        # the common case off Tenstorrent machines: nothing to import, and no logging variables to set
        raise TtnnUnavailableError(
            "ttnn (tt-metal's Python package) is not installed here; run in a tt-metal Python environment"
        )
    if not verbose:
        os.environ.setdefault("TT_LOGGER_LEVEL", "error")
        os.environ.setdefault("LOGURU_LEVEL", "WARNING")
    try:
        import ttnn
    except Exception as exc:  # ImportError, or a broken install raising anything while it loads
        raise TtnnUnavailableError(
            f"ttnn (tt-metal's Python package) does not import here ({type(exc).__name__}: {exc}); "
            "run in a tt-metal Python environment"
        ) from None
    return ttnn


def device_count(ttnn: Any) -> int:
    """The Tenstorrent chips ttnn sees (0 when there are none or the driver cannot tell)."""
    try:
        return int(ttnn.GetNumAvailableDevices())
    except Exception:
        return 0


def chips_hidden() -> bool:
    """True when TT_VISIBLE_DEVICES=none: the process is to open no chip (host-only runs; ttnn not imported)."""
    return os.environ.get(VISIBLE_ENV, "").strip().lower() == "none"


def chips_here(verbose: bool = False) -> int:
    """The Tenstorrent chips this process could open: 0 when TT_VISIBLE_DEVICES=none, when ttnn does not import
    or when it sees none."""
    if chips_hidden():
        return 0
    try:
        return device_count(import_ttnn(verbose))
    except TtnnUnavailableError:
        return 0


def is_ttnn_device(obj: Any) -> bool:
    """True for an open ttnn device object (a MeshDevice or Device of the ttnn module)."""
    return type(obj).__module__.split(".")[0] == "ttnn"


def open_chip(
    ttnn: Any,
    device_id: int,
    dispatch: str = "eth",
    num_command_queues: int = 1,
    *,
    l1_small_size: int = L1_SMALL_SIZE,
    trace_region_size: int = TRACE_REGION_SIZE,
) -> tuple:
    """Open chip `device_id` -> (device, the dispatch actually used). `dispatch` "eth" falls back to "worker"
    with a RuntimeWarning when the ETH open fails; two command queues need worker dispatch."""
    if num_command_queues == 2 and dispatch != "worker":
        raise ValueError("num_command_queues=2 needs dispatch='worker' (ETH dispatch supports 1 command queue)")

    def open_with(kind: Any) -> Any:
        return ttnn.open_device(
            device_id=device_id,
            l1_small_size=l1_small_size,
            trace_region_size=trace_region_size,
            num_command_queues=num_command_queues,
            dispatch_core_config=ttnn.DispatchCoreConfig(kind),
        )

    if dispatch == "eth":
        try:
            return open_with(ttnn.DispatchCoreType.ETH), "eth"
        except Exception as exc:
            warnings.warn(
                f"Tenstorrent device {device_id}: ETH dispatch failed to open ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); using worker dispatch, "
                "which leaves fewer cores for compute on a p150",
                RuntimeWarning,
                stacklevel=3,
            )
    return open_with(ttnn.DispatchCoreType.WORKER), "worker"


def close_chip(ttnn: Any, device: Optional[Any]) -> None:
    """Close a device this process opened (never one a caller passed in: the runner decides)."""
    if device is not None:
        ttnn.close_device(device)
