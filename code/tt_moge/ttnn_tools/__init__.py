"""Tools around the Tenstorrent runner that the runtime never imports: the mock-device check (`mock_check`),
the cost model (`cost`) and the transcriptions of tt-metal's published Blackhole models it is calibrated and
checked on (`hires_vit`, `unet_shallow`). Like `runners.ttnn`, importing this package imports neither torch
nor ttnn: the mock check runs in a Python 3.12 venv with ttnn and numpy only."""
