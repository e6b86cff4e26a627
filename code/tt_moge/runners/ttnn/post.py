"""The output side of the Tenstorrent graph on the device: the finest phase maps -> the raw maps at the canvas.

What `runner.raw_maps` (and `prepare.host_output`) do on the host, here on the device (`DeviceOutput.forward`):

1. the constant map (`finest.const`) is added in the phase layout (it was laid out that way at load);
2. phase interleave: the phase maps (pixels (i, j), (row phase a, column phase b, channel o)) are untilized and
   permuted (two 4-D permutes of the row-major rows) to (o, a, i, b, j), padded to whole tiles: for each
   channel, a matrix whose rows are (a, i) and columns (b, j);
3. the reference's bilinear resize to the canvas (align_corners=False, `prepare.resize_bilinear`'s taps) as
   two matmuls per channel whose fixed matrices take the phases in that order (the interleave is folded into
   them): columns, then rows. Both are split matmuls (`pre.split_matmul`): the maps are float32 and the matrix
   engine would read them to TF32's 10 bits, a 1e-3 error on the depth; split into bfloat16 high and low parts
   (both operands), the resize keeps about 16 bits;
4. the output activations per head, in float32 on the SFPU: points remapped (`exp`: x, y times exp(z), z =
   exp(z); or none), normals divided by their length (rsqrt of the clamped sum of squares), the mask's sigmoid;
5. each head's maps untilized (row-major float32 rows), read back by `read` into recycled host tensors.

Read-back format: float32, channels-first ((3, H, W), (3, H, W), (H, W)); the host views them as (H, W, 3)
through strides (the solve and the finish take strided maps), no host copy. float32 because the depth is
exp(z): bfloat16's 8 bits would be a 2e-3 relative depth error, twice the bound; normals and the mask would
stand bfloat16 (0.1 deg, 0.004), but the host would then spend more converting them to float32 than the link
saves (docs/tenstorrent.md).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from .pre import device_split, exact_compute, resize_matrix, split_matmul

__all__ = ["DeviceOutput", "REMAPS", "host_view", "lend"]

TILE = 32
REMAPS = ("exp", "linear")  # the output remaps run on the device (MoGe-2's is "exp")
FREE_SETS = 2  # idle read-back sets kept for reuse (`DeviceOutput.read`): the current call's and one overlapping


def host_view(T, host_tensor) -> tuple:
    """(float32 numpy array, viewed): a row-major float32 host tensor's data without a copy, through the DLPack
    export of its host buffer (ttnn >= 0.81: `host_buffer().get_shard(MeshCoordinate(0, 0))`, one chip); the
    array keeps the buffer alive. Where that export is missing (older ttnn, the tests' emulator) `to_numpy`'s copy,
    and viewed = False."""
    try:
        shard = host_tensor.host_buffer().get_shard(T.MeshCoordinate(0, 0))
        data = np.from_dlpack(shard)
    except (AttributeError, TypeError, RuntimeError, BufferError):
        return np.asarray(host_tensor.to_numpy(), dtype=np.float32), False
    return data.view(np.float32) if data.dtype != np.float32 else data, True


class _Loan:
    """Offers one lent array to numpy (numpy keeps the offering object as the view's base: `host.buffers` leases
    its pooled blocks the same way); holds the loan's shared token."""

    __slots__ = ("array", "token", "__array_interface__")

    def __init__(self, array: np.ndarray, token: object):
        self.array, self.token = array, token
        self.__array_interface__ = {
            "data": (array.ctypes.data, False),
            "shape": array.shape,
            "strides": array.strides,
            "typestr": array.dtype.str,
            "version": 3,
        }


class _Token:
    __slots__ = ("__weakref__",)


def lend(arrays: list, on_release) -> list:
    """Views of `arrays` (numpy, memory someone else owns and wants back): `on_release()` is called once, from
    whichever thread drops the last of them, when none of the views, nor any view or tensor made from them
    (`torch.from_numpy` keeps its array), is alive any more."""
    token = _Token()
    weakref.finalize(token, on_release)
    return [np.asarray(_Loan(np.asarray(a), token)) for a in arrays]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DeviceOutput:
    """The finest phase maps -> the raw maps at the canvas, on the device (see the module docstring)."""

    def __init__(self, ttnn, device, prepared):
        self.ttnn, self.device, self.prepared = ttnn, device, prepared
        p = self.plan = prepared.plan
        if p["remap"] not in REMAPS:
            raise ValueError(f"the device output runs the remaps {REMAPS}; this checkpoint uses {p['remap']!r}")
        fin = p["finest"]
        self.h, self.w = fin["in_height"], fin["in_width"]
        self.channels = fin["channels"]
        self.width, self.height = p["canvas"]
        self.h_p = _cdiv(self.h, TILE) * TILE  # rows i padded per row phase
        self.k_cols = _cdiv(2 * self.w, TILE) * TILE  # (b, j) padded
        self.heads = [(h["name"], h["channels"]) for h in p["heads"]]
        self.t: dict = {}
        self.loaded = False
        self.zero_copy = False  # whether the last `read` viewed the host tensors in place (`host_view`)
        self._lock = threading.Lock()
        self._free: list = []  # idle sets of read-back host tensors ({head: host tensor}), `read`
        self._closed = False
        self.sets_made = 0  # read-back sets allocated so far (one in a loop whose results are dropped)

    def _tensor(self, array: np.ndarray, dtype: str):
        T = self.ttnn
        a = np.ascontiguousarray(array, np.float32)
        return T.Tensor(a, getattr(T, dtype), self.device, T.TILE_LAYOUT, T.DRAM_MEMORY_CONFIG)

    def load(self) -> None:
        """The phase-laid-out constant map and the resize matrices (split, `pre.split_matmul`) to the device."""
        T, h, w, c = self.ttnn, self.h, self.w, self.channels
        const = self.prepared.arrays["finest.const"]  # (C, 2h, 2w)
        phased = const.reshape(c, h, 2, w, 2).transpose(1, 3, 2, 4, 0).reshape(1, 1, h * w, 4 * c)  # (i j, a b o)
        self.t["const"] = self._tensor(phased, "float32")
        cols = resize_matrix(2 * w, self.width, "bilinear")  # (W, 2w) over the interleaved columns 2 j + b
        right = np.zeros((self.k_cols, self.width), np.float32)
        for b in (0, 1):
            right[b * w : (b + 1) * w] = cols[:, b::2].T
        self.t["cols"] = self._tensor(split_matmul(right, "right"), "bfloat16")  # (3 k_cols, W)
        rows = resize_matrix(2 * h, self.height, "bilinear")  # (H, 2h) over the interleaved rows 2 i + a
        left = np.zeros((self.height, 2 * self.h_p), np.float32)
        for a in (0, 1):
            left[:, a * self.h_p : a * self.h_p + h] = rows[:, a::2]
        self.t["rows"] = self._tensor(split_matmul(left, "left")[None, None], "bfloat16")  # (1, 1, H, 3 (2 h_p))
        self.compute = exact_compute(T, self.device)
        self.loaded = True

    def _interleaved(self, finest):
        """The phase maps (1, 1, h w, 4 C) + the constant map -> (1, C, 2 h_p, k_cols) float32 tiles: per channel o,
        rows (a, i) and columns (b, j), zero-padded."""
        T, h, w, c = self.ttnn, self.h, self.w, self.channels
        dram = T.DRAM_MEMORY_CONFIG
        x = finest
        if x.layout != T.TILE_LAYOUT:
            x = T.to_layout(x, T.TILE_LAYOUT, memory_config=dram)
        y = T.add(x, self.t["const"], dtype=T.float32, memory_config=dram)
        if x is not finest:
            T.deallocate(x)
        rm = T.to_layout(y, T.ROW_MAJOR_LAYOUT, memory_config=dram)  # (1, 1, (i j), (a b o))
        T.deallocate(y)
        a = T.permute(T.reshape(rm, (h, w, 2, 2 * c)), (2, 0, 1, 3), memory_config=dram)  # (a, i, j, (b o))
        T.deallocate(rm)
        b = T.permute(T.reshape(a, (2 * h, w, 2, c)), (3, 0, 2, 1), memory_config=dram)  # (o, (a i), b, j)
        T.deallocate(a)
        b = T.reshape(b, (c, 2, h, 2 * w))  # (o, a, i, (b j))
        padded = b
        if self.h_p > h or self.k_cols > 2 * w:  # (a no-op pad hands back its input: nothing to free then)
            padded = T.pad(
                b, ((0, 0), (0, 0), (0, self.h_p - h), (0, self.k_cols - 2 * w)), value=0.0, memory_config=dram
            )
            T.deallocate(b)
        q = T.to_layout(T.reshape(padded, (1, c, 2 * self.h_p, self.k_cols)), T.TILE_LAYOUT, memory_config=dram)
        T.deallocate(padded)
        return q

    def forward(self, finest) -> dict:
        """The graph's finest phase maps (1, 1, h w, 4 C) float32 -> {head name: its maps (1, channels, H, W) float32,
        row-major, DRAM}, after the output activations. Each channel runs on its own from the (small) interleaved
        map on: columns resized (a split matmul), rows resized (a split matmul), so that no canvas-sized map is
        ever sliced."""
        if not self.loaded:
            raise RuntimeError("DeviceOutput.forward before load()")
        T, dram = self.ttnn, self.ttnn.DRAM_MEMORY_CONFIG
        q = self._interleaved(finest)
        split = device_split(T, q, 3, "hlh")  # (1, C, 2 h_p, 3 k_cols)
        T.deallocate(q)
        rows2, width3 = 2 * self.h_p, 3 * self.k_cols
        channels = []
        for o in range(self.channels):
            part = T.slice(split, (0, o, 0, 0), (1, o + 1, rows2, width3), memory_config=dram)
            r = T.matmul(part, self.t["cols"], dtype=T.float32, compute_kernel_config=self.compute, memory_config=dram)
            T.deallocate(part)  # r: (1, 1, 2 h_p, W): columns resized and interleaved
            r3 = device_split(T, r, 2, "hlh")  # (1, 1, 3 (2 h_p), W)
            T.deallocate(r)
            m = T.matmul(self.t["rows"], r3, dtype=T.float32, compute_kernel_config=self.compute, memory_config=dram)
            T.deallocate(r3)
            channels.append(m)  # (1, 1, H, W)
        T.deallocate(split)
        out, start = {}, 0
        for name, n in self.heads:
            done = self._activation(name, channels[start : start + n])
            start += n
            out[name] = T.to_layout(done, T.ROW_MAJOR_LAYOUT, memory_config=dram)
            T.deallocate(done)
        return out

    def _concat(self, parts: list):
        T = self.ttnn
        if len(parts) == 1:
            return parts[0]
        out = T.concat(parts, dim=1, memory_config=T.DRAM_MEMORY_CONFIG)
        for t in parts:
            T.deallocate(t)
        return out

    def _activation(self, name: str, xs: list):
        """The reference's output activation of one head on its channels ((1, 1, H, W) float32 each; consumed) ->
        (1, n, H, W)."""
        T, dram = self.ttnn, self.ttnn.DRAM_MEMORY_CONFIG
        if name == "points" and self.plan["remap"] == "exp":
            x, y, z = xs
            ez = T.exp(z, memory_config=dram)
            T.deallocate(z)
            px = T.multiply(x, ez, dtype=T.float32, memory_config=dram)
            py = T.multiply(y, ez, dtype=T.float32, memory_config=dram)
            T.deallocate(x)
            T.deallocate(y)
            return self._concat([px, py, ez])
        if name == "normal":
            squares = [T.multiply(v, v, dtype=T.float32, memory_config=dram) for v in xs]
            s = squares[0]
            for sq in squares[1:]:
                total = T.add(s, sq, dtype=T.float32, memory_config=dram)
                T.deallocate(s)
                T.deallocate(sq)
                s = total
            clamped = T.clamp(s, min=1e-24, memory_config=dram)  # F.normalize's max(|n|, 1e-12), squared
            T.deallocate(s)
            inv = T.rsqrt(clamped, memory_config=dram)
            T.deallocate(clamped)
            unit = [T.multiply(v, inv, dtype=T.float32, memory_config=dram) for v in xs]
            T.deallocate(inv)
            for v in xs:
                T.deallocate(v)
            return self._concat(unit)
        if name == "mask":
            out = T.sigmoid(xs[0], memory_config=dram)
            T.deallocate(xs[0])
            return out
        return self._concat(list(xs))

    def read(self, outputs: dict, cq_id: int = 0) -> dict:
        """The device maps -> {head name: float32 numpy (n, H, W), channels-first}, read on queue `cq_id`.

        Each map is read into a host tensor of a recycled set (`copy_device_to_host_tensor`) and handed on as a
        numpy view of that tensor's own memory (`host_view`, lent: `lend`): no copy, and no
        fresh pages either. `from_device` would allocate a new host tensor per call, whose 58 MB (1920x1080
        canvas) of pages the read then faults in one by one, about as long as the link's transfer
        (docs/performance.md); `to_numpy` would copy them once more. A set goes back to the pool only when
        nothing made from the last read into it (the raw maps, any view or tensor of them, a result that kept
        one) is alive, so results stay valid across calls: while the host finish of one call holds its maps,
        `predict_many`'s next read goes into another set (allocated then, reused from then on). At most
        `FREE_SETS` idle sets are kept.

        `zero_copy` says whether the last read could view (False: this ttnn has no DLPack export of host
        buffers, and copied; or no `copy_device_to_host_tensor` or a tiled map, and read through `from_device`)."""
        T = self.ttnn
        if not hasattr(T, "copy_device_to_host_tensor") or any(
            outputs[name].layout != T.ROW_MAJOR_LAYOUT for name, _ in self.heads
        ):
            return self._read_fresh(outputs, cq_id)
        slot = self._take_set(outputs)
        for name, _ in self.heads:
            T.copy_device_to_host_tensor(outputs[name], slot[name], blocking=True, cq_id=cq_id)
        views = [host_view(T, slot[name]) for name, _ in self.heads]
        self.zero_copy = all(viewed for _, viewed in views)
        if self.zero_copy:
            arrays = lend([array for array, _ in views], lambda: self._give_back(slot))
        else:  # copies (to_numpy; a view too, where only some could view): the set is free again at once
            arrays = [np.array(array) if viewed else array for array, viewed in views]
            self._give_back(slot)
        return {name: a.reshape(n, self.height, self.width) for (name, n), a in zip(self.heads, arrays)}

    def _take_set(self, outputs: dict) -> dict:
        """An idle set of host tensors (one per head, each of its device map's shape, dtype and row-major layout),
        or a new one."""
        with self._lock:
            if self._free:
                return self._free.pop()
        T = self.ttnn
        self.sets_made += 1
        return {
            name: T.Tensor(
                np.zeros(tuple(int(d) for d in outputs[name].shape), np.float32),
                outputs[name].dtype,
                None,
                T.ROW_MAJOR_LAYOUT,
            )
            for name, _ in self.heads
        }

    def _give_back(self, slot: dict) -> None:
        with self._lock:
            if len(self._free) < FREE_SETS and not self._closed:
                self._free.append(slot)

    def _read_fresh(self, outputs: dict, cq_id: int) -> dict:
        """The read without a recycled set: `from_device` into fresh host tensors, viewed where it can."""
        T = self.ttnn
        out, views = {}, []
        for name, n in self.heads:
            h = T.from_device(outputs[name], queue_id=cq_id)
            if h.layout != T.ROW_MAJOR_LAYOUT:
                h = T.to_layout(h, T.ROW_MAJOR_LAYOUT)
            array, viewed = host_view(T, h)
            views.append(viewed)
            out[name] = array.reshape(n, self.height, self.width)
        self.zero_copy = all(views)
        return out

    def close(self) -> None:
        """Free the device constants and drop the idle read-back sets (lent ones go when their results do)."""
        for t in self.t.values():
            self.ttnn.deallocate(t)
        self.t = {}
        with self._lock:
            self._closed = True
            self._free = []
