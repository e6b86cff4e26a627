"""The input side of the Tenstorrent graph on the device: canvas -> the patch matrix the ViT's patch embedding takes.

The host uploads the canvas as it is, row-major (1, 3, H, W): no resize, no unfold, no conversion on the host.
The canvas of a photo is 8-bit (uint8 planes, 0..255: `host.canvas.fit_to_canvas(..., uint8=True)`), a quarter
of float32's bytes on the host and the link; a float image of the canvas size is float32 in [0, 1]. Each has its
persistent input (`allocate_input`). On the device (`DeviceInput.forward`):

1. the canvas is converted to bfloat16 and tilized: uint8 by a typecast (exact: 0..255 are bfloat16 integers;
   ttnn tilizes no uint8) then a tilize, its / 255 folded into the row resize's matrix; float32 in one
   converting tilize;
2. the reference's antialiased bilinear resize to the token grid (`F.interpolate(..., antialias=True)`, the
   kernel of `prepare.resize_antialiased`) runs as matmuls with fixed resize matrices built here on the host at
   load time: rows (a batched matmul, one per colour channel) then columns;
3. the resized image is unfolded into patches with two 4-D permutes of the row-major map ((channel, row, ky, col,
   kx) -> (row, col, channel, ky, kx), `prepare.host_input`'s order), padded with zero rows for the prefix tokens
   and zero columns to the padded patch width, and tilized: the graph's input (`TtnnGraph.forward`).

Precision. The patch matrix is bfloat16, as the host path uploaded it. The matrix engine reads bfloat16
operands exactly at HiFi4, so the data (the canvas, then the row-resized image) goes in as bfloat16 (one
rounding each, which the resize's averaging shrinks; none for the uint8 canvas, whose values bfloat16 holds
exactly); the resize weights, which would lose up to 2^-9 each in
bfloat16 and so bias the sums, are split into a bfloat16 high and low part (`split_bf16`), each multiplied in its
own matmul and the two added in float32 (about 16 significant bits of weight).

Memory: the maps before the patch matrix live in L1 when the largest takes at most `L1_MAP_BUDGET` per core
(`intermediates`: the network's buffers are not live yet); the patch matrix goes to DRAM, where the graph takes it.
"""

from __future__ import annotations

import numpy as np

from .prepare import resize_taps
from .tiles import TILE

__all__ = [
    "DeviceInput",
    "INPUT_DTYPES",
    "L1_MAP_BUDGET",
    "exact_compute",
    "intermediates",
    "resize_matrix",
    "split_bf16",
    "split_matmul",
]

INPUT_DTYPES = ("uint8", "float32")  # the canvas's dtypes: a photo's 8-bit planes, a float image of the canvas size
L1_MAP_BUDGET = 256 * 1024  # bytes per core of the largest intermediate map above which the sides keep it in DRAM


def intermediates(T, device, largest: float):
    """Where the input and output sides keep their intermediate maps: L1 (interleaved over the cores; the
    network's buffers are not live then) when the largest, `largest` bytes, takes at most `L1_MAP_BUDGET` per core,
    else DRAM."""
    grid = device.compute_with_storage_grid_size()
    return T.L1_MEMORY_CONFIG if largest / (grid.x * grid.y) <= L1_MAP_BUDGET else T.DRAM_MEMORY_CONFIG


def resize_matrix(in_size: int, out_size: int, kind: str = "antialiased") -> np.ndarray:
    """The (out_size, in_size) float32 matrix of PyTorch's resize along one axis: "antialiased" (bilinear,
    antialias=True) or "bilinear" (align_corners=False), with the taps `prepare` computes for the host path."""
    index, weight = resize_taps(in_size, out_size, kind)
    m = np.zeros((out_size, in_size), np.float64)
    for t in range(index.shape[1]):
        np.add.at(m, (np.arange(out_size), index[:, t]), weight[:, t].astype(np.float64))
    return m.astype(np.float32)


def split_bf16(a: np.ndarray) -> tuple:
    """A float32 array as (hi, lo), both exactly representable in bfloat16, hi + lo = a to about 2^-17."""
    a = np.asarray(a, np.float32)

    def bf16(x):
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even, as ttnn converts
        return bits.astype(np.uint32).view(np.float32)

    hi = bf16(a)
    return hi, bf16(a - hi)


def device_split(ttnn, x, dim: int, order: str, memory_config=None, hi=None):
    """A float32 device tensor -> its bfloat16 parts concatenated along `dim`: order "hlh" gives [hi, lo, hi] (the
    data side of `split_matmul`, the first operand's parts), "hhl" [hi, hi, lo]. `memory_config`: where the parts
    and the result go (default DRAM). `hi`: x's bfloat16 rounding when the caller already has it (not freed)."""
    T = ttnn
    mem = memory_config or T.DRAM_MEMORY_CONFIG
    own = hi is None
    if own:
        hi = T.typecast(x, T.bfloat16, memory_config=mem)
    hi32 = T.typecast(hi, T.float32, memory_config=mem)
    lo = T.subtract(x, hi32, dtype=T.bfloat16, memory_config=mem)  # exact in float32, then rounded
    T.deallocate(hi32)
    parts = [hi, lo, hi] if order == "hlh" else [hi, hi, lo]
    out = T.concat(parts, dim=dim, memory_config=mem)
    if own:
        T.deallocate(hi)
    T.deallocate(lo)
    return out


