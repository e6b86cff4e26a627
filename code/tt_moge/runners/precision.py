"""Which number format the forward runs in, per device: the `precision` option of `MoGeModel.from_pretrained`.

| precision | CPU                                                      | CUDA                                     |
|-----------|----------------------------------------------------------|------------------------------------------|
| "fp32"    | the reference network as is: bit-identical to it          | the reference network, TF32 off          |
| "bf16"    | the fixed-shape graph, bfloat16 matrix work               | the fixed-shape graph in bfloat16        |
| "fp16"    | refused: CPUs have no fast float16 convolutions           | the fixed-shape graph in float16         |
| "int8"    | "bf16", but the ViT's matmuls in int8 (weights per output | refused                                  |
|           | channel, activations per token, at run time): opt-in,     |                                          |
|           | checked on random weights only (docs/)                    |                                          |
| "auto"    | "bf16" where the CPU has bfloat16 dot products            | "fp16" (upstream's own default: it is    |
|           | (AVX512-BF16 or AMX), else "fp32"                         | validated on the real weights, and has   |
|           |                                                          | 3 more mantissa bits than bfloat16)      |

On a Tenstorrent chip the ttnn graph runs bfloat16 ("auto" and "bf16"), or with the ViT's matmul weights in
bfloat8_b ("bfp8", opt-in); the other names are refused there, and "bfp8" everywhere else (see
`runners/ttnn/graph.py` for which tensors stay in float32 and why).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PRECISIONS", "DTYPES", "cpu_has_native_bf16", "cpu_has_int8_dot", "resolve_precision"]

from ..constants import PRECISIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # "int8" is a CPU mode of bf16


def _cpuinfo_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bfloat16 in hardware (x86 AVX512-BF16 or AMX-BF16), so oneDNN's bfloat16
    GEMMs and convolutions run at about twice the float32 rate. Elsewhere PyTorch emulates bfloat16 (slower
    than float32), so "auto" picks float32 there."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(p) for p in probes):
        return any(p() for p in probes)
    flags = _cpuinfo_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_int8_dot() -> bool:
    """True where the CPU has int8 dot-product instructions (AVX512-VNNI / AVX-VNNI / AMX-INT8)."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    if callable(probe):
        return bool(probe())
    flags = _cpuinfo_flags()
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def resolve_precision(precision: Any, device: Any) -> str:
    """Validate `precision` and turn "auto" into the concrete choice for `device` (a torch device or name, or a
    Tenstorrent chip: anything with `.type == "tt"`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    kind = getattr(device, "type", None) if not isinstance(device, str) else None
    kind = kind or torch.device(device).type
    if kind == "tt":
        if precision not in ("auto", "bf16", "bfp8"):
            raise ValueError(
                f"precision={precision!r} is not available on a Tenstorrent chip; use 'bf16', 'bfp8' or 'auto'"
            )
        return "bf16" if precision == "auto" else precision
    if precision == "bfp8":
        raise ValueError(
            "precision='bfp8' (bfloat8_b ViT weights) is a Tenstorrent option; use 'bf16', 'fp32' or 'auto'"
        )
    if kind == "cpu":
        if precision == "fp16":
            raise ValueError(
                "precision='fp16' is not available on the CPU (PyTorch has no fast float16 convolutions "
                "there); use 'bf16', 'fp32' or 'auto'"
            )
        if precision == "auto":
            return "bf16" if cpu_has_native_bf16() else "fp32"
        return precision
    if kind == "cuda":
        if precision == "int8":
            raise ValueError("precision='int8' is a CPU option; on CUDA use 'fp16', 'bf16', 'fp32' or 'auto'")
        return "fp16" if precision == "auto" else precision
    raise ValueError(f"no runner for device type {kind!r}")
