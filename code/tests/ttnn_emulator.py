"""A torch test double of the ttnn API surface that `tt_moge.runners.ttnn.graph` uses (and a few neighbours:
softmax, concat, permute, pad, upsample): the numerics of the Tenstorrent graph, checkable on a CPU. Never
offered to users as a device.

Written from ttnn 0.81's documented semantics and its golden functions (`ttnn.get_golden_function`): linear =
a @ b + bias with b laid out (K, N); layer_norm over the last dim; `split_query_key_value_and_split_heads`
on (B, S, 3 H D) = [q heads | k heads | v heads]; non-causal SDPA over the logical sequence; conv2d on
(1, 1, N*H*W, C) channels-last input with OIHW weights and a zero or replicate padding mode; conv_transpose2d
with (C_in, C_out, kH, kW) weights; slices, reshapes, adds with broadcasting.

Formats. Every tensor is a float32 torch tensor rounded to its ttnn dtype whenever it is created or written
by an op: bfloat16 by round-to-nearest-even (what ttnn's host conversion does), bfloat8_b as ttnn stores it:
each run of 16 consecutive values along the last dim (one row of a 16x16 face of a 32x32 tile) shares the
exponent of its largest magnitude, each value keeps a sign and a 7-bit magnitude rounded to nearest even and
clipped at 127 (checked against ttnn's own host conversion).

The matrix engine (`FIDELITY_BITS`), as tt-metal documents it (tech_reports/matrix_engine, the ISA's MVMUL page): the
source registers hold 19-bit values (TF32: a float32 operand loses its low 13 mantissa bits, bfloat16 and
bfloat8_b are exact); matmul's first operand (activations, in0) goes to SrcB, its second (weights, in1) to
SrcA; one pass of the 5 x 7-bit multipliers uses the implicit bit and the next 4 mantissa bits of SrcA (5
significant bits) and the implicit bit and next 6 of SrcB (7 significant bits). LoFi is that one pass; HiFi2
adds SrcA's next 5 bits (weights exact up to 10 bits, activations 7 bits); HiFi3 instead adds SrcB's next 4 bits;
HiFi4 both (10 x 11 significant bits). The products are summed in the destination register: float32 with
`fp32_dest_acc_en`, else bfloat16, which is rounded to after every 16-deep multiply-accumulate along K (one
MVMUL). Convs are matmuls over their windows, so the same. Elementwise multiplies use the same passes; adds
and subtractions do not (they see TF32 operands), except float32 + float32, which ttnn computes on the SFPU
in float32. SDPA is emulated as the FlashAttention kernel runs it: per key chunk, QK^T and PV at the op's
fidelity, scores, probabilities, the running max, sum and output rounded to bfloat16 (its intermediate
buffers), and the softmax's exp either exact or, with `exp_approx_mode`, the SFPU's fast approximate exp
(Schraudolph's bit trick: 2^(x / ln 2) built in the float's exponent and mantissa fields, a few per cent off).
Layer norm as its kernel runs it: the mean and the variance by the matrix engine's row reduce (fidelity
applies to the input), x - mean, its square, the statistics and the normalised value each stored in float32
with `fp32_dest_acc_en`, else in bfloat16. A compute config that an op is not given takes ttnn 0.81's default
(matmul: LoFi with a program config; HiFi2 without one, for bfloat16 inputs; layer norm: HiFi4 with float32
accumulation; SDPA: HiFi2, approximate exp, no float32 accumulation; conv: HiFi4, float32 accumulation).
Not modelled: intra-op blocking beyond the 16-deep accumulation, other SFPU approximations (gelu, rsqrt).
`TtnnEmulator(exact=True)` is the "float32 everything" mode: no rounding, no fidelity, exact exp.

Cheap validations raise like the real ops (shapes, ranks, program config arithmetic); memory configs and
program configs are otherwise inert. Ops are counted in `emulator.op_counts`.
"""

from __future__ import annotations

import collections
import enum
import math
import types
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["TtnnEmulator", "round_bf16", "round_bfp8"]

TILE = 32


class DataType(enum.Enum):
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    BFLOAT8_B = "bfloat8_b"
    UINT8 = "uint8"


class Layout(enum.Enum):
    ROW_MAJOR = "row_major"
    TILE = "tile"


class TensorMemoryLayout(enum.Enum):
    INTERLEAVED = 0
    HEIGHT_SHARDED = 1
    WIDTH_SHARDED = 2
    BLOCK_SHARDED = 3


class BufferType(enum.Enum):
    DRAM = 0
    L1 = 1


class MathFidelity(enum.Enum):
    LoFi = 0
    HiFi2 = 2
    HiFi3 = 3
    HiFi4 = 4


class UnaryOpType(enum.Enum):
    RELU = "relu"
    GELU = "gelu"
    EXP = "exp"
    SIGMOID = "sigmoid"
    RSQRT = "rsqrt"
    SQUARE = "square"
    MAXIMUM = "maximum"  # max(x, param)


class PaddingMode(enum.Enum):
    Zeros = 0
    Replicate = 1


class SliceType(enum.Enum):
    DRAMSliceHeight = 0
    DRAMSliceWidth = 1
    L1Full = 2


class _Inert:
    """A config object: keyword arguments stored as attributes, nothing else."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "args")
        return f"{type(self).__name__}({fields})"


class MemoryConfig(_Inert):
    pass


class CoreRangeSet(_Inert):
    pass


class CoreCoord:
    def __init__(self, x: int, y: int):
        self.x, self.y = int(x), int(y)

    def __repr__(self):
        return f"CoreCoord({self.x}, {self.y})"


class CoreGrid(CoreCoord):
    def __init__(self, *, x: int, y: int):
        super().__init__(x, y)


class UnaryWithParam:
    def __init__(self, op_type: UnaryOpType, *params):
        self.op_type = op_type
        self.params = params


class MatmulMultiCoreReuseMultiCastProgramConfig(_Inert):
    pass


class SDPAProgramConfig(_Inert):
    pass


class Conv2dConfig(_Inert):
    def __init__(self, *, weights_dtype=None, activation=None, padding_mode=PaddingMode.Zeros, **kwargs):
        super().__init__(weights_dtype=weights_dtype, activation=activation, padding_mode=padding_mode, **kwargs)


class Conv2dSliceConfig(_Inert):
    def __init__(self, *, slice_type: SliceType, num_slices: int = 0):
        super().__init__(slice_type=slice_type, num_slices=num_slices)


class ComputeKernelConfig(_Inert):
    pass


class EmulatedDevice:
    """Stands in for an open P150: a 13x10 worker grid, Blackhole arch."""

    def __init__(self, grid=(13, 10)):
        self._grid = CoreCoord(*grid)

    def compute_with_storage_grid_size(self) -> CoreCoord:
        return self._grid

    def arch(self) -> str:
        return "blackhole"


def round_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 -> nearest bfloat16 (ties to even), as float32."""
    return t.float().to(torch.bfloat16).float()


