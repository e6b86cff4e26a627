"""code/examples/quickstart.py runs from any directory and writes its files (tiny random checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_from_another_directory(checkpoint, tmp_path):
    env = dict(os.environ, MOGE_WEIGHTS_DIR=str(checkpoint("tiny-vits-normal").parent), PYTHONPATH="")
    run = subprocess.run(
        [sys.executable, str(QUICKSTART), "--device", "cpu"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("MoGeOutput(1920x1080, valid ")
    out = tmp_path / "moge_output"
    for name in ("depth.png", "normal.png", "mask.png", "depth.exr", "result.npz", "result.json"):
        assert (out / name).stat().st_size > 0, name
    data = np.load(out / "result.npz")
    assert data["depth"].shape == (1080, 1920) and 0.05 < data["mask"].mean() < 0.95
    import OpenEXR
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(out / "mask.png")) > 0, data["mask"].astype(bool))
    with OpenEXR.File(str(out / "depth.exr")) as exr:
        assert np.array_equal(exr.channels()["Y"].pixels, data["depth"])
    record = json.loads((out / "result.json").read_text())
    assert record["width"] == 1920 and record["source"].endswith("media/source.png")
