"""`python -m tt_moge.cli.tt_prepare`: the Tenstorrent runner's device weights of a checkpoint, prepared (or found
in the cache) and saved as one .npz whose path is printed: what `scripts/tt-mock-check` hands to the mock
device's Python, which has no torch.

    python -m tt_moge.cli.tt_prepare --weights DIR|FILE|REPO --resolution 1920x1080 --num-tokens 1800
    python -m tt_moge.cli.tt_prepare --random vitl-normal --cache /tmp/prepared
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from .argtypes import token_budget, wxh


def main(argv: Optional[list] = None) -> int:
    from ..runners.ttnn.runner import CACHE_ENV, default_cache_dir, prepared_weights
    from ..weights import load_network

    parser = argparse.ArgumentParser(
        prog="python -m tt_moge.cli.tt_prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", help="a Hub repo id, a folder holding model.pt, or model.pt")
    source.add_argument(
        "--random",
        metavar="PRESET",
        help="a random-weight checkpoint of this tt_moge.testing preset (e.g. vitl-normal), written "
        "into the cache folder once",
    )
    parser.add_argument("--resolution", type=wxh, default=(1920, 1080), metavar="WxH")
    parser.add_argument("--num-tokens", type=token_budget, default=1800, metavar="N")
    parser.add_argument(
        "--cache", default=None, help=f"folder of prepared weights (default ${CACHE_ENV} or ~/.cache/tt_moge/ttnn)"
    )
    args = parser.parse_args(argv)
    cache = Path(args.cache) if args.cache else default_cache_dir()
    weights = args.weights
    if args.random:
        from ..testing import make_checkpoint

        weights = cache / "checkpoints" / args.random / "model.pt"
        if not weights.is_file():
            make_checkpoint(weights, args.random)
    network, _ = load_network(weights, None)
    _, path = prepared_weights(network, args.resolution, args.num_tokens, cache)
    if path is None:
        parser.error(f"could not write the prepared weights into {cache}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
