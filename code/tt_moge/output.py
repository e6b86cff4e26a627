"""MoGeOutput: what one image gives, at the image's own resolution, plus the npz layout shared with the server.

Each field of `MoGeOutput` is the one definition of an output (`output_field`): what it holds, its dtype and
shape in the npz, its dtype in memory and its key in the summary. Generated from these definitions: the npz
layout (`NPZ_LAYOUT`: `save_npz`, the server's `/predict` response, the CLI and batch jobs), `from_npz`, the
summary record (`summary()` and `SUMMARY_FIELDS`: the server's /predict/summary, result.json, Parquet rows, the
web page's numbers, `SUMMARY_SHOWN`) and `sliced` (every map cut to a grid). A new output is one new field here,
and its producer in `host/finish.py`.

| key                 | dtype   | shape     | content                                                     |
|---------------------|---------|-----------|-------------------------------------------------------------|
| `points`            | float32 | (H, W, 3) | metres, camera space (x right, y down, z forward)           |
| `depth`             | float32 | (H, W)    | metres (z)                                                  |
| `normal`            | float16 | (H, W, 3) | unit normals, camera space (absent for models without one)  |
| `mask`              | uint8   | (H, W)    | 1 = valid                                                   |
| `intrinsics`        | float32 | (3, 3)    | normalised (fx, cx by width; fy, cy by height)              |
| `intrinsics_pixels` | float32 | (3, 3)    | in pixels                                                   |
| `metric_scale`      | float32 | ()        | the predicted scale, already applied                        |
| `fov_x`, `fov_y`    | float32 | ()        | degrees                                                     |
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import zipfile
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import numpy as np

__all__ = [
    "MoGeOutput",
    "NPZ_LAYOUT",
    "SUMMARY_FIELDS",
    "SUMMARY_SHOWN",
    "Shown",
    "INFER_KEYS",
    "OutputField",
    "output_field",
    "finite_or_none",
    "depth_p1_p99",
]

_KEY = "tt_moge.output"  # the key of a field's OutputField in its dataclass metadata


@dataclass(frozen=True)
class Shown:
    """How the web page shows a number of the summary: `label`, then `value * scale` with `digits` decimals and
    `unit` (e.g. a fraction as a percentage: scale 100, unit " %")."""

    label: str
    digits: int = 4
    unit: str = ""
    scale: float = 1.0


@dataclass(frozen=True)
class OutputField:
    """One output, for people and for each surface.

    content   what it holds, with units (the docs, the npz table, the summary's descriptions).
    npz       (dtype, shape) in the npz layout; a shape starting "(H, W" is a map at the image's size.
    memory    its numpy dtype in memory, where it differs from the npz dtype (scalars are Python floats).
    summary   its key in the summary record (None: not in it; maps are summarised by derived numbers).
    optional  it may be None (then it is absent from the npz), e.g. the normal of a model without that head.
    shown     how the web page shows its summary number (`Shown`; default: its content, 4 decimals).
    """

    content: str
    npz: tuple
    memory: Optional[str] = None
    summary: Optional[str] = None
    optional: bool = False
    shown: Optional[Shown] = None

    @property
    def is_map(self) -> bool:
        return self.npz[1].startswith("(H, W")

    @property
    def is_scalar(self) -> bool:
        return self.npz[1] == "()"


def output_field(
    content: str,
    npz: tuple,
    *,
    memory: Optional[str] = None,
    summary: Optional[str] = None,
    optional: bool = False,
    shown: Optional[Shown] = None,
    **default: Any,
) -> Any:
    """A dataclass field of MoGeOutput that is an output (see `OutputField`); `default=...` gives it a default."""
    return dataclasses.field(**default, metadata={_KEY: OutputField(content, npz, memory, summary, optional, shown)})


def finite_or_none(x: Any) -> Optional[float]:
    """A float for JSON: None where it is not finite."""
    x = float(x)
    return x if math.isfinite(x) else None


def depth_p1_p99(depth: np.ndarray, mask: np.ndarray) -> dict:
    """{"depth_p1_m", "depth_p99_m"}: the 1st and 99th percentile of the valid finite depths (None without any)."""
    valid = mask & np.isfinite(depth)
    p1, p99 = np.percentile(depth[valid], [1.0, 99.0]) if valid.any() else (math.nan, math.nan)
    return {"depth_p1_m": finite_or_none(p1), "depth_p99_m": finite_or_none(p99)}


def _summarised(value: Any) -> Any:
    """An output's summary entry: a number (None where not finite), or nested lists of them."""
    if np.ndim(value) == 0:
        return finite_or_none(value)
    return [_summarised(v) for v in np.asarray(value, np.float64)]


@dataclass(repr=False, eq=False)
class MoGeOutput:
    """The result for one image. Arrays are numpy, at the input image's resolution (see each field)."""

    points: np.ndarray = output_field("metres, camera space (x right, y down, z forward)", ("float32", "(H, W, 3)"))
    depth: np.ndarray = output_field("metres (z); inf where mask is False when masked", ("float32", "(H, W)"))
    normal: Optional[np.ndarray] = output_field(
        "unit normals, camera space (absent for models without one)",
        ("float16", "(H, W, 3)"),
        memory="float32",
        optional=True,
    )
    mask: np.ndarray = output_field("1 = valid", ("uint8", "(H, W)"), memory="bool")
    intrinsics: np.ndarray = output_field(
        "normalised (fx, cx by width; fy, cy by height)", ("float32", "(3, 3)"), summary="intrinsics"
    )
    intrinsics_pixels: np.ndarray = output_field("in pixels", ("float32", "(3, 3)"), summary="intrinsics_pixels")
    metric_scale: float = output_field(
        "the predicted scale, already applied", ("float32", "()"), summary="metric_scale", shown=Shown("Metric scale")
    )
    fov_x: float = output_field(
        "horizontal field of view, degrees",
        ("float32", "()"),
        summary="fov_x_deg",
        shown=Shown("Horizontal field of view", 1, "°"),
    )
    fov_y: float = output_field(
        "vertical field of view, degrees",
        ("float32", "()"),
        summary="fov_y_deg",
        shown=Shown("Vertical field of view", 1, "°"),
    )

    @property
    def size(self) -> tuple:
        """(width, height)."""
        return self.depth.shape[1], self.depth.shape[0]

    @property
    def valid_fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0

    @property
    def median_depth(self) -> float:
        d = self.depth[self.mask]
        d = d[np.isfinite(d)]
        return float(np.median(d)) if d.size else math.nan

    def summary(self, depth_percentiles: bool = False) -> dict:
        """The numbers of this result without the maps (JSON-ready; non-finite values are None), as
        `SUMMARY_FIELDS` lists them: size, the summary entry of each output (fields of view in degrees,
        intrinsics normalised and in pixels, metric scale), valid fraction, median depth of the valid pixels
        (metres), whether there is a normal map; with `depth_percentiles`, also the 1st and 99th percentile depth
        (one pass over the valid pixels). The server's /predict/summary, result.json of the CLI and of batch jobs
        are this record (result.json adds the percentiles)."""
        w, h = self.size
        record: dict = {"width": w, "height": h}
        for name, spec in _FIELDS.items():
            if spec.summary is not None:
                record[spec.summary] = _summarised(getattr(self, name))
        record.update(
            valid_fraction=float(self.valid_fraction),
            median_depth_m=finite_or_none(self.median_depth),
            has_normal=self.normal is not None,
        )
        if depth_percentiles:
            record.update(depth_p1_p99(self.depth, self.mask))
        return record

    def sliced(self, rows: slice, cols: slice) -> "MoGeOutput":
        """The same result with every map cut to `[rows, cols]` (views, no copy); the rest as it is."""
        return dataclasses.replace(
            self,
            **{
                name: getattr(self, name)[rows, cols]
                for name, spec in _FIELDS.items()
                if spec.is_map and getattr(self, name) is not None
            },
        )

    def __repr__(self) -> str:
        w, h = self.size
        med = self.median_depth
        med_s = f"{med:.3f} m" if math.isfinite(med) else "n/a"
        return (
            f"MoGeOutput({w}x{h}, valid {100 * self.valid_fraction:.1f}%, median depth {med_s}, "
            f"fov_x {self.fov_x:.1f} deg, metric_scale {self.metric_scale:.4f})"
        )

    # --- the upstream infer() dict view -------------------------------------------------------------
    def keys(self) -> list:
        """The keys of upstream `infer()`'s dict that this output has (normal only with a normal head)."""
        return [k for k in INFER_KEYS if getattr(self, k) is not None]

    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        value = getattr(self, key)
        if value is None:
            raise KeyError(f"{key} (this model has no {key} head)")
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())

    def to_dict(self) -> dict:
        """{key: numpy array} with the upstream `infer()` keys."""
        return {k: getattr(self, k) for k in self.keys()}

    def to_torch(self) -> dict:
        """The upstream `infer()` dict: torch tensors (points, intrinsics, depth, mask (bool), normal)."""
        import torch

        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.to_dict().items()}

    # --- npz ---------------------------------------------------------------------------------------
    def npz_arrays(self) -> dict:
        """The arrays of the npz layout, with its dtypes."""
        out = {}
        for key, (dtype, _) in NPZ_LAYOUT.items():
            value = getattr(self, key)
            if value is not None:
                out[key] = np.asarray(value, dtype=dtype)
        return out

    def exact_arrays(self) -> dict:
        """Every output as it is in memory (float32 normals, a bool mask), for an exact copy:
        `np.savez(f, **out.exact_arrays())`, which `from_npz` reads back unchanged."""
        return {name: np.asarray(getattr(self, name)) for name in _FIELDS if getattr(self, name) is not None}

    def to_npz_bytes(self, compress: bool = False) -> bytes:
        """The npz file as bytes; compress=True deflates the maps (ISA-L when installed, see `tt_moge.npzio`)."""
        from .npzio import npz_bytes

        return npz_bytes(self.npz_arrays(), compress=compress)

    def save_npz(self, path: Union[str, os.PathLike], compress: bool = False) -> None:
        """Write the npz layout (normal float16, mask uint8) to `path`, part by part (no copy of the whole file
        in memory)."""
        from .npzio import npz_parts

        with open(path, "wb") as f:
            f.writelines(npz_parts(self.npz_arrays(), compress=compress))

    @classmethod
    def from_npz(cls, source: Union[str, os.PathLike, bytes]) -> "MoGeOutput":
        """Read an npz written by `save_npz` or returned by the server (normal comes back as float32), or one
        of `exact_arrays`."""
        try:
            data = np.load(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source, allow_pickle=False)
        except (zipfile.BadZipFile, EOFError, ValueError) as exc:
            raise ValueError(f"not a tt_moge npz ({exc})") from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("not a tt_moge npz (a single .npy array)")
        with data:  # closes the file
            return cls._from_arrays(data)

    @classmethod
    def _from_arrays(cls, data: Any) -> "MoGeOutput":
        values: dict = {}
        try:
            for f in fields(cls):
                spec = f.metadata[_KEY]
                if f.name not in data.files:
                    if spec.optional:
                        values[f.name] = None
                    elif f.default is dataclasses.MISSING:
                        raise KeyError(f"{f.name} is missing")
                    continue
                value = data[f.name]
                if spec.is_scalar:
                    values[f.name] = float(value)
                else:
                    wanted = np.dtype(spec.memory or spec.npz[0])
                    values[f.name] = value if value.dtype == wanted else value.astype(wanted)
            return cls(**values)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ValueError(f"not a tt_moge npz ({exc})") from None


