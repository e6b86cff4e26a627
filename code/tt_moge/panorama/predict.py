"""`predict_panorama`: an equirectangular photo -> distance, points and mask for the whole sphere.

Steps: decode; split into the 12 perspective views (`geometry.split_panorama`); run the model on them with
their known field of view (`fov_x` = 90, so only each view's depth shift is solved) through `predict_many`, so
the device pipeline stays full; each view's distance = |points| (metres, the view's own metric scale);
merge them (`merge.merge_distance_maps`) at up to MERGE_MAX_SIZE; resize to the panorama's size; points =
unit direction x distance.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..output import depth_p1_p99, finite_or_none
from .geometry import VIEW_FOV_DEG, check_panorama_size, panorama_directions, split_panorama, view_cameras
from .merge import merge_distance_maps

__all__ = ["PanoramaOutput", "predict_panorama", "MERGE_MAX_SIZE", "PANORAMA_CANVAS", "options_not_for_panoramas"]

MERGE_MAX_SIZE = (1920, 960)  # (width, height): the merge runs at the panorama's size, at most this (upstream's)
PANORAMA_CANVAS = (512, 512)  # the canvas that fits the views: square, the views' own size (docs/panorama.md)
PANORAMA_CALL_OPTIONS = ("apply_mask",)  # the one option of model(image, ...) that a panorama takes too


def options_not_for_panoramas(call: Any) -> list:
    """The options of a `host.CallOptions` that are set away from their defaults but mean nothing for a
    panorama (as `fields.OptionInfo`s; [] when none). Its views have a known camera (fov_x and intrinsics), a
    fixed square size (fit) and their own projection; only `apply_mask` applies. The command line and the batch
    job refuse these by name instead of ignoring them."""
    from ..fields import options_of

    return [
        info
        for info in options_of(type(call))
        if info.argument not in PANORAMA_CALL_OPTIONS and getattr(call, info.name) != info.default
    ]


# The npz layout of a panorama (PanoramaOutput.save_npz, `tt-moge predict --panorama`).
PANORAMA_NPZ_LAYOUT: dict = {
    "points": ("float32", "(H, W, 3)"),
    "distance": ("float32", "(H, W)"),
    "mask": ("uint8", "(H, W)"),
}


@dataclass(repr=False, eq=False)
class PanoramaOutput:
    """The result for one panorama, at the panorama's resolution (numpy arrays).

    distance (H, W) float32: metres from the viewpoint along each pixel's ray (inf where mask is False when
    masked); points (H, W, 3) float32: unit direction x distance, in the panorama axes of
    `tt_moge.panorama.geometry` (x right, y down, z forward = the centre column on the horizon); mask (H, W)
    bool. views: the per-view MoGeOutputs when asked for (`return_views=True`), else None. view_errors: per view,
    None or why it failed (it then takes no part in the merge). The merge's least-squares solve:
    merge_iterations (CG steps), merge_residual (its final relative residual |rhs - M x| / |rhs|) and
    merge_converged (False when it stopped short of its tolerance: the distances may then be off the
    objective's minimiser, and a RuntimeWarning said so). seconds ("views", "merge", ...) say what the call
    cost.
    """

    distance: np.ndarray
    points: np.ndarray
    mask: np.ndarray
    view_errors: list
    views: Optional[list] = None
    merge_iterations: int = 0
    merge_residual: float = math.nan
    merge_converged: bool = False
    seconds: dict = field(default_factory=dict)

    normal = None  # no normal map for panoramas (the exports skip it)
    is_panorama = True  # the exports close the mesh at the seam

    @property
    def depth(self) -> np.ndarray:
        """The distance map: a panorama has no single optical axis, so "depth" is the distance from its centre."""
        return self.distance

    @property
    def size(self) -> tuple:
        """(width, height)."""
        return self.distance.shape[1], self.distance.shape[0]

    @property
    def valid_fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0

    @property
    def median_distance(self) -> float:
        d = self.distance[self.mask]
        d = d[np.isfinite(d)]
        return float(np.median(d)) if d.size else math.nan

    def summary(self, depth_percentiles: bool = False) -> dict:
        """The numbers of this result without the maps (JSON-ready): size, valid fraction, median distance,
        the views that failed, the merge's iterations, final relative residual and converged flag, the
        seconds; with `depth_percentiles`, the 1st and 99th percentile distance (named depth_* as for photos,
        so the same readers work)."""
        w, h = self.size
        record = {
            "kind": "panorama",
            "width": w,
            "height": h,
            "valid_fraction": self.valid_fraction,
            "median_distance_m": finite_or_none(self.median_distance),
            "views": len(self.view_errors),
            "views_failed": [{"view": i, "error": e} for i, e in enumerate(self.view_errors) if e],
            "merge_iterations": self.merge_iterations,
            "merge_residual": finite_or_none(self.merge_residual),
            "merge_converged": bool(self.merge_converged),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "has_normal": False,
        }
        if depth_percentiles:
            record.update(depth_p1_p99(self.distance, self.mask))
        return record

    def __repr__(self) -> str:
        w, h = self.size
        med = self.median_distance
        failed = sum(e is not None for e in self.view_errors)
        return (
            f"PanoramaOutput({w}x{h}, valid {100 * self.valid_fraction:.1f}%, median distance "
            f"{f'{med:.3f} m' if math.isfinite(med) else 'n/a'}, {len(self.view_errors) - failed}/"
            f"{len(self.view_errors)} views{'' if self.merge_converged else ', merge not converged'})"
        )

    def sliced(self, rows: slice, cols: slice) -> "PanoramaOutput":
        """The same result with every map cut to `[rows, cols]` (views, no copy), as `MoGeOutput.sliced`."""
        maps = {"distance": self.distance[rows, cols], "points": self.points[rows, cols], "mask": self.mask[rows, cols]}
        return dataclasses.replace(self, **maps)

    def npz_arrays(self) -> dict:
        return {k: np.asarray(getattr(self, k), dtype=dt) for k, (dt, _) in PANORAMA_NPZ_LAYOUT.items()}

    def to_npz_bytes(self, compress: bool = False) -> bytes:
        """The npz file as bytes (the bytes of POST /predict/panorama); compress=True deflates the maps."""
        from ..npzio import npz_bytes

        return npz_bytes(self.npz_arrays(), compress=compress)

    @classmethod
    def from_npz(cls, source: Any) -> "PanoramaOutput":
        """The maps of a panorama npz (a path or file, or its bytes: `save_npz`, POST /predict/panorama, a
        `tt-moge batch --panorama --format parquet` row) back as a PanoramaOutput (the views' errors and the
        merge's numbers are not in the file)."""
        import io

        if isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(source)
        with np.load(source) as arrays:
            return cls(
                distance=arrays["distance"], points=arrays["points"], mask=arrays["mask"].astype(bool), view_errors=[]
            )

    def save_npz(self, path: Any, compress: bool = False) -> None:
        """points, distance (float32) and mask (uint8) to `path`; compress=True deflates them (as MoGeOutput)."""
        (np.savez_compressed if compress else np.savez)(path, **self.npz_arrays())


def _predict_views(model: Any, views: list) -> tuple:
    """[MoGeOutput or None], [None or error text]: the views through predict_many; if that fails, one by one,
    so that one failing view costs only itself."""
    from ..service import DeviceError  # here: importing this module must not import torch (the CLI's --help)

    options = dict(fov_x=VIEW_FOV_DEG, apply_mask=False)
    try:
        return list(model.predict_many(views, **options)), [None] * len(views)
    except DeviceError:  # the device failed, not a view: the panorama fails
        raise
    except Exception:
        outputs, errors = [], []
        for view in views:
            try:
                outputs.append(model.predict(view, **options))
                errors.append(None)
            except DeviceError:
                raise
            except Exception as exc:
                outputs.append(None)
                errors.append(str(exc) or type(exc).__name__)
        return outputs, errors


def predict_panorama(model: Any, image: Any, *, return_views: bool = False, apply_mask: bool = True) -> PanoramaOutput:
    """An equirectangular image (any input `model(...)` takes, width = 2 x height) -> PanoramaOutput
    (see the module docstring). A view whose model call fails, or that has no valid pixel, is reported in
    `view_errors` and left out of the merge; a RuntimeError when no view is left."""
    import cv2

    from ..host.decode import to_rgb_array

    t0 = time.perf_counter()
    rgb = to_rgb_array(image, name="image", min_side=1)
    height, width = rgb.shape[:2]
    check_panorama_size(width, height, "image")  # the panorama's own minimum, 16x8
    cameras = view_cameras()
    views = split_panorama(rgb, cameras)
    t1 = time.perf_counter()
    outputs, errors = _predict_views(model, views)
    t2 = time.perf_counter()
    distances, masks = [], []
    for i, out in enumerate(outputs):
        if out is None:
            distances.append(np.ones(views[i].shape[:2], np.float32))
            masks.append(np.zeros(views[i].shape[:2], bool))
            continue
        distance = np.linalg.norm(out.points, axis=-1)
        valid = out.mask & np.isfinite(distance) & (distance > 0)
        if not valid.any() and errors[i] is None:
            errors[i] = "no valid pixel in this view"
        # invalid pixels keep their distance (bilinear samples next to them read it, as upstream's do)
        distances.append(np.where(np.isfinite(distance) & (distance > 0), distance, 1.0).astype(np.float32))
        masks.append(valid)
    if all(e is not None for e in errors):
        raise RuntimeError(
            "image: no view of the panorama gave a valid pixel ("
            + "; ".join(f"view {i}: {e}" for i, e in enumerate(errors))
            + ")"
        )
    merge_w, merge_h = min(MERGE_MAX_SIZE[0], width), min(MERGE_MAX_SIZE[1], height)
    merged = merge_distance_maps(distances, masks, cameras, merge_w, merge_h)
    t3 = time.perf_counter()
    distance, mask = merged.distance, merged.mask
    if (merge_w, merge_h) != (width, height):
        distance = cv2.resize(distance, (width, height), interpolation=cv2.INTER_LINEAR)
        mask = cv2.resize(mask.astype(np.uint8), (width, height), interpolation=cv2.INTER_NEAREST) > 0
    points = (panorama_directions(width, height, np.float32) * distance[..., None]).astype(np.float32)
    if apply_mask:
        distance = np.where(mask, distance, np.float32(np.inf)).astype(np.float32)
        points[~mask] = np.inf
    seconds = {
        "split": t1 - t0,
        "views": t2 - t1,
        "merge": t3 - t2,
        **{f"merge_{k}": v for k, v in merged.seconds.items()},
        "finish": time.perf_counter() - t3,
    }
    return PanoramaOutput(
        distance=distance,
        points=points,
        mask=mask,
        view_errors=errors,
        views=outputs if return_views else None,
        merge_iterations=merged.iterations,
        merge_residual=merged.residual,
        merge_converged=merged.converged,
        seconds=seconds,
    )
