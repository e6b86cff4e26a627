"""The MoGe-2 forward as a ttnn graph: the device part of the Tenstorrent runner.

numpy and an injected `ttnn` module only (the real one, or the torch emulator of the tests); never imports
torch or ttnn itself, so the same code runs on a chip, on the mock P150 (Python 3.12, no torch) and in the
numerics tests.

    graph = TtnnGraph(ttnn, device, Prepared.load("vitl-1920x1080-1800.npz"))
    graph.load()                                    # weights to the device once; conv weights prepared
    x = graph.upload(host_input(plan, canvas_hwc))  # (seq_len, patch_k_padded) patch matrix
    out = graph.forward(x)                          # device tensors: finest phase maps, class token
    raw = host_output(prepared, graph.read(out))    # numpy raw maps at the canvas

What runs on the device, in order (the folds come from `FixedShapeMoGe2` through `prepare.py`):

* Patch embedding: one matmul of the host-unfolded patches by the folded patch kernel, plus a table that holds
  the position embedding (and the patch bias) for the patch rows and the class / register tokens for the
  prefix rows, which are placed after the patch rows and whose patch rows are zero (see `prepare.py`).
* Each DINOv2 block: layer_norm, fused qkv matmul (attention scale folded into q), head split, non-causal
  SDPA writing the heads back side by side, attention output matmul (LayerScale folded), residual add,
  layer_norm, FFN matmul with fused GELU, FFN output matmul (LayerScale folded), residual add. The sequence
  keeps its true length (not a tile multiple): SDPA masks the padded key rows of the last tile itself.
* At each tap, the final layer_norm and a matmul by that tap's share of the folded "output projection +
  neck level-0 conv" matrix, accumulated; the class token is the last tap's normed prefix row.
* The conv decoder, channels-last (1, 1, H*W, C) tiles: constant uv maps added, residual blocks (ReLU, 3x3
  conv with fused ReLU, 3x3 conv, add), 2x2 stride-2 conv-transpose resamplers followed by 3x3 convs, 1x1 convs
  as matmuls. Every 3x3 conv pads by edge replication, as MoGe does: ttnn 0.81's conv2d has a replicate padding
  mode (`Conv2dConfig(padding_mode=PaddingMode.Replicate)`), used here instead of building the padding with
  slices and concats.
* The finest level, phase-folded at the level before it (`prepare.phase_fold`): one 3x3 conv per feature map
  (neck and each head), summed, 4 x (3 + 3 + 1) channels in float32. The host interleaves the phases, adds
  the constant map, resizes to the canvas and applies the output activations (`prepare.host_output`), and runs
  the scale MLP on the class token.

Formats (`FORMATS`, `Formats`): weights in bfloat16 by default, bfloat8_b for the ViT's matmul weights as the
named "bfp8-vit" option; activations between ops in bfloat16 (SDPA takes nothing wider).

The ViT's residual stream is float32, as on the CPU and CUDA paths, and so are its layer norms' inputs and
outputs, the attention / FFN output projections that add into it, and the level-0 accumulator. Two reasons:
* Every block adds two small updates to the stream. In bfloat16 each add rounds the sum to 8 significant bits,
  an error that compounds over the blocks and that every layer norm passes on; in the emulator the ViT's output
  and class-token errors grow clearly with a bfloat16 stream (`Formats(residual="bfloat16")` exists to measure
  it: tests/test_ttnn_lowering.py::test_bfloat16_residual_stream_costs_vit_accuracy).
* DINOv2 ViT-L's stream carries, at a few tokens, channels orders of magnitude larger than the rest (massive
  activations). A layer norm over such a token subtracts a mean dominated by them from every
  channel; the small channels' differences survive only with a float32 input and float32 accumulation
  (fp32_dest_acc_en, set for the layer norms), where bfloat16's 8 bits at that magnitude would leave nothing.
The cost is twice the bytes of each (seq_len, dim) residual tensor. Matmuls and convs also accumulate in
float32 (fp32_dest_acc_en, packer L1 accumulation), at HiFi4 by default (`math_fidelity`); SDPA keeps its
FlashAttention tiles (scores, probabilities, row sums) in bfloat16, which the emulator models.

Memory and program configs: activations live in DRAM, interleaved; each op works out of L1 with an explicit
config sized for Blackhole's 1.5 MB of L1 per core (`_MatmulPlanner` for the ViT matmuls: 2D multicast over a
grid of up to 13x10 cores, K blocks chosen so the circular buffers stay under `L1_BUDGET`; SDPA chunked; each
3x3 conv either wholly in L1 (height- or block-sharded) when its input and output fit a per-core budget, or
DRAM-sliced by rows). `oversize=True` replaces the FFN output matmul's config with one that gives each core
a block of all the rows and the whole of K (circular buffers several times the L1 size): the mock device
must refuse it (the negative check).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

__all__ = ["Formats", "FORMATS", "TtnnGraph", "L1_BYTES", "L1_BUDGET"]

TILE = 32
L1_BYTES = 1536 * 1024  # Blackhole: L1 per Tensix core
L1_BUDGET = 900 * 1024  # what a matmul's circular buffers may take (the rest: other CBs, kernels, halo, margin)
CONV_L1_PER_CORE = 160 * 1024  # a 3x3 conv's input + output per core below which it runs wholly in L1
_TILE_BYTES = {"bfloat16": 2048, "float32": 4096, "bfloat8_b": 1088}


@dataclass(frozen=True)
class Formats:
    """Data formats (ttnn dtype names) of the graph's tensors."""

    vit_weights: str = "bfloat16"      # qkv, attention output, FFN weights of the ViT blocks
    decoder_weights: str = "bfloat16"  # patch embedding, tap projections, decoder convs and 1x1 convs
    activations: str = "bfloat16"      # tensors between ops (matmul / conv outputs, q, k, v, decoder maps)
    residual: str = "float32"          # the ViT residual stream, its layer norms, the level-0 accumulator
    finest: str = "float32"            # the finest (phase-folded) conv outputs, read back by the host

    def __post_init__(self):
        for name in ("vit_weights", "decoder_weights", "activations", "residual", "finest"):
            value = getattr(self, name)
            if value not in _TILE_BYTES:
                raise ValueError(f"Formats.{name}: expected one of {sorted(_TILE_BYTES)}, got {value!r}")
        for name in ("residual", "finest"):
            if getattr(self, name) == "bfloat8_b":
                raise ValueError(f"Formats.{name}: bfloat8_b is for weights and activations only")
        if self.activations == "float32":
            raise ValueError("Formats.activations: ttnn's SDPA takes bfloat16 or bfloat8_b q, k, v, not float32")


