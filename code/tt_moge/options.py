"""The load options of `MoGeModel.from_pretrained`, validated and resolved once, before any weights are read.

`LoadOptions.resolve(...)` takes the arguments as a caller gives them (the API, the server's and the CLI's
flags) and returns one frozen record in which every choice is made: the weights source and revision, the
torch device, the concrete precision, the canvas, the token budget, the Tenstorrent dispatch options and the
canonical warm-up variants. The server resolves its flags this way before it binds its port, then loads from
the same record; nothing downstream validates or resolves an option again.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from .constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS, MAX_CANVAS_SIDE
from .network import validate_token_budget
from .runners.precision import resolve_precision
from .warmup import expand_variants
from .weights import DEFAULT_REPO, DEFAULT_REVISION

__all__ = ["LoadOptions", "TtChip", "DISPATCH", "validate_resolution", "select_device", "normalize_revision"]

DISPATCH = ("eth", "worker")
DEFAULT_BRANCH_NAMES = ("main", "")  # revision names that mean "the default branch" (revision None)


def validate_resolution(resolution: Any) -> tuple:
    """A canvas (width, height) of ints, 64..MAX_CANVAS_SIDE per side, aspect ratio in [1/4, 4]."""
    if isinstance(resolution, list):
        resolution = tuple(resolution)
    if (not isinstance(resolution, tuple) or len(resolution) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in resolution)):
        raise ValueError(f"resolution must be a (width, height) pair of ints, got {resolution!r}")
    w, h = resolution
    if not (64 <= w <= MAX_CANVAS_SIDE and 64 <= h <= MAX_CANVAS_SIDE and 0.25 <= w / h <= 4.0):
        raise ValueError(f"resolution must be a canvas of 64..{MAX_CANVAS_SIDE} pixels per side with an aspect ratio in [1/4, 4], got {w}x{h}")
    return int(w), int(h)


def normalize_revision(revision: Optional[str]) -> Optional[str]:
    """The Hub revision to ask for: None (the default branch) for None, "" and "main"; else the name itself."""
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a string or None, got {type(revision).__name__}")
    return None if revision is None or revision.strip() in DEFAULT_BRANCH_NAMES else revision.strip()


@dataclass(frozen=True, eq=False)
class TtChip:
    """A Tenstorrent chip: `handle` is an open ttnn device the caller owns (the model never closes it), or None
    when the runner opens chip `device_id` itself (and closes it in `close()`)."""

    device_id: int
    handle: Any = None
    type = "tt"

    def __str__(self) -> str:
        return f"tt:{self.device_id}"


def _tt_chip(text: str, device_id: int, verbose: bool) -> TtChip:
    """device='tt' or 'tt:N': that chip, or a ValueError saying why it cannot be used."""
    from .runners.ttnn.device import VISIBLE_ENV, TtnnUnavailableError, chips_hidden, device_count, import_ttnn

    index_text = text[3:] if text.startswith("tt:") else ""
    if text not in ("tt",) and not index_text.isdigit():
        raise ValueError(f"device must be 'tt' or 'tt:N' for a Tenstorrent chip, got {text!r}")
    index = int(index_text) if index_text else device_id
    if chips_hidden():
        raise ValueError(f"device={text!r}: {VISIBLE_ENV}=none hides every Tenstorrent chip from this process")
    try:
        count = device_count(import_ttnn(verbose))
    except TtnnUnavailableError as exc:
        raise ValueError(f"device={text!r}: {exc}") from None
    if index >= count:
        raise ValueError(f"device={text!r}: no Tenstorrent chip {index} here ({count} found by ttnn)")
    return TtChip(index)


def select_device(device: Any = None, device_id: int = 0, verbose: bool = False) -> Union[torch.device, TtChip]:
    """Where to run. None: a Tenstorrent chip (`device_id`) when ttnn imports and sees one, else CUDA, else the
    CPU (with a RuntimeWarning only when this torch is a CUDA build: a GPU was expected but none is seen; with a
    CPU build the CPU is the only choice); a `device_id` the machine lacks is a ValueError, never another kind of
    device; TT_VISIBLE_DEVICES=none hides the chips. An open ttnn device is used as it is (never closed by the model);
    "tt" / "tt:N" name a chip; "cpu", "cuda", "cuda:N" or a torch.device a torch device."""
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"device_id must be a non-negative int, got {device_id!r}")
    if device is None:
        from .runners.ttnn.device import chips_here

        chips = chips_here(verbose)
        if chips > device_id:
            return TtChip(device_id)
        if chips:  # chips are here but not the one asked for: never fall back to another kind of device
            raise ValueError(f"device_id={device_id}: no Tenstorrent chip {device_id} here ({chips} found by ttnn)")
        if torch.cuda.is_available():
            if device_id >= torch.cuda.device_count():
                raise ValueError(f"device_id={device_id}: only {torch.cuda.device_count()} CUDA device(s) present")
            return torch.device("cuda", device_id)
        if device_id:
            raise ValueError(f"device_id={device_id}: no Tenstorrent chip and no CUDA GPU here, and the CPU has no "
                             "device ids; leave device_id at 0 or pass device='cpu'")
        if torch.backends.cuda.is_built():
            warnings.warn(f"no Tenstorrent chip, and no CUDA GPU found by this CUDA build of torch ({torch.__version__}): "
                          "running MoGe-2 on the CPU; pass device='cpu' to choose it explicitly", RuntimeWarning,
                          stacklevel=4)
        return torch.device("cpu")
    from .runners.ttnn.device import TtnnUnavailableError, import_ttnn, is_ttnn_device

    if is_ttnn_device(device):
        try:
            import_ttnn(verbose)
        except TtnnUnavailableError as exc:
            raise ValueError(f"device: an open ttnn device was given, but {exc}") from None
        return TtChip(device_id, handle=device)
    if isinstance(device, str) and device.strip().lower().startswith("tt"):
        return _tt_chip(device.strip().lower(), device_id, verbose)
    if not isinstance(device, (str, torch.device)):
        raise TypeError("device must be None, 'cpu', 'cuda', 'cuda:N', 'tt', 'tt:N', an open ttnn device or a "
                        f"torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N', 'tt' or 'tt:N', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: no CUDA GPU is available on this machine (torch {torch.__version__})")
        index = dev.index if dev.index is not None else device_id
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


@dataclass(frozen=True)
class LoadOptions:
    """Every load-time choice of a MoGeModel, resolved (see `resolve`)."""

    weights: str  # a Hub repo id, a folder holding model.pt, or a model.pt path, as given
    revision: Optional[str]  # None: the default branch
    device: Union[torch.device, TtChip]
    precision: str  # concrete: "fp32", "bf16", "fp16" or "int8"
    resolution: tuple  # the canvas (width, height)
    num_tokens: int
    dispatch: str  # Tenstorrent: "eth" or "worker"
    num_command_queues: Optional[int]  # Tenstorrent: None (1) or 1 or 2 (worker dispatch only)
    warmup: int  # device forwards at load
    warmup_variants: tuple  # canonical variants (see tt_moge.warmup)
    verbose: bool = False

    @classmethod
    def resolve(cls, pretrained_model_name_or_path: Union[str, os.PathLike] = DEFAULT_REPO, *,
                device: Any = None, device_id: int = 0, revision: Optional[str] = DEFAULT_REVISION,
                resolution: Sequence[int] = DEFAULT_CANVAS, num_tokens: int = DEFAULT_NUM_TOKENS,
                dispatch: str = "eth", num_command_queues: Optional[int] = None, warmup: int = 2,
                warmup_variants: Any = "default", verbose: bool = False, precision: str = "auto") -> "LoadOptions":
        """Validate the arguments of `from_pretrained` (a ValueError/TypeError naming the argument) and resolve
        them: the device (None -> a Tenstorrent chip, else CUDA, else the CPU with a RuntimeWarning), "auto"
        precision, "main" revision."""
        if not isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
            raise TypeError("pretrained_model_name_or_path must be a repo id or a path, "
                            f"got {type(pretrained_model_name_or_path).__name__}")
        canvas = validate_resolution(resolution)
        tokens = validate_token_budget(num_tokens)
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {DISPATCH}, got {dispatch!r}")
        if isinstance(num_command_queues, bool) or num_command_queues not in (None, 1, 2):
            raise ValueError(f"num_command_queues must be None, 1 or 2, got {num_command_queues!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative int (device forwards at load), got {warmup!r}")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be True or False, got {verbose!r}")
        variants = tuple(expand_variants(warmup_variants, canvas))
        chosen = select_device(device, device_id, bool(verbose))
        callers_chip = isinstance(chosen, TtChip) and chosen.handle is not None  # opened already: dispatch is moot
        if num_command_queues == 2 and dispatch != "worker" and not callers_chip:
            raise ValueError("num_command_queues=2 needs dispatch='worker' (ETH dispatch supports 1 command queue)")
        return cls(weights=os.fspath(pretrained_model_name_or_path), revision=normalize_revision(revision),
                   device=chosen, precision=resolve_precision(precision, chosen), resolution=canvas,
                   num_tokens=tokens, dispatch=dispatch, num_command_queues=num_command_queues, warmup=warmup,
                   warmup_variants=variants, verbose=bool(verbose))
