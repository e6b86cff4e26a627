"""Tools around the Tenstorrent runner that the runtime never imports: the mock-device check (`mock_check`),
the cost model (`cost`), its calibration on tt-metal's published Blackhole figures (`calibration`: what is fitted,
what is held out) and the transcriptions of tt-metal's models it is calibrated and checked on (`hires_vit`,
`vit_base`, `unet_shallow`, `sentence_bert`, `ufld_v2`, `vgg_unet`, `resnet50`). Like `runners.ttnn`, importing
this package imports neither torch nor ttnn: the mock check runs in a Python 3.12 venv with ttnn and numpy only."""
