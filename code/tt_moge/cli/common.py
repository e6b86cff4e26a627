"""What every `tt-moge` command shares: the model flags and the per-image flags (generated from the options'
definitions: `options.LoadOptions`, `host.CallOptions`), the format flags, exit codes, messages, and the one
mapping from parsed flags to `MoGeModel.from_pretrained` and call arguments."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Optional

from ..export import DEFAULT_FORMATS, DEFAULT_MESH_STEP, FORMATS, MESH_FACE_BUDGET
from ..fields import OptionInfo, options_of, own_options
from ..host import CallOptions
from ..options import LoadOptions
from . import argtypes
from .commands import (  # noqa: F401  (every command takes them from here)
    EXIT_CODES,
    EXIT_IMAGES_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_START,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Formatter,
    say,
)

__all__ = [
    "EXIT_OK",
    "EXIT_IMAGES_FAILED",
    "EXIT_USAGE",
    "EXIT_START",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "Interrupted",
    "SignalGuard",
    "Ticker",
    "EXIT_CODES",
    "DEFAULT_OUTPUT",
    "FORMAT_MB",
    "FULL_MESH_MB",
    "Formatter",
    "say",
    "add_model_arguments",
    "add_call_arguments",
    "add_format_arguments",
    "add_options",
    "option_values",
    "format_group_title",
    "chosen_formats",
    "mesh_choice",
    "model_kwargs",
    "call_options",
    "load_model",
]

DEFAULT_OUTPUT = "moge_output"
# What each format group writes for one 1920x1080 photo with 3/4 of its pixels valid, in MB (10^6 bytes), as
# `python -m perf.cli.export_bench --image <a 1920x1080 photo>` measures it (docs/performance.md); the 3D files
# grow with the valid share. tests/test_first_run.py checks these numbers against a fresh measurement.
FORMAT_MB = {"maps": 7, "npz": 30, "ply": 44, "glb": 26}
FULL_MESH_MB = 91  # mesh.glb with --mesh-step 1


class Interrupted(BaseException):
    """Raised in the main thread by `SignalGuard` on SIGINT or SIGTERM: a BaseException, like
    KeyboardInterrupt, so that no `except Exception` of the run takes it for an image's failure."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}")


class SignalGuard:
    """SIGINT and SIGTERM during a run (a context manager): the first one raises `Interrupted` in the main
    thread while `raising` is true, else it is only remembered (the run is writing its record: it ends
    after that, with `exit_code`); a second one ends the process at once (128 + the signal), without
    clean-up, for a run that does not stop. The previous handlers come back on exit. Outside the main thread
    (where Python cannot set handlers) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.raising = True
        self._saved: dict = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            message = f"tt-moge: {signal.Signals(signum).name} again: stopping now, without clean-up\n".encode()
            try:  # sys.stderr: the terminal even while fd 2 goes through a filter (batch.session.ray_noise_filtered)
                os.write(sys.stderr.fileno(), message)
            except (OSError, ValueError, AttributeError):
                os.write(2, message)
            os._exit(128 + signum)
        self.signum = signum
        if self.raising:
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise `Interrupted` for a signal received while raising whose exception never arrived: a library
        swallowed it (trimesh's optional imports catch BaseException). Call it after such code (the first
        imports of the format writers, the model load) and between steps."""
        if self.signum is not None and self.raising:
            raise Interrupted(self.signum)

    @property
    def exit_code(self) -> Optional[int]:
        """128 + the signal received, or None."""
        return None if self.signum is None else 128 + self.signum

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is threading.main_thread():
            self._saved = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved = {}


