"""A cost model of a ttnn graph on one Blackhole chip, from the device operations the (mock) device ran.

No chip can be measured here, so speed is estimated: every device operation that a forward runs on the mock
P150 (`mock_check.py` captures them with ttnn's own graph capture, one ttnn call at a time) is costed from what
it computes and what it moves, and the sum is the forward's estimate.

    recorder = OpRecorder(ttnn, capture_api=ttnn.graph)  # the ttnn module, wrapped
    recorder.capture = True                              # record the device ops of each call from here
    graph = TtnnGraph(recorder, device, prepared)        # the graph calls ttnn through it
    graph.forward(x)
    est = estimate(recorder.ops, chip)                   # Estimate: total, kernel, dispatch, per group, per op

An op's time has two parts, as tt-metal's profiler tells them apart:

* **kernel** (what "DEVICE KERNEL DURATION" measures, first core's start to last core's end): the larger of what
  the busiest core computes and what the op moves, plus what cannot overlap either (the first operand blocks a
  matmul must hold before it can start), plus a fixed start-up cost per op (`Chip.kernel_ns`).
* **dispatch**: the gap a traced replay still leaves between one op's end and the next one's start
  (`Chip.dispatch_ns` per op): end-to-end time minus the summed kernel time.

Compute counts every pass the kernels run, each at its unit's rate:

* the matrix engine: a 32x32x32 tile product is 16 cycles at LoFi, times the math fidelity's passes (LoFi 1,
  HiFi2 2, HiFi3 3, HiFi4 4), at `Chip.fpu_efficiency` of that ideal; matmuls and convs count the busiest core's
  tile products (its output block x K tiles), SDPA its QK^T and PV products;
* one pass over a tile (unpack, an FPU or SFPU step, pack: an add, a reduction, a broadcast multiply, packing a
  matmul's output tile): `Chip.pass_cycles`; the exp on the SFPU on top of its pass: `Chip.exp_cycles` (exact) or
  `Chip.exp_cycles_approx`;
* SDPA (FlashAttention, per query chunk x key chunk on a core): QK^T, pack, row max, subtract and exp, row sum,
  PV and its pack, and from the second key chunk on the rescale of the running max, sum and output; at the end
  the output divided by the sum;
* layer norm: seven passes a tile (mean, subtract, square, variance, scale by 1/sigma, gamma, beta), on the cores
  of its shard grid, or, interleaved, on one core per tile row as ttnn splits it; softmax: exp, sum, scale.

Data: bytes read and written, each tensor at the bandwidth of where it lives: DRAM (`Chip.dram_bytes_per_s`,
shared by the chip) or L1 (`Chip.noc_bytes_per_cycle` per core of the shard grid, or of the whole grid when
interleaved); a matmul's multicast operand blocks over the NoC; SDPA's keys and values, which every core of a head
streams once per query chunk (from DRAM when they live there). Weights read from DRAM overlap compute except for
the first block a core needs, which is the matmul's fill.

The cores an op uses come from what the capture recorded: a sharded tensor's shard grid, a matmul's program
config (per-core blocks over the output tiles, from the ttnn call's arguments, which `OpRecorder` keeps), SDPA's
work units (batch x heads x query chunks). An interleaved op with no config uses the whole grid (`Chip.grid`).

Four figures are fitted, the rest are tt-metal's documented ones: `calibration.py` fits `fpu_efficiency`,
`exp_cycles`, `kernel_ns` and `dispatch_ns` on part of tt-metal's published Blackhole figures and reports the error
on the rest (held out); docs/tenstorrent.md says which and how far off.

numpy-free and torch-free: this module runs in the mock's Python (ttnn only) and in the tests.
"""

from __future__ import annotations

import collections
import math
import re
import types
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

__all__ = [
    "Chip",
    "BLACKHOLE_P150",
    "Link",
    "PCIE",
    "TensorInfo",
    "DeviceOp",
    "OpRecorder",
    "OpCost",
    "Estimate",
    "op_cost",
    "estimate",
    "device_ops_from_capture",
    "call_attributes",
    "ops_to_json",
    "ops_from_json",
    "l1_local_bytes_per_s",
    "L1_LOCAL_GBPS",
    "GROUPS",
    "FITTED",
    "TILE",
    "FIDELITY_PASSES",
    "DTYPE_TILE_BYTES",
]

TILE = 32
GROUPS = ("encoder", "sdpa", "norms_adds", "decoder", "transfers", "input_output")
FITTED = ("fpu_efficiency", "exp_cycles", "kernel_ns", "dispatch_ns")  # the figures calibration.fit fits


