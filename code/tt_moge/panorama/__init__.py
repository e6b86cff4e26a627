"""360-degree equirectangular panoramas: split into 12 perspective views, the model on each, the views'
distances merged into one metric distance map of the whole sphere (see docs/panorama.md).

`predict_panorama(model, image)` (also `MoGeModel.predict_panorama`) -> `PanoramaOutput`. The pieces:
`geometry` (axes, views, split) and `merge` (the least-squares merge and its metric offset)."""

from .geometry import (
    ASPECT_TOLERANCE,
    VIEW_FOV_DEG,
    VIEW_SIZE,
    ViewCamera,
    check_panorama_size,
    directions_to_pixels,
    panorama_directions,
    split_panorama,
    view_cameras,
)
from .merge import MergeResult, merge_distance_maps
from .predict import MERGE_MAX_SIZE, PANORAMA_CANVAS, PANORAMA_NPZ_LAYOUT, PanoramaOutput, predict_panorama

__all__ = [
    "ASPECT_TOLERANCE",
    "VIEW_FOV_DEG",
    "VIEW_SIZE",
    "ViewCamera",
    "check_panorama_size",
    "directions_to_pixels",
    "panorama_directions",
    "split_panorama",
    "view_cameras",
    "MergeResult",
    "merge_distance_maps",
    "MERGE_MAX_SIZE",
    "PANORAMA_CANVAS",
    "PANORAMA_NPZ_LAYOUT",
    "PanoramaOutput",
    "predict_panorama",
]
