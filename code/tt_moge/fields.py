"""One definition per option: a dataclass field whose metadata (`Spec`) holds its help text, its checks and
how each surface spells it.

`options.LoadOptions` (the arguments of `from_pretrained`) and `host.CallOptions` (the options of
`model(image, ...)`) are made of such fields. Generated from them: the command-line flags (`cli/common.py`), the
web page's controls (`server/ui.py`), the fields of `batch.BatchJob` and the keys of a warm-up variant
(`warmup.py`). The server's limits (`server.settings.ServerSettings`) and a batch job's own settings
(`batch.BatchJob`) are such fields too: their flags, checks and forwarding are generated the same way. The output
fields have their own definitions, in `output.py`.

The Python signatures (`from_pretrained`, `model(...)`, `predict`, `predict_many`, `infer`, `predict_video`,
`CallOptions.make`, ...) and the HTTP query parameters (`server/serving.py`, `server/video.py`) are written out in
their defs, so that a reader and a static tool see them; `signature` gives what each must be, and
tests/test_one_definition.py checks every written one against it: a new option is one new field plus its
parameter in those defs, and a def that lacks it fails that test. The defs pass their options on by
`arguments_of(record, locals())`, never by a list of names; `takes_options` gives an unknown keyword the same
TypeError as `bind`.

This module is the machinery only; it imports nothing of tt_moge.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TypeVar

__all__ = [
    "Spec",
    "Limit",
    "OptionInfo",
    "option",
    "options_of",
    "signature",
    "bind",
    "takes_options",
    "arguments_of",
    "checked",
    "include_options",
    "own_options",
    "non_negative_int",
    "FIELD_KEY",
]

FIELD_KEY = "tt_moge"  # the key of a field's Spec in its dataclass metadata
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Spec:
    """What an option is, for people and for each surface.

    help      one phrase, for --help, the API's parameter description and the docs. `%(default)s` stands for
              the default (argparse's own notation; "%%" is a percent sign).
    argument  the keyword argument, where it differs from the field name (`weights` is the argument
              `pretrained_model_name_or_path`); `positional`: it may also be given by position (first).
    flag      the command-line flag (default: --field-name); `short` an extra short one, e.g. "-v".
    metavar   the value's name in --help.
    choices   the allowed values (None may be one: "not given").
    parse     command-line text -> value; a ValueError says what was expected (the command line turns it
              into a usage error).
    check     value -> checked value; raises a ValueError / TypeError naming the argument.
    bounds    (low, high): a number strictly between them, finite (the API's query limits too).
    limit     a `Limit`: a number at least (or above) a minimum; it gives the check and, without `parse`, the
              command-line parser too.
    show      value -> its command-line text, where the flag's unit differs from the field's (bytes given in MiB):
              the flag's default in --help; `parse` is its inverse.
    group     the --help group of the flag, where a command puts the options of one record in more than one
              (`cli.common.add_options`); None: the record's main group.
    warm      for a warm-up variant: None, the value is part of the variant's key; else only "given or not"
              matters, and a given one warms with the value `warm`.
    argtype   the type the argument accepts, where it differs from the field's (a resolved record's) type.
    """

    help: str
    argument: Optional[str] = None
    positional: bool = False
    flag: Optional[str] = None
    short: Optional[str] = None
    metavar: Optional[str] = None
    choices: Optional[tuple] = None
    parse: Optional[Callable[[str], Any]] = None
    check: Optional[Callable[[Any], Any]] = None
    bounds: Optional[tuple] = None
    warm: Any = None
    argtype: Any = None
    limit: Optional["Limit"] = None
    show: Optional[Callable[[Any], str]] = None
    group: Optional[str] = None


@dataclass(frozen=True)
class Limit:
    """A number option's range: at least `low` (above it, with `strict`), finite, an int when `integer`, None
    allowed when `optional`. The same words say it on every surface: "a positive integer", "a number >= 0"."""

    low: float
    integer: bool = True
    strict: bool = False
    optional: bool = False

    def expected(self) -> str:
        if self.integer:
            return "a positive integer" if self.low == 1 and not self.strict else f"an integer >= {self.low:g}"
        return f"a finite number > {self.low:g}" if self.strict else f"a number >= {self.low:g}"

    def _inside(self, value: float) -> bool:
        return math.isfinite(value) and (value > self.low if self.strict else value >= self.low)

    def parse(self, text: str) -> Any:
        """Command-line text -> the number; a ValueError saying what was expected."""
        if self.integer:
            ok = text.strip().isdigit()
            value: Any = int(text) if ok else None
        else:
            try:
                value, ok = float(text), True
            except ValueError:
                value, ok = None, False
        if not ok or not self._inside(value):
            raise ValueError(f"expected {self.expected()}, got {text!r}")
        return value

    def check(self, name: str, value: Any, error: type = ValueError) -> Any:
        """`value` checked (an int stays an int, a float a float); `error` names the option."""
        if value is None and self.optional:
            return None
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not self._inside(value):
            raise error(f"{name} must be {self.expected()}{' or None' * self.optional}, got {value!r}")
        return int(value) if self.integer else value


@dataclass(frozen=True)
class OptionInfo:
    """One option of a record, with everything resolved: its field name, argument name, type and default."""

    name: str  # the dataclass field
    argument: str  # the keyword argument
    type: Any  # the field's annotation, resolved
    default: Any
    spec: Spec

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.argument.replace("_", "-")

    @property
    def parse(self) -> Optional[Callable[[str], Any]]:
        """Command-line text -> value: the definition's `parse`, else its limit's (None: the text itself)."""
        return self.spec.parse or (self.spec.limit.parse if self.spec.limit is not None else None)

    def shown_default(self) -> Any:
        """The default as the flag says it: `show(default)` where the flag has its own unit, else the default."""
        return self.spec.show(self.default) if self.spec.show is not None and self.default is not None else self.default

    def describe(self) -> str:
        """The help text with its default filled in (for surfaces other than argparse)."""
        return self.spec.help.replace("%(default)s", str(self.shown_default())).replace("%%", "%")


def option(default: Any, help: str, *, required: bool = False, **spec: Any) -> Any:
    """A dataclass field that is an option (the keywords are those of `Spec`). `default` is the argument's
    default; `required=True` keeps it off the dataclass itself (a resolved record has no defaults)."""
    metadata = {FIELD_KEY: Spec(help=help, **spec), "default": default}
    if required:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)  # options' defaults are immutable values


@functools.lru_cache(maxsize=None)
def options_of(cls: type) -> tuple:
    """The options of a dataclass made of `option` fields, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(FIELD_KEY)
        if isinstance(spec, Spec):
            found.append(
                OptionInfo(f.name, spec.argument or f.name, hints.get(f.name, Any), f.metadata["default"], spec)
            )
    return tuple(found)


def signature(
    cls: type, *, keyword_only: bool = True, leading: tuple = (), returns: Any = inspect.Signature.empty
) -> inspect.Signature:
    """A function signature with one parameter per option of `cls` (after `leading` parameters): keyword-only
    (or, with keyword_only=False, positional-or-keyword), except a `positional` option, which comes first. What the
    parameters of a call that takes these options must be (tests/test_one_definition.py checks the written defs)."""
    kinds = inspect.Parameter
    params = list(leading)
    for info in sorted(options_of(cls), key=lambda i: not i.spec.positional):
        kind = kinds.POSITIONAL_OR_KEYWORD if info.spec.positional or not keyword_only else kinds.KEYWORD_ONLY
        annotation = info.type if info.spec.argtype is None else info.spec.argtype
        params.append(kinds(info.argument, kind, default=info.default, annotation=annotation))
    return inspect.Signature(params, return_annotation=returns)


def bind(sig: inspect.Signature, where: str, args: tuple, kwargs: dict) -> dict:
    """{argument: value} of a call, defaults filled in; a TypeError naming `where` for unknown or extra arguments."""
    unknown = sorted(set(kwargs) - set(sig.parameters))
    if unknown:
        raise _unknown(where, [name for name, p in sig.parameters.items() if p.kind is not p.VAR_KEYWORD], unknown)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{where}(): {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _unknown(where: str, names: list, unknown: list) -> TypeError:
    return TypeError(f"{where}() got unexpected option(s) {unknown}; it takes {names}")


def takes_options(where: str) -> Callable[[F], F]:
    """A decorator for a call whose options are written out in its signature: an unknown keyword argument, or too
    many positional ones, are the TypeErrors of `bind` ("`where`() got unexpected option(s) [...]; it takes
    [...]", the options it does take) rather than Python's own. The signature stays the def's
    (`inspect.signature` follows `__wrapped__`)."""

    def decorate(func: F) -> F:
        sig = inspect.signature(func)
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        accepted = frozenset(name for name, p in sig.parameters.items() if p.kind in kinds)
        positional = sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
        options = [name for name, p in sig.parameters.items() if p.kind in kinds and p.default is not p.empty]

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not accepted.issuperset(kwargs):
                raise _unknown(where, options, sorted(set(kwargs) - accepted))
            if len(args) > positional:
                raise TypeError(f"{where}(): too many positional arguments")
            return func(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


def arguments_of(cls: type, values: Mapping) -> dict:
    """{argument: value} for each option of `cls`, taken from `values`: in a def that has the options as its
    parameters, `arguments_of(cls, locals())` passes all of them on, without a list of names."""
    return {info.argument: values[info.argument] for info in options_of(cls)}


def checked(info: OptionInfo, value: Any, error: type = ValueError, type_error: type = TypeError) -> Any:
    """`value` after the option's own checks: a bool option takes only True or False; then its choices, then its
    `check` (or, without one, its bounds). `error` / `type_error`: the exceptions for a bad value / type."""
    spec, name = info.spec, info.argument
    if info.type is bool and not isinstance(value, bool):
        raise type_error(f"{name} must be True or False, got {value!r}")
    if spec.choices is not None:
        a_bool = isinstance(value, bool) and not any(isinstance(c, bool) for c in spec.choices)  # True is not 1
        if a_bool or value not in spec.choices:
            raise error(f"{name} must be one of {spec.choices}, got {value!r}")
    if spec.check is not None:
        return spec.check(value)
    if spec.limit is not None:
        return spec.limit.check(name, value, error)
    if spec.bounds is not None and value is not None:
        low, high = spec.bounds
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{name} must be a number, {low} < {name} < {high}, or None, got {type(value).__name__}")
        if not (math.isfinite(value) and low < value < high):
            raise error(f"{name} must be a number, {low} < {name} < {high}, got {value}")
    return value


_INCLUDED = "__tt_moge_included__"  # a class attribute: the names of the fields that include_options copied


def include_options(source: type, *, after: str) -> Callable[[type], type]:
    """A class decorator, applied before @dataclass: the option fields of the dataclass `source` become fields
    of the decorated class too, right after its field `after` (same names, types, defaults and metadata).
    `own_options` leaves them out."""

    def decorate(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        if after not in own:
            raise TypeError(f"{cls.__name__} has no field {after!r} to put the options of {source.__name__} after")
        annotations: dict = {}
        resolved = typing.get_type_hints(source)  # its names resolve in its own module, not in cls's
        for name, annotation in own.items():
            annotations[name] = annotation
            if name == after:
                for f in dataclasses.fields(source):
                    if f.name in own:
                        raise TypeError(f"{cls.__name__}.{f.name} would shadow the option of {source.__name__}")
                    annotations[f.name] = resolved.get(f.name, f.type)
                    default = (
                        {"default": f.default}
                        if f.default is not dataclasses.MISSING
                        else {"default_factory": f.default_factory}
                    )
                    setattr(cls, f.name, dataclasses.field(**default, metadata=f.metadata))
        cls.__annotations__ = annotations
        setattr(cls, _INCLUDED, cls.__dict__.get(_INCLUDED, ()) + tuple(f.name for f in dataclasses.fields(source)))
        return cls

    return decorate


def own_options(cls: type) -> tuple:
    """The options of `cls` that it defines itself: those of `options_of(cls)` that `include_options` did not copy
    from another record (a BatchJob's own settings, without the call and clip options)."""
    included = set(cls.__dict__.get(_INCLUDED, ()))
    return tuple(info for info in options_of(cls) if info.name not in included)


def non_negative_int(text: str) -> int:
    """Command-line text -> an integer >= 0."""
    if not text.strip().isdigit():
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return int(text)