@dataclass(frozen=True)
class Chip:
    """The figures the model needs of one chip. Defaults: a Blackhole P150. The four of `FITTED` are the values
    `calibration.fit` finds (rounded; tests/test_ttnn_cost.py checks that they are); docs/tenstorrent.md says where
    each other one comes from."""

    name: str = "Blackhole P150"
    grid: tuple = (13, 10)  # worker cores (x, y) that ttnn gives ops; the mock check sets the device's
    clock_hz: float = 1.35e9
    flop_per_cycle_lofi: int = 4096  # one core's matrix engine (8x16 @ 16x16 per cycle) at LoFi
    fpu_efficiency: float = 0.724  # the share of that ideal the matrix engine reaches (fitted)
    pass_cycles: float = 32.0  # one unpack, FPU / SFPU step and pack of a 32x32 tile
    exp_cycles: float = 72.2  # the SFPU's exact exp on a tile, on top of its pass (fitted)
    exp_cycles_approx: float = 52.0  # the same with the fast approximate exp
    dram_bytes_per_s: float = 512e9 * 0.9  # eight GDDR6 channels, 512 GB/s peak, at the share reached
    noc_bytes_per_cycle: float = 37.0  # what one core reads or writes over the NoC (or L1 to L1), saturated
    kernel_ns: float = 6053.0  # per device op, its kernels' start-up on every core (fitted)
    dispatch_ns: float = 1284.0  # per device op, the gap between ops in a traced replay (fitted)

    @property
    def cores(self) -> int:
        return self.grid[0] * self.grid[1]

    def cycles_ns(self, cycles: float) -> float:
        return cycles / self.clock_hz * 1e9

    def with_grid(self, grid) -> "Chip":
        """The same chip with another worker grid (x, y), e.g. the 11x10 of current P150 firmware."""
        return replace(self, grid=(int(grid[0]), int(grid[1])))


BLACKHOLE_P150 = Chip()

GIB, MIB = float(1 << 30), float(1 << 20)


@dataclass(frozen=True)
class Link:
    """Host <-> chip transfer rates over PCIe, bytes per second, as tt-metal's own benchmarks measured them (read
    from their issues and pull requests, not fitted; each beside its source). Each is the rate at 2048-byte pages,
    the largest page those tables list: our transfers are row-major rows of 1920 to 7680 bytes.

    d2h_pinned: a device -> host read into pinned host memory, which ttnn uses when it reads into a preallocated
    host tensor (`copy_device_to_host_tensor`; tt-metal PR 41612's pinned-memory cache); d2h_unpinned: a read
    through the completion queue (a fresh host tensor, `from_device`), whose copy out of it takes a host core;
    h2d: a host -> device write (the canvas, 6 MB: under the 32 MiB at which ttnn writes from pinned memory)."""

    d2h_pinned: float = 31.14 * GIB  # tt-metal issue 27846 (Blackhole, 2026-04-30): ReadPinnedMemory, 1 GiB buffer
    d2h_unpinned: float = 7.38 * GIB  # tt-metal issue 27846 (Blackhole, 2026-04-30): Read, 1 GiB buffer
    h2d: float = 14373.224 * MIB  # tt-metal PR 25791 (2025-07-24): mesh write, 512 MiB transfer; card not named


PCIE = Link()

FIDELITY_PASSES = {"LoFi": 1, "HiFi2": 2, "HiFi3": 3, "HiFi4": 4}
DTYPE_TILE_BYTES = {
    "BFLOAT16": 2048,
    "FLOAT32": 4096,
    "BFLOAT8_B": 1088,
    "BFLOAT4_B": 576,
    "UINT32": 4096,
    "INT32": 4096,
    "UINT16": 2048,
    "UINT8": 1024,
}


# ------------------------------------------------------------------------------------------ the op list


