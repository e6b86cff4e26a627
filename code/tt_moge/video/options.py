"""VideoOptions: the options of a video call beyond those of one image, each defined once (`tt_moge.fields`).

`predict_video(model, source, ...)` and `model.predict_video(source, ...)` take the call options of one image
(`host.CallOptions`: fit, fov_x, intrinsics, apply_mask, force_projection) and these, written out in their defs
(tests/test_one_definition.py checks them against these fields). `tt-moge predict`'s video flags are generated
from both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Mapping, Optional

from ..fields import checked, option, options_of, takes_options
from ..host import InputError

__all__ = ["VideoOptions", "DEFAULT_CALIBRATION_FRAMES", "DEFAULT_NEW_CHAIN_AFTER"]

DEFAULT_CALIBRATION_FRAMES = 16
DEFAULT_NEW_CHAIN_AFTER = 3  # failed frames in a row before a new chain starts


def _count(name: str, minimum: int, optional: bool):
    def check(value: Any) -> Optional[int]:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
            raise InputError(f"{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}")
        return int(value)

    return check


def _count_text(minimum: int):
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)

    return parse


def _check_voxel(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real) or not (math.isfinite(value) and value > 0):
        raise InputError(f"voxel_size must be a positive number of metres or None, got {value!r}")
    return float(value)


def _voxel_text(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected metres, e.g. 0.05, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a positive number of metres, got {text!r}")
    return value


@dataclass(frozen=True)
class VideoOptions:
    """The per-clip options of `predict_video`, validated (`make`). Each field is the one definition of its option:
    the video flags of `tt-moge predict` are generated from them; `make`, `predict_video`, `iter_video` and the
    query parameters of the server's /predict/video have them written out, in this order (checked by
    tests/test_one_definition.py)."""

    stride: int = option(
        1, "use every Nth frame of the source", metavar="N", parse=_count_text(1), check=_count("stride", 1, False)
    )
    max_frames: Optional[int] = option(
        None,
        "stop after this many frames (counted after the stride)",
        metavar="N",
        parse=_count_text(1),
        check=_count("max_frames", 1, True),
    )
    calibration_frames: int = option(
        DEFAULT_CALIBRATION_FRAMES,
        "the clip's intrinsics and metric scale are estimated on its first N frames (their forwards are kept in "
        "memory until the real pass finishes them again; default %(default)s)",
        metavar="N",
        parse=_count_text(2),
        check=_count("calibration_frames", 2, False),
    )
    window: Optional[int] = option(
        None,
        "re-estimate the intrinsics and the metric scale every N frames, to follow slow changes such as a zoom "
        "(default: once per clip)",
        metavar="N",
        parse=_count_text(2),
        check=_count("window", 2, True),
    )
    new_chain_after: int = option(
        DEFAULT_NEW_CHAIN_AFTER,
        "when N frames in a row fail registration (a cut to another scene), a new chain of poses starts in a world "
        "of its own: at the first of them with the texture to register against (with calibrate_chains; else at "
        "the Nth) (default %(default)s; 0: never, the frames after a cut stay flagged)",
        metavar="N",
        parse=_count_text(0),
        check=_count("new_chain_after", 0, False),
    )
    calibrate_chains: bool = option(
        True,
        "calibrate each new chain on its own first calibration_frames frames (a cut is mostly to another shot: "
        "another lens or zoom, another scene): its intrinsics (unless given) and its metric level; the frames run "
        "again from the chain's first one (the failed frames before the cut was known are held, then run again "
        "in the chain), and a cut back to an earlier chain runs on with that chain's intrinsics (off: every chain "
        "keeps the clip's, and starts at the last of the failed frames)",
    )
    voxel_size: Optional[float] = option(
        None,
        "the voxel of the fused point cloud, in metres (default: 1%% of the first frame's median depth)",
        metavar="M",
        parse=_voxel_text,
        check=_check_voxel,
    )

    def __post_init__(self) -> None:
        if self.window is not None and self.window < self.calibration_frames:
            raise InputError(
                f"window ({self.window}) must be at least calibration_frames ({self.calibration_frames}): each "
                "window is calibrated on its first calibration_frames frames"
            )

    @classmethod
    @takes_options("VideoOptions.make")
    def make(
        cls,
        stride: int = 1,
        max_frames: Optional[int] = None,
        calibration_frames: int = DEFAULT_CALIBRATION_FRAMES,
        window: Optional[int] = None,
        new_chain_after: int = DEFAULT_NEW_CHAIN_AFTER,
        calibrate_chains: bool = True,
        voxel_size: Optional[float] = None,
    ) -> "VideoOptions":
        """Validated options (an InputError naming the option); positional arguments in field order."""
        return cls.of_arguments(locals())

    @classmethod
    def of_arguments(cls, given: Mapping) -> "VideoOptions":
        """The options in `given`, a mapping that holds every option's argument (a `bind` result, or the `locals()`
        of a def that has them as its parameters), validated: a bad value is an InputError naming the option."""
        return cls(**{i.name: checked(i, given[i.argument], InputError, InputError) for i in options_of(cls)})

    def kwargs(self) -> dict:
        """{argument: value}: these options as keyword arguments of `predict_video`."""
        return {i.argument: getattr(self, i.name) for i in options_of(type(self))}
