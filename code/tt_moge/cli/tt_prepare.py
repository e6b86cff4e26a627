"""`python -m tt_moge.cli.tt_prepare`: the Tenstorrent runner's device weights of a checkpoint, prepared (or found
in the cache) and saved as one .npz whose path is printed: what `scripts/tt-mock-check` hands to the mock
device's Python, which has no torch.

    python -m tt_moge.cli.tt_prepare --weights DIR|FILE|REPO --resolution 1920x1080 --num-tokens 1800
    python -m tt_moge.cli.tt_prepare --random vitl-normal --cache /tmp/prepared

The model flags (--weights, --revision, --resolution, --num-tokens) are those of every tt-moge command, with
the same defaults and checks (generated from `options.LoadOptions`): a Hub repo id is read at its pinned
revision unless --revision says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from .common import Formatter, add_model_arguments, model_kwargs

PREPARE_FLAGS = ("weights", "revision", "resolution", "num_tokens")  # the model flags that apply


def build_parser() -> argparse.ArgumentParser:
    from ..runners.ttnn.runner import CACHE_ENV

    parser = argparse.ArgumentParser(
        prog="python -m tt_moge.cli.tt_prepare",
        description=__doc__,
        formatter_class=Formatter,
    )
    add_model_arguments(parser, only=PREPARE_FLAGS)
    parser.add_argument(
        "--random",
        metavar="PRESET",
        help="instead of --weights: a random-weight checkpoint of this tt_moge.random_weights preset "
        "(e.g. vitl-normal), written into the cache folder once",
    )
    parser.add_argument(
        "--cache", default=None, help=f"folder of prepared weights (default ${CACHE_ENV} or ~/.cache/tt_moge/ttnn)"
    )
    return parser


def main(argv: Optional[list] = None) -> int:
    from ..options import LoadOptions
    from ..runners.ttnn.runner import default_cache_dir, prepared_weights
    from ..weights import load_network

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = LoadOptions.arguments(**model_kwargs(args, only=PREPARE_FLAGS))  # checked, defaults filled in
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    weights, revision = model["pretrained_model_name_or_path"], model["revision"]
    default_weights = parser.get_default("weights")
    if args.random and weights != default_weights:
        parser.error("give --weights or --random, not both")
    cache = Path(args.cache) if args.cache else default_cache_dir()
    if args.random:
        from ..random_weights import make_checkpoint

        weights, revision = cache / "checkpoints" / args.random / "model.pt", None
        if not weights.is_file():
            make_checkpoint(weights, args.random)
    network, _ = load_network(weights, revision)
    _, path = prepared_weights(network, model["resolution"], model["num_tokens"], cache)
    if path is None:
        parser.error(f"could not write the prepared weights into {cache}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
