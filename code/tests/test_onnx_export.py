"""`tt-moge export onnx`: the file ONNX Runtime runs matches our forward, names its input and outputs as the
spec says, carries the canvas and token budget, and the host steps of docs/export.md turn its outputs into the
same MoGeOutput as `model(image)`. Needs the export extra (onnx, onnxscript, onnxruntime), which CI installs."""

from __future__ import annotations

import re

import numpy as np
import pytest

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason='the export extra (pip install -e "code/[export]") is not installed')

from .conftest import TEST_CANVAS, TEST_TOKENS  # noqa: E402


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    """The tiny well-posed checkpoint exported through the command line at the API tests' small canvas, once:
    (path of the file, exit code, what the command printed), on a terminal where every step counts as slow
    (`progress.SLOW_STEP_S` = 0: each names itself)."""
    import contextlib
    import io

    from tt_moge import progress
    from tt_moge.cli import main

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    out, err = io.StringIO(), Terminal()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as patch:
        patch.setattr(progress, "SLOW_STEP_S", 0.0)
        code = main(
            [
                "export",
                "onnx",
                "-o",
                str(path),
                "--weights",
                str(checkpoint("tiny-vits-normal")),
                "--resolution",
                f"{TEST_CANVAS[0]}x{TEST_CANVAS[1]}",
                "--num-tokens",
                str(TEST_TOKENS),
            ]
        )
    return path, code, out.getvalue() + err.getvalue()


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_export_writes_the_raw_forward_that_onnx_runtime_runs_to_our_precision(exported, checkpoint):
    import torch

    from tt_moge.host import CallOptions, prepare
    from tt_moge.onnx_export import read_metadata
    from tt_moge.synthetic import synthetic_photo
    from tt_moge.weights import load_network

    path, code, printed = exported
    assert code == 0, printed
    assert "max |ONNX Runtime - ours|" in printed and "points relative to their scale" in printed
    # each step says what it does while it runs (the export was silent for 97 s on the ViT-L, issue 48)
    for step in (r"loading the weights \S+ \.\.\.", r"exporting the 448x252 forward to \S+ \(torch.onnx\) \.\.\."):
        assert re.search(f"^tt-moge: {step}$", printed, re.M), printed
    assert re.search(r"^tt-moge: checking \S+ with ONNX Runtime against our forward: \d+\.\d s$", printed, re.M)
    width, height = TEST_CANVAS
    session = _session(path)
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("image", [1, 3, height, width])]
    assert [o.name for o in session.get_outputs()] == ["points", "normal", "mask", "metric_scale"]
    meta = read_metadata(path)
    assert (meta["tt_moge.canvas_width"], meta["tt_moge.canvas_height"]) == (str(width), str(height))
    assert meta["tt_moge.num_tokens"] == str(TEST_TOKENS)

    # an image the command's own check did not use, against the float32 reference network computed here
    canvas = prepare(synthetic_photo((640, 360), seed=21), TEST_CANVAS, CallOptions()).canvas
    onnx_out = dict(zip(["points", "normal", "mask", "metric_scale"], session.run(None, {"image": canvas.numpy()})))
    network, _ = load_network(checkpoint("tiny-vits-normal"), None)
    with torch.inference_mode():
        ours = {k: v.numpy() for k, v in network(canvas, TEST_TOKENS).items()}
    for name, value in onnx_out.items():
        assert value.shape == ours[name].shape, name
        assert np.isfinite(value).all(), name
    points_rel = np.abs(onnx_out["points"] - ours["points"]).max() / np.abs(ours["points"]).max()
    assert points_rel <= 1e-4, points_rel
    assert np.abs(onnx_out["normal"] - ours["normal"]).max() <= 1e-4
    assert np.abs(onnx_out["mask"] - ours["mask"]).max() <= 1e-4
    assert abs(onnx_out["metric_scale"][0] / ours["metric_scale"][0] - 1) <= 1e-5
    # non-trivial: the mask probability straddles the threshold, the points vary over the canvas
    share = float((ours["mask"] > 0.5).mean())
    assert 0.05 < share < 0.95, share
    assert np.ptp(ours["points"][..., 2]) > 0.1


def test_the_host_steps_of_docs_export_md_finish_its_outputs_as_model_does(exported, tiny_model):
    """docs/export.md's recipe (prepare -> ONNX Runtime -> raw_maps -> postprocess) equals `model(image)` at
    precision fp32 (the reference network) on the same checkpoint and canvas."""
    from tt_moge.host import CallOptions, postprocess, prepare
    from tt_moge.onnx_export import raw_maps
    from tt_moge.synthetic import synthetic_photo

    path, code, printed = exported
    assert code == 0, printed
    image = synthetic_photo((800, 600), seed=5)
    options = CallOptions()
    prepared = prepare(image, TEST_CANVAS, options)
    session = _session(path)
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, {"image": prepared.canvas.numpy()})))
    out = postprocess(raw_maps(outputs), prepared.plan, options)

    ref = tiny_model(image)
    assert out.depth.shape == ref.depth.shape == (600, 800)
    assert 0.05 < ref.valid_fraction < 0.95, ref.valid_fraction
    agreement = float((out.mask == ref.mask).mean())
    assert agreement >= 0.999, agreement
    both = out.mask & ref.mask
    rel = np.abs(out.depth[both] - ref.depth[both]) / ref.depth[both]
    assert np.isfinite(rel).all() and rel.max() < 1e-3, rel.max()
    assert np.allclose(out.intrinsics, ref.intrinsics, rtol=1e-4, atol=1e-6)
    assert abs(out.metric_scale / ref.metric_scale - 1) < 1e-5


def test_export_refuses_bad_flags_with_a_usage_error(tmp_path, capsys):
    from tt_moge.cli import main

    assert main(["export", "onnx", "-o", str(tmp_path / "m.onnx"), "--resolution", "10x10"]) == 2
    assert "resolution" in capsys.readouterr().err
    assert main(["export", "tflite", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["export", "onnx", "--weights", str(tmp_path / "missing")]) == 2  # -o is required
    assert not (tmp_path / "m.onnx").exists()


def test_export_of_missing_weights_says_so(tmp_path, capsys):
    from tt_moge.cli import main

    code = main(["export", "onnx", "-o", str(tmp_path / "m.onnx"), "--weights", str(tmp_path / "nowhere")])
    assert code == 3
    assert "does not exist" in capsys.readouterr().err
