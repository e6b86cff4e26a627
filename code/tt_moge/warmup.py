"""Warm-up variants: the call paths `from_pretrained` prepares so that their first real call is fast.

A variant is a dict with the keys below (any subset; the rest take their defaults). Presets name lists of
variants. `MoGeModel.warmup(**variant)` runs one; it is idempotent per canonical variant.

| key                | values                                                        | default        |
|--------------------|---------------------------------------------------------------|----------------|
| input              | "array" (uint8 numpy), "float" (float32 torch (1,3,H,W)),     | "array"        |
|                    | "png", "jpeg" (a temporary file path), "pil"                  |                |
| size               | (width, height) of the input image                            | the canvas     |
| every call option  | as in model(image, ...) (`host.CallOptions`: fit, fov_x,      | call defaults  |
|                    | apply_mask, force_projection); for fov_x only "given or not"  |                |
|                    | matters                                                       |                |
| call               | "call", "predict_many" (2 images), "infer", "forward"         | "call"         |

The call-option keys are generated from `host.CallOptions`: a new call option is a new key.

How a variant is warmed (`run_variant`): one real call of that kind with a synthetic photo-like image of that
size (one image per size per load; a temporary PNG/JPEG file for the decoders). The device part is the same
fixed-shape forward for every variant and is warmed by the device warm-up forwards, so host variants do not
run the device again: they call a copy of the model whose runner replays the raw maps of the last device
warm-up (`runners.base.ReplayRunner`).
Loading therefore stays fast on a CPU device too, and only the host paths (decoder, canvas fit, solve,
finish, their scratch and output buffers, see tt_moge/host/buffers.py) are exercised per variant.
No result is kept, so warm-up does not change any output.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Iterable, Union

import numpy as np

from .fields import checked, options_of
from .host.pipeline import CallOptions
from .synthetic import synthetic_photo

__all__ = [
    "INPUTS",
    "CALLS",
    "PRESETS",
    "KEYS",
    "canonical_variant",
    "expand_variants",
    "run_variant",
]

INPUTS = ("array", "float", "png", "jpeg", "pil")
CALLS = ("call", "predict_many", "infer", "forward")
_CALL_OPTIONS = options_of(CallOptions)
KEYS = ("input", "size", *(o.argument for o in _CALL_OPTIONS), "call")  # of a variant, in its canonical order
_SMALL = (800, 600)

PRESETS: dict[str, list] = {
    "none": [],
    "minimal": [{"input": "array"}],
    "default": [
        {"input": "array"},
        {"input": "float"},
        {"input": "png"},
        {"input": "jpeg", "size": _SMALL},
        {"input": "array", "size": _SMALL, "fit": "stretch"},
        {"input": "array", "fov_x": True},
        {"input": "array", "apply_mask": False, "force_projection": False},
        {"input": "float", "call": "forward"},
    ],
}
PRESETS["all"] = PRESETS["default"] + [
    {"input": "pil", "size": _SMALL},
    {"input": "float", "size": _SMALL},
    {"input": "float", "size": _SMALL, "call": "infer"},
    {"input": "png", "size": _SMALL},
    {"input": "png", "size": _SMALL, "call": "predict_many"},
    {"input": "array", "apply_mask": False},
    {"input": "array", "force_projection": False},
    {"input": "array", "call": "forward"},
]


def canonical_variant(variant: dict, canvas_size: tuple, name: str = "warm-up variant") -> tuple:
    """Validate a variant dict and return its hashable canonical form (key, value) pairs in KEYS order. Errors
    begin with `name` (the argument the variant came from)."""
    if not isinstance(variant, dict):
        raise TypeError(f"{name} must be a dict, got {type(variant).__name__}")
    unknown = sorted(set(variant) - set(KEYS))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; expected keys from {list(KEYS)}")
    v = {"input": "array", "size": tuple(canvas_size), "call": "call"}
    v.update({o.argument: False if o.spec.warm is not None else o.default for o in _CALL_OPTIONS})
    v.update(variant)
    if v["input"] not in INPUTS:
        raise ValueError(f"{name}: input must be one of {INPUTS}, got {v['input']!r}")
    if v["call"] not in CALLS:
        raise ValueError(f"{name}: call must be one of {CALLS}, got {v['call']!r}")
    size = v["size"]
    if (
        not isinstance(size, (tuple, list))
        or len(size) != 2
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 8 for s in size)
    ):
        raise ValueError(f"{name}: size must be (width, height) integers >= 8, got {size!r}")
    v["size"] = tuple(size)
    for o in _CALL_OPTIONS:
        if o.spec.warm is not None:  # only "given or not" matters
            v[o.argument] = v[o.argument] is not None and v[o.argument] is not False
        else:
            try:
                v[o.argument] = checked(o, v[o.argument])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{name}: {exc}") from None
    if v["call"] == "forward" and v["size"] != tuple(canvas_size):
        raise ValueError(f"{name}: call='forward' takes the canvas size {tuple(canvas_size)}, got size {v['size']}")
    return tuple((k, v[k]) for k in KEYS)


def expand_variants(spec: Union[str, dict, Iterable, None], canvas_size: tuple) -> list:
    """A preset name, a variant dict, or a list of them -> canonical variants without duplicates, in order."""
    if spec is None:
        return []
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(
                f"warmup_variants: unknown preset {spec!r}; expected one of {sorted(PRESETS)}, a variant dict or a list"
            )
        items: list[Any] = list(PRESETS[spec])
    elif isinstance(spec, dict):
        items = [spec]
    elif isinstance(spec, (list, tuple)):
        items = []
        for entry in spec:
            items.extend(PRESETS[entry] if isinstance(entry, str) and entry in PRESETS else [entry])
    else:
        raise TypeError(f"warmup_variants must be a preset name, a variant dict or a list, got {type(spec).__name__}")
    out: list = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            raise ValueError(f"warmup_variants: unknown preset {item!r}; expected one of {sorted(PRESETS)}")
        where = (
            "warmup_variants" if isinstance(spec, dict) else f"warmup_variants (variant {index + 1} of {len(items)})"
        )
        key = canonical_variant(item, canvas_size, where)
        if key not in out:
            out.append(key)
    return out


def run_variant(model: Any, key: tuple, photos: dict) -> None:
    """Call `model` (a MoGeModel, normally one that replays fixed raw maps) once the way the canonical variant
    `key` describes. `photos` caches one synthetic photo per size across the variants of a load."""
    v = dict(key)
    photo = photos.get(v["size"])
    if photo is None:
        photo = photos[v["size"]] = synthetic_photo(v["size"])
    options = {
        o.argument: (o.spec.warm if v[o.argument] else o.default) if o.spec.warm is not None else v[o.argument]
        for o in _CALL_OPTIONS
    }
    with tempfile.TemporaryDirectory(prefix="tt_moge-warmup-") as tmp:
        inputs = [_input(v["input"], photo, Path(tmp), i) for i in range(2 if v["call"] == "predict_many" else 1)]
        if v["call"] == "forward":
            model.forward(inputs[0])
        elif v["call"] == "infer":  # upstream's (3, H, W) float input, with every call option
            image = inputs[0]
            model.infer(image[0] if hasattr(image, "dim") else image, **options)
        elif v["call"] == "predict_many":
            model.predict_many(inputs, **options)
        else:
            model.predict(inputs[0], **options)


def _input(kind: str, photo: np.ndarray, tmp: Path, index: int) -> Any:
    """The synthetic photo as the input kind of a variant (a file path for "png" / "jpeg")."""
    if kind == "array":
        return photo
    if kind == "float":
        import torch

        return torch.from_numpy(photo).permute(2, 0, 1)[None].float().div_(255)
    from PIL import Image

    if kind == "pil":
        return Image.fromarray(photo)
    path = tmp / f"warmup{index}.{'png' if kind == 'png' else 'jpg'}"
    Image.fromarray(photo).save(path, quality=90) if kind == "jpeg" else Image.fromarray(photo).save(path)
    return str(path)