def split_matmul(a: np.ndarray, side: str) -> np.ndarray:
    """The constant operand of a split matmul, its parts concatenated along K: `side` "left" (the constant is the
    first operand, (M, K) -> (M, 3 K) as [hi, hi, lo]) or "right" ((K, N) -> (3 K, N) as [hi; hi; lo]); the data
    operand is split on the device as [hi, lo, hi] (`device_split`), so that the sum over K is hi*hi + hi*lo +
    lo*hi."""
    hi, lo = split_bf16(a)
    axis = 1 if side == "left" else 0
    return np.concatenate([hi, hi, lo], axis=axis)


def exact_compute(T, device):
    """The compute config of the input and output sides' split matmuls: HiFi4, exact math, float32 accumulation
    in the destination register and the packer (the split parts keep about 16 bits only if nothing rounds them)."""
    return T.init_device_compute_kernel_config(
        device.arch(),
        math_fidelity=T.MathFidelity.HiFi4,
        math_approx_mode=False,
        fp32_dest_acc_en=True,
        packer_l1_acc=True,
    )


class DeviceInput:
    """The canvas -> patch matrix steps on the device (see the module docstring).

    ttnn: the ttnn module (or the emulator). device: the open device. prepared: `prepare.Prepared`. `activations`:
    the dtype name of the patch matrix (the graph's `Formats.activations`). The canvas is "uint8" or "float32"
    (`INPUT_DTYPES`), told apart by its dtype."""

    def __init__(self, ttnn, device, prepared, activations: str = "bfloat16"):
        self.ttnn, self.device = ttnn, device
        p = self.plan = prepared.plan
        self.width, self.height = p["canvas"]
        self.rows, self.cols, self.patch = p["rows"], p["cols"], p["patch"]
        self.grid_h, self.grid_w = self.rows * self.patch, self.cols * self.patch
        self.activations = activations
        self.w: dict = {}
        self.loaded = False

    def _tensor(self, array: np.ndarray, dtype: str, layout=None):
        T = self.ttnn
        layout = T.TILE_LAYOUT if layout is None else layout
        a = np.ascontiguousarray(array, np.float32)
        return T.Tensor(a, getattr(T, dtype), self.device, layout, T.DRAM_MEMORY_CONFIG)

    def load(self) -> None:
        """The resize matrices (each as its bfloat16 high and low parts) to the device; the rows' twice: for the
        float32 canvas, and / 255 for the uint8 one."""
        rows = resize_matrix(self.height, self.grid_h)  # (grid_h, H)
        cols_hi, cols_lo = split_bf16(resize_matrix(self.width, self.grid_w).T)  # (W, grid_w)
        for key, m in (("rows", rows), ("rows8", rows / np.float32(255))):
            for half, part in zip(("hi", "lo"), split_bf16(m)):  # one copy per colour channel (batched)
                self.w[f"{key}.{half}"] = self._tensor(np.broadcast_to(part, (1, 3) + part.shape), "bfloat16")
        self.w["cols.hi"] = self._tensor(cols_hi, "bfloat16")
        self.w["cols.lo"] = self._tensor(cols_lo, "bfloat16")
        T = self.ttnn
        self.compute = exact_compute(T, self.device)
        h_p = -(-self.height // TILE) * TILE
        self.mem = intermediates(T, self.device, max(3 * h_p * self.width * 2, 3 * self.grid_h * self.width * 4))
        self.loaded = True

    def _split_weight_matmul(self, x, key: str, left: bool):
        """x times the resize matrix `key` (high part + low part, two matmuls added in float32); `left`: the
        matrix is the first operand."""
        T, mem = self.ttnn, self.mem
        parts = []
        for half in ("hi", "lo"):
            w = self.w[f"{key}.{half}"]
            a, b = (w, x) if left else (x, w)
            parts.append(T.matmul(a, b, dtype=T.float32, compute_kernel_config=self.compute, memory_config=mem))
        out = T.add(parts[0], parts[1], dtype=T.float32, memory_config=mem)
        T.deallocate(parts[0])
        T.deallocate(parts[1])
        return out

    # --------------------------------------------------------------------------------------- the input
    def input_shape(self) -> tuple:
        return (1, 3, self.height, self.width)

    @staticmethod
    def input_dtype(canvas: np.ndarray) -> str:
        """ "uint8" for a uint8 canvas, else "float32" (`INPUT_DTYPES`)."""
        return "uint8" if np.asarray(canvas).dtype == np.uint8 else "float32"

    def host_tensor(self, canvas: np.ndarray):
        """The canvas (1, 3, H, W), uint8 (0..255) or float (in [0, 1]), as a row-major host ttnn tensor of the same
        bytes (uint8, or float32): no conversion on the host but a copy into C order where it is strided."""
        T = self.ttnn
        a = np.asarray(canvas)
        if a.shape != self.input_shape():
            raise ValueError(f"canvas: expected shape {self.input_shape()}, got {a.shape}")
        kind = self.input_dtype(a)
        return T.Tensor(np.ascontiguousarray(a, kind), getattr(T, kind), None, T.ROW_MAJOR_LAYOUT)

    def allocate_input(self, dtype: str = "float32"):
        """The persistent device tensor a canvas of `dtype` ("uint8" or "float32") is written into (`upload`)."""
        if dtype not in INPUT_DTYPES:
            raise ValueError(f"dtype={dtype!r}: the canvas is one of {INPUT_DTYPES}")
        T = self.ttnn
        return T.allocate_tensor_on_device(
            T.Shape(list(self.input_shape())), getattr(T, dtype), T.ROW_MAJOR_LAYOUT, self.device, T.DRAM_MEMORY_CONFIG
        )

    def upload(self, canvas: np.ndarray, into=None, cq_id: int = 0):
        """Canvas -> the device input: a new device tensor, or written into `into` (from `allocate_input` with
        the canvas's dtype)."""
        T = self.ttnn
        host = self.host_tensor(canvas)
        if into is None:
            return T.to_device(host, self.device, memory_config=T.DRAM_MEMORY_CONFIG)
        T.copy_host_to_device_tensor(host, into, cq_id=cq_id)
        return into

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, canvas):
        """Device canvas (1, 3, H, W) row-major uint8 or float32 -> the patch matrix (1, 1, seq_len,
        patch_k_padded) in the activations format, tile layout, DRAM: what `TtnnGraph.forward` takes."""
        if not self.loaded:
            raise RuntimeError("DeviceInput.forward before load()")
        T, p = self.ttnn, self.plan
        dram, mem = T.DRAM_MEMORY_CONFIG, self.mem  # the patch matrix to DRAM, the maps before it in `mem`
        if canvas.dtype == T.uint8:  # 0..255: exact in bfloat16; the / 255 is in the "rows8" matrix
            half = T.typecast(canvas, T.bfloat16, memory_config=mem)
            tiles = T.to_layout(half, T.TILE_LAYOUT, memory_config=mem)  # (1, 3, H, W)
            T.deallocate(half)
            rows = "rows8"
        else:
            tiles = T.to_layout(canvas, T.TILE_LAYOUT, dtype=T.bfloat16, memory_config=mem)  # (1, 3, H, W)
            rows = "rows"
        resized = self._split_weight_matmul(tiles, rows, left=True)  # (1, 3, grid_h, W): rows resized
        T.deallocate(tiles)
        half = T.typecast(resized, T.bfloat16, memory_config=mem)
        T.deallocate(resized)
        small = self._split_weight_matmul(half, "cols", left=False)  # (1, 3, grid_h, grid_w)
        T.deallocate(half)
        typed = T.typecast(small, T.bfloat16, memory_config=mem)  # the unfold moves bfloat16 rows
        T.deallocate(small)
        small = typed
        rm = T.to_layout(small, T.ROW_MAJOR_LAYOUT, memory_config=mem)
        T.deallocate(small)
        r, c, k = self.rows, self.cols, self.patch
        a = T.reshape(rm, (3 * r, k, c, k))  # (channel row, ky, col, kx)
        b = T.permute(a, (0, 2, 1, 3), memory_config=mem)  # (channel row, col, ky, kx)
        T.deallocate(rm)
        b = T.reshape(b, (1, 3, r * c, k * k))
        patches = T.permute(b, (0, 2, 1, 3), memory_config=mem)  # (1, row col, channel, ky kx)
        T.deallocate(b)
        patches = T.reshape(patches, (1, 1, r * c, 3 * k * k))
        padded = T.pad(
            patches,
            ((0, 0), (0, 0), (0, p["seq_len"] - r * c), (0, p["patch_k_padded"] - 3 * k * k)),
            value=0.0,
            memory_config=mem,
        )
        T.deallocate(patches)
        out = T.to_layout(padded, T.TILE_LAYOUT, memory_config=dram)
        T.deallocate(padded)
        if self.activations != "bfloat16":
            typed = T.typecast(out, getattr(T, self.activations), memory_config=dram)
            T.deallocate(out)
            out = typed
        return out

    def close(self) -> None:
        for t in self.w.values():
            self.ttnn.deallocate(t)
        self.w = {}