_FIELDS: dict = {f.name: f.metadata[_KEY] for f in fields(MoGeOutput)}  # {name: OutputField}, in field order
NPZ_LAYOUT: dict = {name: spec.npz for name, spec in _FIELDS.items()}  # {key: (dtype, shape)}
# The numbers the summary derives from the maps: {key: (type, what it is, how the web page shows it or None)}.
_DERIVED: dict = {
    "valid_fraction": (float, "share of pixels with mask == 1", Shown("Valid pixels", 1, " %", 100.0)),
    "median_depth_m": (
        Optional[float],
        "median depth of the valid pixels, metres; null when none is valid",
        Shown("Median depth", 2, " m"),
    ),
    "has_normal": (bool, "whether there is a normal map (the model has a normal head)", None),
}
# The summary record: {key: (type, what it is)}, in its order (the server's Summary is generated from it).
SUMMARY_FIELDS: dict = {
    "width": (int, "image width, pixels"),
    "height": (int, "image height, pixels"),
    **{
        spec.summary: (Optional[float] if spec.is_scalar else list[list[Optional[float]]], f"{name}: {spec.content}")
        for name, spec in _FIELDS.items()
        if spec.summary is not None
    },
    **{key: (kind, what) for key, (kind, what, _) in _DERIVED.items()},
}
# The numbers of the summary the web page shows, {key: Shown}, in the summary's order: every scalar output's,
# then the derived ones that say how (the page's numbers table is built from this, served by /ui/api/config).
SUMMARY_SHOWN: dict = {
    **{
        spec.summary: spec.shown or Shown(spec.content)
        for spec in _FIELDS.values()
        if spec.summary is not None and spec.is_scalar
    },
    **{key: shown for key, (_, _, shown) in _DERIVED.items() if shown is not None},
}
# The keys of upstream MoGe's `infer()` dict, in its order.
INFER_KEYS = ("points", "intrinsics", "depth", "mask", "normal")
