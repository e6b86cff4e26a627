"""The load options of `MoGeModel.from_pretrained`, validated and resolved once, before any weights are read.

Each field of `LoadOptions` is the one definition of its option (`tt_moge.fields`): its default, its help
and its checks. The model flags of every `tt-moge` command and the model arguments a batch job accepts are
generated from these fields; `from_pretrained`, `LoadOptions.arguments` and `LoadOptions.resolve` have them written
out as their parameters (tests/test_one_definition.py checks each against the fields).

`LoadOptions.resolve(...)` takes the arguments as a caller gives them (the API, the server's and the CLI's
flags) and returns one frozen record in which every choice is made: the weights source and revision, the
torch device, the concrete precision, the canvas, the token budget, the Tenstorrent dispatch options and the
canonical warm-up variants. The server resolves its flags this way before it binds its port, then loads from
the same record; nothing downstream validates or resolves an option again. `LoadOptions.arguments(...)` runs
the checks that do not depend on the machine (for a batch job's driver, whose replicas may run elsewhere).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from .constants import DEFAULT_CANVAS, DEFAULT_NUM_TOKENS, MAX_CANVAS_SIDE, PRECISIONS
from .fields import arguments_of, checked, non_negative_int, option, options_of, takes_options
from .host.call_options import CallOptions
from .network.config import validate_token_budget
from .weights import DEFAULT_REPO, DEFAULT_REVISION, WEIGHTS_DIR_ENV

if TYPE_CHECKING:  # only in annotations: torch is imported where a device is chosen
    import torch

__all__ = [
    "LoadOptions",
    "CallOptions",
    "TtChip",
    "DISPATCH",
    "validate_resolution",
    "select_device",
    "normalize_revision",
    "parse_wxh",
    "parse_canvas",
    "parse_token_budget",
    "parse_warmup_spec",
]

DISPATCH = ("eth", "worker")
DEFAULT_BRANCH_NAMES = ("main", "")  # revision names that mean "the default branch" (revision None)


def validate_resolution(resolution: Any) -> tuple:
    """A canvas (width, height) of ints, 64..MAX_CANVAS_SIDE per side, aspect ratio in [1/4, 4]."""
    if isinstance(resolution, list):
        resolution = tuple(resolution)
    if (
        not isinstance(resolution, tuple)
        or len(resolution) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in resolution)
    ):
        raise ValueError(f"resolution must be a (width, height) pair of ints, got {resolution!r}")
    w, h = resolution
    if not (64 <= w <= MAX_CANVAS_SIDE and 64 <= h <= MAX_CANVAS_SIDE and 0.25 <= w / h <= 4.0):
        raise ValueError(
            f"resolution must be a canvas of 64..{MAX_CANVAS_SIDE} pixels "
            f"per side with an aspect ratio in [1/4, 4], got {w}x{h}"
        )
    return int(w), int(h)


def parse_wxh(text: str) -> tuple:
    """'1920x1080' -> (1920, 1080)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"expected WIDTHxHEIGHT, e.g. 1920x1080, got {text!r}")
    return int(match[1]), int(match[2])


def parse_canvas(text: str) -> tuple:
    """A canvas size WxH that from_pretrained accepts."""
    return validate_resolution(parse_wxh(text))


def parse_token_budget(text: str) -> int:
    if not text.strip().lstrip("-").isdigit():
        raise ValueError(f"expected an integer, got {text!r}")
    return validate_token_budget(int(text))


def parse_warmup_spec(text: str) -> Any:
    """A preset name, a comma-separated list of presets, or JSON (a variant dict or a list)."""
    if text.lstrip().startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
    names = [part.strip() for part in text.split(",") if part.strip()]
    return names[0] if len(names) == 1 else names


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


def _check_device_id(device_id: Any) -> int:
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"device_id must be a non-negative int, got {device_id!r}")
    return device_id