# The named format sets. A float32 study of the graph is the emulator's exact mode (tests/ttnn_emulator.py),
# not a format set: SDPA has no float32 inputs on the device.
FORMATS = {
    "bf16": Formats(),
    "bfp8-vit": Formats(vit_weights="bfloat8_b"),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


class _MatmulPlanner:
    """2D-multicast matmul program configs for (M, K) @ (K, N) with DRAM-interleaved operands."""

    def __init__(self, ttnn, grid_x: int, grid_y: int, fp32_acc: bool):
        self.ttnn = ttnn
        self.grid_x, self.grid_y = grid_x, grid_y
        self.max_subblock = 4 if fp32_acc else 8
        self.fp32_acc = fp32_acc

    def cb_bytes(self, per_m: int, per_n: int, in0_block_w: int, in0: str, in1: str, out: str) -> int:
        """Circular buffers of one core: double-buffered in0 and in1 blocks, the output block and, with float32
        accumulation, a float32 partials block."""
        b = 2 * per_m * in0_block_w * _TILE_BYTES[in0] + 2 * in0_block_w * per_n * _TILE_BYTES[in1]
        b += per_m * per_n * _TILE_BYTES[out]
        if self.fp32_acc:
            b += per_m * per_n * _TILE_BYTES["float32"]
        return b

    def config(self, m: int, k: int, n: int, *, in0: str, in1: str, out: str, gelu: bool = False,
               whole_k: bool = False):
        mt, kt, nt = _cdiv(m, TILE), k // TILE, n // TILE
        gx = _largest_divisor(nt, self.grid_x)
        per_n = nt // gx
        per_m = mt if whole_k else _cdiv(mt, self.grid_y)  # whole_k: the oversized negative check
        gy = _cdiv(mt, per_m)
        sub_w = _largest_divisor(per_n, self.max_subblock)
        sub_h = _largest_divisor(per_m, self.max_subblock // sub_w)
        if whole_k:
            block = kt
        else:
            block = 1
            for cand in (8, 4, 2, 1):
                if kt % cand == 0 and self.cb_bytes(per_m, per_n, cand, in0, in1, out) <= L1_BUDGET:
                    block = cand
                    break
        act = self.ttnn.UnaryWithParam(self.ttnn.UnaryOpType.GELU, 0.0) if gelu else None
        return self.ttnn.MatmulMultiCoreReuseMultiCastProgramConfig(
            compute_with_storage_grid_size=self.ttnn.CoreCoord(gx, gy), in0_block_w=block,
            out_subblock_h=sub_h, out_subblock_w=sub_w, per_core_M=per_m, per_core_N=per_n,
            transpose_mcast=False, fused_activation=act)


class TtnnGraph:
    """The fixed-shape MoGe-2 forward on one ttnn device (see the module docstring).

    ttnn: the ttnn module (or a stand-in with the same API). device: an open ttnn device. prepared: a
    `prepare.Prepared`. formats: a `FORMATS` name or a `Formats`. math_fidelity: "hifi4", "hifi2" or "lofi"
    for matmuls, convs and SDPA. oversize: the negative check's deliberately oversized matmul config.
    """

    def __init__(self, ttnn, device, prepared, *, formats: Union[str, Formats] = "bf16",
                 math_fidelity: str = "hifi4", oversize: bool = False):
        if isinstance(formats, str):
            if formats not in FORMATS:
                raise ValueError(f"formats: expected one of {sorted(FORMATS)} or a Formats, got {formats!r}")
            formats = FORMATS[formats]
        fidelities = {"hifi4": "HiFi4", "hifi2": "HiFi2", "lofi": "LoFi"}
        if math_fidelity not in fidelities:
            raise ValueError(f"math_fidelity: expected one of {sorted(fidelities)}, got {math_fidelity!r}")
        self.ttnn = ttnn
        self.device = device
        self.prepared = prepared
        self.plan = prepared.plan
        self.formats = formats
        self.oversize = oversize
        T = ttnn
        self._dt = lambda name: getattr(T, name)
        grid = device.compute_with_storage_grid_size()
        self.grid = (grid.x, grid.y)
        self.num_cores = grid.x * grid.y
        fidelity = getattr(T.MathFidelity, fidelities[math_fidelity])
        arch = device.arch()
        self.ck_matmul = T.init_device_compute_kernel_config(arch, math_fidelity=fidelity, math_approx_mode=False,
                                                             fp32_dest_acc_en=True, packer_l1_acc=True)
        self.ck_norm = T.init_device_compute_kernel_config(arch, math_fidelity=T.MathFidelity.HiFi4,
                                                           math_approx_mode=False, fp32_dest_acc_en=True,
                                                           packer_l1_acc=False)
        self.ck_sdpa = T.init_device_compute_kernel_config(arch, math_fidelity=fidelity, math_approx_mode=False,
                                                           fp32_dest_acc_en=False, packer_l1_acc=False)
        self.dram = T.DRAM_MEMORY_CONFIG
        self._planner = _MatmulPlanner(T, grid.x, grid.y, fp32_acc=True)
        self._program_configs()
        self.w: dict = {}      # device tensors (matmul weights, biases, norms, tables, constant maps)
        self.convs: dict = {}  # conv name -> (weight, bias): host tensors until the first forward prepares them
        self.loaded = False

    # ------------------------------------------------------------------------------------------ configs
    def _program_configs(self) -> None:
        p, f = self.plan, self.formats
        n, c, ffn = p["seq_len"], p["dim"], p["ffn_dim"]
        mm = self._planner.config
        self.pc = {
            "patch": mm(n, p["patch_k_padded"], c, in0=f.activations, in1=f.decoder_weights, out=f.residual),
            "qkv": mm(n, c, 3 * c, in0=f.residual, in1=f.vit_weights, out=f.activations),
            "attn_out": mm(n, c, c, in0=f.activations, in1=f.vit_weights, out=f.residual),
            "ffn_in": mm(n, c, ffn, in0=f.residual, in1=f.vit_weights, out=f.activations, gelu=True),
            "ffn_out": mm(n, ffn, c, in0=f.activations, in1=f.vit_weights, out=f.residual, whole_k=self.oversize),
            "tap": mm(n, c, p["neck_in0_dim"], in0=f.residual, in1=f.decoder_weights, out=f.residual),
        }
        chunk = min(256, _cdiv(n, TILE) * TILE)
        self.sdpa_config = self.ttnn.SDPAProgramConfig(
            compute_with_storage_grid_size=self.ttnn.CoreCoord(*self.grid), q_chunk_size=chunk, k_chunk_size=chunk,
            exp_approx_mode=False)

    def _conv_placement(self, height: int, width: int, c_in: int, c_out: int, out_dtype: str) -> tuple:
        """(shard layout, slice config) of a 3x3 conv: wholly in L1 when its input and output take at most
        CONV_L1_PER_CORE per core (block-sharded for wide inputs, height-sharded otherwise), else DRAM-sliced
        by rows into as many slices as that budget needs."""
        T = self.ttnn
        pixels = height * width
        act = _TILE_BYTES[self.formats.activations] / (TILE * TILE)
        out = _TILE_BYTES[out_dtype] / (TILE * TILE)
        per_core = (pixels * c_in * act + pixels * _cdiv(c_out, TILE) * TILE * out) / self.num_cores
        shard = T.TensorMemoryLayout.BLOCK_SHARDED if c_in > 256 else T.TensorMemoryLayout.HEIGHT_SHARDED
        if per_core <= CONV_L1_PER_CORE:
            return shard, T.Conv2dL1FullSliceConfig
        slices = min(height, _cdiv(int(per_core), CONV_L1_PER_CORE))
        return T.TensorMemoryLayout.HEIGHT_SHARDED, T.Conv2dSliceConfig(slice_type=T.Conv2dDRAMSliceHeight,
                                                                        num_slices=slices)

    # --------------------------------------------------------------------------------------------- load
    def _tensor(self, array: np.ndarray, dtype: str, shape: Optional[tuple] = None, device: bool = True,
                layout=None):
        T = self.ttnn
        a = np.ascontiguousarray(array, dtype=np.float32)
        if shape is not None:
            a = a.reshape(shape)
        layout = T.TILE_LAYOUT if layout is None else layout
        if device:
            return T.Tensor(a, self._dt(dtype), self.device, layout, self.dram)
        return T.Tensor(a, self._dt(dtype), None, layout)

    def load(self, prepare_convs: bool = True) -> None:
        """Upload every weight once. With `prepare_convs`, run one forward on a zero input so that ttnn prepares
        the conv weights on the device (later forwards, and a trace, reuse them)."""
        p, f, a = self.plan, self.formats, self.prepared.arrays
        res, act = f.residual, f.activations
        w = self.w
        w["patch.w"] = self._tensor(a["patch.w"], f.decoder_weights)
        w["token_table"] = self._tensor(a["token_table"], res, (1, 1) + a["token_table"].shape)
        for i in range(p["blocks"]):
            for norm in ("norm1", "norm2"):
                for part in ("w", "b"):
                    key = f"blocks.{i}.{norm}.{part}"
                    w[key] = self._tensor(a[key], res, (1, -1))
            for name in ("qkv", "attn_out", "ffn_in", "ffn_out"):
                key = f"blocks.{i}.{name}"
                w[key + ".w"] = self._tensor(a[key + ".w"], f.vit_weights)
                w[key + ".b"] = self._tensor(a[key + ".b"], act, (1, -1))
        for part in ("w", "b"):
            w[f"final_norm.{part}"] = self._tensor(a[f"final_norm.{part}"], res, (1, -1))
        for k in range(len(p["taps"])):
            w[f"neck_in0.{k}.w"] = self._tensor(a[f"neck_in0.{k}.w"], f.decoder_weights)
        w["neck_in0.const"] = self._tensor(a["neck_in0.const"], res, (1, 1) + a["neck_in0.const"].shape)
        for i in range(1, len(p["levels"]) - 1):
            key = f"neck.const.{i}"
            w[key] = self._tensor(a[key], act, (1, 1) + a[key].shape)
        for key in a:
            if key.endswith(".w") and a[key].ndim == 2 and (key.startswith("neck.") or key.startswith("head.")):
                w[key] = self._tensor(a[key], f.decoder_weights)  # 1x1 convs as matmuls
                w[key[:-2] + ".b"] = self._tensor(a[key[:-2] + ".b"], act, (1, -1))
            elif key.endswith(".w") and a[key].ndim == 4:  # 3x3 convs, conv transposes, the finest fold
                bias = a.get(key[:-2] + ".b")
                self.convs[key[:-2]] = (
                    self._tensor(a[key], "float32", device=False, layout=self.ttnn.ROW_MAJOR_LAYOUT),
                    None if bias is None else self._tensor(bias, "float32", (1, 1, 1, -1), device=False,
                                                           layout=self.ttnn.ROW_MAJOR_LAYOUT))
        self.loaded = True
        if prepare_convs:
            self.forward(self.upload(np.zeros((p["seq_len"], p["patch_k_padded"]), np.float32)))

    def _input_shape(self) -> tuple:
        p = self.plan
        return (1, 1, p["seq_len"], p["patch_k_padded"])

    def host_tensor(self, patches: np.ndarray):
        """The host patch matrix (`prepare.host_input`) as a host ttnn tensor in the input's dtype and layout."""
        shape = self._input_shape()
        if tuple(np.shape(patches)[-2:]) != shape[2:]:
            raise ValueError(f"patches: expected {shape[2:]}, got {np.shape(patches)}")
        return self._tensor(patches, self.formats.activations, shape, device=False)

    def allocate_input(self):
        """A device input tensor to fill with `upload(patches, into=...)` (a persistent buffer, e.g. for a trace)."""
        T = self.ttnn
        return T.allocate_tensor_on_device(T.Shape(list(self._input_shape())), self._dt(self.formats.activations),
                                           T.TILE_LAYOUT, self.device, self.dram)

    def upload(self, patches: np.ndarray, into=None, cq_id: int = 0):
        """The host patch matrix -> the device input (1, 1, seq_len, patch_k_padded): a new tensor, or written
        into `into` (from `allocate_input`) on command queue `cq_id`."""
        T = self.ttnn
        host = self.host_tensor(patches)
        if into is None:
            return T.to_device(host, self.device, memory_config=self.dram)
        T.copy_host_to_device_tensor(host, into, cq_id=cq_id)
        return into

    def input_spec(self) -> dict:
        """Shape, dtype name and layout of the device input."""
        return {"shape": self._input_shape(), "dtype": self.formats.activations, "layout": "TILE", "memory": "DRAM"}

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, x) -> dict:
        """Device input (`upload`) -> {"finest": (1, 1, in_height * in_width, phase_channels) float32 phase maps,
        "cls_token": (1, 1, 1, dim) class token after the final norm}, device tensors."""
        if not self.loaded:
            raise RuntimeError("TtnnGraph.forward before load()")
        level0, cls_token = self.encode(x)
        return {"finest": self.decode(level0), "cls_token": cls_token}

    def encode(self, x) -> tuple:
        """Patch matrix -> (level-0 map (1, 1, rows * cols, d0), class token (1, 1, 1, dim))."""
        T, p, f, w = self.ttnn, self.plan, self.formats, self.w
        res = self._dt(f.residual)
        tokens = T.linear(x, w["patch.w"], program_config=self.pc["patch"], compute_kernel_config=self.ck_matmul,
                          dtype=res, memory_config=self.dram)
        tokens = T.add(tokens, w["token_table"], dtype=res, memory_config=self.dram)
        taps = p["taps"]
        acc, cls_token = None, None
        for i in range(p["blocks"]):
            tokens = self.block(tokens, i)
            if i in taps:
                k = taps.index(i)
                h = T.layer_norm(tokens, weight=w["final_norm.w"], bias=w["final_norm.b"], epsilon=p["final_ln_eps"],
                                 compute_kernel_config=self.ck_norm, memory_config=self.dram)
                y = T.linear(h, w[f"neck_in0.{k}.w"], program_config=self.pc["tap"],
                             compute_kernel_config=self.ck_matmul, dtype=res, memory_config=self.dram)
                if i == taps[-1]:
                    r = p["grid_tokens"]
                    cls_token = T.slice(h, (0, 0, r, 0), (1, 1, r + 1, p["dim"]))
                T.deallocate(h)
                if acc is None:
                    acc = y
                else:
                    summed = T.add(acc, y, dtype=res, memory_config=self.dram)
                    T.deallocate(acc)
                    T.deallocate(y)
                    acc = summed
        T.deallocate(tokens)
        level0 = T.slice(acc, (0, 0, 0, 0), (1, 1, p["grid_tokens"], p["neck_in0_dim"]))
        T.deallocate(acc)
        level0 = T.add(level0, w["neck_in0.const"], dtype=self._dt(f.activations), memory_config=self.dram)
        return level0, cls_token

    def block(self, x, i: int):
        """DINOv2 block i on the residual stream x (1, 1, seq_len, dim) (residual format); returns the new stream."""
        T, p, f, w = self.ttnn, self.plan, self.formats, self.w
        res, act = self._dt(f.residual), self._dt(f.activations)
        n, c = p["seq_len"], p["dim"]
        key = f"blocks.{i}"
        h = T.layer_norm(x, weight=w[key + ".norm1.w"], bias=w[key + ".norm1.b"], epsilon=p["ln_eps"],
                         compute_kernel_config=self.ck_norm, memory_config=self.dram)
        qkv = T.linear(h, w[key + ".qkv.w"], bias=w[key + ".qkv.b"], program_config=self.pc["qkv"],
                       compute_kernel_config=self.ck_matmul, dtype=act, memory_config=self.dram)
        T.deallocate(h)
        q, k, v = T.transformer.split_query_key_value_and_split_heads(
            T.reshape(qkv, (1, n, 3 * c)), num_heads=p["num_heads"], transpose_key=False, memory_config=self.dram)
        T.deallocate(qkv)
        a = T.transformer.scaled_dot_product_attention(
            q, k, v, is_causal=False, scale=1.0, program_config=self.sdpa_config, compute_kernel_config=self.ck_sdpa,
            output_concat_heads=True, memory_config=self.dram)  # (1, 1, n, c); the scale is folded into q
        for t in (q, k, v):
            T.deallocate(t)
        o = T.linear(a, w[key + ".attn_out.w"], bias=w[key + ".attn_out.b"], program_config=self.pc["attn_out"],
                     compute_kernel_config=self.ck_matmul, dtype=res, memory_config=self.dram)
        T.deallocate(a)
        x1 = T.add(x, o, dtype=res, memory_config=self.dram)
        T.deallocate(o)
        T.deallocate(x)
        h = T.layer_norm(x1, weight=w[key + ".norm2.w"], bias=w[key + ".norm2.b"], epsilon=p["ln_eps"],
                         compute_kernel_config=self.ck_norm, memory_config=self.dram)
        g = T.linear(h, w[key + ".ffn_in.w"], bias=w[key + ".ffn_in.b"], program_config=self.pc["ffn_in"],
                     compute_kernel_config=self.ck_matmul, dtype=act, memory_config=self.dram)
        T.deallocate(h)
        o = T.linear(g, w[key + ".ffn_out.w"], bias=w[key + ".ffn_out.b"], program_config=self.pc["ffn_out"],
                     compute_kernel_config=self.ck_matmul, dtype=res, memory_config=self.dram)
        T.deallocate(g)
        x2 = T.add(x1, o, dtype=res, memory_config=self.dram)
        T.deallocate(o)
        T.deallocate(x1)
        return x2

    # ------------------------------------------------------------------------------------------ decoder
    def _matmul1x1(self, x, key: str):
        """A 1x1 conv over (1, 1, pixels, C) as a matmul."""
        T = self.ttnn
        return T.linear(x, self.w[key + ".w"], bias=self.w[key + ".b"], compute_kernel_config=self.ck_matmul,
                        dtype=self._dt(self.formats.activations), memory_config=self.dram)

    def _conv_config(self, shard, relu: bool):
        T = self.ttnn
        return T.Conv2dConfig(weights_dtype=self._dt(self.formats.decoder_weights), shard_layout=shard,
                              padding_mode=T.PaddingMode.Replicate,
                              activation=T.UnaryWithParam(T.UnaryOpType.RELU) if relu else None,
                              deallocate_activation=False, output_layout=T.TILE_LAYOUT)

    def _conv3x3(self, x, key: str, height: int, width: int, relu: bool = False, out_dtype: Optional[str] = None):
        """A replicate-padded 3x3 conv over (1, 1, height * width, C_in) -> (1, 1, height * width, C_out)."""
        T = self.ttnn
        weight, bias = self.convs[key]
        c_out, c_in = self.prepared.arrays[key + ".w"].shape[:2]
        out_dtype = out_dtype or self.formats.activations
        shard, slicing = self._conv_placement(height, width, c_in, c_out, out_dtype)
        y, (h, w_), (weight, bias) = T.conv2d(
            input_tensor=x, weight_tensor=weight, bias_tensor=bias, device=self.device, in_channels=c_in,
            out_channels=c_out, batch_size=1, input_height=height, input_width=width, kernel_size=(3, 3),
            stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, dtype=self._dt(out_dtype),
            conv_config=self._conv_config(shard, relu), compute_config=self.ck_matmul, slice_config=slicing,
            memory_config=self.dram, return_output_dim=True, return_weights_and_bias=True)
        self.convs[key] = (weight, bias)
        return y

    def _upsample(self, x, key: str, height: int, width: int):
        """Conv-transpose 2x2 stride 2, then the resampler's 3x3 conv: (height, width) -> (2 height, 2 width)."""
        T = self.ttnn
        weight, bias = self.convs[key + ".convt"]
        c_in, c_out = self.prepared.arrays[key + ".convt.w"].shape[:2]
        y, (h, w_), (weight, bias) = T.conv_transpose2d(
            input_tensor=x, weight_tensor=weight, bias_tensor=bias, device=self.device, in_channels=c_in,
            out_channels=c_out, batch_size=1, input_height=height, input_width=width, kernel_size=(2, 2),
            stride=(2, 2), padding=(0, 0), output_padding=(0, 0), dilation=(1, 1), groups=1,
            dtype=self._dt(self.formats.activations), conv_config=self._conv_config(None, False),
            compute_config=self.ck_matmul, memory_config=self.dram, return_output_dim=True,
            return_weights_and_bias=True)
        self.convs[key + ".convt"] = (weight, bias)
        z = self._conv3x3(y, key + ".conv", 2 * height, 2 * width)
        T.deallocate(y)
        return z

    def _res_block(self, x, key: str, height: int, width: int):
        """relu -> 3x3 conv (+ fused relu) -> 3x3 conv, plus x (MoGe's residual block without norms)."""
        T = self.ttnn
        y = T.relu(x, memory_config=self.dram)
        z = self._conv3x3(y, key + ".conv1", height, width, relu=True)
        T.deallocate(y)
        y = self._conv3x3(z, key + ".conv2", height, width)
        T.deallocate(z)
        out = T.add(x, y, memory_config=self.dram)
        T.deallocate(y)
        return out

    def _stack_level(self, x, key: str, stack: dict, i: int):
        """Residual blocks of level i of a stack; the level's output (1x1 conv or x itself)."""
        level = self.plan["levels"][i]
        for j in range(stack["res_blocks"][i]):
            x = self._res_block(x, f"{key}.res.{i}.{j}", level["height"], level["width"])
        out = self._matmul1x1(x, f"{key}.out.{i}") if stack["outputs"][i] else x
        return x, out

    def decode(self, level0):
        """Level-0 map -> the finest phase maps (1, 1, in_height * in_width, phase_channels), float32."""
        T, p = self.ttnn, self.plan
        levels = p["levels"]
        last = len(levels) - 1
        x = level0
        neck_out = []
        for i in range(last):
            if i > 0:
                x = T.add(x, self.w[f"neck.const.{i}"], memory_config=self.dram)
            x, out = self._stack_level(x, "neck", p["neck"], i)
            neck_out.append(out)
            if i < last - 1:
                x = self._upsample(x, f"neck.up.{i}", levels[i]["height"], levels[i]["width"])
        fin = p["finest"]
        finest = self._conv3x3(x, "finest.neck", fin["in_height"], fin["in_width"], out_dtype=self.formats.finest)
        for head in p["heads"]:
            name = head["name"]
            key = f"head.{name}"
            h = None
            for i in range(last):
                feature = self._matmul1x1(neck_out[i], f"{key}.in.{i}") if head["inputs"][i] else neck_out[i]
                h = feature if h is None else T.add(h, feature, memory_config=self.dram)
                h, _ = self._stack_level(h, key, head, i)
                if i < last - 1:
                    h = self._upsample(h, f"{key}.up.{i}", levels[i]["height"], levels[i]["width"])
            part = self._conv3x3(h, f"finest.{name}", fin["in_height"], fin["in_width"], out_dtype=self.formats.finest)
            finest = T.add(finest, part, dtype=self._dt(self.formats.finest), memory_config=self.dram)
        return finest

    # --------------------------------------------------------------------------------------------- read
    def to_host(self, t, shape: tuple, cq_id: int = 0) -> np.ndarray:
        """A device tensor -> float32 numpy array of `shape` (its logical values, reshaped), read on command
        queue `cq_id` (blocking)."""
        T = self.ttnn
        h = T.from_device(t, queue_id=cq_id)
        if h.layout != T.ROW_MAJOR_LAYOUT:
            h = T.to_layout(h, T.ROW_MAJOR_LAYOUT)
        if h.dtype != T.float32:
            h = T.to_dtype(h, T.float32)
        return np.asarray(h.to_numpy(), dtype=np.float32).reshape(shape)

    def read(self, outputs: dict, cq_id: int = 0) -> dict:
        """Device outputs of `forward` -> {"finest": (in_height * in_width, phase_channels), "cls_token": (dim,)},
        float32 numpy (what `prepare.host_output` takes), read on command queue `cq_id`."""
        fin = self.plan["finest"]
        shape = (fin["in_height"] * fin["in_width"], fin["phase_channels"])
        return {"finest": self.to_host(outputs["finest"], shape, cq_id),
                "cls_token": self.to_host(outputs["cls_token"], (self.plan["dim"],), cq_id)}

    def describe(self) -> dict:
        return {"formats": self.formats.__dict__, "grid": self.grid, "oversize": self.oversize}
