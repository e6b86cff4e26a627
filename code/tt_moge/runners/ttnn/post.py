"""The output side of the Tenstorrent graph on the device: the finest phase maps -> the raw maps at the canvas.

What `runner.raw_maps` (and `prepare.host_output`) do on the host, here on the device (`DeviceOutput.forward`):

1. the constant map (`finest.const`) is added in the phase layout (it was laid out that way at load);
2. phase interleave: the phase maps (pixels (i, j), (row phase a, column phase b, channel o)) are untilized and
   permuted (one 5-D permute of the row-major rows) to (o, i, a, j, b): for each channel, the interleaved map
   itself (rows 2 i + a, columns 2 j + b), zero-padded to whole tiles, all channels in one (1, C, rows, cols)
   tensor;
3. the reference's bilinear resize to the canvas (align_corners=False, `prepare.resize_bilinear`'s taps) as two
   batched matmuls per head, one channel per batch (no per-channel slices): columns (the map times a fixed
   (cols, W) matrix, broadcast over the batch), then rows (a fixed (H, rows) matrix, one copy per channel, times
   the column-resized maps). Precision per head, as its output needs it:
   * points: both matmuls split (`pre.split_matmul`): the maps are float32 and the matrix engine would read them
     to TF32's 10 bits, a 1e-3 error on the depth (exp(z)); split into bfloat16 high and low parts (both
     operands), the resize keeps about 16 bits;
   * normals and the mask: not split (a third of K, one matmul each): the map and the matrices in bfloat16, the
     column-resized maps kept in float32 (the row resize reads them at TF32's 10 bits); a normal is divided by its
     length and a mask probability thresholded at 0.5, and this keeps them within ~0.1 degree and ~2e-3
     (docs/tenstorrent.md, tests/test_ttnn_prepost.py);
4. the output activations per head, computed in float32 on the SFPU, with the unary steps fused into the binary ops
   where ttnn takes them (`input_tensor_a_activations`, `activations`) or given to the matmul (the mask's sigmoid, which
   ttnn runs as its own op after it): points
   remapped (`exp`: x, y times exp(z), z = exp(z); or none), normals times the rsqrt of their clamped squared
   length, the mask's sigmoid;
5. each head's maps untilized once into row-major (n, H, W) in DRAM, in the head's read-back format
   (`READBACK`): what `read` reads back into recycled host tensors.

Memory: every intermediate lives in L1 (interleaved over the cores; the network's buffers are free by then)
when the largest, a head's three float32 canvas maps, takes at most `pre.L1_MAP_BUDGET` per core
(`pre.intermediates`); only the outputs go to DRAM. Larger canvases keep everything in DRAM.

Read-back format (`READBACK`): channels-first ((3, H, W), (3, H, W), (1, H, W)); the host views them as (H, W, 3)
through strides (the solve and the finish take strided maps), no host copy. The points in float32: the depth is
exp(z), and bfloat16's 8 bits would be a 2e-3 relative depth error, twice the bound. The normals in bfloat16 (the
head's last op rounds to it; its arithmetic stays float32): a mean angle under 0.1 degree, and 12 MB less over
PCIe at 1920x1080 (docs/tenstorrent.md). The mask in float32: bfloat16 reads the probabilities in (0.5, 0.502] as
0.5, which flips their pixels and, through the samples it keeps, moves the camera solve (the depth by 6e-4 on the
tests' model) for 4 MB (0.17 ms of link); `readback={"mask": "bfloat16"}` has it. `read` hands a bfloat16 map on
as its bits (uint16 numpy: numpy has no bfloat16); the runner views those as torch bfloat16, which the native
finish and solve read as they are (`widen` gives float32 where a caller wants it).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from .pre import device_split, exact_compute, intermediates, resize_matrix, split_matmul
from .tiles import TILE, cdiv

__all__ = ["DeviceOutput", "HEADS", "READBACK", "REMAPS", "host_view", "lend", "widen"]

REMAPS = ("exp", "linear")  # the output remaps run on the device (MoGe-2's is "exp")
HEADS = ("points", "normal", "mask")  # the heads the device output side knows the activations of
NORMAL_EPS2 = 1e-24  # F.normalize's max(|n|, 1e-12), squared
FREE_SETS = 2  # idle read-back sets kept for reuse (`DeviceOutput.read`): the current call's and one overlapping
READBACK = {"points": "float32", "normal": "bfloat16", "mask": "float32"}  # each head's read-back format


def widen(array: np.ndarray) -> np.ndarray:
    """A read map as float32: bfloat16 bits (uint16, what `read` gives for a bfloat16 head) widened exactly; a
    float32 map as it is."""
    if array.dtype == np.uint16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def host_view(T, host_tensor, bits: bool = False) -> tuple:
    """(numpy array, viewed): a row-major host tensor's data without a copy, through the DLPack export of its host
    buffer (ttnn >= 0.81: `host_buffer().get_shard(MeshCoordinate(0, 0))`, one chip, the raw bytes); the array keeps
    the buffer alive. float32, or with `bits` (a bfloat16 tensor) uint16: the bfloat16 bits. Where that export is
    missing (older ttnn) a copy (`to_numpy`, after `to_dtype` float32 for bfloat16), and viewed = False."""
    want = np.uint16 if bits else np.float32
    try:
        shard = host_tensor.host_buffer().get_shard(T.MeshCoordinate(0, 0))
        data = np.from_dlpack(shard)
    except (AttributeError, TypeError, RuntimeError, BufferError):
        if not bits:
            return np.asarray(host_tensor.to_numpy(), dtype=np.float32), False
        wide = np.asarray(T.to_dtype(host_tensor, T.float32).to_numpy(), dtype=np.float32)
        return (wide.view(np.uint32) >> 16).astype(np.uint16), False  # exact: the values are bfloat16's
    return data.view(want) if data.dtype != want else data, True


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


class DeviceOutput:
    """The finest phase maps -> the raw maps at the canvas, on the device (see the module docstring)."""

    def __init__(self, ttnn, device, prepared, readback: dict = None):
        """`readback`: {head: "float32" | "bfloat16"} to read some heads back in another format than `READBACK`'s
        (the tests compare the float32 arithmetic before the rounding)."""
        self.ttnn, self.device, self.prepared = ttnn, device, prepared
        p = self.plan = prepared.plan
        if p["remap"] not in REMAPS:
            raise ValueError(f"the device output runs the remaps {REMAPS}; this checkpoint uses {p['remap']!r}")
        fin = p["finest"]
        self.h, self.w = fin["in_height"], fin["in_width"]
        self.channels = fin["channels"]
        self.width, self.height = p["canvas"]
        self.rows = cdiv(2 * self.h, TILE) * TILE  # the interleaved rows 2 i + a, padded
        self.cols = cdiv(2 * self.w, TILE) * TILE  # the interleaved columns 2 j + b, padded
        self.heads, start = [], 0  # (name, first channel, channels)
        for head in p["heads"]:
            if head["name"] not in HEADS:
                raise ValueError(f"the device output runs the heads {HEADS}; this checkpoint has {head['name']!r}")
            self.heads.append((head["name"], start, head["channels"]))
            start += head["channels"]
        formats = {**READBACK, **(readback or {})}
        if formats["points"] != "float32" or any(
            formats[name] not in ("float32", "bfloat16") for name, _, _ in self.heads
        ):
            raise ValueError(
                f"readback: the points are read back as 'float32', the other heads as 'float32' or 'bfloat16'; "
                f"got {readback!r}"
            )
        self.readback = {name: formats[name] for name, _, _ in self.heads}  # the format each head is read back in
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
        """The phase-laid-out constant map and the resize matrices to the device: split (`pre.split_matmul`) for the
        points, plain bfloat16 for the other heads; the row matrix once per channel of its head (batched)."""
        T, h, w, c = self.ttnn, self.h, self.w, self.channels
        const = self.prepared.arrays["finest.const"]  # (C, 2h, 2w)
        phased = const.reshape(c, h, 2, w, 2).transpose(1, 3, 2, 4, 0).reshape(1, 1, h * w, 4 * c)  # (i j, a b o)
        self.t["const"] = self._tensor(phased, "float32")
        right = np.zeros((self.cols, self.width), np.float32)  # (cols, W): the interleaved columns 2 j + b
        right[: 2 * w] = resize_matrix(2 * w, self.width, "bilinear").T
        left = np.zeros((self.height, self.rows), np.float32)  # (H, rows): the interleaved rows 2 i + a
        left[:, : 2 * h] = resize_matrix(2 * h, self.height, "bilinear")
        for name, _, n in self.heads:
            if name == "points":
                self.t["cols.split"] = self._tensor(split_matmul(right, "right"), "bfloat16")  # (3 cols, W)
                rows = split_matmul(left, "left")  # (H, 3 rows)
                self.t["rows.split"] = self._tensor(np.tile(rows, (1, n, 1, 1)), "bfloat16")
            else:
                self.t.setdefault("cols", self._tensor(right, "bfloat16"))  # (cols, W)
                self.t[f"rows.{n}"] = self._tensor(np.tile(left, (1, n, 1, 1)), "bfloat16")
        self.compute = exact_compute(T, self.device)
        self.mem = intermediates(T, self.device, 3 * cdiv(self.height, TILE) * TILE * self.width * 4)  # 3 maps
        self.loaded = True

    def _interleaved(self, finest):
        """The phase maps (1, 1, h w, 4 C) + the constant map -> (1, C, rows, cols) float32 tiles: per channel o, the
        interleaved map (rows 2 i + a, columns 2 j + b), zero-padded."""
        T, h, w, c, mem = self.ttnn, self.h, self.w, self.channels, self.mem
        x = finest
        if x.layout != T.TILE_LAYOUT:
            x = T.to_layout(x, T.TILE_LAYOUT, memory_config=mem)
        y = T.add(x, self.t["const"], dtype=T.float32, memory_config=mem)
        if x is not finest:
            T.deallocate(x)
        rm = T.to_layout(y, T.ROW_MAJOR_LAYOUT, memory_config=mem)  # (1, 1, (i j), (a b o))
        T.deallocate(y)
        p = T.permute(T.reshape(rm, (h, w, 2, 2, c)), (4, 0, 2, 1, 3), memory_config=mem)  # (o, i, a, j, b)
        T.deallocate(rm)
        p = T.reshape(p, (1, c, 2 * h, 2 * w))
        padded = p
        if self.rows > 2 * h or self.cols > 2 * w:  # (a no-op pad hands back its input: nothing to free then)
            padded = T.pad(
                p, ((0, 0), (0, 0), (0, self.rows - 2 * h), (0, self.cols - 2 * w)), value=0.0, memory_config=mem
            )
            T.deallocate(p)
        q = T.to_layout(padded, T.TILE_LAYOUT, memory_config=mem)
        T.deallocate(padded)
        return q

    def _channels(self, x, start: int, n: int):
        """Channels [start, start + n) of a (1, C, rows, width) tensor (x itself when that is all of it)."""
        if start == 0 and n == x.shape[1]:
            return x
        T = self.ttnn
        return T.slice(x, (0, start, 0, 0), (1, start + n, x.shape[2], x.shape[3]), memory_config=self.mem)

    def output_shape(self, name: str) -> tuple:
        """The shape of head `name`'s maps: (1, channels, H, W)."""
        return (1, next(n for head, _, n in self.heads if head == name), self.height, self.width)

    def allocate_outputs(self) -> dict:
        """Persistent device tensors for one call's maps ({head: (1, channels, H, W) row-major, DRAM, in the head's
        read-back format}), which `forward(..., into=)` fills: allocated before any trace is captured, no trace's
        intermediates lie where they live, so one call's maps stay intact while another call's trace runs."""
        T = self.ttnn
        return {
            name: T.allocate_tensor_on_device(
                T.Shape(list(self.output_shape(name))),
                self._out(name),
                T.ROW_MAJOR_LAYOUT,
                self.device,
                T.DRAM_MEMORY_CONFIG,
            )
            for name, _, _ in self.heads
        }

    def forward(self, finest, into: dict = None) -> dict:
        """The graph's finest phase maps (1, 1, h w, 4 C) float32 -> {head name: its maps (1, channels, H, W) float32,
        row-major, DRAM}, after the output activations. Each head runs on its own channels of the interleaved map:
        columns resized, rows resized (batched matmuls, one channel per batch), its activation, one untilize.
        `into` (from `allocate_outputs`): each head's maps are untilized where the intermediates live and copied
        into it (returned), instead of untilized into a new DRAM tensor."""
        if not self.loaded:
            raise RuntimeError("DeviceOutput.forward before load()")
        T = self.ttnn
        q = self._interleaved(finest)
        hi = T.typecast(q, T.bfloat16, memory_config=self.mem)  # every head's bfloat16 part (the points' high part)
        out = {}
        for name, start, n in self.heads:
            if name == "points":
                maps = self._resize_split(self._channels(q, start, n), self._channels(hi, start, n), n)
            else:
                mask = name == "mask"  # the sigmoid is the matmul's, its output the head's read-back format
                maps = self._resize_plain(
                    self._channels(hi, start, n), n, "sigmoid" if mask else None, self._out(name) if mask else None
                )
            done = self._activation(name, maps)
            if into is None:
                out[name] = T.to_layout(done, T.ROW_MAJOR_LAYOUT, memory_config=T.DRAM_MEMORY_CONFIG)
            else:
                rows = T.to_layout(done, T.ROW_MAJOR_LAYOUT, memory_config=self.mem)
                T.copy(rows, into[name])
                T.deallocate(rows)
                out[name] = into[name]
            T.deallocate(done)
        T.deallocate(q)
        T.deallocate(hi)
        return out

    def _resize_split(self, x, hi, n: int):
        """x (1, n, rows, cols) float32 and its bfloat16 rounding `hi` (both consumed unless they are the whole
        interleaved map) -> (1, n, H, W) float32, both resizes split (about 16 bits)."""
        T, mem, ck = self.ttnn, self.mem, self.compute
        parts = device_split(T, x, 3, "hlh", memory_config=mem, hi=hi)  # (1, n, rows, 3 cols)
        if n != self.channels:  # slices: ours to free
            T.deallocate(x)
            T.deallocate(hi)
        cols = T.matmul(parts, self.t["cols.split"], dtype=T.float32, compute_kernel_config=ck, memory_config=mem)
        T.deallocate(parts)  # cols: (1, n, rows, W), columns resized
        parts = device_split(T, cols, 2, "hlh", memory_config=mem)  # (1, n, 3 rows, W)
        T.deallocate(cols)
        out = T.matmul(self.t["rows.split"], parts, dtype=T.float32, compute_kernel_config=ck, memory_config=mem)
        T.deallocate(parts)
        return out

    def _out(self, name: str):
        """The ttnn dtype of a head's read-back format."""
        return getattr(self.ttnn, self.readback[name])

    def _resize_plain(self, hi, n: int, activation=None, dtype=None):
        """hi (1, n, rows, cols) bfloat16 (consumed unless it is the whole map) -> (1, n, H, W) float32 (after the
        matmul's fused `activation`, rounded to `dtype`, float32 unless given): bfloat16 map and matrices, float32
        accumulation, the column-resized maps in float32 (a quarter less angle error on the normals than bfloat16
        there, for 20 us of NoC traffic)."""
        T, mem, ck = self.ttnn, self.mem, self.compute
        cols = T.matmul(hi, self.t["cols"], dtype=T.float32, compute_kernel_config=ck, memory_config=mem)
        if n != self.channels:
            T.deallocate(hi)
        out = T.matmul(
            self.t[f"rows.{n}"],
            cols,
            dtype=dtype or T.float32,
            compute_kernel_config=ck,
            memory_config=mem,
            activation=activation,
        )
        T.deallocate(cols)
        return out

    def _activation(self, name: str, x):
        """The reference's output activation of one head on its (1, n, H, W) float32 maps (consumed) -> the head's
        maps, tile layout (the mask's sigmoid ran in its matmul)."""
        T, mem = self.ttnn, self.mem
        U, op = T.UnaryOpType, T.UnaryWithParam
        if name == "points" and self.plan["remap"] == "exp":
            xy = T.slice(x, (0, 0, 0, 0), (1, 2, x.shape[2], x.shape[3]), memory_config=mem)
            z = T.slice(x, (0, 2, 0, 0), (1, 3, x.shape[2], x.shape[3]), memory_config=mem)
            T.deallocate(x)
            ez = T.exp(z, memory_config=mem)
            T.deallocate(z)
            pxy = T.multiply(xy, ez, dtype=T.float32, memory_config=mem)  # (x, y) exp(z), z's map broadcast
            T.deallocate(xy)
            out = T.concat([pxy, ez], dim=1, memory_config=mem)
            T.deallocate(pxy)
            T.deallocate(ez)
            return out
        if name == "normal":
            n0, n1, n2 = (
                T.slice(x, (0, i, 0, 0), (1, i + 1, x.shape[2], x.shape[3]), memory_config=mem) for i in range(3)
            )
            square = [op(U.SQUARE)]
            s = T.add(n0, n1, input_tensor_a_activations=square, input_tensor_b_activations=square, memory_config=mem)
            inv = T.add(  # rsqrt(max(n0^2 + n1^2 + n2^2, eps^2)) in one pass
                s,
                n2,
                input_tensor_b_activations=square,
                activations=[op(U.MAXIMUM, NORMAL_EPS2), op(U.RSQRT)],
                memory_config=mem,
            )
            for t in (n0, n1, n2, s):
                T.deallocate(t)
            out = T.multiply(x, inv, dtype=self._out(name), memory_config=mem)  # the inverse length broadcast
            T.deallocate(x)
            T.deallocate(inv)
            return out
        return x  # the mask (its sigmoid and format are the matmul's), the linear remap's points

    def read(self, outputs: dict, cq_id: int = 0) -> dict:
        """The device maps -> {head name: numpy (n, H, W), channels-first}, read on queue `cq_id` and waited for:
        `finish_read(start_read(...))` with a blocking read."""
        return self.finish_read(self.start_read(outputs, cq_id, blocking=True))

    def start_read(self, outputs: dict, cq_id: int = 0, blocking: bool = False):
        """Enqueue the read of the device maps on queue `cq_id` (`blocking=False`: returns before the data is on the
        host; the caller waits for an event recorded after it) -> a handle for `finish_read`: {head name: numpy
        (n, H, W), channels-first}, float32, or for a bfloat16 head (`readback`) its bits as uint16 (`widen` makes
        float32 of them).

        Each map is read into a host tensor of a recycled set (`copy_device_to_host_tensor`) and handed on as a
        numpy view of that tensor's own memory (`host_view`, lent: `lend`): no copy, and no
        fresh pages either. `from_device` would allocate a new host tensor per call, whose 58 MB (1920x1080
        canvas) of pages the read then faults in one by one, about as long as the link's transfer
        (docs/performance.md); `to_numpy` would copy them once more. A set goes back to the pool only when
        nothing made from the last read into it (the raw maps, any view or tensor of them, a result that kept
        one) is alive, so results stay valid across calls: while the host finish of one call holds its maps,
        `predict_many`'s next read goes into another set (allocated then, reused from then on). At most
        `FREE_SETS` idle sets are kept. A preallocated host tensor is also what ttnn reads into through pinned
        memory (tt-metal's pinned-memory cache, PR 41612: the host buffer is pinned on its first read and the pin
        kept for the next ones; `from_device`'s fresh tensors are read through the completion queue), about 4x
        the link rate of an unpinned read on Blackhole (`ttnn_tools.cost.Link`).

        `zero_copy` says whether the last read could view (False: this ttnn has no DLPack export of host
        buffers, and copied; or no `copy_device_to_host_tensor` or a tiled map, and read through `from_device`)."""
        T = self.ttnn
        if not hasattr(T, "copy_device_to_host_tensor") or any(
            outputs[name].layout != T.ROW_MAJOR_LAYOUT for name, _, _ in self.heads
        ):
            return ("fresh", self._read_fresh(outputs, cq_id))
        slot = self._take_set(outputs)
        for name, _, _ in self.heads:
            T.copy_device_to_host_tensor(outputs[name], slot[name], blocking=blocking, cq_id=cq_id)
        return ("set", slot)

    def finish_read(self, handle) -> dict:
        """`start_read`'s maps, once its read has completed (the caller waited for it)."""
        kind, value = handle
        if kind == "fresh":
            return value
        T, slot = self.ttnn, value
        views = [host_view(T, slot[name], self.readback[name] == "bfloat16") for name, _, _ in self.heads]
        self.zero_copy = all(viewed for _, viewed in views)
        if self.zero_copy:
            arrays = lend([array for array, _ in views], lambda: self._give_back(slot))
        else:  # copies (to_numpy; a view too, where only some could view): the set is free again at once
            arrays = [np.array(array) if viewed else array for array, viewed in views]
            self._give_back(slot)
        return {name: a.reshape(n, self.height, self.width) for (name, _, n), a in zip(self.heads, arrays)}

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
            for name, _, _ in self.heads
        }

    def _give_back(self, slot: dict) -> None:
        with self._lock:
            if len(self._free) < FREE_SETS and not self._closed:
                self._free.append(slot)

    def _read_fresh(self, outputs: dict, cq_id: int) -> dict:
        """The read without a recycled set: `from_device` into fresh host tensors, viewed where it can."""
        T = self.ttnn
        out, views = {}, []
        for name, _, n in self.heads:
            h = T.from_device(outputs[name], queue_id=cq_id)
            if h.layout != T.ROW_MAJOR_LAYOUT:
                h = T.to_layout(h, T.ROW_MAJOR_LAYOUT)
            array, viewed = host_view(T, h, self.readback[name] == "bfloat16")
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