def _check_weights(name: Any) -> str:
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"pretrained_model_name_or_path must be a repo id or a path, got {type(name).__name__}")
    return os.fspath(name)


def _check_warmup(count: Any) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"warmup must be a non-negative int (device forwards at load), got {count!r}")
    return count


def select_device(device: Any = None, device_id: int = 0, verbose: bool = False) -> Union[torch.device, TtChip]:
    """Where to run. None: a Tenstorrent chip (`device_id`) when ttnn imports and sees one, else CUDA, else the
    CPU (with a RuntimeWarning only when this torch is a CUDA build: a GPU was expected but none is seen; with a
    CPU build the CPU is the only choice); a `device_id` the machine lacks is a ValueError, never another kind of
    device; TT_VISIBLE_DEVICES=none hides the chips. An open ttnn device is used as it is (never closed by the model);
    "tt" / "tt:N" name a chip; "cpu", "cuda", "cuda:N" or a torch.device a torch device."""
    import torch  # here, not at the top: the command line builds its flags from these options without torch

    _check_device_id(device_id)
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
            raise ValueError(
                f"device_id={device_id}: no Tenstorrent chip and no CUDA GPU here, and the CPU has no "
                "device ids; leave device_id at 0 or pass device='cpu'"
            )
        if torch.backends.cuda.is_built():
            warnings.warn(
                f"no Tenstorrent chip, and no CUDA GPU found by this CUDA build of torch ({torch.__version__}): "
                "running MoGe-2 on the CPU; pass device='cpu' to choose it explicitly",
                RuntimeWarning,
                stacklevel=6,  # the caller of from_pretrained (its frame and resolve's, each under takes_options)
            )
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
        raise TypeError(
            "device must be None, 'cpu', 'cuda', 'cuda:N', 'tt', 'tt:N', an open ttnn device or a "
            f"torch.device, got {type(device).__name__}"
        )
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
    """Every load-time choice of a MoGeModel, resolved (see `resolve`). Each field is an option of
    `from_pretrained` (its argument default, help and checks are in its definition)."""

    weights: str = option(
        DEFAULT_REPO,
        f"a Hugging Face repo id, a folder holding model.pt, or model.pt itself (default {DEFAULT_REPO}; "
        f"${WEIGHTS_DIR_ENV}, when set, replaces a repo id)",
        required=True,
        argument="pretrained_model_name_or_path",
        positional=True,
        flag="--weights",
        metavar="REPO|DIR|FILE",
        check=_check_weights,
        argtype=Union[str, os.PathLike],
    )
    device: Any = option(  # resolved: a torch.device or a TtChip
        None,
        "cpu, cuda, cuda:N, tt or tt:N (default: a Tenstorrent chip when ttnn sees one, else CUDA when present, "
        "else the CPU)",
        required=True,
        argtype=Any,
    )
    device_id: int = option(
        0,
        "the chip or GPU to open when --device is not given or names no index (default 0)",
        required=True,
        metavar="N",
        parse=non_negative_int,
        check=_check_device_id,
    )
    revision: Optional[str] = option(
        DEFAULT_REVISION,
        "Hub revision of a repo id (default: the pinned revision of the published numbers; 'main' for the newest)",
        required=True,
        check=normalize_revision,
    )
    resolution: tuple = option(
        DEFAULT_CANVAS,
        f"the canvas every image is fitted onto (default {DEFAULT_CANVAS[0]}x{DEFAULT_CANVAS[1]})",
        required=True,
        metavar="WxH",
        parse=parse_canvas,
        check=validate_resolution,
        argtype=Sequence[int],
    )
    num_tokens: int = option(
        DEFAULT_NUM_TOKENS,
        "ViT token budget, 1200-3600 (default %(default)s)",
        required=True,
        metavar="N",
        parse=parse_token_budget,
        check=validate_token_budget,
    )
    dispatch: str = option("eth", "Tenstorrent dispatch (default %(default)s)", required=True, choices=DISPATCH)
    num_command_queues: Optional[int] = option(
        None, "Tenstorrent command queues (2: worker dispatch only)", required=True, choices=(None, 1, 2), parse=int
    )
    warmup: int = option(
        2,
        "device forwards at load (default %(default)s)",
        required=True,
        metavar="N",
        parse=non_negative_int,
        check=_check_warmup,
    )
    warmup_variants: tuple = option(
        "default",
        "host warm-up: a preset (default, all, minimal, none), presets separated by commas, or JSON such "
        'as \'["default", {"input": "jpeg", "size": [4032, 3024]}]\' (default %(default)s)',
        required=True,
        metavar="SPEC",
        parse=parse_warmup_spec,
        argtype=Any,
    )  # resolved with the canvas, in resolve()
    verbose: bool = option(False, "print model loading steps", required=True, short="-v")
    precision: str = option(
        "auto",
        "arithmetic of the forward (default auto: bf16 on CPUs with bfloat16 instructions, else fp32; fp16 on "
        "CUDA; bf16 on a Tenstorrent chip). fp32 is the exact reference; int8 is an opt-in CPU mode, bfp8 an opt-in "
        "Tenstorrent mode",
        required=True,
        choices=PRECISIONS,
    )  # concrete once resolved: fp32, bf16, fp16, int8, bfp8

    @classmethod
    @takes_options("from_pretrained")
    def arguments(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike] = DEFAULT_REPO,
        *,
        device: Any = None,
        device_id: int = 0,
        revision: Optional[str] = DEFAULT_REVISION,
        resolution: Sequence[int] = DEFAULT_CANVAS,
        num_tokens: int = DEFAULT_NUM_TOKENS,
        dispatch: str = "eth",
        num_command_queues: Optional[int] = None,
        warmup: int = 2,
        warmup_variants: Any = "default",
        verbose: bool = False,
        precision: str = "auto",
    ) -> dict:
        """{argument: value} of a `from_pretrained` call with its defaults filled in, each option checked on its
        own (its type, choices and range: a ValueError / TypeError naming it); nothing is chosen for the machine
        yet. Unknown arguments are a TypeError."""
        given = locals()
        return {info.argument: checked(info, given[info.argument]) for info in options_of(cls)}

    @classmethod
    @takes_options("from_pretrained")
    def resolve(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike] = DEFAULT_REPO,
        *,
        device: Any = None,
        device_id: int = 0,
        revision: Optional[str] = DEFAULT_REVISION,
        resolution: Sequence[int] = DEFAULT_CANVAS,
        num_tokens: int = DEFAULT_NUM_TOKENS,
        dispatch: str = "eth",
        num_command_queues: Optional[int] = None,
        warmup: int = 2,
        warmup_variants: Any = "default",
        verbose: bool = False,
        precision: str = "auto",
    ) -> "LoadOptions":
        """Validate the arguments of `from_pretrained` (a ValueError/TypeError naming the argument) and resolve
        them: the device (None -> a Tenstorrent chip, else CUDA, else the CPU with a RuntimeWarning), "auto"
        precision, "main" revision, the warm-up variants for the canvas."""
        given = cls.arguments(**arguments_of(cls, locals()))
        values = {info.name: given[info.argument] for info in options_of(cls)}
        from .warmup import expand_variants

        values["warmup_variants"] = tuple(expand_variants(values["warmup_variants"], values["resolution"]))
        chosen = select_device(values["device"], values["device_id"], values["verbose"])
        callers_chip = isinstance(chosen, TtChip) and chosen.handle is not None  # opened already: dispatch is moot
        if values["num_command_queues"] == 2 and values["dispatch"] != "worker" and not callers_chip:
            raise ValueError("num_command_queues=2 needs dispatch='worker' (ETH dispatch supports 1 command queue)")
        from .runners.precision import resolve_precision

        values.update(device=chosen, precision=resolve_precision(values["precision"], chosen))
        return cls(**values)
