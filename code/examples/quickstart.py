#!/usr/bin/env python3
"""MoGe-2 on one photo: metric depth, points, normals, mask and intrinsics, written to a folder.

    python code/examples/quickstart.py                      # the demo image media/source.png
    python code/examples/quickstart.py --image photo.jpg --out results/

Writes depth.png (colourised, with a depth scale), normal.png, result.npz (the arrays) and result.json (field of
view, intrinsics, metric scale, valid share, median depth) — plus mask.png and depth.exr — to ./moge_output/.
Weights: Ruicheng/moge-2-vitl-normal from the Hugging Face hub, or the model.pt in $MOGE_WEIGHTS_DIR.
Works from any directory: the demo image is found relative to this file.
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEMO_IMAGE = HERE.parents[1] / "media" / "source.png"

try:
    import tt_moge  # noqa: F401
except ImportError:  # a source checkout without `pip install -e code/`
    sys.path.insert(0, str(HERE.parent))

from tt_moge import MoGeModel, load_image  # noqa: E402
from tt_moge.export import write_outputs  # noqa: E402
from tt_moge.weights import CheckpointError  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default=str(DEMO_IMAGE), help="the photo (default: media/source.png)")
    parser.add_argument("--out", default="moge_output", help="output folder (default: ./moge_output)")
    parser.add_argument("--weights", default=None, help="repo id, folder or model.pt (default: the hub model)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the best available)")
    args = parser.parse_args()

    weights = {} if args.weights is None else {"pretrained_model_name_or_path": args.weights}
    try:
        model = MoGeModel.from_pretrained(**weights, device=args.device, warmup=1, warmup_variants="none")
    except CheckpointError as exc:  # no weights (offline, say): the message names the three ways out
        print(f"quickstart: {exc}", file=sys.stderr)
        return 1
    with model:
        out = model(args.image)  # a path, PIL image, numpy array or torch tensor
    print(out)  # MoGeOutput(WxH, valid %, median depth, fov_x, metric_scale)
    depth = out.depth  # (H, W) float32, metres; inf where out.mask is False
    points = out.points  # (H, W, 3) float32, metres, camera space (x right, y down, z forward)
    K = out.intrinsics_pixels  # (3, 3) camera matrix in pixels
    print(f"depth {depth.shape}, points {points.shape}, fx {K[0, 0]:.1f} px, fy {K[1, 1]:.1f} px")

    write_outputs(out, load_image(args.image), args.out, formats=("maps", "npz"), source=args.image)
    print(f"wrote depth.png, normal.png, mask.png, depth.exr, result.npz, result.json to {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
