"""tt_moge: MoGe-2 monocular geometry (metric depth, points, normals, mask, intrinsics) from Python, a shell and HTTP.

    from tt_moge import MoGeModel
    with MoGeModel.from_pretrained() as model:
        out = model("photo.jpg")

`MoGeModel` (the model facade), `ModelPool` (one model per device, behind the same calls), `MoGeOutput` (one
result) and `load_image` (any supported image input -> an (H, W, 3) RGB array, as the model decodes it) are
imported on first use, so that subpackages that do not need torch (the Tenstorrent device graph, which runs in a
ttnn environment) can be imported without it.

Importing tt_moge before torch also sets OpenMP's wait policy for torch's CPU threads to passive, unless the
caller chose one (`tt_moge.openmp`: why, and how to keep OpenMP's default).
"""

from . import openmp as _openmp

_openmp.set_wait_policy()

__version__ = "0.1.0"

__all__ = ["MoGeModel", "ModelPool", "MoGeOutput", "load_image", "__version__"]


def __getattr__(name: str):
    if name == "MoGeModel":
        from .model import MoGeModel

        return MoGeModel
    if name == "ModelPool":
        from .pool import ModelPool

        return ModelPool
    if name == "MoGeOutput":
        from .output import MoGeOutput

        return MoGeOutput
    if name == "load_image":
        from .host.decode import to_rgb_array

        return to_rgb_array
    raise AttributeError(f"module 'tt_moge' has no attribute {name!r}")
