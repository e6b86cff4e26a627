"""ONNX export of the raw fixed-shape forward: the network part of MoGe-2 as one file other runtimes can run.

`export_onnx(network, path, canvas_size, num_tokens)` writes the same graph the fast runners run
(`runners.fixed_graph.FixedShapeMoGe2`, in float32, PyTorch SDPA attention, NCHW), exported with PyTorch's
dynamo exporter (`torch.onnx.export(..., dynamo=True)`, which needs `onnx` and `onnxscript`):

* one input, `image`: (1, 3, H, W) float32 in [0, 1], at the canvas size (the canvas fit is host work:
  `tt_moge.host.prepare`);
* the outputs named as `model.forward` returns them: `points` (1, H, W, 3) affine points, `normal`
  (1, H, W, 3) where the checkpoint has a normal head, `mask` (1, H, W) probability, `metric_scale` (1,)
  where it has a scale head;
* the canvas and the token budget in the model's metadata (`metadata_props`: METADATA_KEYS), so a runtime
  elsewhere can fit images onto the right canvas.

The shape is fixed (the token grid and the folds depend on it): one file per canvas and token budget, as on
every runner. `check_onnx` runs the file with ONNX Runtime (`onnxruntime`, the `export` extra) on a
photo-like canvas and compares it with our float32 reference forward (`MoGe2Network`). The host steps (camera
solve, finish) run on the outputs from Python: `raw_maps(outputs)` gives the `RawMaps` that
`tt_moge.host.postprocess` takes (docs/export.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

__all__ = [
    "INPUT_NAME",
    "OUTPUT_NAMES",
    "METADATA_KEYS",
    "MISSING_EXTRA",
    "OnnxCheck",
    "ExportGraph",
    "export_onnx",
    "check_onnx",
    "read_metadata",
    "raw_maps",
]

INPUT_NAME = "image"
OUTPUT_NAMES = ("points", "normal", "mask", "metric_scale")  # in this order, those the checkpoint has
METADATA_KEYS = ("tt_moge.canvas_width", "tt_moge.canvas_height", "tt_moge.num_tokens", "tt_moge.outputs")
# as the README installs extras (from a clone); the packages by name for an installed wheel
MISSING_EXTRA = (
    'install the export extra, from a clone of the repository: pip install -e "code/[export]" '
    "(or: pip install onnx onnxscript onnxruntime)"
)


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"ONNX export needs {module!r} ({exc}); {MISSING_EXTRA}") from None


class ExportGraph:
    """Builds the module that is exported: `FixedShapeMoGe2` in float32 for one canvas and token budget (on the
    folds of `runners.folding.fold`, as every fast path), its dict of outputs turned into a tuple in OUTPUT_NAMES
    order (ONNX outputs are positional)."""

    def __init__(self, network: Any, canvas_size: tuple, num_tokens: int):
        import torch

        from .runners.fixed_graph import FixedShapeMoGe2

        self.canvas_size = (int(canvas_size[0]), int(canvas_size[1]))
        self.num_tokens = int(num_tokens)
        graph = FixedShapeMoGe2(
            network.to("cpu").float(),
            self.canvas_size,
            self.num_tokens,
            torch.float32,
            channels_last=False,  # ONNX is NCHW: channels-last would add a transpose around every conv
            attention="sdpa",  # one operator the exporter knows (the other kernels are CPU-specific)
        ).eval()
        present = set(graph.head_names) | ({"metric_scale"} if graph.scale_head is not None else set())
        self.output_names = tuple(name for name in OUTPUT_NAMES if name in present)

        names = self.output_names

        class _Positional(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fixed = graph  # not `graph`: the exported GraphModule has an attribute of that name

            def forward(self, image: torch.Tensor) -> tuple:
                out = self.fixed(image)
                return tuple(out[name] for name in names)

        self.module = _Positional().eval()


def export_onnx(
    network: Any,
    path: Union[str, os.PathLike],
    canvas_size: tuple,
    num_tokens: int,
    *,
    metadata: Optional[Mapping[str, str]] = None,
) -> tuple:
    """Write the raw forward of `network` (a `MoGe2Network`) for one canvas (width, height) and token budget
    to `path` (an .onnx file; a graph over 2 GB keeps its weights in a file beside it, as ONNX requires).
    `metadata` adds string entries to the model's metadata. Returns the output names, in order."""
    import logging
    import warnings

    import torch

    for module in ("onnx", "onnxscript"):
        _require(module)
    graph = ExportGraph(network, canvas_size, num_tokens)
    width, height = graph.canvas_size
    example = torch.zeros(1, 3, height, width)
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # its notes that torchvision's operators are skipped (we use none)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation notes from inside torch.export
            program = torch.onnx.export(
                graph.module,
                (example,),
                dynamo=True,
                input_names=[INPUT_NAME],
                output_names=list(graph.output_names),
                verbose=False,
            )
    finally:
        exporter_log.setLevel(level)
    props = {
        "tt_moge.canvas_width": str(width),
        "tt_moge.canvas_height": str(height),
        "tt_moge.num_tokens": str(graph.num_tokens),
        "tt_moge.outputs": ",".join(graph.output_names),
    }
    props.update({str(k): str(v) for k, v in (metadata or {}).items()})
    program.model.metadata_props.update(props)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    program.save(os.fspath(path))
    return graph.output_names


