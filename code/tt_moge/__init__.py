"""tt_moge: MoGe-2 monocular geometry (metric depth, points, normals, mask, intrinsics) from Python, a shell and HTTP."""
__version__ = "0.1.0"

from .model import MoGeModel  # noqa: E402
from .output import MoGeOutput  # noqa: E402

__all__ = ["MoGeModel", "MoGeOutput", "__version__"]
