"""Test and benchmark support that ships with the package: random-weight checkpoints in the published
`model.pt` format (`tt_moge.random_weights`, re-exported here under the names users know), the room of planes of
the panorama path, with a recorder of upstream's panorama least squares (`room`), the stand-in video model
(`video`) and the comparisons of one answer by two routes (`compare`). The analytic scene with exact ground truth
is `tt_moge.scene`. The library itself imports nothing from here (tests/test_layout.py)."""

from ..random_weights import (
    PRESETS,
    add_outlier_channels,
    add_residual_outliers,
    calibration_image,
    make_checkpoint,
    make_network,
    model_config,
)
from .room import recording_upstream_lsmr

__all__ = [
    "PRESETS",
    "add_outlier_channels",
    "add_residual_outliers",
    "calibration_image",
    "make_checkpoint",
    "make_network",
    "model_config",
    "recording_upstream_lsmr",
]