@dataclass
class TensorInfo:
    """A device tensor as the capture saw it."""

    shape: tuple  # logical
    dtype: str  # "BFLOAT16", "FLOAT32", "BFLOAT8_B", ...
    layout: str  # "TILE" or "ROW_MAJOR"
    buffer: str  # "DRAM" or "L1"
    memory_layout: str  # "INTERLEAVED", "HEIGHT_SHARDED", "WIDTH_SHARDED", "BLOCK_SHARDED"
    cores: int  # cores of the shard grid; 0 when interleaved
    nbytes: int  # the buffer's size

    @property
    def sharded(self) -> bool:
        return self.memory_layout != "INTERLEAVED"

    @property
    def padded_shape(self) -> tuple:
        s = list(self.shape)
        if self.layout == "TILE" and len(s) >= 2:
            s[-1], s[-2] = -(-s[-1] // TILE) * TILE, -(-s[-2] // TILE) * TILE
        return tuple(s)

    @property
    def rows(self) -> int:
        """Product of all dims but the last (padded in tile layout)."""
        return math.prod(self.padded_shape[:-1])


@dataclass
class DeviceOp:
    """One device operation of a forward: what ran, on what, with which compute config; `call` is the ttnn
    function of the graph that ran it, `call_attrs` what that call's arguments say (program configs, convs)."""

    name: str
    inputs: list
    outputs: list
    call: str
    stage: str = ""
    fidelity: Optional[str] = None
    approx: Optional[bool] = None
    fp32_acc: Optional[bool] = None
    call_attrs: dict = field(default_factory=dict)


_SHAPE = re.compile(r"Shape\(\[([0-9, ]*)\]\)")
_GRID_RANGE = re.compile(r'\{"start":\{"x":(\d+),"y":(\d+)\},"end":\{"x":(\d+),"y":(\d+)\}')
_MEMORY = re.compile(
    r"memory_layout=TensorMemoryLayout::(\w+),buffer_type=BufferType::(\w+),"
    r"shard_spec=(std::nullopt|ShardSpec\{grid=\[(.*?)\], shape)"
)
_COMPUTE = re.compile(r"ComputeKernelConfig\(math_fidelity=(\w+),math_approx_mode=(\d),fp32_dest_acc_en=(\d)")


def _shape(text: str) -> tuple:
    m = _SHAPE.search(text)
    return tuple(int(v) for v in m.group(1).split(",") if v.strip()) if m else ()


def _grid_cores(ranges: str) -> int:
    return sum(
        (x1 - x0 + 1) * (y1 - y0 + 1)
        for x0, y0, x1, y1 in (tuple(int(v) for v in m.groups()) for m in _GRID_RANGE.finditer(ranges))
    )


def _tensor_info(params: dict) -> TensorInfo:
    memory = params.get("memory_config", "")
    m = _MEMORY.search(memory)
    layout, buffer = (m.group(1), m.group(2)) if m else ("INTERLEAVED", "DRAM")
    cores = _grid_cores(m.group(4) or "") if m and m.group(4) else 0
    info = TensorInfo(
        shape=_shape(params.get("shape", "")),
        dtype=params.get("dtype", "").split("::")[-1],
        layout=params.get("layout", "").split("::")[-1],
        buffer=buffer,
        memory_layout=layout,
        cores=cores,
        nbytes=0,
    )
    info.nbytes = _nbytes(info) or int(params.get("size", 0) or 0)
    return info


_ELEMENT_BYTES = {"BFLOAT16": 2, "FLOAT32": 4, "UINT32": 4, "INT32": 4, "UINT16": 2, "UINT8": 1}


def _nbytes(t: TensorInfo) -> int:
    """What the tensor occupies: whole tiles in tile layout (bfloat8_b: 1088 bytes a tile, exponents included),
    else its values. (The capture's own "size" counts bfloat8_b at one byte a value.)"""
    if not t.shape:
        return 0
    if t.layout == "TILE":
        return math.prod(t.padded_shape) // (TILE * TILE) * DTYPE_TILE_BYTES.get(t.dtype, 2048)
    return math.prod(t.shape) * _ELEMENT_BYTES.get(t.dtype, 2)


def _is_device_op(name: str) -> bool:
    """Device operations are named by their class (MatmulDeviceOperation, SDPAOperation, Pool2D); the capture's
    other functions are namespaced (Tensor::reshape, tt::tt_metal::create_device_tensor)."""
    return bool(name) and "::" not in name


def device_ops_from_capture(captured: list, call: str, call_attrs: Optional[dict] = None, stage: str = "") -> list:
    """The device operations in a ttnn graph capture (`ttnn.graph.end_graph_capture()`) of one ttnn call."""
    ops = []
    open_ops: list = []
    for node in captured:
        kind = node.get("node_type")
        params = node.get("params") or {}
        name = params.get("name", "")
        if kind == "function_start" and _is_device_op(name):
            inputs = [
                _tensor_info(captured[i]["params"])
                for i in node.get("input_tensors", [])
                if captured[i].get("node_type") == "tensor"
            ]
            text = " ".join(node.get("arguments", []))
            c = _COMPUTE.search(text)
            op = DeviceOp(
                name=name,
                inputs=inputs,
                outputs=[],
                call=call,
                stage=stage,
                fidelity=c.group(1) if c else None,
                approx=bool(int(c.group(2))) if c else None,
                fp32_acc=bool(int(c.group(3))) if c else None,
                call_attrs=dict(call_attrs or {}),
            )
            open_ops.append(op)
        elif kind == "function_end" and open_ops and name == open_ops[-1].name:
            op = open_ops.pop()
            op.outputs = [
                _tensor_info(captured[i]["params"])
                for i in node.get("connections", [])
                if captured[i].get("node_type") == "tensor"
            ]
            if not open_ops:  # an op nested in another is costed as part of it
                ops.append(op)
    return ops


def _attr(obj, name, default=None):
    return getattr(obj, name, default) if obj is not None else default


def call_attributes(name: str, kwargs: dict) -> dict:
    """What a ttnn call's arguments say that the capture does not print: matmul program-config blocks, SDPA
    chunks, conv geometry."""
    attrs: dict = {}
    pc = kwargs.get("program_config")
    if pc is not None:
        grid = _attr(pc, "compute_with_storage_grid_size")
        if grid is not None:
            attrs["grid"] = [int(grid.x), int(grid.y)]
        for key in (
            "per_core_M",
            "per_core_N",
            "in0_block_w",
            "q_chunk_size",
            "k_chunk_size",
            "exp_approx_mode",
            "out_subblock_h",
            "out_subblock_w",
        ):
            value = _attr(pc, key)
            if value is not None:
                attrs[key] = value if isinstance(value, bool) else int(value)
        attrs["program_config"] = type(pc).__name__
    if "kernel_size" in kwargs and "in_channels" in kwargs:
        attrs.update(
            kernel=list(kwargs["kernel_size"]),
            in_channels=int(kwargs["in_channels"]),
            out_channels=int(kwargs["out_channels"]),
            groups=int(kwargs.get("groups", 1) or 1),
            stride=list(kwargs.get("stride", (1, 1))),
            height=int(kwargs["input_height"]),
            width=int(kwargs["input_width"]),
            transposed=name == "conv_transpose2d",
        )
    return attrs


class OpRecorder:
    """A proxy for the ttnn module: counts the calls of its functions and, while `capture` is true, records the
    device operations each call runs (`ops`: one graph capture per call, with `capture_api`, ttnn's C++ graph
    module `ttnn._ttnn.graph`, which needs no torch). `stage` labels the ops recorded from then on ("encoder",
    "decoder"). Classes and config helpers pass through untouched."""

    _NOT_OPS = {"init_device_compute_kernel_config"}

    def __init__(self, module, capture_api=None, prefix: str = "", root: "OpRecorder" = None):
        self._module = module
        self._prefix = prefix
        self._root = root or self
        if root is None:
            self.counts = collections.Counter()
            self.device_counts = collections.Counter()
            self.ops: list = []
            self.capture_api = capture_api
            self.capture = False
            self.stage = ""
            self.last = None

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if isinstance(attr, types.ModuleType):
            return OpRecorder(attr, prefix=f"{self._prefix}{name}.", root=self._root)
        if callable(attr) and not isinstance(attr, type) and name not in self._NOT_OPS:
            return self._wrap(self._prefix + name, attr)
        return attr

    def _wrap(self, key: str, fn):
        root = self._root

        def call(*args, **kwargs):
            root.counts[key] += 1
            root.last = key
            if not root.capture or key in ("deallocate", "synchronize_device"):
                return fn(*args, **kwargs)
            graph = root.capture_api
            graph.begin_graph_capture(graph.RunMode.NORMAL)
            try:
                result = fn(*args, **kwargs)
            finally:
                captured = graph.end_graph_capture()
            ops = device_ops_from_capture(captured, key, call_attributes(key.split(".")[-1], kwargs), root.stage)
            root.ops.extend(ops)
            for node in captured:
                if node.get("node_type") == "function_start" and node.get("stacking_level") == 1:
                    root.device_counts[(node.get("params") or {}).get("name", "?")] += 1
            return result

        return call

    def clear(self) -> None:
        self.counts.clear()
        self.device_counts.clear()
        self.ops.clear()


def _tensor_row(t: TensorInfo) -> list:
    return [list(t.shape), t.dtype, t.layout, t.buffer, t.memory_layout, t.cores, t.nbytes]


def ops_to_json(ops: Iterable[DeviceOp]) -> list:
    """A compact JSON form of an op list (one list per op), read back by `ops_from_json`."""
    return [
        [
            op.name,
            op.call,
            op.stage,
            op.fidelity,
            op.approx,
            op.fp32_acc,
            op.call_attrs,
            [_tensor_row(t) for t in op.inputs],
            [_tensor_row(t) for t in op.outputs],
        ]
        for op in ops
    ]


def ops_from_json(rows: list) -> list:
    def tensor(row):
        shape, dtype, layout, buffer, memory_layout, cores, nbytes = row
        return TensorInfo(tuple(shape), dtype, layout, buffer, memory_layout, cores, nbytes)

    return [
        DeviceOp(name, [tensor(t) for t in ins], [tensor(t) for t in outs], call, stage, fid, approx, acc, attrs)
        for name, call, stage, fid, approx, acc, attrs, ins, outs in rows
    ]


# ------------------------------------------------------------------------------------------- the costs


@dataclass
class OpCost:
    """One op's estimate: `kernel_ns` = max(compute, data) + fill + the fixed start-up; `total_ns` adds dispatch."""

    name: str
    call: str
    group: str
    compute_ns: float
    data_ns: float
    fill_ns: float  # what overlaps neither: a matmul's first operand blocks
    startup_ns: float  # the op's fixed kernel start-up (Chip.kernel_ns)
    dispatch_ns: float  # the gap before the next op (Chip.dispatch_ns)
    cores: int
    detail: str

    @property
    def kernel_ns(self) -> float:
        return max(self.compute_ns, self.data_ns) + self.fill_ns + self.startup_ns

    @property
    def total_ns(self) -> float:
        return self.kernel_ns + self.dispatch_ns

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ns >= self.data_ns else "data"


@dataclass
class _Work:
    compute_ns: float
    data_ns: float
    cores: int
    detail: str
    fill_ns: float = 0.0


def _base(name: str) -> str:
    return name.replace("DeviceOperation", "").replace("Operation", "").split("::")[-1]


def _tile_bytes(t: TensorInfo) -> int:
    return DTYPE_TILE_BYTES.get(t.dtype, 2048)


def _tiles(t: TensorInfo) -> float:
    return math.prod(t.padded_shape) / (TILE * TILE) if t.shape else 0.0


def _tensor_time_ns(t: TensorInfo, chip: Chip) -> float:
    """Reading or writing one tensor in L1: each core of its shard grid (or, interleaved, every core) moves its
    share at the per-core NoC / L1 rate."""
    return chip.cycles_ns(t.nbytes / (t.cores or chip.cores) / chip.noc_bytes_per_cycle)


def _data_ns(op: DeviceOp, chip: Chip) -> float:
    tensors = op.inputs + op.outputs
    dram = sum(t.nbytes for t in tensors if t.buffer == "DRAM")
    on_chip = max([_tensor_time_ns(t, chip) for t in tensors if t.buffer != "DRAM"], default=0.0)
    return max(dram / chip.dram_bytes_per_s * 1e9, on_chip)


def _passes(op: DeviceOp) -> int:
    return FIDELITY_PASSES.get(op.fidelity or "HiFi4", 4)


def _product_cycles(op: DeviceOp, chip: Chip) -> float:
    """One 32x32x32 tile product on the matrix engine at the op's fidelity and the FPU efficiency."""
    return TILE**3 * 2 / chip.flop_per_cycle_lofi * _passes(op) / chip.fpu_efficiency


def _op_cores(op: DeviceOp, chip: Chip, blocks: Optional[int] = None) -> int:
    sharded = [t.cores for t in op.outputs + op.inputs if t.sharded and t.cores]
    if sharded:
        return max(sharded)
    if blocks is not None:
        return max(1, min(chip.cores, blocks))
    return chip.cores


def _matmul(op: DeviceOp, chip: Chip) -> _Work:
    """The busiest core's tile products (its output block x K tiles) and the packing of its output tiles, against
    DRAM traffic and the operand blocks streamed to it over the NoC (2D multicast: a row's first core reads the
    row's in0 blocks, a column's first core the column's in1 blocks, on the two NoCs at once). The first K block
    of each operand must arrive before the first product: the fill."""
    a, b = op.inputs[0], op.inputs[1]
    m, k, n = a.rows, a.padded_shape[-1], b.padded_shape[-1]
    mt, nt, kt = -(-m // TILE), -(-n // TILE), -(-k // TILE)  # rows count every batch of a batched matmul
    attrs = op.call_attrs
    if "per_core_M" in attrs and "per_core_N" in attrs:
        per_m, per_n = attrs["per_core_M"], attrs["per_core_N"]
        cores = max(1, min(chip.cores, -(-mt // per_m) * -(-nt // per_n)))
    else:  # ttnn's own config: assume the output tiles spread evenly over the cores it uses
        cores = _op_cores(op, chip, blocks=mt * nt)
        per_m, per_n = 1, -(-mt * nt // cores)
    block_k = min(kt, attrs.get("in0_block_w", 1))  # ttnn's own config: its block is not recorded, take one tile
    compute = chip.cycles_ns(per_m * per_n * (kt * _product_cycles(op, chip) + chip.pass_cycles))
    in0, in1 = per_m * _tile_bytes(a), per_n * _tile_bytes(b)  # one K tile of each operand's block
    data = max(_data_ns(op, chip), chip.cycles_ns(max(in0, in1) * kt / chip.noc_bytes_per_cycle))
    fill = chip.cycles_ns((in0 + in1) * block_k / chip.noc_bytes_per_cycle)
    return _Work(compute, data, cores, f"{m}x{k}x{n} {op.fidelity} {cores} cores", fill)


def _conv(op: DeviceOp, chip: Chip) -> _Work:
    """A conv as ttnn runs it: a matmul of the im2col windows (output pixels x kh kw C_in) by the prepared weight
    matrix, whose shape the capture records (a grouped conv's weights are expanded to the full C_in with zeros,
    so its cost is a dense conv's), plus the packing of its output tiles; against the activation reader building
    the windows from the halo'd shard (kh kw C_in bfloat16 values per output pixel, copied a window row at a time
    at the measured L1 rate for that transaction size) and the data."""
    attrs = op.call_attrs
    out = op.outputs[0] if op.outputs else op.inputs[0]
    pixels = out.rows
    weight = op.inputs[1] if len(op.inputs) > 1 else None
    if weight is not None and len(weight.padded_shape) >= 2:
        k, n = weight.padded_shape[-2], weight.padded_shape[-1]
    else:
        kh, kw = attrs.get("kernel", (1, 1))
        k, n = kh * kw * attrs.get("in_channels", 32), -(-attrs.get("out_channels", 32) // TILE) * TILE
    cores = _op_cores(op, chip)
    products = pixels / TILE * (k / TILE) * (n / TILE) / cores
    out_tiles = pixels / TILE * (n / TILE) / cores
    compute = chip.cycles_ns(products * _product_cycles(op, chip) + out_tiles * chip.pass_cycles)
    c_in = attrs.get("in_channels", k)
    kw = (attrs.get("kernel") or (1, 1))[1]
    stick = kw * c_in * 2  # the reader copies one window row (kw pixels of C_in bfloat16 values) at a time
    reader = pixels / cores * k * 2 / l1_local_bytes_per_s(stick) * 1e9
    weights = weight.nbytes if weight is not None else k * n * 2
    data = max(_data_ns(op, chip), reader, chip.cycles_ns(weights / chip.noc_bytes_per_cycle))
    kernel = "x".join(str(v) for v in attrs.get("kernel", ())) or "?"
    detail = (
        f"{pixels}px {attrs.get('in_channels', '?')}->{attrs.get('out_channels', '?')} "
        f"{kernel} g{attrs.get('groups', 1)} {op.fidelity} {cores} cores"
    )
    return _Work(compute, data, cores, detail)


# What one Blackhole core reads from its own L1 per transaction size (bytes -> GB/s): the measured table of
# tt-metal's data-movement cost model (ttnn/.../data_movement/common/common.cpp, common_tm_bw_model, "L1 local").
L1_LOCAL_GBPS = (
    (32, 1.337),
    (256, 10.708),
    (512, 21.413),
    (1024, 42.792),
    (2048, 46.455),
    (4096, 48.5),
    (65536, 50.21),
)


def l1_local_bytes_per_s(transaction: float) -> float:
    """`L1_LOCAL_GBPS` interpolated log-linearly in the transaction size (clamped at its ends), in bytes/s."""
    table = L1_LOCAL_GBPS
    if transaction <= table[0][0]:
        return table[0][1] * 1e9
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if transaction <= x1:
            t = math.log(transaction / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0))) * 1e9
    return table[-1][1] * 1e9


def _untilize_ns(t: TensorInfo, chip: Chip, cores: int) -> float:
    """Tile <-> row-major conversion on the cores: tt-metal's own per-tile latencies (80 cycles for rows up to
    8 tiles wide, 390 beyond), spread over the cores."""
    if t.layout != "TILE":
        return 0.0
    width = t.padded_shape[-1] // TILE
    return chip.cycles_ns(_tiles(t) / max(1, cores) * (80 if width <= 8 else 390))


def _exp_cycles(op: DeviceOp, chip: Chip, approx: Optional[bool]) -> float:
    return chip.exp_cycles_approx if approx else chip.exp_cycles


def _sdpa(op: DeviceOp, chip: Chip) -> _Work:
    """FlashAttention as ttnn's SDPA splits it: batch x heads first, then each head's query chunks over the cores
    left (`q_parallel`); the busiest core runs `chunks` query chunks, each against every key chunk. Per score tile:
    QK^T (head_dim / 32 products) and its pack, the row max, subtract and exp, the row sum, PV (head_dim / 32
    products); per key chunk PV's output tiles packed, and from the second key chunk on the rescale (the old max
    against the new, its exp, the sum and the output tiles scaled and added); per query chunk the output divided by
    the sum. Data: each core streams its head's keys and values once per query chunk."""
    q, k = op.inputs[0], op.inputs[1]
    b, h, sq, d = (1,) * (4 - len(q.padded_shape)) + q.padded_shape[-4:]
    sk = k.padded_shape[-2]
    attrs = op.call_attrs
    q_chunk, k_chunk = attrs.get("q_chunk_size", 32), attrs.get("k_chunk_size", 32)
    gx, gy = attrs.get("grid", chip.grid)
    grid_cores = gx * gy
    heads = b * h
    q_chunks, k_chunks = -(-sq // q_chunk), -(-sk // k_chunk)
    q_parallel = max(1, min(grid_cores // heads, q_chunks)) if grid_cores >= heads else 1
    chunks = -(-q_chunks // q_parallel) * -(-heads // grid_cores)
    cores = min(grid_cores, heads * q_parallel)
    qt, kt, dt = q_chunk // TILE, k_chunk // TILE, d // TILE
    approx = attrs.get("exp_approx_mode", op.approx)
    exp = _exp_cycles(op, chip, approx)
    pc = chip.pass_cycles
    score = 2 * dt * _product_cycles(op, chip) + 4 * pc + exp  # QK^T, PV; pack, max, sub + exp, sum
    per_k_chunk = qt * kt * score + qt * dt * pc  # PV's output tiles packed
    rescale = qt * (dt + 4) * pc + qt * exp  # new max, exp(old - new), sum, output scaled and added
    per_q_chunk = k_chunks * per_k_chunk + (k_chunks - 1) * rescale + qt * (dt + 1) * pc  # 1 / sum, scale
    compute = chip.cycles_ns(chunks * per_q_chunk)
    kv_core = chunks * 2 * sk * d * _tile_bytes(k) / (TILE * TILE)  # each core's key and value stream
    data = max(_data_ns(op, chip), chip.cycles_ns(kv_core / chip.noc_bytes_per_cycle))
    if k.buffer == "DRAM":  # every core of a head reads them: the chip's DRAM carries them `cores` times
        data = max(data, cores * kv_core / chip.dram_bytes_per_s * 1e9)
    detail = f"{h}h {sq}x{sk}x{d} q{q_chunk}/k{k_chunk} {op.fidelity}{' approx' if approx else ''} {cores} cores"
    return _Work(compute, data, cores, detail)


def _per_core_tiles(op: DeviceOp, chip: Chip, rows_only: bool = False) -> tuple:
    out = op.outputs[0] if op.outputs else op.inputs[0]
    tiles = _tiles(out)
    if rows_only:  # split by tile rows (an interleaved layer norm: a row's statistics stay on one core)
        cores = _op_cores(op, chip, blocks=max(1, int(out.rows // TILE)))
    else:
        cores = _op_cores(op, chip, blocks=max(1, int(tiles)))
    return out, tiles / cores, cores


def _eltwise(op: DeviceOp, chip: Chip) -> _Work:
    """One pass per output tile (an add, a multiply, a unary function)."""
    out, per_core, cores = _per_core_tiles(op, chip)
    compute = chip.cycles_ns(per_core * chip.pass_cycles)
    return _Work(compute, _data_ns(op, chip), cores, f"{tuple(out.shape)} {cores} cores")


def _layer_norm(op: DeviceOp, chip: Chip) -> _Work:
    """Seven passes per tile: the row mean (a reduction), subtract, square, the variance (a reduction), scale by
    1/sigma, gamma, beta. Sharded: on the shard grid; interleaved: one core per tile row, as ttnn splits it."""
    out, per_core, cores = _per_core_tiles(op, chip, rows_only=not any(t.sharded for t in op.inputs))
    compute = chip.cycles_ns(per_core * 7 * chip.pass_cycles)
    return _Work(compute, _data_ns(op, chip), cores, f"{tuple(out.shape)} {out.dtype.lower()} {cores} cores")


def _softmax(op: DeviceOp, chip: Chip) -> _Work:
    """Three passes per tile (exp, the row sum, the scale by its inverse) and the exp on the SFPU."""
    out, per_core, cores = _per_core_tiles(op, chip)
    compute = chip.cycles_ns(per_core * (3 * chip.pass_cycles + _exp_cycles(op, chip, op.approx)))
    return _Work(compute, _data_ns(op, chip), cores, f"{tuple(out.shape)} {cores} cores")


def _transfer(op: DeviceOp, chip: Chip) -> _Work:
    """Data movement: bytes in and out; halo and untilize also convert tiles to rows, tilize rows to tiles."""
    out = op.outputs[0] if op.outputs else (op.inputs[0] if op.inputs else None)
    cores = _op_cores(op, chip)
    base = _base(op.name)
    compute = 0.0
    if base in ("Halo", "Untilize", "UntilizeWithUnpadding", "UntilizeWithHalo", "UntilizeCodegen") and op.inputs:
        compute = _untilize_ns(op.inputs[0], chip, cores)
    elif base in ("Tilize", "TilizeWithValPadding") and op.outputs:
        compute = _untilize_ns(op.outputs[0], chip, cores)
    detail = f"{tuple(out.shape) if out else ()} {out.memory_layout if out else ''} {out.buffer if out else ''}"
    return _Work(compute, _data_ns(op, chip), cores, detail)


# device op (its class name without "DeviceOperation" / "Operation") -> (cost, kind); kinds decide the group.
# Matmul* and Conv2d* variants match by prefix; anything else is data movement.
_OPS: dict = {
    "Matmul": (_matmul, "matmul"),
    "Conv2d": (_conv, "matmul"),
    "SDPA": (_sdpa, "sdpa"),
    "LayerNorm": (_layer_norm, "norm"),
    "Softmax": (_softmax, "norm"),
    "BinaryNg": (_eltwise, "norm"),
    "Binary": (_eltwise, "norm"),
    "Unary": (_eltwise, "norm"),
}


def _kind(base: str) -> tuple:
    for prefix in ("Matmul", "Conv2d"):
        if base.startswith(prefix):
            return _OPS[prefix]
    return _OPS.get(base, (_transfer, "transfer"))


def _group(op: DeviceOp, kind: str) -> str:
    if op.stage in ("input", "output"):  # pre.py / post.py, every op: resize and unfold, interleave and resize back
        return "input_output"
    if kind == "sdpa":
        return "sdpa"
    if kind == "transfer":
        return "transfers"
    if op.stage == "decoder":
        return "decoder"
    return "norms_adds" if kind == "norm" else "encoder"


def op_cost(op: DeviceOp, chip: Chip = BLACKHOLE_P150) -> OpCost:
    """The estimated time of one device operation (see the module docstring)."""
    cost, kind = _kind(_base(op.name))
    w: _Work = cost(op, chip)
    return OpCost(
        op.name,
        op.call,
        _group(op, kind),
        w.compute_ns,
        w.data_ns,
        w.fill_ns,
        chip.kernel_ns,
        chip.dispatch_ns,
        w.cores,
        w.detail,
    )


@dataclass
class Estimate:
    """A forward's estimate: total = kernel + dispatch milliseconds, per group (each op's kernel and dispatch in
    its group), and the costed ops."""

    total_ms: float
    kernel_ms: float
    dispatch_ms: float
    groups_ms: dict
    ops: list
    chip: str
    grid: tuple

    def top(self, n: int = 10) -> list:
        """The n costliest kinds of op (same name, call and detail), with their count and summed time."""
        rows: dict = {}
        for c in self.ops:
            row = rows.setdefault(
                (c.name, c.call, c.detail),
                {"op": c.name, "call": c.call, "detail": c.detail, "group": c.group, "bound": c.bound, "count": 0},
            )
            row["count"] += 1
            row["ms"] = row.get("ms", 0.0) + c.total_ns / 1e6
        return sorted(rows.values(), key=lambda r: -r["ms"])[:n]

    def summary(self, top: int = 10) -> dict:
        return {
            "total": round(self.total_ms, 3),
            "kernel": round(self.kernel_ms, 3),
            "dispatch": round(self.dispatch_ms, 3),
            **{g: round(v, 3) for g, v in self.groups_ms.items()},
            "device_ops": len(self.ops),
            "chip": self.chip,
            "grid": f"{self.grid[0]}x{self.grid[1]}",
            "top": [{**r, "ms": round(r["ms"], 3)} for r in self.top(top)],
        }


def estimate(ops: Iterable[DeviceOp], chip: Chip = BLACKHOLE_P150) -> Estimate:
    costs = [op_cost(op, chip) for op in ops]
    groups = {g: 0.0 for g in GROUPS}
    for c in costs:
        groups[c.group] += c.total_ns / 1e6
    kernel = sum(c.kernel_ns for c in costs) / 1e6
    dispatch = sum(c.dispatch_ns for c in costs) / 1e6
    return Estimate(kernel + dispatch, kernel, dispatch, groups, costs, chip.name, tuple(chip.grid))
