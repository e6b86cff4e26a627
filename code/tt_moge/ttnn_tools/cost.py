"""A cost model of a ttnn graph on one Blackhole chip, from the device operations the (mock) device ran.

No chip can be measured here, so speed is estimated: every device operation that a forward runs on the mock
P150 (`mock_check.py` captures them with ttnn's own graph capture, one ttnn call at a time) is costed with
tt-metal's ideal formulas, and the sum is the forward's estimate.

    recorder = OpRecorder(ttnn, capture_api=ttnn.graph)  # the ttnn module, wrapped
    recorder.capture = True                              # record the device ops of each call from here
    graph = TtnnGraph(recorder, device, prepared)        # the graph calls ttnn through it
    graph.forward(x)
    est = estimate(recorder.ops)                         # Estimate: total_ms, per group, per op

Per device operation (`op_cost`), the time is the larger of what it computes and what it moves, plus a fixed
dispatch cost:

* compute: a matmul's or conv's 2 M N K multiply-adds / (cores x 4096 FLOP per cycle x the clock) x the math
  fidelity's passes (LoFi 1, HiFi2 2, HiFi3 3, HiFi4 4), divided by the FPU efficiency `Chip.fpu_efficiency`;
  SDPA's two matmuls the same way, plus its softmax on the SFPU (`Chip.exp_cycles_per_tile`, exact or
  approximate exp); eltwise ops and layer norms a few FPU/SFPU passes per tile.
* data: bytes read and written, each tensor at the bandwidth of where it lives: DRAM (`Chip.dram_bytes_per_s`,
  shared by the chip) or L1 (sharded: `Chip.l1_bytes_per_cycle` per core of the shard grid); a matmul's
  multicast operand blocks over the NoC (`Chip.noc_bytes_per_cycle` per core).
* dispatch: `Chip.op_overhead_ns` per device operation (a traced forward replays its programs back to back;
  each still starts and ends its kernels on every core).

The cores an op uses come from what the capture recorded: a sharded tensor's shard grid, a matmul's program
config (per-core blocks over the output tiles, from the ttnn call's arguments, which `OpRecorder` keeps), SDPA's
work units (batch x heads x query chunks). An interleaved op with no config is assumed to use the whole grid.

Calibration (`calibration_table`, `fit_calibration`): the same model, applied to the op list of tt-metal's own
high-resolution Blackhole ViT (`hires_vit.py`, run on the mock like our graph), is compared with the times
tt-metal publishes for it; the constants of `BLACKHOLE_P150` are fixed by that comparison and by the chip's
documented figures, and are not tuned to our graph. Both the constants and the comparison are in
docs/tenstorrent.md.

numpy-free and torch-free: this module runs in the mock's Python (ttnn only) and in the tests.
"""

from __future__ import annotations

import collections
import math
import re
import types
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

__all__ = [
    "Chip",
    "BLACKHOLE_P150",
    "TensorInfo",
    "DeviceOp",
    "OpRecorder",
    "OpCost",
    "Estimate",
    "op_cost",
    "estimate",
    "device_ops_from_capture",
    "GROUPS",
    "PUBLISHED_HIRES_VIT_MS",
]

TILE = 32
GROUPS = ("encoder", "sdpa", "norms_adds", "decoder", "transfers")

# tt-metal's published end-to-end times (2 command queues, traced, batch 1) of its Blackhole high-resolution ViT
# (models/demos/blackhole/vit, test_demo_vit_hiRes_ttnn_inference_perf_e2e_2cq_trace.py): tokens -> ms.
PUBLISHED_HIRES_VIT_MS = {1024: 4.1, 2048: 9.5, 3072: 14.5}