class Ticker:
    """Redraws a progress bar once a second while work runs (a context manager), so that its elapsed time moves
    before the first item is done (on a CPU, the first chunk of photos or a clip's calibration can take
    minutes); `stage()`, when given, is shown after the bar each time (what the work is doing now)."""

    def __init__(self, bar: Any, stage: Optional[Any] = None, every_s: float = 1.0) -> None:
        self.bar, self.stage, self.every_s = bar, stage, every_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.stage is not None:
                self.bar.set_postfix_str(self.stage())  # redraws
            else:
                self.bar.refresh()

    def __enter__(self) -> "Ticker":
        if not self.bar.disable:
            self._thread = threading.Thread(target=self._run, name="tt_moge-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _dest(info: OptionInfo) -> str:
    return info.flag.lstrip("-").replace("-", "_")  # argparse's own: --device-id -> args.device_id


def _add_option(group: Any, info: OptionInfo, default: Any) -> None:
    """One flag of an option, as its definition says (tt_moge.fields.Spec)."""
    spec = info.spec
    flags = ([spec.short] if spec.short else []) + [info.flag]
    if spec.show is not None and default is not None:
        default = spec.show(default)  # argparse parses a text default with the flag's type: --help shows the text
    kwargs: dict = dict(default=default, help=spec.help)
    if info.type is bool:
        if default:  # --x / --no-x
            kwargs.update(action=argparse.BooleanOptionalAction, help=f"{spec.help} (default: on)")
        else:
            kwargs.update(action="store_true")
        group.add_argument(*flags, **kwargs)
        return
    parse = info.parse
    if parse is not None:  # builtins (int, float) keep argparse's own "invalid int value" message
        kwargs["type"] = parse if parse in (int, float, str) else argtypes.usage(parse)
    if spec.choices is not None:
        kwargs["choices"] = [c for c in spec.choices if c is not None]
    if spec.metavar:
        kwargs["metavar"] = spec.metavar
    if spec.choices is not None and default is not None and "default" not in spec.help:
        kwargs["help"] = f"{spec.help} (default %(default)s)"  # a help that lists choices, but not which one
    group.add_argument(*flags, **kwargs)


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    warmup: int = 0,
    warmup_variants: str = "none",
    only: Optional[tuple] = None,
) -> None:
    """The flags of `MoGeModel.from_pretrained`, for every command: one per field of `options.LoadOptions`
    (`only`: those fields by name, for a command that loads the weights but runs no model, `export`).
    `warmup` / `warmup_variants` are the command's defaults: a run over many images does not need its first
    call to be fast; a server does."""
    group = parser.add_argument_group("model (as MoGeModel.from_pretrained)")
    defaults = {"warmup": warmup, "warmup_variants": warmup_variants}
    for info in options_of(LoadOptions):
        if only is None or info.name in only:
            _add_option(group, info, defaults.get(info.argument, info.default))


def add_call_arguments(parser: argparse.ArgumentParser) -> Any:
    """The per-image flags, as the options of `model(image, ...)`: one per field of `host.CallOptions`.
    Returns their group (a command may add its own per-image flags to it)."""
    group = parser.add_argument_group("per-image options (as model(image, ...))")
    for info in options_of(CallOptions):
        _add_option(group, info, info.default)
    return group


def add_options(group: Any, record: type, section: Optional[str] = None) -> None:
    """One flag per option that `record` defines itself (a dataclass of `tt_moge.fields` options, e.g.
    `video.VideoOptions`, `server.ServerSettings`; those it includes from another record have their own flags),
    as its definition says; `option_values` maps them back. `section`: only the options whose `Spec.group` is
    that name (a command that spreads one record's flags over several --help groups calls this once per group;
    None: those without a group)."""
    for info in own_options(record):
        if info.spec.group == section:
            _add_option(group, info, info.default)


def option_values(args: argparse.Namespace, record: type) -> dict:
    """{argument: value} of every option of `record`, from the flags that `add_options` (or, for the options it
    includes, `add_call_arguments` / `add_model_arguments`) made: the one way the command line hands a record's
    options on. A flag that was never added is an AttributeError here, not a silently dropped option."""
    return {info.argument: getattr(args, _dest(info)) for info in options_of(record)}


