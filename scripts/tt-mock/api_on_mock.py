"""The whole Python API on the mock P150: `MoGeModel.from_pretrained(weights, device=<an open ttnn device>)`,
then `model(image)`, in a Python where both ttnn and torch import (the mock venv after
`pip install torch` (PyPI's CUDA build for cp312) and `pip install -c <(echo 'numpy<2') -e code/`).

    cd $MOGE_MOCK_DIR && . ./env.sh
    python /path/to/scripts/tt-mock/api_on_mock.py --weights DIR_OR_MODEL_PT --resolution 640x480 --num-tokens 1200

The mock computes nothing (every value read back is zero), so the outputs say only that every step ran: the
device graph at the model's canvas and token budget, the host's resize, solve and finish. No trace: the mock
cannot capture one (MOGE_TTNN_TRACE=0 is set here).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("MOGE_TTNN_TRACE", "0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--resolution", default="640x480")
    parser.add_argument("--num-tokens", type=int, default=1200)
    args = parser.parse_args()
    width, height = (int(v) for v in args.resolution.lower().split("x"))

    import numpy as np
    import ttnn

    from tt_moge import MoGeModel
    from tt_moge.runners.ttnn.device import L1_SMALL_SIZE

    device = ttnn.open_device(device_id=0, l1_small_size=L1_SMALL_SIZE)
    try:
        t = time.perf_counter()
        with MoGeModel.from_pretrained(
            args.weights,
            device=device,
            resolution=(width, height),
            num_tokens=args.num_tokens,
            warmup=1,
            warmup_variants="minimal",
        ) as model:
            print(f"loaded on the mock in {time.perf_counter() - t:.1f} s: {model.info()['runner']}")
            image = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
            t = time.perf_counter()
            out = model(image)
            print(f"model(image) ran in {time.perf_counter() - t:.2f} s: {out!r}")
            print("(the mock computes nothing: every value read back is zero, so these numbers mean nothing)")
    finally:
        ttnn.close_device(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
