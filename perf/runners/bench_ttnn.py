"""Tenstorrent: the spec's per-call latencies on one chip, beside the spec's published p150 numbers.

Rows: `model.forward(float32 canvas)` (the published `tt(image)` call), `model(uint8 array)` at 1920x1080 and
`model("photo.png")`, and `predict_many` per image; warm, batch 1, medians and minima over --calls calls. ViT-L,
1920x1080, 1800 tokens; by default a random-weight full-size checkpoint (`tt_moge.testing`, written once to
~/.cache/tt_moge/bench): the forward's cost does not depend on the weights' values. Prints the ratio to the
spec's p150 medians (forward 20.3 ms, model(array) 25.6 ms) and the command to rerun it.

Needs a Tenstorrent chip (ttnn imports and sees one) and says so without one; on the mock P150 the numbers
would mean nothing (`scripts/tt-mock-check` is the check there).

    python -m perf.runners.bench_ttnn --calls 50
    python -m perf.runners.bench_ttnn --dispatch worker --num-command-queues 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from perf import common

SPEC_MS = {"forward(float32 canvas)": 20.3, "model(uint8 array 1920x1080)": 25.6}  # the spec's p150 medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a MoGe-2 model.pt (default: the cached random full-size ViT-L)")
    ap.add_argument("--calls", type=int, default=50, help="timed calls per row (after one warm call)")
    ap.add_argument("--device", default="tt", help="tt or tt:N")
    ap.add_argument("--precision", default="auto", help="auto (bf16) | bfp8")
    ap.add_argument("--dispatch", default="eth", choices=["eth", "worker"])
    ap.add_argument("--num-command-queues", type=int, default=None, choices=[1, 2])
    ap.add_argument("--json", help="write the numbers to this file")
    args = ap.parse_args()

    from tt_moge.runners.ttnn.device import chips_here

    if chips_here() == 0:
        sys.exit(
            "perf.runners.bench_ttnn needs a Tenstorrent chip (ttnn imports and sees one); "
            "without one, scripts/tt-mock-check checks the graph on a mock P150"
        )
    import torch
    from PIL import Image

    from tt_moge import MoGeModel

    size, tokens = (1920, 1080), 1800
    path = common.full_size_checkpoint(args.checkpoint)
    image = common.photo(size)
    canvas = torch.from_numpy(image).permute(2, 0, 1)[None].float().div(255)
    t = time.perf_counter()
    model = MoGeModel.from_pretrained(
        path,
        device=args.device,
        precision=args.precision,
        dispatch=args.dispatch,
        num_command_queues=args.num_command_queues,
        resolution=size,
        num_tokens=tokens,
    )
    load_s = time.perf_counter() - t
    info = model.info()
    print(f"{info['runner']}; loaded + warmed in {load_s:.1f} s", flush=True)
    result: dict = {"runner": info["runner"], "load_s": load_s, "calls": args.calls}
    with tempfile.TemporaryDirectory(prefix="tt_moge-bench-ttnn-") as tmp:
        png = Path(tmp) / "photo.png"
        Image.fromarray(image).save(png)
        rows = {
            "forward(float32 canvas)": lambda: model.forward(canvas),
            "model(uint8 array 1920x1080)": lambda: model(image),
            "model(png path)": lambda: model(str(png)),
        }
        for name, call in rows.items():
            median, best = common.median_min_ms(call, args.calls)
            result[name] = {"median_ms": median, "min_ms": best}
            spec = f", {median / SPEC_MS[name]:.2f}x the spec's {SPEC_MS[name]} ms" if name in SPEC_MS else ""
            print(f"  {name:32s} median {median:7.2f} ms, min {best:7.2f} ms{spec}", flush=True)
        t = time.perf_counter()
        model.predict_many([image] * 16)
        per_image = (time.perf_counter() - t) * 1e3 / 16
        result["predict_many(arrays), per image"] = {"ms": per_image}
        print(f"  {'predict_many(16 arrays)':32s} {per_image:7.2f} ms per image")
    model.close()
    common.finish_report(result, args.json)


if __name__ == "__main__":
    main()