def format_group_title() -> str:
    """The title of the format flags' group: the default and what the sizes in the flags' help mean."""
    default = " ".join(f"--{name}" for name in DEFAULT_FORMATS)
    return f"formats (default: {default}; MB per 1920x1080 photo with 3/4 of its pixels valid)"


def add_format_arguments(group: Any) -> None:
    """--maps --npz --ply --glb (none given: DEFAULT_FORMATS) and --mesh-step, each with what it costs."""
    for name, what in FORMATS.items():
        extra = f" ({FULL_MESH_MB} MB with --mesh-step 1)" if name == "glb" else ""
        default = "[default] " if name in DEFAULT_FORMATS else ""
        group.add_argument(f"--{name}", action="store_true", help=f"{default}{what}: about {FORMAT_MB[name]} MB{extra}")
    mesh = group.add_mutually_exclusive_group()
    mesh.add_argument(
        "--mesh-step",
        type=argtypes.positive_int,
        default=None,
        metavar="N",
        help=f"mesh.glb samples every Nth row and column: 1 every pixel, 2 a quarter of the vertices (default "
        f"{DEFAULT_MESH_STEP}, coarser for photos whose mesh would have more than about 1 M faces, e.g. step 7 "
        f"for 24 MP; a step given here is kept)",
    )
    mesh.add_argument(
        "--mesh-full", action="store_true", help="mesh.glb of every pixel, however large (as --mesh-step 1)"
    )


def chosen_formats(args: argparse.Namespace) -> list:
    """The format groups whose flag was given, in FORMATS order (empty: none was given, DEFAULT_FORMATS apply)."""
    return [f for f in FORMATS if getattr(args, f)]


def mesh_choice(args: argparse.Namespace) -> tuple:
    """(mesh_step, mesh_faces) of `write_outputs` for --mesh-step / --mesh-full: neither given, the default step
    bounded to MESH_FACE_BUDGET faces; else the step asked for, unbounded."""
    if getattr(args, "mesh_full", False):
        return 1, None
    if args.mesh_step is None:
        return DEFAULT_MESH_STEP, MESH_FACE_BUDGET
    return args.mesh_step, None


def model_kwargs(args: argparse.Namespace, only: Optional[tuple] = None) -> dict:
    """The keyword arguments of `MoGeModel.from_pretrained` that the model flags stand for (`only`: those of a
    command that added only these, as `add_model_arguments(only=...)`; the others keep their defaults)."""
    return {
        info.argument: getattr(args, _dest(info))
        for info in options_of(LoadOptions)
        if only is None or info.name in only
    }


def refuse_options_not_for_panoramas(options: CallOptions, parser: argparse.ArgumentParser) -> None:
    """Exit 2 naming the flags of `options` that do not apply to --panorama (only --[no-]apply-mask does)."""
    from ..panorama.predict import options_not_for_panoramas

    wrong = options_not_for_panoramas(options)
    if wrong:
        flags = [f"--no-{info.flag[2:]}" if info.default is True else info.flag for info in wrong]
        parser.error(
            f"{' and '.join(flags)} {'does' if len(flags) == 1 else 'do'} not apply to --panorama (its views' "
            "camera and canvas are fixed: 90 degrees, square; only --[no-]apply-mask applies)"
        )


def call_options(args: argparse.Namespace) -> CallOptions:
    """The options of `model(image, ...)` that the per-image flags stand for (checked by their flags' types)."""
    return CallOptions.make(**option_values(args, CallOptions))


def load_model(args: argparse.Namespace) -> Optional[Any]:
    """The MoGeModel of the parsed model flags, or None after saying why it could not load. Warnings (e.g. no
    GPU found, running on the CPU) become one "note:" line each, in command-line terms."""
    from ..model import MoGeModel

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = MoGeModel.from_pretrained(**model_kwargs(args))
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            say(f"could not load the model: {exc}")
            return None
    for warning in caught:
        say("note: " + str(warning.message).replace("device='cpu'", "--device cpu"))
    if args.verbose:
        say(f"model {model!r} loaded in {time.perf_counter() - t0:.1f} s")
    return model
