"""Test and benchmark support that ships with the package: random-weight checkpoints in the published
`model.pt` format (`checkpoints`), the analytic demo scene with exact ground truth (`scene`) and the room of
planes of the panorama path, with a recorder of upstream's panorama least squares (`room`)."""

from .checkpoints import (
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