def round_bfp8(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat8_b values, as float32: blocks of 16 along the last dim share the exponent of their
    largest magnitude; 7-bit magnitudes, ties to even, clipped at 127."""
    t = t.float()
    shape = t.shape
    width = shape[-1]
    pad = (-width) % 16
    x = F.pad(t, (0, pad)) if pad else t
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    peak = blocks.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(torch.where(peak > 0, peak, torch.ones_like(peak)))  # peak = m 2^e, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(peak), (exponent - 1 - 6).to(torch.int32))
    q = torch.clamp(torch.round(blocks / step), -127, 127) * step
    q = q.reshape(*x.shape)
    return q[..., :width] if pad else q


# The significant bits of each operand a fidelity's passes read, (SrcA = weights, SrcB = activations): LoFi's one
# pass reads 5 and 7; HiFi2 adds SrcA's next 5 (10 in all), HiFi3 SrcB's next 4 (11), HiFi4 both. The passes'
# partial products summed are the product of the operands cut to those bits (the sum is bilinear), so the
# emulator forms that product directly, in one matmul.
FIDELITY_BITS = {"LoFi": (5, 7), "HiFi2": (10, 7), "HiFi3": (5, 11), "HiFi4": (10, 11)}


def truncate_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 values keeping `bits` significant bits (the implicit one included), the rest cut toward zero."""
    i = t.float().contiguous().view(torch.int32)
    return (i & ~((1 << (24 - bits)) - 1)).view(torch.float32)


def fidelity_operands(x: torch.Tensor, w: torch.Tensor, fidelity: str) -> tuple:
    """(activations, weights) as the passes of `fidelity` read them (`FIDELITY_BITS`)."""
    bits_a, bits_b = FIDELITY_BITS[fidelity]
    return truncate_bits(x, bits_b), truncate_bits(w, bits_a)


def fidelity_name(config, default: str) -> str:
    f = getattr(config, "math_fidelity", None)
    return default if f is None else (f.name if isinstance(f, enum.Enum) else str(f))


def approx_exp(x: torch.Tensor) -> torch.Tensor:
    """Schraudolph's exp: the float whose bits are round(x * 2^23 / ln 2 + 127 * 2^23 - 486411), 0 below ~-87."""
    a = x.double().clamp_(min=-87.0).mul_(2**23 / math.log(2)).add_(127 * 2**23 - 486411)  # in place: one buffer
    return a.clamp_(min=0).round_().to(torch.int32).view(torch.float32)


class _Numerics:
    """The matrix engine, the destination register and the SFPU's exp, for one emulator (see the docstring)."""

    def __init__(self, exact: bool):
        self.exact = exact

    def matmul(self, x: torch.Tensor, w: torch.Tensor, fidelity: str, fp32_acc: bool) -> torch.Tensor:
        """x (..., M, K) @ w (..., K, N) as the matrix engine computes it."""
        if self.exact:
            return x @ w
        xb, wa = fidelity_operands(x, w, fidelity)
        if fp32_acc:
            return xb @ wa
        acc = None
        for k in range(0, x.shape[-1], 16):  # bfloat16 destination: rounded after every 16-deep MVMUL
            part = xb[..., k : k + 16] @ wa[..., k : k + 16, :]
            acc = round_bf16(part if acc is None else acc + part)
        return acc

    def conv(
        self,
        fn,
        x: torch.Tensor,
        w: torch.Tensor,
        fidelity: str,
        fp32_acc: bool,
        weight_in_dim: int = 1,
        groups: int = 1,
    ) -> torch.Tensor:
        """fn(x, w): a conv without bias (bilinear in x and w) as the matrix engine computes it; the weight's
        input channels are along `weight_in_dim` (1 for conv2d's OIHW, 0 for conv_transpose2d's IOHW)."""
        if self.exact:
            return fn(x, w)
        xb, wa = fidelity_operands(x, w, fidelity)
        if fp32_acc:
            return fn(xb, wa)
        if groups != 1:
            raise NotImplementedError("bfloat16 accumulation of a grouped conv is not emulated")
        acc = None
        for c in range(0, x.shape[1], 16):  # bfloat16 destination: rounded after every 16 input channels
            part = fn(xb[:, c : c + 16], wa.narrow(weight_in_dim, c, min(16, x.shape[1] - c)))
            acc = round_bf16(part if acc is None else acc + part)
        return acc

    def mul(self, a: torch.Tensor, b: torch.Tensor, fidelity: str) -> torch.Tensor:
        """An elementwise multiply on the FPU (a in SrcA, b in SrcB)."""
        if self.exact:
            return a * b
        bb, aa = fidelity_operands(b, a, fidelity)
        return aa * bb

    def tf32(self, t: torch.Tensor) -> torch.Tensor:
        """An operand of an FPU add or subtract (a TF32 source register)."""
        return t if self.exact else truncate_bits(t, 11)

    def store(self, t: torch.Tensor, fp32: bool) -> torch.Tensor:
        """An intermediate circular buffer: float32 with fp32_dest_acc_en, else bfloat16."""
        return t if self.exact or fp32 else round_bf16(t)

    def exp(self, x: torch.Tensor, approx: bool) -> torch.Tensor:
        return approx_exp(x) if approx and not self.exact else torch.exp(x)


FLASH_ROWS = 128  # query rows per block of the attention's emulation (see TtnnEmulator._flash_attention)


class TtnnEmulator:
    """The emulated `ttnn` module: pass an instance where graph.py expects `ttnn`.

    exact: store every tensor in float32 whatever its dtype (the "float32 everything" mode).
    """

    def __init__(self, exact: bool = False):
        self.exact = exact
        self.op_counts: collections.Counter = collections.Counter()
        self.bfloat16, self.float32, self.bfloat8_b = DataType.BFLOAT16, DataType.FLOAT32, DataType.BFLOAT8_B
        self.uint8 = DataType.UINT8
        self.DataType = DataType
        self.TILE_LAYOUT, self.ROW_MAJOR_LAYOUT = Layout.TILE, Layout.ROW_MAJOR
        self.Layout = Layout
        self.TensorMemoryLayout, self.BufferType = TensorMemoryLayout, BufferType
        self.DRAM_MEMORY_CONFIG = MemoryConfig(
            memory_layout=TensorMemoryLayout.INTERLEAVED, buffer_type=BufferType.DRAM
        )
        self.L1_MEMORY_CONFIG = MemoryConfig(memory_layout=TensorMemoryLayout.INTERLEAVED, buffer_type=BufferType.L1)
        self.MemoryConfig = MemoryConfig
        self.num = _Numerics(exact)
        self.MathFidelity, self.UnaryOpType, self.UnaryWithParam = MathFidelity, UnaryOpType, UnaryWithParam
        self.CoreCoord, self.CoreGrid = CoreCoord, CoreGrid
        self.MatmulMultiCoreReuseMultiCastProgramConfig = MatmulMultiCoreReuseMultiCastProgramConfig
        self.SDPAProgramConfig = SDPAProgramConfig
        self.Conv2dConfig, self.Conv2dSliceConfig, self.PaddingMode = Conv2dConfig, Conv2dSliceConfig, PaddingMode
        self.Conv2dDRAMSliceHeight, self.Conv2dDRAMSliceWidth = SliceType.DRAMSliceHeight, SliceType.DRAMSliceWidth
        self.Conv2dL1Full = SliceType.L1Full
        self.Conv2dL1FullSliceConfig = Conv2dSliceConfig(slice_type=SliceType.L1Full)
        emulator = self
        self.Tensor = type("Tensor", (EmulatedTensor,), {"_emulator": emulator})
        self.transformer = types.SimpleNamespace(
            split_query_key_value_and_split_heads=self._recorded(self._split_heads),
            scaled_dot_product_attention=self._recorded(self._sdpa),
            concatenate_heads=self._recorded(self._concatenate_heads),
        )
        # Trace capture records every op (with its result objects); a replay runs them again in order and writes
        # each new result into the recorded objects, as a replayed trace overwrites its output buffers.
        for name in _TRACED_OPS:
            setattr(self, name, self._recorded(getattr(self, name)))
        self._recording: Optional[list] = None
        self.traces: dict = {}
        self.device_count = 1  # chips GetNumAvailableDevices reports
        self.opened: list = []  # open_device calls (kwargs), for the runner tests
        self.closed: list = []
        self.events: list = []  # (call, cq_id) of record_event / wait_for_event, in order
        self.reads: list = []  # cq_id of each copy_device_to_host_tensor, in order
        # every command-queue step, in the order the host enqueued it: (what, cq_id, detail): ("write", cq, device
        # tensor), ("trace", cq, trace id), ("read", cq, device tensor), ("record", cq, event), ("wait", cq, event),
        # and the host's waits ("sync", None, event), ("sync_all", None, None)
        self.queue_log: list = []
        self.MeshCoordinate = lambda *coordinate: coordinate
        self.DispatchCoreType = types.SimpleNamespace(ETH="eth", WORKER="worker")
        self.DispatchCoreConfig = lambda kind=None, *a, **k: kind

    # ----------------------------------------------------------------------------------------- helpers
    def open_device(self, **kwargs) -> EmulatedDevice:
        self.opened.append(kwargs)
        return EmulatedDevice()

    def close_device(self, device) -> None:
        self.closed.append(device)

    def GetNumAvailableDevices(self) -> int:
        return self.device_count

    # ----------------------------------------------------------------------------- trace and events
    def _recorded(self, fn):
        def op(*args, **kwargs):
            result = fn(*args, **kwargs)
            if self._recording is not None:
                self._recording.append((fn, args, kwargs, result))
            return result

        return op

    def begin_trace_capture(self, device, cq_id=0) -> int:
        if self._recording is not None:
            raise RuntimeError("begin_trace_capture: a capture is already active")
        self._recording = []
        return len(self.traces) + 1

    def end_trace_capture(self, device, trace_id, cq_id=0) -> None:
        if self._recording is None:
            raise RuntimeError("end_trace_capture without begin_trace_capture")
        self.traces[trace_id], self._recording = self._recording, None

    def execute_trace(self, device, trace_id, cq_id=0, blocking=True) -> None:
        if trace_id not in self.traces:
            raise RuntimeError(f"execute_trace: no trace {trace_id} (released or never captured)")
        self._count("execute_trace")
        self.queue_log.append(("trace", cq_id, trace_id))
        for fn, args, kwargs, result in self.traces[trace_id]:
            _overwrite(result, fn(*args, **kwargs))

    def release_trace(self, device, trace_id) -> None:
        if self.traces.pop(trace_id, None) is None:
            raise RuntimeError(f"release_trace: no trace {trace_id}")

    def record_event(self, device, cq_id=0):
        self.events.append(("record", cq_id))
        event = ("event", cq_id, len(self.events))
        self.queue_log.append(("record", cq_id, event))
        return event

    def wait_for_event(self, cq_id, event) -> None:
        self.events.append(("wait", cq_id))
        self.queue_log.append(("wait", cq_id, event))

    def event_synchronize(self, event) -> None:
        self.queue_log.append(("sync", None, event))

    def round(self, t: torch.Tensor, dtype: DataType) -> torch.Tensor:
        if self.exact or dtype == DataType.FLOAT32:
            return t.float()
        if dtype == DataType.BFLOAT16:
            return round_bf16(t)
        if dtype == DataType.BFLOAT8_B:
            return round_bfp8(t)
        if dtype == DataType.UINT8:  # integers 0..255 (a canvas's 8-bit planes)
            return t.float().round().clamp(0, 255)
        raise TypeError(f"unsupported dtype {dtype}")

    def _new(self, data: torch.Tensor, dtype: DataType, layout: Layout = Layout.TILE, device=True, memory_config=None):
        if dtype == DataType.BFLOAT8_B and layout != Layout.TILE:
            raise RuntimeError("bfloat8_b tensors must be in TILE layout")
        t = EmulatedTensor.__new__(self.Tensor)
        t._init(self.round(data, dtype), dtype, layout, device, memory_config or self.DRAM_MEMORY_CONFIG)
        return t

    def _count(self, name: str) -> None:
        self.op_counts[name] += 1

    @staticmethod
    def _check(t, name: str, on_device: bool = True):
        if not isinstance(t, EmulatedTensor):
            raise TypeError(f"{name}: expected a ttnn.Tensor, got {type(t).__name__}")
        if t.deallocated:
            raise RuntimeError(f"{name}: tensor was deallocated")
        if on_device and t.device is None:
            raise RuntimeError(f"{name}: tensor must be on the device")

    def _activation(self, x: torch.Tensor, act) -> torch.Tensor:
        """A fused unary step (an op type, a `UnaryWithParam` or its name; a list: applied in order), in float32 on
        the SFPU (taken as exact, as the standalone unary ops)."""
        if act is None:
            return x
        if isinstance(act, (list, tuple)):
            for a in act:
                x = self._activation(x, a)
            return x
        op = act.op_type if isinstance(act, UnaryWithParam) else act
        op = op.value if isinstance(op, UnaryOpType) else op
        fns = {
            "relu": torch.relu,
            "gelu": F.gelu,  # graph.py passes a parameter of 0: the exact (erf) GELU
            "exp": torch.exp,
            "sigmoid": torch.sigmoid,
            "rsqrt": torch.rsqrt,
            "square": torch.square,
        }
        if op in fns:
            return fns[op](x.float())
        if op == "maximum" and isinstance(act, UnaryWithParam) and len(act.params) == 1:
            return x.float().clamp(min=float(act.params[0]))
        raise ValueError(f"activation {act!r} not emulated")

    def _binary_inputs(self, a, b, kwargs: dict) -> tuple:
        """The operands' data after the binary op's fused input activations (`input_tensor_a_activations`,
        `input_tensor_b_activations`), and whether the pair takes the float32 (SFPU) path."""
        x = self._activation(a.data, kwargs.get("input_tensor_a_activations"))
        y = self._activation(b.data, kwargs.get("input_tensor_b_activations"))
        return x, y, a.dtype == DataType.FLOAT32 and b.dtype == DataType.FLOAT32

    # ----------------------------------------------------------------------------------- tensor moves
    def init_device_compute_kernel_config(self, arch, *_, **kwargs) -> ComputeKernelConfig:
        return ComputeKernelConfig(arch=arch, **kwargs)

    def from_device(self, t, **_):
        self._check(t, "from_device")
        self._count("from_device")
        out = t._copy()
        out.device = None
        return out

    def copy_device_to_host_tensor(self, device_tensor, host_tensor, blocking=True, cq_id=0) -> None:
        """ttnn's read into an existing host tensor: the host tensor's own memory is overwritten (views of it,
        `host_buffer`, see the new values), shapes, dtypes and layouts must match."""
        self._check(device_tensor, "copy_device_to_host_tensor")
        self._check(host_tensor, "copy_device_to_host_tensor", on_device=False)
        if host_tensor.device is not None or tuple(host_tensor.data.shape) != tuple(device_tensor.data.shape):
            raise RuntimeError("copy_device_to_host_tensor: a host tensor of the device tensor's shape is needed")
        if host_tensor.dtype != device_tensor.dtype or host_tensor.layout != device_tensor.layout:
            raise RuntimeError("copy_device_to_host_tensor: dtype and layout must match")
        self._count("copy_device_to_host_tensor")
        self.reads.append(cq_id)
        self.queue_log.append(("read", cq_id, device_tensor))
        host_tensor.data.copy_(device_tensor.data)

    def to_device(self, t, device, memory_config=None, **_):
        self._check(t, "to_device", on_device=False)
        out = t._copy()
        out.device = device
        out.mem = memory_config or self.DRAM_MEMORY_CONFIG
        return out

    def Shape(self, dims) -> tuple:
        return tuple(int(d) for d in dims)

    def allocate_tensor_on_device(self, shape, dtype, layout, device, memory_config=None):
        return self._new(torch.zeros(tuple(shape)), dtype, layout, device, memory_config)

    def copy_host_to_device_tensor(self, host, device_tensor, cq_id=0) -> None:
        self.queue_log.append(("write", cq_id, device_tensor))
        self._check(host, "copy_host_to_device_tensor", on_device=False)
        self._check(device_tensor, "copy_host_to_device_tensor")
        if host.device is not None or tuple(host.data.shape) != tuple(device_tensor.data.shape):
            raise RuntimeError("copy_host_to_device_tensor: a host tensor of the device tensor's shape is needed")
        if host.dtype != device_tensor.dtype or host.layout != device_tensor.layout:
            raise RuntimeError("copy_host_to_device_tensor: dtype and layout must match")
        device_tensor.data = host.data.clone()

    def to_layout(self, t, layout, dtype=None, *, memory_config=None, **_):
        """On the host, or on the device (ttnn's tilize / untilize ops, counted): the values are unchanged, or
        rounded to `dtype` when one is given (a tilize that converts, on the device)."""
        self._check(t, "to_layout", on_device=False)
        if t.dtype == DataType.UINT8 and layout == Layout.TILE and t.layout != Layout.TILE:  # ttnn's TT_FATAL
            raise RuntimeError("to_layout: can only tilize bfloat16/float32 or int32/uint32/uint16 tensors")
        if (dtype or t.dtype) == DataType.BFLOAT8_B and layout != Layout.TILE:
            raise RuntimeError("to_layout: bfloat8_b tensors must stay in TILE layout")
        if dtype is not None and dtype != t.dtype:
            if t.device is None:
                raise RuntimeError("to_layout: a dtype change is done on the device (or with to_dtype on the host)")
            self._count("to_layout")
            return self._new(t.data, dtype, layout, t.device, memory_config or t.mem)
        out = t._copy()
        out.layout = layout
        if t.device is not None:
            self._count("to_layout")
            out.data = t.data.clone()
            out.mem = memory_config or t.mem
        return out

    def to_dtype(self, t, dtype):
        self._check(t, "to_dtype", on_device=False)
        if t.device is not None:
            raise RuntimeError("to_dtype works on host tensors")
        return self._new(t.data, dtype, t.layout, None)

    def typecast(self, t, dtype, **kwargs):
        self._check(t, "typecast")
        self._count("typecast")
        return self._new(t.data, dtype, t.layout, t.device, kwargs.get("memory_config"))

    def to_memory_config(self, t, memory_config, **_):
        self._check(t, "to_memory_config")
        out = t._copy()
        out.mem = memory_config
        return out

    def num_cores_to_corerangeset(self, cores: int, grid, row_wise: bool = True):
        return CoreRangeSet(cores=int(cores), grid=grid, row_wise=row_wise)

    def untilize(self, t, *, memory_config=None, **_):
        self._check(t, "untilize")
        self._count("untilize")
        if t.dtype == DataType.BFLOAT8_B:
            raise RuntimeError("untilize: bfloat8_b has no row-major layout")
        return self._new(t.data, t.dtype, Layout.ROW_MAJOR, t.device, memory_config or t.mem)

    def reallocate(self, t, *_, **__):
        self._check(t, "reallocate")
        return t._copy()

    def deallocate(self, t, *_, **__) -> None:
        self._check(t, "deallocate")
        t.deallocated = True

    def synchronize_device(self, *_, **__) -> None:
        self.queue_log.append(("sync_all", None, None))

    def copy(self, a, b) -> None:
        """ttnn.copy: a's values into the existing device tensor b (same shape), in b's format."""
        self._check(a, "copy")
        self._check(b, "copy")
        if tuple(a.data.shape) != tuple(b.data.shape):
            raise RuntimeError(f"copy: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)} differ")
        self._count("copy")
        b.data = self.round(a.data.clone(), b.dtype)

    # ---------------------------------------------------------------------------------- data movement
    def reshape(self, t, shape, **_):
        self._check(t, "reshape", on_device=False)
        self._count("reshape")
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != t.data.numel():
            raise RuntimeError(f"reshape: {tuple(t.data.shape)} has {t.data.numel()} values, cannot become {shape}")
        out = t._copy()
        out.data = t.data.reshape(shape)
        return out

    def slice(self, t, starts, ends, steps=None, **_):
        self._check(t, "slice")
        self._count("slice")
        if len(starts) != t.data.dim() or len(ends) != t.data.dim():
            raise RuntimeError(f"slice: rank {t.data.dim()} tensor, got starts {starts} ends {ends}")
        steps = steps or [1] * len(starts)
        for s, e, n in zip(starts, ends, t.data.shape):
            if not 0 <= s < e <= n:
                raise RuntimeError(f"slice: [{s}, {e}) out of range for a dim of {n}")
        index = tuple(slice(int(s), int(e), int(st)) for s, e, st in zip(starts, ends, steps))
        return self._new(t.data[index].clone(), t.dtype, t.layout, t.device)

    def permute(self, t, dims, **kwargs):
        self._check(t, "permute")
        self._count("permute")
        if sorted(dims) != list(range(t.data.dim())):
            raise RuntimeError(f"permute: {dims} is not a permutation of {t.data.dim()} dims")
        return self._new(t.data.permute(*dims).contiguous(), t.dtype, t.layout, t.device, kwargs.get("memory_config"))

    def pad(self, t, padding, value=0.0, **kwargs):
        """padding: (before, after) pairs for the trailing dims (the first ttnn.pad overload). A pad of nothing
        returns the input tensor itself, as ttnn does (freeing "both" then frees the one buffer)."""
        self._check(t, "pad")
        self._count("pad")
        pairs = [tuple(p) for p in padding]
        if len(pairs) > t.data.dim() or any(a < 0 or b < 0 for a, b in pairs):
            raise RuntimeError(f"pad: bad padding {padding} for rank {t.data.dim()}")
        if not any(a or b for a, b in pairs):  # ttnn hands back the input itself for a pad of nothing
            return t
        flat = [v for a, b in reversed(pairs) for v in (a, b)]
        return self._new(
            F.pad(t.data, flat, value=float(value)), t.dtype, t.layout, t.device, kwargs.get("memory_config")
        )

    def upsample(self, t, scale_factor, *, mode="nearest", memory_config=None, **_):
        """(N, H, W, C) -> (N, sH H, sW W, C); bilinear is half-pixel (align_corners=False), integer scales only."""
        self._check(t, "upsample")
        self._count("upsample")
        if t.data.dim() != 4:
            raise RuntimeError("upsample: expected an (N, H, W, C) tensor")
        scale = (scale_factor, scale_factor) if isinstance(scale_factor, (int, float)) else tuple(scale_factor)
        if mode == "bilinear" and any(float(s) != int(s) for s in scale):
            raise RuntimeError("upsample: bilinear needs integer scale factors")
        x = t.data.permute(0, 3, 1, 2)
        kwargs = {"align_corners": False} if mode == "bilinear" else {}
        y = F.interpolate(x, scale_factor=tuple(float(s) for s in scale), mode=mode, **kwargs)
        return self._new(y.permute(0, 2, 3, 1).contiguous(), t.dtype, t.layout, t.device, memory_config)

    def concat(self, tensors, dim=0, **kwargs):
        for t in tensors:
            self._check(t, "concat")
        self._count("concat")
        return self._new(
            torch.cat([t.data for t in tensors], dim=dim),
            tensors[0].dtype,
            tensors[0].layout,
            tensors[0].device,
            kwargs.get("memory_config"),
        )

    # ---------------------------------------------------------------------------------------- compute
    def add(self, a, b, *, dtype=None, memory_config=None, activations=None, **kwargs):
        """a + b (broadcasting), after the fused input activations and before the fused `activations`: float32
        pairs on the SFPU in float32, otherwise TF32 operands on the FPU."""
        self._check(a, "add")
        self._check(b, "add")
        self._count("add")
        try:
            torch.broadcast_shapes(a.data.shape, b.data.shape)
        except RuntimeError:
            raise RuntimeError(
                f"add: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)} do not broadcast"
            ) from None
        x, w, fp32 = self._binary_inputs(a, b, kwargs)
        y = x + w if fp32 else self.num.tf32(x) + self.num.tf32(w)  # ttnn adds float32 pairs on the SFPU
        return self._new(self._activation(y, activations), dtype or a.dtype, Layout.TILE, a.device, memory_config)

    def subtract(self, a, b, *, dtype=None, memory_config=None, activations=None, **kwargs):
        """a - b: float32 pairs on the SFPU in float32 (as `add`), otherwise TF32 operands on the FPU."""
        self._check(a, "subtract")
        self._check(b, "subtract")
        self._count("subtract")
        torch.broadcast_shapes(a.data.shape, b.data.shape)
        x, w, fp32 = self._binary_inputs(a, b, kwargs)
        y = x - w if fp32 else self.num.tf32(x) - self.num.tf32(w)
        return self._new(self._activation(y, activations), dtype or a.dtype, Layout.TILE, a.device, memory_config)

    def multiply(self, a, b, *, dtype=None, memory_config=None, compute_kernel_config=None, activations=None, **kwargs):
        """a * b (broadcasting): float32 pairs on the SFPU in float32 (binary_ng's float32 path), otherwise on the
        FPU with the fidelity passes of the compute config (default HiFi4)."""
        self._check(a, "multiply")
        self._check(b, "multiply")
        self._count("multiply")
        try:
            torch.broadcast_shapes(a.data.shape, b.data.shape)
        except RuntimeError:
            raise RuntimeError(
                f"multiply: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)} do not broadcast"
            ) from None
        x, w, fp32 = self._binary_inputs(a, b, kwargs)
        y = x * w if fp32 else self.num.mul(x, w, fidelity_name(compute_kernel_config, "HiFi4"))
        return self._new(self._activation(y, activations), dtype or a.dtype, Layout.TILE, a.device, memory_config)

    def _unary(self, name: str, t, fn, memory_config=None):
        """An SFPU op: computed in float32 (the SFPU's exp, rsqrt and sigmoid are taken as exact: their
        approximate modes are not used by the graph), stored in the input's dtype."""
        self._check(t, name)
        self._count(name)
        if t.layout != Layout.TILE:
            raise RuntimeError(f"{name}: expected a TILE layout tensor")
        return self._new(fn(t.data), t.dtype, t.layout, t.device, memory_config)

    def exp(self, t, *, memory_config=None, **_):
        return self._unary("exp", t, torch.exp, memory_config)

    def sigmoid(self, t, *, memory_config=None, **_):
        return self._unary("sigmoid", t, torch.sigmoid, memory_config)

    def rsqrt(self, t, *, memory_config=None, **_):
        return self._unary("rsqrt", t, torch.rsqrt, memory_config)

    def clamp(self, t, min=None, max=None, *, memory_config=None, **_):
        return self._unary("clamp", t, lambda x: x.clamp(min=min, max=max), memory_config)

    def transpose(self, t, dim0: int, dim1: int, *, memory_config=None, **_):
        """Swap two dims (data movement: values unchanged)."""
        self._check(t, "transpose")
        self._count("transpose")
        return self._new(t.data.transpose(dim0, dim1).contiguous(), t.dtype, t.layout, t.device, memory_config)

    def relu(self, t, *, memory_config=None, **_):
        self._check(t, "relu")
        self._count("relu")
        return self._new(torch.relu(t.data), t.dtype, t.layout, t.device, memory_config)

    def gelu(self, t, *, memory_config=None, **_):
        self._check(t, "gelu")
        self._count("gelu")
        return self._new(F.gelu(t.data), t.dtype, t.layout, t.device, memory_config)

    def _check_matmul_config(self, pc, m: int, k: int, n: int) -> None:
        if pc is None:
            return
        mt, kt, nt = -(-m // TILE), -(-k // TILE), -(-n // TILE)
        grid = pc.compute_with_storage_grid_size
        gx, gy = (grid.x, grid.y) if isinstance(grid, CoreCoord) else grid
        if pc.per_core_M * gy < mt or pc.per_core_N * gx < nt:
            raise RuntimeError(
                f"matmul program config: per_core_M {pc.per_core_M} x {gy} rows / per_core_N "
                f"{pc.per_core_N} x {gx} columns do not cover {mt} x {nt} output tiles"
            )
        if kt % pc.in0_block_w:
            raise RuntimeError(f"matmul program config: in0_block_w {pc.in0_block_w} does not divide K = {kt} tiles")
        if pc.per_core_M % pc.out_subblock_h or pc.per_core_N % pc.out_subblock_w:
            raise RuntimeError("matmul program config: out subblock does not divide the per-core block")
        if pc.out_subblock_h * pc.out_subblock_w > 8:
            raise RuntimeError("matmul program config: out subblock larger than 8 tiles")

    def _matmul_config(self, ck, program_config, a_dtype, b_dtype, out_dtype) -> tuple:
        """(fidelity, fp32 accumulation) of a matmul: its compute config, else ttnn 0.81's defaults."""
        if ck is not None and getattr(ck, "math_fidelity", None) is not None:
            return fidelity_name(ck, "HiFi4"), bool(getattr(ck, "fp32_dest_acc_en", False))
        low = {DataType.BFLOAT8_B}
        if program_config is not None or (a_dtype in low and b_dtype in low):
            return "LoFi", out_dtype == DataType.FLOAT32
        if a_dtype == DataType.FLOAT32 and b_dtype == DataType.FLOAT32:
            return "HiFi4", True
        return "HiFi2", out_dtype == DataType.FLOAT32

    def linear(
        self,
        a,
        b,
        *,
        bias=None,
        dtype=None,
        program_config=None,
        activation=None,
        memory_config=None,
        transpose_a=False,
        transpose_b=False,
        compute_kernel_config=None,
        **_,
    ):
        self._check(a, "linear")
        self._check(b, "linear")
        self._count("linear")
        for t in (a, b):
            if t.layout != Layout.TILE:
                raise RuntimeError("linear: operands must be in TILE layout")
        x = a.data.transpose(-1, -2) if transpose_a else a.data
        w = b.data.transpose(-1, -2) if transpose_b else b.data
        if x.shape[-1] != w.shape[-2]:
            raise RuntimeError(f"linear: K mismatch, {tuple(x.shape)} @ {tuple(w.shape)}")
        self._check_matmul_config(program_config, x.shape[-2], x.shape[-1], w.shape[-1])
        out_dtype = dtype or a.dtype
        fidelity, fp32_acc = self._matmul_config(compute_kernel_config, program_config, a.dtype, b.dtype, out_dtype)
        y = self.num.matmul(x, w, fidelity, fp32_acc)
        if bias is not None:
            self._check(bias, "linear bias")
            if bias.data.shape[-1] != w.shape[-1] or bias.data.numel() != w.shape[-1]:
                raise RuntimeError(f"linear: bias {tuple(bias.data.shape)} for {w.shape[-1]} outputs")
            y = self.num.store(y + bias.data.reshape(-1), fp32_acc)
        fused = getattr(program_config, "fused_activation", None) if program_config is not None else None
        if fused is not None and activation is not None:
            raise RuntimeError("linear: pass the activation in the program config or as `activation`, not both")
        y = self._activation(y, fused if fused is not None else activation)
        return self._new(y, out_dtype, Layout.TILE, a.device, memory_config)

    matmul = linear

    def _reduce_mean(self, x: torch.Tensor, fidelity: str, fp32: bool) -> torch.Tensor:
        """The matrix engine's row average (the input in SrcA, the 1/N scaler in SrcB), accumulated in the
        destination register (bfloat16 after every 16 values unless fp32)."""
        n = x.shape[-1]
        terms = self.num.mul(x, torch.full_like(x, 1.0 / n), fidelity)
        if self.exact or fp32:
            return terms.sum(-1, keepdim=True)
        acc = None
        for k in range(0, n, 16):
            part = terms[..., k : k + 16].sum(-1, keepdim=True)
            acc = round_bf16(part if acc is None else acc + part)
        return acc

    def layer_norm(
        self,
        t,
        *,
        weight=None,
        bias=None,
        epsilon=1e-12,
        residual_input_tensor=None,
        memory_config=None,
        compute_kernel_config=None,
        program_config=None,
        **_,
    ):
        """As tt-metal's layer-norm kernel computes it (see the module docstring): two passes of the row
        reduce, intermediates in float32 with fp32_dest_acc_en (ttnn's default) else in bfloat16."""
        self._check(t, "layer_norm")
        self._count("layer_norm")
        if t.layout != Layout.TILE:
            raise RuntimeError("layer_norm: input must be in TILE layout")
        N = self.num
        ck = compute_kernel_config
        fidelity = fidelity_name(ck, "HiFi4")
        fp32 = True if ck is None else bool(getattr(ck, "fp32_dest_acc_en", True))
        x = t.data
        if residual_input_tensor is not None:
            x = N.store(N.tf32(x) + N.tf32(residual_input_tensor.data), fp32)
        width = x.shape[-1]
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and p.data.shape[-1] != width:
                raise RuntimeError(f"layer_norm: {name} width {p.data.shape[-1]} != input width {width}")
        if self.exact:
            y = F.layer_norm(
                x,
                (width,),
                None if weight is None else weight.data.reshape(-1),
                None if bias is None else bias.data.reshape(-1),
                epsilon,
            )
            return self._new(y, t.dtype, Layout.TILE, t.device, memory_config)
        mean = N.store(self._reduce_mean(x, fidelity, fp32), fp32)
        centred = N.store(N.tf32(x) - N.tf32(mean), fp32)
        var = N.store(self._reduce_mean(N.store(N.mul(centred, centred, fidelity), fp32), fidelity, fp32), fp32)
        inv = N.store(torch.rsqrt(N.store(var + epsilon, fp32)), fp32)
        y = N.store(N.mul(centred, inv.expand_as(centred), fidelity), fp32)
        if weight is not None:
            y = N.store(N.mul(y, weight.data.reshape(-1).expand_as(y), fidelity), fp32)
        if bias is not None:
            y = N.tf32(y) + N.tf32(bias.data.reshape(-1))
        return self._new(y, t.dtype, Layout.TILE, t.device, memory_config)

    def softmax(self, t, dim=-1, **kwargs):
        self._check(t, "softmax")
        self._count("softmax")
        return self._new(torch.softmax(t.data, dim=dim), t.dtype, t.layout, t.device, kwargs.get("memory_config"))

    def _split_heads(
        self, t, kv_input_tensor=None, *, num_heads, num_kv_heads=None, transpose_key=True, memory_config=None, **_
    ):
        self._check(t, "split_query_key_value_and_split_heads")
        self._count("transformer.split_query_key_value_and_split_heads")
        if kv_input_tensor is not None or num_kv_heads not in (None, num_heads):
            raise NotImplementedError("split heads: only fused qkv with equal head counts is emulated")
        x = t.data
        if x.dim() != 3:
            raise RuntimeError(f"split_query_key_value_and_split_heads: expected 3 dimensions, got {x.dim()}")
        b, s, width = x.shape
        if width % (3 * num_heads):
            raise RuntimeError(f"split heads: width {width} is not 3 x {num_heads} heads")
        d = width // (3 * num_heads)
        heads = x.reshape(b, s, 3 * num_heads, d)
        q, k, v = (heads[:, :, i * num_heads : (i + 1) * num_heads].permute(0, 2, 1, 3).contiguous() for i in range(3))
        if transpose_key:
            k = k.transpose(-1, -2).contiguous()
        return tuple(self._new(z, t.dtype, Layout.TILE, t.device, memory_config) for z in (q, k, v))

    def _flash_attention(self, q, k, v, scale, fidelity, fp32_acc, approx, k_chunk) -> torch.Tensor:
        """Non-causal attention as the FlashAttention kernel computes it, key chunk by key chunk, with its
        bfloat16 intermediates (exactly softmax attention in the exact mode). Query rows do not depend on each
        other, so they are emulated in blocks of FLASH_ROWS (as the kernel's query chunks): the intermediates of a
        block stay in the CPU's cache, which makes the emulation several times faster than whole score matrices."""
        rows = [q[..., i : i + FLASH_ROWS, :] for i in range(0, q.shape[-2], FLASH_ROWS)]
        args = (k, v, scale, fidelity, fp32_acc, approx, k_chunk)
        return torch.cat([self._flash_attention_rows(block, *args) for block in rows], dim=-2)

    def _flash_attention_rows(self, q, k, v, scale, fidelity, fp32_acc, approx, k_chunk) -> torch.Tensor:
        N = self.num
        inter = (lambda z: z) if self.exact else round_bf16
        m = torch.full(q.shape[:-1] + (1,), -math.inf)
        total = torch.zeros(q.shape[:-1] + (1,))
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],))
        kt = k.transpose(-1, -2)
        for j in range(0, k.shape[-2], k_chunk):
            scores = inter(N.matmul(q, kt[..., j : j + k_chunk], fidelity, fp32_acc) * scale)
            m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
            p = inter(N.exp(scores - m_new, approx))
            correction = inter(N.exp(m - m_new, approx))
            total = inter(total * correction + p.sum(dim=-1, keepdim=True))
            out = inter(out * correction + N.matmul(p, v[..., j : j + k_chunk, :], fidelity, fp32_acc))
            m = m_new
        return out / total

    def _sdpa(
        self,
        q,
        k,
        v,
        *,
        attn_mask=None,
        is_causal=True,
        scale=None,
        program_config=None,
        output_concat_heads=False,
        memory_config=None,
        compute_kernel_config=None,
        **_,
    ):
        for t in (q, k, v):
            self._check(t, "scaled_dot_product_attention")
        self._count("transformer.scaled_dot_product_attention")
        if is_causal or attn_mask is not None:
            raise NotImplementedError("SDPA: only non-causal attention without a mask is emulated")
        if any(t.dtype not in (DataType.BFLOAT16, DataType.BFLOAT8_B) for t in (q, k, v)):
            raise RuntimeError("SDPA: q, k, v must be BFLOAT16 or BFLOAT8_B")
        if q.data.dim() != 4 or q.data.shape[-1] != k.data.shape[-1] or k.data.shape != v.data.shape:
            raise RuntimeError(f"SDPA: q {tuple(q.data.shape)}, k {tuple(k.data.shape)}, v {tuple(v.data.shape)}")
        if program_config is not None and (program_config.q_chunk_size % TILE or program_config.k_chunk_size % TILE):
            raise RuntimeError("SDPA: chunk sizes must be multiples of 32")
        scale = q.data.shape[-1] ** -0.5 if scale is None else scale
        fidelity = fidelity_name(compute_kernel_config, "HiFi2")
        fp32_acc = bool(getattr(compute_kernel_config, "fp32_dest_acc_en", False))
        approx = True if program_config is None else bool(getattr(program_config, "exp_approx_mode", True))
        k_chunk = getattr(program_config, "k_chunk_size", None) or TILE
        out = self._flash_attention(q.data, k.data, v.data, scale, fidelity, fp32_acc, approx, k_chunk)
        if output_concat_heads:
            b, h, s, d = out.shape
            out = out.permute(0, 2, 1, 3).reshape(b, 1, s, h * d)
        return self._new(out, q.dtype, Layout.TILE, q.device, memory_config)

    def _concatenate_heads(self, t, *, memory_config=None, **_):
        self._check(t, "concatenate_heads")
        self._count("transformer.concatenate_heads")
        b, h, s, d = t.data.shape
        return self._new(t.data.permute(0, 2, 1, 3).reshape(b, s, h * d), t.dtype, Layout.TILE, t.device, memory_config)

    # ------------------------------------------------------------------------------------------- convs
    def _conv_params(
        self,
        name,
        input_tensor,
        weight_tensor,
        bias_tensor,
        in_channels,
        batch_size,
        input_height,
        input_width,
        conv_config,
    ):
        self._check(input_tensor, name)
        x = input_tensor.data
        if x.numel() != batch_size * input_height * input_width * in_channels:
            raise RuntimeError(
                f"{name}: input {tuple(x.shape)} is not {batch_size}x{input_height}x{input_width}x{in_channels}"
            )
        x = x.reshape(batch_size, input_height, input_width, in_channels).permute(0, 3, 1, 2)
        wdtype = getattr(conv_config, "weights_dtype", None) or DataType.BFLOAT16
        weight = weight_tensor.data if weight_tensor._prepared else self.round(weight_tensor.data, wdtype)
        bias = None
        if bias_tensor is not None:
            bias = bias_tensor.data.reshape(-1)
            bias = bias if bias_tensor._prepared else self.round(bias, wdtype)
        return x, weight, bias, wdtype

    def _prepared_weight(self, data: torch.Tensor, dtype: DataType):
        t = self._new(data, DataType.FLOAT32, Layout.TILE, True)
        t.dtype = dtype
        t._prepared = True
        return t

    def _conv_out(
        self,
        y,
        act,
        dtype,
        device,
        memory_config,
        weight,
        bias,
        wdtype,
        weight_tensor,
        bias_tensor,
        return_output_dim,
        return_weights_and_bias,
    ):
        y = self._activation(y, act)
        n, c, h, w = y.shape
        out = self._new(y.permute(0, 2, 3, 1).reshape(1, 1, n * h * w, c), dtype, Layout.TILE, device, memory_config)
        result = [out]
        if return_output_dim:
            result.append([h, w])
        if return_weights_and_bias:
            pw = weight_tensor if weight_tensor._prepared else self._prepared_weight(weight, wdtype)
            pb = (
                None
                if bias is None
                else (bias_tensor if bias_tensor._prepared else self._prepared_weight(bias, wdtype))
            )
            result.append((pw, pb))
        return out if len(result) == 1 else tuple(result)

    @staticmethod
    def _conv_compute(ck) -> tuple:
        """(fidelity, fp32 accumulation) of a conv: its compute config, else HiFi4 with float32 accumulation."""
        if ck is None:
            return "HiFi4", True
        return fidelity_name(ck, "HiFi4"), bool(getattr(ck, "fp32_dest_acc_en", True))

    def conv2d(
        self,
        *,
        input_tensor,
        weight_tensor,
        device,
        in_channels,
        out_channels,
        batch_size,
        input_height,
        input_width,
        kernel_size,
        stride=(1, 1),
        padding=(0, 0),
        dilation=(1, 1),
        groups=1,
        bias_tensor=None,
        conv_config=None,
        dtype=None,
        memory_config=None,
        return_output_dim=False,
        return_weights_and_bias=False,
        compute_config=None,
        **_,
    ):
        self._count("conv2d")
        x, weight, bias, wdtype = self._conv_params(
            "conv2d",
            input_tensor,
            weight_tensor,
            bias_tensor,
            in_channels,
            batch_size,
            input_height,
            input_width,
            conv_config,
        )
        kh, kw = kernel_size
        if tuple(weight.shape) != (out_channels, in_channels // groups, kh, kw):
            raise RuntimeError(
                f"conv2d: weight {tuple(weight.shape)}, expected {(out_channels, in_channels // groups, kh, kw)}"
            )
        if bias is not None and bias.numel() != out_channels:
            raise RuntimeError(f"conv2d: bias of {bias.numel()} values for {out_channels} outputs")
        pad = tuple(padding)
        top, bottom, left, right = (pad[0], pad[0], pad[1], pad[1]) if len(pad) == 2 else pad
        mode = getattr(conv_config, "padding_mode", PaddingMode.Zeros)
        x = F.pad(x, (left, right, top, bottom), mode="replicate" if mode == PaddingMode.Replicate else "constant")
        fidelity, fp32_acc = self._conv_compute(compute_config)
        y = self.num.conv(
            lambda a, w: F.conv2d(a, w, stride=tuple(stride), dilation=tuple(dilation), groups=groups),
            x,
            weight,
            fidelity,
            fp32_acc,
            weight_in_dim=1,
            groups=groups,
        )
        if bias is not None:
            y = y + bias.reshape(1, -1, 1, 1)
        return self._conv_out(
            y,
            getattr(conv_config, "activation", None),
            dtype or input_tensor.dtype,
            input_tensor.device,
            memory_config,
            weight,
            bias,
            wdtype,
            weight_tensor,
            bias_tensor,
            return_output_dim,
            return_weights_and_bias,
        )

    def conv_transpose2d(
        self,
        *,
        input_tensor,
        weight_tensor,
        device,
        in_channels,
        out_channels,
        batch_size,
        input_height,
        input_width,
        kernel_size,
        stride=(1, 1),
        padding=(0, 0),
        output_padding=(0, 0),
        dilation=(1, 1),
        groups=1,
        bias_tensor=None,
        conv_config=None,
        dtype=None,
        memory_config=None,
        return_output_dim=False,
        return_weights_and_bias=False,
        compute_config=None,
        **_,
    ):
        self._count("conv_transpose2d")
        x, weight, bias, wdtype = self._conv_params(
            "conv_transpose2d",
            input_tensor,
            weight_tensor,
            bias_tensor,
            in_channels,
            batch_size,
            input_height,
            input_width,
            conv_config,
        )
        kh, kw = kernel_size
        if tuple(weight.shape) != (in_channels, out_channels // groups, kh, kw):
            raise RuntimeError(
                f"conv_transpose2d: weight {tuple(weight.shape)}, expected "
                f"{(in_channels, out_channels // groups, kh, kw)} (C_in, C_out, kH, kW)"
            )
        fidelity, fp32_acc = self._conv_compute(compute_config)
        y = self.num.conv(
            lambda a, w: F.conv_transpose2d(
                a,
                w,
                stride=tuple(stride),
                padding=tuple(padding),
                output_padding=tuple(output_padding),
                groups=groups,
                dilation=tuple(dilation),
            ),
            x,
            weight,
            fidelity,
            fp32_acc,
            weight_in_dim=0,
            groups=groups,
        )
        if bias is not None:
            y = y + bias.reshape(1, -1, 1, 1)
        return self._conv_out(
            y,
            getattr(conv_config, "activation", None),
            dtype or input_tensor.dtype,
            input_tensor.device,
            memory_config,
            weight,
            bias,
            wdtype,
            weight_tensor,
            bias_tensor,
            return_output_dim,
            return_weights_and_bias,
        )


# Ops whose results a trace replay recomputes (every op graph.py runs on the device between upload and read).
_TRACED_OPS = (
    "matmul",
    "subtract",
    "multiply",
    "exp",
    "sigmoid",
    "rsqrt",
    "clamp",
    "transpose",
    "reshape",
    "slice",
    "permute",
    "pad",
    "upsample",
    "concat",
    "add",
    "relu",
    "gelu",
    "linear",
    "layer_norm",
    "softmax",
    "conv2d",
    "conv_transpose2d",
    "typecast",
    "to_memory_config",
    "to_layout",
    "untilize",
    "reallocate",
    "deallocate",
    "copy",
)


def _overwrite(recorded, fresh) -> None:
    """Write a replayed op's result into the objects the capture returned (tensors, in tuples too)."""
    if isinstance(recorded, EmulatedTensor) and isinstance(fresh, EmulatedTensor):
        recorded._init(fresh.data, fresh.dtype, fresh.layout, fresh.device, fresh.mem)
        recorded._prepared = fresh._prepared
    elif isinstance(recorded, (tuple, list)) and isinstance(fresh, (tuple, list)):
        for a, b in zip(recorded, fresh):
            _overwrite(a, b)


class _HostBuffer:
    def __init__(self, data: torch.Tensor):
        self.data = data

    def get_shard(self, coordinate) -> torch.Tensor:
        """The raw bytes, as ttnn exports them (uint8 through DLPack): a float32 tensor's own memory; a bfloat16
        tensor's bits, made at export (the emulator holds every tensor as float32, so there is no bfloat16 memory to
        view: a copy of the values the last read wrote)."""
        return self.data.view(-1).view(torch.uint8)


class EmulatedTensor:
    """A ttnn.Tensor stand-in: float32 data rounded to `dtype`, a layout, a device (None: host)."""

    _emulator: Optional[TtnnEmulator] = None

    def __init__(self, array, dtype=None, device=None, layout=None, mem_config=None, *_, **__):
        emulator = self._emulator
        data = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        dtype = dtype or DataType.FLOAT32
        layout = layout or Layout.ROW_MAJOR
        if dtype == DataType.BFLOAT8_B and layout != Layout.TILE:
            raise RuntimeError("bfloat8_b tensors must be in TILE layout")
        self._init(emulator.round(data, dtype), dtype, layout, device, mem_config or emulator.DRAM_MEMORY_CONFIG)

    def _init(self, data, dtype, layout, device, mem):
        self.data, self.dtype, self.layout, self.device, self.mem = data, dtype, layout, device, mem
        self.deallocated = False
        self._prepared = False

    def _copy(self) -> "EmulatedTensor":
        t = EmulatedTensor.__new__(type(self))
        t._init(self.data, self.dtype, self.layout, self.device, self.mem)
        t._prepared = self._prepared
        return t

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def padded_shape(self) -> tuple:
        s = list(self.data.shape)
        if self.layout == Layout.TILE and len(s) >= 2:
            s[-1], s[-2] = -(-s[-1] // TILE) * TILE, -(-s[-2] // TILE) * TILE
        return tuple(s)

    def memory_config(self):
        return self.mem

    def is_sharded(self) -> bool:
        return self.mem.memory_layout != TensorMemoryLayout.INTERLEAVED

    def host_buffer(self) -> "_HostBuffer":
        """ttnn >= 0.81's host buffer of a host tensor: `get_shard(coordinate)` exports the tensor's own memory
        through DLPack as raw bytes (uint8), as ttnn's: float32 (the tensor's own memory) and bfloat16 (a copy of its
        bits, see `_HostBuffer.get_shard`) here."""
        if self.device is not None:
            raise RuntimeError("host_buffer: the tensor must be on the host")
        if self.dtype == DataType.BFLOAT16:
            return _HostBuffer(self.data.to(torch.bfloat16))  # exact: the values are bfloat16's
        if self.dtype != DataType.FLOAT32:
            raise RuntimeError("host_buffer: only float32 and bfloat16 host tensors are emulated")
        return _HostBuffer(self.data)

    def to_numpy(self) -> np.ndarray:
        if self.device is not None:
            raise RuntimeError("to_numpy: the tensor must be on the host (from_device first)")
        if self.dtype != DataType.FLOAT32:
            raise RuntimeError("to_numpy: bfloat16 has no numpy dtype here; convert with to_dtype(t, float32) first")
        return self.data.numpy().copy()