@dataclass(frozen=True)
class Chip:
    """The figures the model needs of one chip. Defaults: a Blackhole P150; docs/tenstorrent.md says where each
    comes from (tt-metal's documents and perf models) and which two the calibration sets (`op_overhead_ns`,
    `softmax_cycles_per_tile`)."""

    name: str = "Blackhole P150"
    grid: tuple = (13, 10)  # worker cores (x, y) that ttnn gives ops
    clock_hz: float = 1.35e9
    flop_per_cycle_lofi: int = 4096  # one core's matrix engine (8x16 @ 16x16 per cycle) at LoFi
    fpu_efficiency: float = 0.85  # the share of that ideal a well-blocked matmul reaches (tt-metal's GEMM report)
    conv_efficiency: float = 0.85  # a conv's matmul, the same (its reader is costed on its own)
    dram_bytes_per_s: float = 512e9 * 0.9  # eight GDDR6 channels, 512 GB/s peak, at the share reached
    noc_bytes_per_cycle: float = 37.0  # what one core reads or writes over the NoC (or L1 to L1), saturated
    softmax_cycles_per_tile_approx: float = 52.0  # SDPA, per 32x32 score tile: the SFPU's fast approximate exp
    softmax_cycles_per_tile: float = 355.0  # the same with exp_approx_mode=False (calibrated)
    eltwise_cycles_per_tile: float = 32.0  # one FPU / SFPU pass over a tile (add, relu, a layer-norm step)
    op_overhead_ns: float = 7200.0  # per device operation, what its costs leave out (calibrated)
    pcie_bytes_per_s: float = 24e9  # host <-> chip, one stream over PCIe Gen5 x16

    @property
    def cores(self) -> int:
        return self.grid[0] * self.grid[1]

    def cycles_ns(self, cycles: float) -> float:
        return cycles / self.clock_hz * 1e9


BLACKHOLE_P150 = Chip()