def read_metadata(path: Union[str, os.PathLike]) -> dict:
    """The model's metadata of an exported file (without loading its weights): {key: value} strings."""
    onnx = _require("onnx")
    model = onnx.load(os.fspath(path), load_external_data=False)
    return {prop.key: prop.value for prop in model.metadata_props}


@dataclass
class OnnxCheck:
    """ONNX Runtime's outputs against our float32 reference forward, on one canvas."""

    max_abs: dict  # output name -> max |onnx - ours|
    points_max_rel: float  # max |onnx - ours| of the points over the largest |point| of ours
    outputs: dict  # output name -> ONNX Runtime's array

    def summary(self) -> str:
        diffs = ", ".join(f"{name} {value:.2e}" for name, value in self.max_abs.items())
        return f"max |ONNX Runtime - ours|: {diffs}; points relative to their scale: {self.points_max_rel:.2e}"


def check_onnx(path: Union[str, os.PathLike], network: Any, num_tokens: int, canvas: Any = None) -> OnnxCheck:
    """Run the file with ONNX Runtime (CPU) on `canvas` ((1, 3, H, W) float32 in [0, 1]; default: a
    photo-like image fitted to the file's canvas) and compare every output with `network`'s float32 forward."""
    import numpy as np
    import torch

    ort = _require("onnxruntime")
    meta = read_metadata(path)
    size = (int(meta["tt_moge.canvas_width"]), int(meta["tt_moge.canvas_height"]))
    if canvas is None:
        from .host import CallOptions, prepare
        from .synthetic import synthetic_photo

        canvas = prepare(synthetic_photo(size, seed=3), size, CallOptions()).canvas
    session = ort.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    arrays = dict(zip(names, session.run(None, {INPUT_NAME: canvas.numpy().astype(np.float32)})))
    with torch.inference_mode():
        ours = network.to("cpu").float()(canvas.float(), num_tokens)
    max_abs = {name: float(np.abs(arrays[name] - ours[name].numpy()).max()) for name in names}
    ref_points = ours["points"].numpy()
    rel = float(np.abs(arrays["points"] - ref_points).max() / np.abs(ref_points).max())
    return OnnxCheck(max_abs=max_abs, points_max_rel=rel, outputs=arrays)


def raw_maps(outputs: Mapping[str, Any]) -> Any:
    """ONNX Runtime's outputs ({name: numpy array}, batch of 1) -> the `RawMaps` that `tt_moge.host.postprocess`
    finishes into a `MoGeOutput`."""
    import numpy as np
    import torch

    from .runners.base import RawMaps

    return RawMaps.from_outputs({name: torch.from_numpy(np.asarray(value)) for name, value in outputs.items()})
