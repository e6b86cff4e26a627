"""Test and benchmark support that ships with the package: random-weight checkpoints in the published
`model.pt` format (`checkpoints`) and the analytic demo scene with exact ground truth (`scene`)."""

from .checkpoints import PRESETS, add_outlier_channels, calibration_image, make_checkpoint, make_network, model_config

__all__ = ["PRESETS", "add_outlier_channels", "calibration_image", "make_checkpoint", "make_network", "model_config"]
