"""The CPU runner's native kernels (`tt_moge/native/cpu_kernels.cpp`, in the host library): the fused
bfloat16 attention, and the int8 glue (per-row quantisation with the smoothing of `Int8Linear`, int32 -> float
dequantisation) with a torch reference for each.

* Attention (`attention_bf16`): both products with AVX512-BF16 dot products, the scores and the softmax of 8
  queries at a time in float32 in a per-thread buffer: faster than the torch head-by-head path, and closer to
  float32 (its scores are not rounded to bfloat16). Built only where the compiler targets AVX512-BF16
  (`-march=native`); elsewhere the torch path runs.
* int8 glue: for finite inputs bit-identical to the torch reference ops (the same float operations in the same order,
  tests/test_runners.py), one pass each where torch makes five or six over activations of up to 1825 x 4096
  (`python -m perf.runners.profile_forward --precision int8 [--torch-glue]` measures what it saves).

The measured times and errors are in docs/performance.md (one-off measurements, and the forward's breakdown).

They run when the host library is available when the runner is built (not with MOGE_HOST=torch then), on as
many threads as torch uses (`torch.get_num_threads()`, set per forward by `CpuGraphRunner`).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "native_library",
    "quantize_rows",
    "dequantize",
    "quantize_rows_reference",
    "dequantize_reference",
    "native_attention_amx",
    "native_attention_supported",
    "attention_bf16",
]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def native_library():
    """The loaded host library, or None (torch path). Its runner kernels use one thread until
    `moge_runner_set_threads` (CpuGraphRunner sets torch's thread count before each forward)."""
    from .. import native

    return native.library()


def quantize_rows_reference(
    x: torch.Tensor, inv_smooth: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, K) float32/bfloat16, times `inv_smooth` (K,) when given -> (int8 (N, K), float32 scales (N, 1)):
    one scale per row, |q| <= 127."""
    xs = x.float() if inv_smooth is None else x.float() * inv_smooth
    scale = xs.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127)
    return torch.round(xs / scale).to(torch.int8), scale


def dequantize_reference(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """int32 (N, M) -> acc * row_scale (N, 1) * col_scale (M,) + bias (M,) in `dtype`."""
    return acc.float().mul_(row_scale).mul_(col_scale).add_(bias).to(dtype)


def _check(t: torch.Tensor, name: str, dtypes) -> None:
    if t.device.type != "cpu" or t.dtype not in dtypes:
        raise ValueError(f"{name}: expected a CPU tensor of {[str(d) for d in dtypes]}, got {t.dtype} on {t.device}")


def quantize_rows(
    x: torch.Tensor, lib=None, inv_smooth: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference`, natively when `lib` is the host library (rows may be strided, columns not)."""
    if lib is None:
        return quantize_rows_reference(x, inv_smooth)
    _check(x, "x", _DTYPE_CODES)
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    rows, cols = x.shape
    if inv_smooth is not None:
        inv_smooth = inv_smooth.float().contiguous()
        if inv_smooth.numel() != cols:
            raise ValueError(f"inv_smooth: expected {cols} values (one per column), got {inv_smooth.numel()}")
    out = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    lib.moge_quantize_rows(
        x.data_ptr(),
        _DTYPE_CODES[x.dtype],
        rows,
        cols,
        x.stride(0),
        None if inv_smooth is None else inv_smooth.data_ptr(),
        out.data_ptr(),
        scale.data_ptr(),
    )
    return out, scale


def dequantize(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor,
    dtype: torch.dtype,
    lib=None,
) -> torch.Tensor:
    """`dequantize_reference`, natively when `lib` is the host library."""
    if lib is None:
        return dequantize_reference(acc, row_scale, col_scale, bias, dtype)
    _check(acc, "acc", (torch.int32,))
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
    acc, row_scale, col_scale, bias = (
        t.contiguous() for t in (acc, row_scale.float(), col_scale.float(), bias.float())
    )
    rows, cols = acc.shape
    if row_scale.numel() != rows or col_scale.numel() != cols or bias.numel() != cols:
        raise ValueError(f"dequantize: scales/bias do not fit a {rows}x{cols} accumulator")
    out = torch.empty(rows, cols, dtype=dtype)
    lib.moge_dequantize(
        acc.data_ptr(),
        rows,
        cols,
        row_scale.data_ptr(),
        col_scale.data_ptr(),
        bias.data_ptr(),
        _DTYPE_CODES[dtype],
        out.data_ptr(),
    )
    return out


NATIVE_HEAD_DIM = 64  # the fused attention's head size (every DINOv2 ViT: S, B, L, g)


def native_attention_supported(lib, head_dim: int) -> bool:
    """Whether `attention_bf16` can run: the library was built for a CPU with AVX512-BF16, heads of 64."""
    return lib is not None and head_dim == NATIVE_HEAD_DIM and bool(lib.moge_attention_supported())


def native_attention_amx(lib) -> bool:
    """Whether `attention_bf16` runs its two products on AMX tiles: the library was built for a CPU with AMX-BF16
    and Linux lets this process use the tiles. Elsewhere it runs them by AVX512-BF16 dot products."""
    return lib is not None and bool(lib.moge_attention_amx_supported())


def attention_bf16(qkv: torch.Tensor, num_heads: int, lib, amx: bool | None = None) -> torch.Tensor:
    """Fused multi-head softmax attention of one image: qkv (N, 3C) bfloat16 rows [q | k | v] with q already
    scaled by 1/sqrt(head_dim) -> (N, C) bfloat16. Scores and sums in float32, the probabilities rounded to
    bfloat16 for the product with v (as the unfused bfloat16 path); the score matrix never reaches memory.
    `amx`: the products on AMX tiles (None: where `native_attention_amx`; True where it is not is an error)."""
    _check(qkv, "qkv", (torch.bfloat16,))
    n, three_c = qkv.shape
    c = three_c // 3
    if three_c != 3 * c or c != num_heads * NATIVE_HEAD_DIM:
        raise ValueError(f"qkv: expected (N, 3 * {num_heads} * {NATIVE_HEAD_DIM}), got {tuple(qkv.shape)}")
    if amx is None:
        amx = native_attention_amx(lib)
    elif amx and not native_attention_amx(lib):
        raise ValueError("amx=True: this CPU (or this build, or the kernel's permission) has no AMX tiles")
    qkv = qkv.contiguous()
    out = torch.empty(n, c, dtype=torch.bfloat16)
    status = lib.moge_attention_bf16(qkv.data_ptr(), n, c, num_heads, int(amx), out.data_ptr())
    if status != 0:
        raise RuntimeError(f"moge_attention_bf16 failed ({status}): this build has no AVX512-BF16 attention")
    return out