_FIDELITY_PASSES = {"LoFi": 1, "HiFi2": 2, "HiFi3": 3, "HiFi4": 4}
_DTYPE_TILE_BYTES = {
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
        return math.prod(t.padded_shape) // (TILE * TILE) * _DTYPE_TILE_BYTES.get(t.dtype, 2048)
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


# ------------------------------------------------------------------------------------------- the costs


@dataclass
class OpCost:
    name: str
    call: str
    group: str
    compute_ns: float
    data_ns: float
    overhead_ns: float
    cores: int
    detail: str

    @property
    def total_ns(self) -> float:
        return max(self.compute_ns, self.data_ns) + self.overhead_ns

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ns >= self.data_ns else "data"


_COMPUTE_OPS = ("Matmul", "Conv2d", "SDPA", "LayerNorm", "BinaryNg", "Binary", "Unary", "Softmax")


def _base(name: str) -> str:
    return name.replace("DeviceOperation", "").replace("Operation", "").split("::")[-1]


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
    return _FIDELITY_PASSES.get(op.fidelity or "HiFi4", 4)


def _op_cores(op: DeviceOp, chip: Chip, blocks: Optional[int] = None) -> int:
    sharded = [t.cores for t in op.outputs + op.inputs if t.sharded and t.cores]
    if sharded:
        return max(sharded)
    if blocks is not None:
        return max(1, min(chip.cores, blocks))
    return chip.cores


def _matmul(op: DeviceOp, chip: Chip) -> tuple:
    """The busiest core's tile products (per-core output block x K tiles; 16 cycles each at LoFi) at the FPU
    efficiency, against DRAM traffic and the operand blocks streamed to each core over the NoC."""
    a, b = op.inputs[0], op.inputs[1]
    m, k, n = a.rows, a.padded_shape[-1], b.padded_shape[-1]
    batch_b = math.prod(b.padded_shape[:-2]) if len(b.shape) > 2 else 1
    mt, nt, kt = -(-m // TILE), -(-n // TILE), -(-k // TILE)
    attrs = op.call_attrs
    if "per_core_M" in attrs and "per_core_N" in attrs:
        per_m, per_n = attrs["per_core_M"], attrs["per_core_N"]
        cores = max(1, min(chip.cores, -(-mt // per_m) * -(-nt // per_n)))
    else:  # ttnn's own config: assume the output tiles spread evenly over the cores it uses
        cores = _op_cores(op, chip, blocks=mt * nt)
        per_m, per_n = 1, -(-mt * nt // cores)
    products = per_m * per_n * kt * max(1, batch_b)
    tile_cycles = TILE**3 * 2 / chip.flop_per_cycle_lofi * _passes(op)
    compute = chip.cycles_ns(products * tile_cycles / chip.fpu_efficiency)
    # 2D multicast: a row's first core reads the row's in0 blocks and multicasts them, a column's first core the
    # column's in1 blocks, on the two NoCs at once: the longer of the two streams bounds the op
    streams = (per_m * _DTYPE_TILE_BYTES.get(a.dtype, 2048) * kt, per_n * _DTYPE_TILE_BYTES.get(b.dtype, 2048) * kt)
    data = max(_data_ns(op, chip), chip.cycles_ns(max(streams) / chip.noc_bytes_per_cycle))
    return compute, data, cores, f"{m}x{k}x{n} {op.fidelity} {cores} cores"


def _conv(op: DeviceOp, chip: Chip) -> tuple:
    """A conv as ttnn runs it: a matmul of the im2col windows (output pixels x kh kw C_in) by the prepared weight
    matrix, whose shape the capture records (a grouped conv's weights are expanded to the full C_in with zeros,
    so its cost is a dense conv's), at the conv efficiency; against the activation reader building the windows
    from the halo'd shard (kh kw C_in bfloat16 values per output pixel, copied a window row at a time at the
    measured L1 rate for that transaction size) and the data."""
    attrs = op.call_attrs
    out = op.outputs[0] if op.outputs else op.inputs[0]
    pixels = out.rows
    weight = op.inputs[1] if len(op.inputs) > 1 else None
    if weight is not None and len(weight.padded_shape) >= 2:
        k, n = weight.padded_shape[-2], weight.padded_shape[-1]
    else:
        kh, kw = attrs.get("kernel", (1, 1))
        k, n = kh * kw * attrs.get("in_channels", 32), -(-attrs.get("out_channels", 32) // TILE) * TILE
    flops = 2.0 * pixels * k * n
    cores = _op_cores(op, chip)
    compute = chip.cycles_ns(flops / (cores * chip.flop_per_cycle_lofi) * _passes(op)) / chip.conv_efficiency
    c_in = attrs.get("in_channels", k)
    kw = (attrs.get("kernel") or (1, 1))[1]
    stick = kw * c_in * 2  # the reader copies one window row (kw pixels of C_in bfloat16 values) at a time
    reader = pixels / cores * k * 2 / l1_local_bytes_per_s(stick) * 1e9
    weights = weight.nbytes if weight is not None else k * n * 2
    data = max(_data_ns(op, chip), reader, chip.cycles_ns(weights / chip.noc_bytes_per_cycle))
    kernel = "x".join(str(v) for v in attrs.get("kernel", ())) or "?"
    return (
        compute,
        data,
        cores,
        f"{pixels}px {attrs.get('in_channels', '?')}->{attrs.get('out_channels', '?')} "
        f"{kernel} g{attrs.get('groups', 1)} {op.fidelity} {cores} cores",
    )


# What one Blackhole core reads from its own L1 per transaction size (bytes -> GB/s): the measured table of
# tt-metal's data-movement cost model (ttnn/.../data_movement/common/common.cpp, common_tm_bw_model, "L1 local").
_L1_LOCAL_GBPS = (
    (32, 1.337),
    (256, 10.708),
    (512, 21.413),
    (1024, 42.792),
    (2048, 46.455),
    (4096, 48.5),
    (65536, 50.21),
)


def l1_local_bytes_per_s(transaction: float) -> float:
    """`_L1_LOCAL_GBPS` interpolated log-linearly in the transaction size (clamped at its ends), in bytes/s."""
    table = _L1_LOCAL_GBPS
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
    tiles = math.prod(t.padded_shape) / (TILE * TILE)
    width = t.padded_shape[-1] // TILE
    return chip.cycles_ns(tiles / max(1, cores) * (80 if width <= 8 else 390))


def _sdpa(op: DeviceOp, chip: Chip) -> tuple:
    """FlashAttention as ttnn's SDPA splits it: batch x heads first, then each head's query chunks over the cores
    left (`q_parallel`); the busiest core runs `chunks` query chunks, each against every key chunk. Per 32x32 score
    tile: the two matmuls (QK^T and PV, head_dim / 32 tile products each) at the op's fidelity, and the softmax on
    the SFPU; per (query chunk, key chunk) the running output's rescale."""
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
    score_tiles = chunks * (q_chunk // TILE) * k_chunks * (k_chunk // TILE)
    approx = attrs.get("exp_approx_mode", op.approx)
    softmax = chip.softmax_cycles_per_tile_approx if approx else chip.softmax_cycles_per_tile
    mm = 2 * (d // TILE) * TILE**3 * 2 / chip.flop_per_cycle_lofi * _passes(op) / chip.fpu_efficiency
    rescale = chunks * k_chunks * (q_chunk // TILE) * (d // TILE + 2) * chip.eltwise_cycles_per_tile
    compute = chip.cycles_ns(score_tiles * (mm + softmax) + rescale)
    kv_stream = chunks * 2 * sk * d * _DTYPE_TILE_BYTES.get(k.dtype, 2048) / (TILE * TILE)
    data = max(_data_ns(op, chip), chip.cycles_ns(kv_stream / chip.noc_bytes_per_cycle))
    return (
        compute,
        data,
        cores,
        f"{h}h {sq}x{sk}x{d} q{q_chunk}/k{k_chunk} {op.fidelity}{' approx' if approx else ''} {cores} cores",
    )


def _eltwise(op: DeviceOp, chip: Chip, passes: float) -> tuple:
    out = op.outputs[0] if op.outputs else op.inputs[0]
    tiles = math.prod(out.padded_shape) / (TILE * TILE)
    cores = _op_cores(op, chip, blocks=int(tiles))
    compute = chip.cycles_ns(tiles / cores * chip.eltwise_cycles_per_tile * passes)
    return compute, _data_ns(op, chip), cores, f"{tuple(out.shape)} {cores} cores"


def _group(op: DeviceOp, base: str) -> str:
    if base in ("SDPA",):
        return "sdpa"
    if base not in _COMPUTE_OPS and not base.startswith("Matmul"):  # data movement: reshard, halo, untilize, ...
        return "transfers"
    if op.stage == "decoder":
        return "decoder"
    if base in ("LayerNorm", "BinaryNg", "Binary", "Unary", "Softmax"):
        return "norms_adds"
    return "encoder"


def op_cost(op: DeviceOp, chip: Chip = BLACKHOLE_P150) -> OpCost:
    """The estimated time of one device operation (see the module docstring)."""
    base = _base(op.name)
    if base.startswith("Matmul"):
        compute, data, cores, detail = _matmul(op, chip)
    elif base.startswith("Conv2d"):
        compute, data, cores, detail = _conv(op, chip)
    elif base == "SDPA":
        compute, data, cores, detail = _sdpa(op, chip)
    elif base == "LayerNorm":  # mean, variance, normalise, scale and shift: about five passes per tile
        compute, data, cores, detail = _eltwise(op, chip, 5.0)
    elif base == "Softmax":
        compute, data, cores, detail = _eltwise(op, chip, chip.softmax_cycles_per_tile / chip.eltwise_cycles_per_tile)
    elif base in ("BinaryNg", "Binary", "Unary"):
        compute, data, cores, detail = _eltwise(op, chip, 1.0)
    else:  # data movement: bytes in and out; halo and untilize also convert tiles to rows
        out = op.outputs[0] if op.outputs else (op.inputs[0] if op.inputs else None)
        compute, data, cores = 0.0, _data_ns(op, chip), _op_cores(op, chip)
        if base in ("Halo", "Untilize", "UntilizeWithUnpadding", "UntilizeWithHalo") and op.inputs:
            compute = _untilize_ns(op.inputs[0], chip, cores)
        elif base in ("Tilize", "TilizeWithValPadding") and op.outputs:
            compute = _untilize_ns(op.outputs[0], chip, cores)
        detail = f"{tuple(out.shape) if out else ()} {out.memory_layout if out else ''} {out.buffer if out else ''}"
    return OpCost(op.name, op.call, _group(op, base), compute, data, chip.op_overhead_ns, cores, detail)


@dataclass
class Estimate:
    """A forward's estimate: total and per-group milliseconds, and the costed ops."""

    total_ms: float
    groups_ms: dict
    ops: list
    chip: str

    def top(self, n: int = 10) -> list:
        """The n costliest kinds of op (same name, call and detail), with their count and summed time."""
        rows: dict = {}
        for c in self.ops:
            key = (c.name, c.call, c.detail)
            row = rows.setdefault(
                key,
                {
                    "op": c.name,
                    "call": c.call,
                    "detail": c.detail,
                    "group": c.group,
                    "bound": c.bound,
                    "count": 0,
                    "ms": 0.0,
                },
            )
            row["count"] += 1
            row["ms"] += c.total_ns / 1e6
        return sorted(rows.values(), key=lambda r: -r["ms"])[:n]

    def summary(self, top: int = 10) -> dict:
        return {
            "total": round(self.total_ms, 3),
            **{g: round(v, 3) for g, v in self.groups_ms.items()},
            "device_ops": len(self.ops),
            "chip": self.chip,
            "top": [{**r, "ms": round(r["ms"], 3)} for r in self.top(top)],
        }


def estimate(ops: Iterable[DeviceOp], chip: Chip = BLACKHOLE_P150) -> Estimate:
    costs = [op_cost(op, chip) for op in ops]
    groups = {g: 0.0 for g in GROUPS}
    for c in costs:
        groups[c.group] += c.total_ns / 1e6
    return Estimate(sum(groups.values()), groups, costs, chip.name)


def calibration_table(
    op_lists: dict, chip: Chip = BLACKHOLE_P150, layers: int = 12, published_ms: Optional[dict] = None
) -> dict:
    """tokens -> {estimate_ms, published_ms, ratio} for tt-metal's hiRes ViT: `op_lists` maps a token count of
    `published_ms` (default `PUBLISHED_HIRES_VIT_MS`) to the device ops of one of its layers (all alike)."""
    published_ms = PUBLISHED_HIRES_VIT_MS if published_ms is None else published_ms
    table = {}
    for tokens, ops in sorted(op_lists.items()):
        est = layers * estimate(ops, chip).total_ms
        published = published_ms[tokens]
        table[str(tokens)] = {
            "estimate_ms": round(est, 3),
            "published_ms": published,
            "ratio": round(est / published, 3),
        }
    return table


def fit_calibration(
    op_lists: dict, chip: Chip = BLACKHOLE_P150, layers: int = 12, published_ms: Optional[dict] = None
) -> dict:
    """The `op_overhead_ns` and `softmax_cycles_per_tile` that minimise the squared relative errors of the hiRes
    ViT estimates against the published times, every other figure of `chip` held. Both enter the estimate
    linearly (the ops they touch are bound by their compute), so one linear least-squares step is exact."""
    base = dict(asdict(chip))
    names = ("op_overhead_ns", "softmax_cycles_per_tile")
    steps = {"op_overhead_ns": 1000.0, "softmax_cycles_per_tile": 100.0}

    def ests(**change):
        c = Chip(**{**base, **change})
        return [layers * estimate(ops, c).total_ms for _, ops in sorted(op_lists.items())]

    published_ms = PUBLISHED_HIRES_VIT_MS if published_ms is None else published_ms
    published = [published_ms[t] for t in sorted(op_lists)]
    e0 = ests()
    columns = [[(b - a) / steps[n] for a, b in zip(e0, ests(**{n: base[n] + steps[n]}))] for n in names]
    # solve min sum_i ((e0_i + sum_j J_ij d_j - p_i) / p_i)^2 for d (2 unknowns: the normal equations by hand)
    rows = [[columns[j][i] / published[i] for j in range(2)] for i in range(len(published))]
    rhs = [(published[i] - e0[i]) / published[i] for i in range(len(published))]
    a11 = sum(r[0] * r[0] for r in rows)
    a12 = sum(r[0] * r[1] for r in rows)
    a22 = sum(r[1] * r[1] for r in rows)
    b1 = sum(r[0] * y for r, y in zip(rows, rhs))
    b2 = sum(r[1] * y for r, y in zip(rows, rhs))
    det = a11 * a22 - a12 * a12
    d = ((a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det)
    fitted = {n: base[n] + d[j] for j, n in enumerate(names)}
    return {
        **{n: round(v, 1) for n, v in fitted.items()},
        "table": calibration_table(op_lists, Chip(**{**base, **fitted}), layers, published_ms),
    }
