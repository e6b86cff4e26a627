"""The MoGe-2 forward as a ttnn graph: the device part of the Tenstorrent runner.

numpy and an injected `ttnn` module only (the real one, or the torch emulator of the tests); never imports
torch or ttnn itself, so the same code runs on a chip, on the mock P150 (Python 3.12, no torch) and in the
numerics tests.

    graph = TtnnGraph(ttnn, device, Prepared.load("vitl-1920x1080-1800.npz"))
    graph.load()                                    # weights to the device once; conv weights prepared
    x = graph.upload(host_input(plan, canvas_hwc))  # (seq_len, patch_k_padded) patch matrix
    out = graph.forward(x)                          # device tensors: finest phase maps, class token
    raw = host_output(prepared, graph.read(out))    # numpy raw maps at the canvas

The runner does not use the host steps around it: `pre.DeviceInput` makes the patch matrix from the canvas on
the device and `post.DeviceOutput` turns the finest maps into the raw maps on the device (set `finest_tiles`
so that `decode` leaves its output in tiles for it); `host_input` / `host_output` remain the references.

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
  (neck and each head), summed, 4 x (3 + 3 + 1) channels in float32. The output side (`post.py`, on the
  device in the runner; `prepare.host_output` on the host) interleaves the phases, adds the constant map,
  resizes to the canvas and applies the output activations; the host runs
  the scale MLP on the class token.

Formats (`FORMATS`, `Formats`) say what precision each tensor is stored in; configurations (`CONFIGS`,
`GraphConfig`) say everything else: where activations live, the math fidelity of each kind of op, SDPA's
chunks and exp, how the decoder runs. Two are named:

* "fast" (the default). The encoder keeps every activation in L1 (interleaved over all cores' L1: the residual
  stream, layer norms and adds never touch DRAM), its 1024-wide matmuls use the whole grid (uneven per-core blocks),
  qkv, the attention projection and the MLP run at LoFi with their weights rounded to the bits LoFi reads (the patch
  and tap matmuls at HiFi2), SDPA at LoFi in the chunks that leave the busiest core the least work (`_sdpa_chunks`),
  with the approximate exp; the decoder's convs are chained in L1, height-sharded, each conv's output feeding the next
  conv, ReLU and residual add where it lies (no round trip through DRAM, no resharding between ops), at LoFi with
  their weights rounded like the ViT's (HiFi4 at the finest level); the level-0 upsamples are matmuls and a pixel
  shuffle; the finest maps are untilized on the device. Where a token budget's maps would not fit L1, the encoder or
  the decoder falls back to DRAM (`TtnnGraph._placement`). Why each choice, and the accuracy it keeps (measured in
  the fidelity-aware emulator) and the time it buys (the cost model, `cost.py`), are in docs/tenstorrent.md.
* "safe": the first graph that ran on the mock: every activation in DRAM, HiFi4 everywhere, exact exp, each
  conv placed on its own (in L1 when small, else DRAM-sliced by rows). Slower, simpler, and the switch back
  ($MOGE_TTNN_GRAPH=safe) where a choice of "fast" cannot be checked without silicon.

Formats: weights in bfloat16 by default, bfloat8_b for the ViT's matmul weights as the named "bfp8-vit" option;
activations between ops in bfloat16 (SDPA takes nothing wider).

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
The cost is twice the bytes of each (seq_len, dim) residual tensor. Matmuls and convs accumulate in float32
(fp32_dest_acc_en, packer L1 accumulation); SDPA keeps its FlashAttention tiles (scores, probabilities, row
sums) in bfloat16, which the emulator models.

Program configs: each op works out of L1 with an explicit config sized for Blackhole's 1.5 MB of L1 per core
(`_MatmulPlanner` for the ViT matmuls: 2D multicast over a grid of up to 13x10 cores, K blocks chosen so the
circular buffers stay under `L1_BUDGET`; SDPA chunked; in the safe graph each 3x3 conv either wholly in L1
(height- or block-sharded) when its input and output fit a per-core budget, or DRAM-sliced by rows).
`oversize=True` replaces the FFN output matmul's config with one that gives each core a block of all the rows
and the whole of K (circular buffers several times the L1 size): the mock device must refuse it (the
negative check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from .prepare import convt_as_matmul

__all__ = ["Formats", "FORMATS", "GraphConfig", "CONFIGS", "TtnnGraph", "L1_BYTES", "L1_BUDGET"]

TILE = 32
L1_BYTES = 1536 * 1024  # Blackhole: L1 per Tensix core
L1_BUDGET = 900 * 1024  # what a matmul's circular buffers may take (the rest: other CBs, kernels, halo, margin)
CONV_L1_PER_CORE = 160 * 1024  # safe graph: a 3x3 conv's input + output per core below which it runs wholly in L1
ENCODER_L1_LIVE = 400 * 1024  # "l1" placement: the encoder's live activations per core above which they go to DRAM
DECODER_L1_MAP = 160 * 1024  # "chained" decoder: one finest-level map per core above which the decoder is sliced
CONV_WEIGHTS_PER_CORE = 384 * 1024  # chained decoder: a height-sharded conv's weights (all of them, on every core)
CONV_WINDOW_BUDGET = 128 * 1024  # chained decoder: a conv's im2col block (act_block_h rows x kh kw C_in values)
SDPA_SCORE_TILES = 150  # sdpa_even: query x key tiles of a chunk pair (10 x 15 and 5 x 29 fit at 11x10, 9 x 29 not)
_TILE_BYTES = {"bfloat16": 2048, "float32": 4096, "bfloat8_b": 1088}
_FIDELITIES = {"hifi4": "HiFi4", "hifi3": "HiFi3", "hifi2": "HiFi2", "lofi": "LoFi"}


@dataclass(frozen=True)
class Formats:
    """Data formats (ttnn dtype names) of the graph's tensors."""

    vit_weights: str = "bfloat16"  # qkv, attention output, FFN weights of the ViT blocks
    decoder_weights: str = "bfloat16"  # patch embedding, tap projections, decoder convs and 1x1 convs
    activations: str = "bfloat16"  # tensors between ops (matmul / conv outputs, q, k, v, decoder maps)
    residual: str = "float32"  # the ViT residual stream, its layer norms, the level-0 accumulator
    finest: str = "float32"  # the finest (phase-folded) conv outputs, read back by the host
    decoder_activations: str = ""  # the decoder's maps from level 1 on ("": as `activations`)

    @property
    def decoder_maps(self) -> str:
        return self.decoder_activations or self.activations

    def __post_init__(self):
        if self.decoder_activations and self.decoder_activations not in _TILE_BYTES:
            raise ValueError(
                f"Formats.decoder_activations: expected one of {sorted(_TILE_BYTES)} or '', "
                f"got {self.decoder_activations!r}"
            )
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
    "bfp8-decoder": Formats(decoder_weights="bfloat8_b"),
    "bfp8": Formats(vit_weights="bfloat8_b", decoder_weights="bfloat8_b"),
    "bf16-residual": Formats(residual="bfloat16"),  # the residual-stream study (docs/tenstorrent.md)
}


@dataclass(frozen=True)
class GraphConfig:
    """Everything about the device graph but its data formats (see the module docstring).

    placement: "dram" (every activation in DRAM, interleaved) or "l1" (the encoder's activations in L1,
    interleaved, where they fit; the decoder's as its decoder mode says). decoder: "sliced" (each 3x3 conv placed
    on its own, DRAM in and out) or "chained" (L1 height-sharded from conv to conv, where the maps fit).
    Fidelities: "hifi4", "hifi2", "lofi" for the attention projections (qkv, attention output), the patch and tap
    matmuls (tap_fidelity; "": as the attention's), the MLP, SDPA, the decoder's convs and 1x1 convs of the coarse
    levels, those of the finest level with the phase-folded finest conv, and the layer norms. whole_grid: matmul
    blocks that need not divide the tile counts, so that a 1024-wide matmul uses 11-13 columns instead of 8. output:
    "tiles" (the finest maps read back in tile layout, untilized by the host) or "rows" (untilized on the device).
    sdpa_q_chunk, sdpa_k_chunk: SDPA's query and key chunks (tokens), or with sdpa_even their largest sizes, the
    chunks then planned from the grid (`TtnnGraph._sdpa_chunks`). round_lofi_weights: the weights of a matmul run at
    LoFi are rounded to nearest at the 5 significant bits LoFi's one pass reads of them (`round_significant`), so
    that the pass's cut toward zero loses nothing more (an unbiased error half as large as the cut's).
    """

    placement: str = "dram"
    decoder: str = "sliced"
    attention_fidelity: str = "hifi4"
    tap_fidelity: str = ""
    mlp_fidelity: str = "hifi4"
    sdpa_fidelity: str = "hifi4"
    decoder_fidelity: str = "hifi4"
    finest_fidelity: str = "hifi4"
    norm_fidelity: str = "hifi4"
    sdpa_q_chunk: int = 256
    sdpa_k_chunk: int = 256
    sdpa_even: bool = False
    sdpa_exp_approx: bool = False
    round_lofi_weights: bool = True
    whole_grid: bool = False
    output: str = "tiles"

    def __post_init__(self):
        choices = {"placement": ("dram", "l1"), "decoder": ("sliced", "chained"), "output": ("tiles", "rows")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GraphConfig.{name}: expected one of {list(allowed)}, got {getattr(self, name)!r}")
        for name in ("attention", "tap", "mlp", "sdpa", "decoder", "finest", "norm"):
            value = getattr(self, name + "_fidelity") or (self.attention_fidelity if name == "tap" else "")
            if value not in _FIDELITIES:
                raise ValueError(f"GraphConfig.{name}_fidelity: expected one of {sorted(_FIDELITIES)}, got {value!r}")
        for name in ("sdpa_q_chunk", "sdpa_k_chunk"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0 and value % TILE == 0):
                raise ValueError(f"GraphConfig.{name}: expected a positive multiple of {TILE}, got {value!r}")


CONFIGS = {
    "safe": GraphConfig(),
    "fast": GraphConfig(
        placement="l1",
        decoder="chained",
        attention_fidelity="lofi",
        tap_fidelity="hifi2",
        mlp_fidelity="lofi",
        sdpa_fidelity="lofi",
        decoder_fidelity="lofi",
        finest_fidelity="hifi4",
        norm_fidelity="hifi4",
        sdpa_q_chunk=512,
        sdpa_k_chunk=1024,
        sdpa_even=True,
        sdpa_exp_approx=True,
        whole_grid=True,
        output="rows",
    ),
}


LOFI_WEIGHT_BITS = 5  # the significant bits of the weights (SrcA) that LoFi's one matrix-engine pass reads


def round_significant(a: np.ndarray, bits: int) -> np.ndarray:
    """float32 values rounded to nearest (ties to even) at `bits` significant bits, the implicit one included."""
    i = np.array(a, dtype=np.float32).view(np.int32)  # a copy, as its bits: sign, exponent, 23 mantissa bits
    shift = 24 - bits  # the mantissa bits dropped
    i += (1 << (shift - 1)) - 1 + ((i >> shift) & 1)  # half an ulp (ties to even); a carry moves up the exponent
    i &= ~np.int32((1 << shift) - 1)
    return i.view(np.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


class _MatmulPlanner:
    """2D-multicast matmul program configs for (M, K) @ (K, N) with interleaved operands. whole_grid: per-core
    blocks of ceil(tiles / grid) (the last row or column of cores has fewer), else N's block divides its tiles."""

    def __init__(self, ttnn, grid_x: int, grid_y: int, fp32_acc: bool, whole_grid: bool = False):
        self.ttnn = ttnn
        self.grid_x, self.grid_y = grid_x, grid_y
        self.max_subblock = 4 if fp32_acc else 8
        self.fp32_acc = fp32_acc
        self.whole_grid = whole_grid

    def cb_bytes(self, per_m: int, per_n: int, in0_block_w: int, in0: str, in1: str, out: str) -> int:
        """Circular buffers of one core: double-buffered in0 and in1 blocks, the output block and, with float32
        accumulation, a float32 partials block."""
        b = 2 * per_m * in0_block_w * _TILE_BYTES[in0] + 2 * in0_block_w * per_n * _TILE_BYTES[in1]
        b += per_m * per_n * _TILE_BYTES[out]
        if self.fp32_acc:
            b += per_m * per_n * _TILE_BYTES["float32"]
        return b

    def config(
        self, m: int, k: int, n: int, *, in0: str, in1: str, out: str, gelu: bool = False, whole_k: bool = False
    ):
        mt, kt, nt = _cdiv(m, TILE), k // TILE, n // TILE
        if self.whole_grid:
            per_n = _cdiv(nt, self.grid_x)
            gx = _cdiv(nt, per_n)
        else:
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
            compute_with_storage_grid_size=self.ttnn.CoreCoord(gx, gy),
            in0_block_w=block,
            out_subblock_h=sub_h,
            out_subblock_w=sub_w,
            per_core_M=per_m,
            per_core_N=per_n,
            transpose_mcast=False,
            fused_activation=act,
        )


class TtnnGraph:
    """The fixed-shape MoGe-2 forward on one ttnn device (see the module docstring).

    ttnn: the ttnn module (or a stand-in with the same API). device: an open ttnn device. prepared: a
    `prepare.Prepared`. formats: a `FORMATS` name or a `Formats`. config: a `CONFIGS` name or a `GraphConfig`.
    oversize: the negative check's deliberately oversized matmul config.
    """

    def __init__(
        self,
        ttnn,
        device,
        prepared,
        *,
        formats: Union[str, Formats] = "bf16",
        config: Union[str, GraphConfig] = "fast",
        oversize: bool = False,
    ):
        if isinstance(formats, str):
            if formats not in FORMATS:
                raise ValueError(f"formats: expected one of {sorted(FORMATS)} or a Formats, got {formats!r}")
            formats = FORMATS[formats]
        if isinstance(config, str):
            if config not in CONFIGS:
                raise ValueError(f"config: expected one of {sorted(CONFIGS)} or a GraphConfig, got {config!r}")
            config = CONFIGS[config]
        self.ttnn = ttnn
        self.device = device
        self.prepared = prepared
        self.plan = prepared.plan
        self.formats = formats
        self.config = config
        self.oversize = oversize
        T = ttnn
        self._dt = lambda name: getattr(T, name)
        grid = device.compute_with_storage_grid_size()
        self.grid = (grid.x, grid.y)
        self.num_cores = grid.x * grid.y
        self.dram = T.DRAM_MEMORY_CONFIG
        self.encoder_in_l1, self.chained = self._placement()
        # chained decoder: stack key -> whether its level-0 input 1x1 conv is folded into the level-0 upsample
        self.level0_folds = dict(self._level0_folds()) if self.chained else {}
        self.act_mem = T.L1_MEMORY_CONFIG if self.encoder_in_l1 else T.DRAM_MEMORY_CONFIG
        arch = device.arch()

        def compute(fidelity: str, fp32: bool = True, l1_acc: bool = True):
            return T.init_device_compute_kernel_config(
                arch,
                math_fidelity=getattr(T.MathFidelity, _FIDELITIES[fidelity]),
                math_approx_mode=False,
                fp32_dest_acc_en=fp32,
                packer_l1_acc=l1_acc,
            )

        c = config
        self.ck_attention = compute(c.attention_fidelity)
        self.ck_tap = compute(c.tap_fidelity or c.attention_fidelity)
        self.ck_mlp = compute(c.mlp_fidelity)
        self.ck_decoder = compute(c.decoder_fidelity)
        self.ck_finest = compute(c.finest_fidelity)
        self.ck_norm = compute(c.norm_fidelity, l1_acc=False)
        self.ck_sdpa = compute(c.sdpa_fidelity, fp32=False, l1_acc=False)
        self._planner = _MatmulPlanner(T, grid.x, grid.y, fp32_acc=True, whole_grid=c.whole_grid)
        self._program_configs()
        self.w: dict = {}  # device tensors (matmul weights, biases, norms, tables, constant maps)
        self.convs: dict = {}  # conv name -> (weight, bias): host tensors until the first forward prepares them
        self.conv_shapes: dict = {}  # conv name -> its weight's shape as prepared (OIHW; IOHW for conv transposes)
        self._shardings: dict = {}  # chained decoder: (height, width) -> (core grid, shard rows), `_level_sharding`
        self.finest_tiles = False  # True: keep the finest maps in tiles for the device output side (post.py)
        self.loaded = False

    # ------------------------------------------------------------------------------------------ configs
    def _placement(self) -> tuple:
        """(encoder activations in L1, decoder chained in L1): what the config asks, where it fits. Both sizes
        follow the token budget, not the canvas: the encoder's live tensors at the MLP (two residual-stream
        tensors, the MLP's hidden map, the tap accumulator) must leave each core room for the matmuls'
        circular buffers; the chained decoder holds several maps of the finest level it convolves."""
        p, f = self.plan, self.formats
        seq = _cdiv(p["seq_len"], TILE) * TILE
        res, act = _TILE_BYTES[f.residual] / TILE**2, _TILE_BYTES[f.activations] / TILE**2
        live = seq * (3 * p["dim"] * res + p["ffn_dim"] * act) / self.num_cores
        fin = p["finest"]
        finest_map = fin["in_height"] * fin["in_width"] * p["levels"][-2]["dim"] * 2 / self.num_cores
        return (
            self.config.placement == "l1" and live <= ENCODER_L1_LIVE,
            self.config.decoder == "chained" and finest_map <= DECODER_L1_MAP,
        )

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
        q_chunk, k_chunk = self._sdpa_chunks()
        self.sdpa_config = self.ttnn.SDPAProgramConfig(
            compute_with_storage_grid_size=self.ttnn.CoreCoord(*self.grid),
            q_chunk_size=q_chunk,
            k_chunk_size=k_chunk,
            exp_approx_mode=self.config.sdpa_exp_approx,
        )

    def _sdpa_chunks(self) -> tuple:
        """SDPA's (query chunk, key chunk) in tokens. ttnn's SDPA gives each head grid_cores // heads cores and
        splits the head's query chunks over them (ceil(chunks / cores) each); every query chunk then runs against
        every key chunk, the last one padded, and rescales its running output once per key chunk after the first.
        With sdpa_even the pair is the one that leaves the busiest core the least work: its query tiles (at best
        ceil(tiles / cores per head)) times the padded key tiles, plus a row of tiles per rescale; ties go to the
        fewest passes over the keys (one per query chunk). When q, k, v live in DRAM the fewest passes come first:
        each pass reads the keys and values again from DRAM on every core. Within sdpa_q_chunk / sdpa_k_chunk and a
        score block of at most SDPA_SCORE_TILES tiles (what the kernel's circular buffers hold beside the
        L1-resident encoder). ViT-L's 58 tiles: two key chunks of 29 tiles (no padding, one rescale) and query
        chunks of 4 / 3 / 5 tiles at 13x10 / 12x10 / 11x10 (8 / 9 / 10 tiles a core, as even as the split allows),
        where one query chunk a core and 480-token key chunks cost 60 key tiles and three rescales. Else the
        configured sizes, at most the sequence."""
        cfg = self.config
        tiles = _cdiv(self.plan["seq_len"], TILE)
        q_max, k_max = max(1, cfg.sdpa_q_chunk // TILE), max(1, cfg.sdpa_k_chunk // TILE)
        if not cfg.sdpa_even:
            return min(q_max, tiles) * TILE, min(k_max, tiles) * TILE
        per_head = min(tiles, max(1, self.num_cores // self.plan["num_heads"]))
        best = None
        for k_tiles in range(1, min(k_max, tiles) + 1):
            k_chunks = _cdiv(tiles, k_tiles)
            for q_tiles in range(1, min(q_max, tiles) + 1):
                if q_tiles * k_tiles > SDPA_SCORE_TILES and (q_tiles, k_tiles) != (1, 1):
                    continue
                passes = _cdiv(_cdiv(tiles, q_tiles), per_head)  # the busiest core's query chunks
                work = passes * q_tiles * (k_chunks * k_tiles + k_chunks - 1)
                key = (work, passes) if self.encoder_in_l1 else (passes, work)
                if best is None or key + (-q_tiles,) < best[0]:
                    best = (key + (-q_tiles,), q_tiles, k_tiles)
        return best[1] * TILE, best[2] * TILE

    def _conv_placement(self, height: int, width: int, c_in: int, c_out: int, out_dtype: str) -> tuple:
        """Safe graph: (shard layout, slice config) of a 3x3 conv: wholly in L1 when its input and output take at
        most CONV_L1_PER_CORE per core (block-sharded for wide inputs, height-sharded otherwise), else DRAM-sliced
        by rows into as many slices as that budget needs. Chained decoder: height-sharded, wholly in L1."""
        T = self.ttnn
        if self.chained:  # height-sharded: every core holds all the weights; block-sharded when they are large
            weights = 9 * _cdiv(c_in, TILE) * _cdiv(c_out, TILE) * _TILE_BYTES[self.formats.decoder_weights]
            wide = weights > CONV_WEIGHTS_PER_CORE
            return (
                T.TensorMemoryLayout.BLOCK_SHARDED if wide else T.TensorMemoryLayout.HEIGHT_SHARDED,
                T.Conv2dL1FullSliceConfig,
            )
        pixels = height * width
        act = _TILE_BYTES[self.formats.activations] / (TILE * TILE)
        out = _TILE_BYTES[out_dtype] / (TILE * TILE)
        per_core = (pixels * c_in * act + pixels * _cdiv(c_out, TILE) * TILE * out) / self.num_cores
        shard = T.TensorMemoryLayout.BLOCK_SHARDED if c_in > 256 else T.TensorMemoryLayout.HEIGHT_SHARDED
        if per_core <= CONV_L1_PER_CORE:
            return shard, T.Conv2dL1FullSliceConfig
        slices = min(height, _cdiv(int(per_core), CONV_L1_PER_CORE))
        return T.TensorMemoryLayout.HEIGHT_SHARDED, T.Conv2dSliceConfig(
            slice_type=T.Conv2dDRAMSliceHeight, num_slices=slices
        )

    # --------------------------------------------------------------------------------------------- load
    def _tensor(self, array: np.ndarray, dtype: str, shape: Optional[tuple] = None, device: bool = True, layout=None):
        T = self.ttnn
        a = np.ascontiguousarray(array, dtype=np.float32)
        if shape is not None:
            a = a.reshape(shape)
        layout = T.TILE_LAYOUT if layout is None else layout
        if device:
            return T.Tensor(a, self._dt(dtype), self.device, layout, self.dram)
        return T.Tensor(a, self._dt(dtype), None, layout)

    def _host_conv(self, key: str, weight: np.ndarray, bias: Optional[np.ndarray]) -> None:
        """A conv's weights, float32 numpy until its first forward (`_conv_weights`)."""
        self.conv_shapes[key] = tuple(np.shape(weight))
        self.convs[key] = (np.asarray(weight, np.float32), None if bias is None else np.asarray(bias, np.float32))

    def _conv_weights(self, key: str, height: int) -> tuple:
        """A conv's (weight, bias) for ttnn.conv2d at a level of `height` rows: on its first forward, host float32
        row-major tensors (ttnn prepares them on the device and returns them for the next forwards), the weights
        rounded to what LoFi reads when the level runs at LoFi (`_matmul_weights`)."""
        T = self.ttnn
        weight, bias = self.convs[key]
        if isinstance(weight, np.ndarray):
            weight = self._matmul_weights(self._level_fidelity(height))(weight)
            weight = self._tensor(weight, "float32", device=False, layout=T.ROW_MAJOR_LAYOUT)
            if bias is not None:
                bias = self._tensor(bias, "float32", (1, 1, 1, -1), device=False, layout=T.ROW_MAJOR_LAYOUT)
        return weight, bias

    def load(self, prepare_convs: bool = True) -> None:
        """Upload every weight once. With `prepare_convs`, run one forward on a zero input so that ttnn prepares
        the conv weights on the device (later forwards, and a trace, reuse them)."""
        p, f, a = self.plan, self.formats, self.prepared.arrays
        res, act = f.residual, f.activations
        w = self.w
        c = self.config
        attention, mlp = self._matmul_weights(c.attention_fidelity), self._matmul_weights(c.mlp_fidelity)
        tap = self._matmul_weights(c.tap_fidelity or c.attention_fidelity)
        w["patch.w"] = self._tensor(tap(a["patch.w"]), f.decoder_weights)
        w["token_table"] = self._tensor(a["token_table"], res, (1, 1) + a["token_table"].shape)
        for i in range(p["blocks"]):
            for norm in ("norm1", "norm2"):
                for part in ("w", "b"):
                    key = f"blocks.{i}.{norm}.{part}"
                    w[key] = self._tensor(a[key], res, (1, -1))
            for name in ("qkv", "attn_out", "ffn_in", "ffn_out"):
                key = f"blocks.{i}.{name}"
                weights = mlp if name.startswith("ffn") else attention
                w[key + ".w"] = self._tensor(weights(a[key + ".w"]), f.vit_weights)
                w[key + ".b"] = self._tensor(a[key + ".b"], act, (1, -1))
        for part in ("w", "b"):
            w[f"final_norm.{part}"] = self._tensor(a[f"final_norm.{part}"], res, (1, -1))
        for k in range(len(p["taps"])):
            w[f"neck_in0.{k}.w"] = self._tensor(tap(a[f"neck_in0.{k}.w"]), f.decoder_weights)
        w["neck_in0.const"] = self._tensor(a["neck_in0.const"], res, (1, 1) + a["neck_in0.const"].shape)
        for i in range(1, len(p["levels"]) - 1):
            key = f"neck.const.{i}"
            w[key] = self._tensor(a[key], act, (1, 1) + a[key].shape)
        for key in a:
            if key.endswith(".w") and a[key].ndim == 2 and (key.startswith("neck.") or key.startswith("head.")):
                name = key[:-2]
                if self.chained and not name.endswith(".0"):  # 1x1 convs on sharded maps: conv2d's own
                    self._host_conv(name, a[key].T[:, :, None, None], a[name + ".b"])
                elif not (name.endswith(".in.0") and self.level0_folds.get(name[: -len(".in.0")])):
                    # 1x1 convs as matmuls (the folded level-0 input convs live in the upsample's weights)
                    w[key] = self._tensor(self._matmul_weights(c.decoder_fidelity)(a[key]), f.decoder_weights)
                    w[name + ".b"] = self._tensor(a[name + ".b"], act, (1, -1))
                    if self.chained:  # on the level-0 map (the token grid), with an explicit config
                        self.pc[name] = self._planner.config(
                            p["grid_tokens"],
                            *a[key].shape,
                            in0=f.activations,
                            in1=f.decoder_weights,
                            out=f.activations,
                        )
            elif key.endswith(".w") and a[key].ndim == 4:  # 3x3 convs, conv transposes, the finest fold
                self._host_conv(key[:-2], a[key], a.get(key[:-2] + ".b"))
        if self.chained:
            self._load_level0_upsamples()
        self.loaded = True
        if prepare_convs:
            self.forward(self.upload(np.zeros((p["seq_len"], p["patch_k_padded"]), np.float32)))

    def _matmul_weights(self, fidelity: str):
        """The host-side treatment of the weights of matmuls run at `fidelity`: rounded to what LoFi reads
        (`GraphConfig.round_lofi_weights`), else as they are."""
        if fidelity == "lofi" and self.config.round_lofi_weights:
            return lambda array: round_significant(array, LOFI_WEIGHT_BITS)
        return lambda array: array

    def _level0_folds(self) -> list:
        """Chained decoder: the level-0 upsamples run as matmul + pixel shuffle (`_upsample0`): (stack key, whether
        the stack's level-0 input 1x1 conv is folded into it). A head whose level 0 is only that 1x1 conv (no
        residual blocks, no output conv: MoGe-2's structure) reads the neck's level-0 map through one matmul."""
        p = self.plan
        folds = [("neck", False)]
        for head in p["heads"]:
            plain = head["inputs"][0] and head["res_blocks"][0] == 0 and not head["outputs"][0]
            folds.append((f"head.{head['name']}", plain))
        return folds

    def _load_level0_upsamples(self) -> None:
        a, f = self.prepared.arrays, self.formats
        for key, fold in self.level0_folds.items():
            before = (a[f"{key}.in.0.w"], a[f"{key}.in.0.b"]) if fold else None
            w, b = convt_as_matmul(a[f"{key}.up.0.convt.w"], a[f"{key}.up.0.convt.b"], before)
            self.w[f"{key}.up0.w"] = self._tensor(
                self._matmul_weights(self.config.decoder_fidelity)(w), f.decoder_weights
            )
            self.w[f"{key}.up0.b"] = self._tensor(b, f.activations, (1, -1))
            c_in, c_out = w.shape[0], w.shape[1] // 4
            self.pc[f"{key}.up0"] = self._planner.config(
                self.plan["grid_tokens"], c_in, 4 * c_out, in0=f.activations, in1=f.decoder_weights, out=f.activations
            )

    def _input_shape(self) -> tuple:
        p = self.plan
        return (1, 1, p["seq_len"], p["patch_k_padded"])

    def host_tensor(self, patches: np.ndarray):
        """The host patch matrix (`prepare.host_input`) as a host ttnn tensor in the input's dtype and layout."""
        shape = self._input_shape()
        if tuple(np.shape(patches)[-2:]) != shape[2:]:
            raise ValueError(f"patches: expected {shape[2:]}, got {np.shape(patches)}")
        return self._tensor(patches, self.formats.activations, shape, device=False)

    def upload(self, patches: np.ndarray):
        """The host patch matrix -> the device input (1, 1, seq_len, patch_k_padded), a new device tensor. The
        reference path (the tests, the conv preparation in `load`); the runner's input, written into one
        persistent tensor per trace, is the canvas (`pre.DeviceInput.upload`)."""
        return self.ttnn.to_device(self.host_tensor(patches), self.device, memory_config=self.dram)

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
        res, mem = self._dt(f.residual), self.act_mem
        tokens = T.linear(
            x,
            w["patch.w"],
            program_config=self.pc["patch"],
            compute_kernel_config=self.ck_tap,
            dtype=res,
            memory_config=mem,
        )
        embedded = T.add(tokens, w["token_table"], dtype=res, memory_config=mem)
        T.deallocate(tokens)
        tokens = embedded
        taps = p["taps"]
        acc, cls_token = None, None
        for i in range(p["blocks"]):
            tokens = self.block(tokens, i)
            if i in taps:
                k = taps.index(i)
                h = T.layer_norm(
                    tokens,
                    weight=w["final_norm.w"],
                    bias=w["final_norm.b"],
                    epsilon=p["final_ln_eps"],
                    compute_kernel_config=self.ck_norm,
                    memory_config=mem,
                )
                y = T.linear(
                    h,
                    w[f"neck_in0.{k}.w"],
                    program_config=self.pc["tap"],
                    compute_kernel_config=self.ck_tap,
                    dtype=res,
                    memory_config=mem,
                )
                if i == taps[-1]:
                    r = p["grid_tokens"]
                    cls_token = T.slice(h, (0, 0, r, 0), (1, 1, r + 1, p["dim"]), memory_config=self.dram)
                T.deallocate(h)
                if acc is None:
                    acc = y
                else:
                    summed = T.add(acc, y, dtype=res, memory_config=mem)
                    T.deallocate(acc)
                    T.deallocate(y)
                    acc = summed
        T.deallocate(tokens)
        rows = T.slice(acc, (0, 0, 0, 0), (1, 1, p["grid_tokens"], p["neck_in0_dim"]), memory_config=mem)
        T.deallocate(acc)
        level0 = T.add(
            rows, w["neck_in0.const"], dtype=self._dt(f.activations), memory_config=mem if self.chained else self.dram
        )
        T.deallocate(rows)
        return level0, cls_token

    def block(self, x, i: int):
        """DINOv2 block i on the residual stream x (1, 1, seq_len, dim) (residual format); returns the new stream."""
        T, p, f, w = self.ttnn, self.plan, self.formats, self.w
        res, act, mem = self._dt(f.residual), self._dt(f.activations), self.act_mem
        n, c = p["seq_len"], p["dim"]
        key = f"blocks.{i}"
        h = T.layer_norm(
            x,
            weight=w[key + ".norm1.w"],
            bias=w[key + ".norm1.b"],
            epsilon=p["ln_eps"],
            compute_kernel_config=self.ck_norm,
            memory_config=mem,
        )
        qkv = T.linear(
            h,
            w[key + ".qkv.w"],
            bias=w[key + ".qkv.b"],
            program_config=self.pc["qkv"],
            compute_kernel_config=self.ck_attention,
            dtype=act,
            memory_config=mem,
        )
        T.deallocate(h)
        q, k, v = T.transformer.split_query_key_value_and_split_heads(
            T.reshape(qkv, (1, n, 3 * c)), num_heads=p["num_heads"], transpose_key=False, memory_config=mem
        )
        T.deallocate(qkv)
        a = T.transformer.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=False,
            scale=1.0,
            program_config=self.sdpa_config,
            compute_kernel_config=self.ck_sdpa,
            output_concat_heads=True,
            memory_config=mem,
        )  # (1, 1, n, c); the scale is folded into q
        for t in (q, k, v):
            T.deallocate(t)
        o = T.linear(
            a,
            w[key + ".attn_out.w"],
            bias=w[key + ".attn_out.b"],
            program_config=self.pc["attn_out"],
            compute_kernel_config=self.ck_attention,
            dtype=res,
            memory_config=mem,
        )
        T.deallocate(a)
        x1 = T.add(x, o, dtype=res, memory_config=mem)
        T.deallocate(o)
        T.deallocate(x)
        h = T.layer_norm(
            x1,
            weight=w[key + ".norm2.w"],
            bias=w[key + ".norm2.b"],
            epsilon=p["ln_eps"],
            compute_kernel_config=self.ck_norm,
            memory_config=mem,
        )
        g = T.linear(
            h,
            w[key + ".ffn_in.w"],
            bias=w[key + ".ffn_in.b"],
            program_config=self.pc["ffn_in"],
            compute_kernel_config=self.ck_mlp,
            dtype=act,
            memory_config=mem,
        )
        T.deallocate(h)
        o = T.linear(
            g,
            w[key + ".ffn_out.w"],
            bias=w[key + ".ffn_out.b"],
            program_config=self.pc["ffn_out"],
            compute_kernel_config=self.ck_mlp,
            dtype=res,
            memory_config=mem,
        )
        T.deallocate(g)
        x2 = T.add(x1, o, dtype=res, memory_config=mem)
        T.deallocate(o)
        T.deallocate(x1)
        return x2

    # ------------------------------------------------------------------------------------------ decoder
    def _matmul1x1(self, x, key: str):
        """A 1x1 conv over (1, 1, pixels, C) as a matmul (the safe graph's, and the heads' level-0 inputs)."""
        T = self.ttnn
        return T.linear(
            x,
            self.w[key + ".w"],
            bias=self.w[key + ".b"],
            program_config=self.pc.get(key),  # set at load in the chained decoder; else ttnn chooses
            compute_kernel_config=self.ck_decoder,
            dtype=self._dt(self.formats.activations),
            memory_config=self.act_mem if self.chained else self.dram,
        )

    def _conv_config(self, shard, relu: bool, act_block_h: int = 0, core_grid=None):
        T = self.ttnn
        extra = {} if core_grid is None else {"core_grid": core_grid, "override_sharding_config": True}
        return T.Conv2dConfig(
            weights_dtype=self._dt(self.formats.decoder_weights),
            shard_layout=shard,
            padding_mode=T.PaddingMode.Replicate,
            activation=T.UnaryWithParam(T.UnaryOpType.RELU) if relu else None,
            deallocate_activation=False,
            output_layout=T.TILE_LAYOUT,
            act_block_h_override=act_block_h,
            **extra,
        )

    def _level_sharding(self, height: int, width: int) -> tuple:
        """Chained decoder: (core grid, shard rows) that every map of this size shares (so that adds, ReLUs and
        the next conv take each other's outputs as they lie): height-sharded, the shard a whole number of tiles,
        chosen among the heights near pixels / cores for one with a large divisor (the act blocks must divide
        it: `_act_block_h`)."""
        key = (height, width)
        if key not in self._shardings:
            tiles = _cdiv(height * width, TILE)
            least = _cdiv(tiles, self.num_cores)
            candidates = range(least, max(least, int(least * 1.3)) + 1)
            shard = min(candidates, key=lambda s: s * (1 + 1 / max(d for d in range(1, min(s, 8) + 1) if s % d == 0)))
            cores = _cdiv(tiles, shard)
            grid = self.ttnn.num_cores_to_corerangeset(cores, self.ttnn.CoreCoord(*self.grid), True)
            self._shardings[key] = (grid, shard * TILE)
        return self._shardings[key]

    @staticmethod
    def _act_block_h(rows: int, window: int) -> int:
        """The largest act block (rows, a multiple of 32 dividing the shard's rows) whose im2col block of `window`
        values per row (kh kw C_in, bfloat16) fits CONV_WINDOW_BUDGET: the default (all the shard's rows) needs
        more L1 than a chained level leaves."""
        best = TILE
        for h in range(TILE, rows + 1, TILE):
            if rows % h == 0 and h * window * 2 <= CONV_WINDOW_BUDGET:
                best = h
        return best

    def _conv(self, x, key: str, height: int, width: int, relu: bool = False, out_dtype: Optional[str] = None):
        """A replicate-padded 3x3 conv (or a 1x1 conv, by the weight's shape) over (1, 1, height * width, C_in)
        -> (1, 1, height * width, C_out): DRAM in and out in the safe graph, L1 height-sharded when chained."""
        T = self.ttnn
        weight, bias = self._conv_weights(key, height)
        c_out, c_in, _, k = self.conv_shapes[key]
        out_dtype = out_dtype or self.formats.decoder_maps
        shard, slicing = self._conv_placement(height, width, c_in, c_out, out_dtype)
        if self.chained and shard == T.TensorMemoryLayout.HEIGHT_SHARDED:
            grid, rows = self._level_sharding(height, width)
            config = self._conv_config(shard, relu, self._act_block_h(rows, k * k * c_in), grid)
        else:
            config = self._conv_config(shard, relu)
        y, (h, w_), (weight, bias) = T.conv2d(
            input_tensor=x,
            weight_tensor=weight,
            bias_tensor=bias,
            device=self.device,
            in_channels=c_in,
            out_channels=c_out,
            batch_size=1,
            input_height=height,
            input_width=width,
            kernel_size=(k, k),
            stride=(1, 1),
            padding=(k // 2, k // 2),
            dilation=(1, 1),
            groups=1,
            dtype=self._dt(out_dtype),
            conv_config=config,
            compute_config=self._level_compute(height),
            slice_config=slicing,
            memory_config=None if self.chained else self.dram,
            return_output_dim=True,
            return_weights_and_bias=True,
        )
        self.convs[key] = (weight, bias)
        return y

    def _level_fidelity(self, height: int) -> str:
        """The fidelity of a conv at a decoder level: the finest level's (the one the phase-folded finest conv
        reads) `finest_fidelity`, the coarser ones' `decoder_fidelity`."""
        finest = height == self.plan["finest"]["in_height"]
        return self.config.finest_fidelity if finest else self.config.decoder_fidelity

    def _level_compute(self, height: int):
        """The compute config of a conv at a decoder level (`_level_fidelity`)."""
        return self.ck_finest if height == self.plan["finest"]["in_height"] else self.ck_decoder

    def _upsample(self, x, key: str, height: int, width: int):
        """Conv-transpose 2x2 stride 2, then the resampler's 3x3 conv: (height, width) -> (2 height, 2 width)."""
        T = self.ttnn
        weight, bias = self._conv_weights(key + ".convt", 2 * height)
        c_in, c_out = self.conv_shapes[key + ".convt"][:2]
        config = self._conv_config(None, False)
        if self.chained:  # on the next level's cores, as its maps are (conv_transpose2d shards its output)
            grid, rows = self._level_sharding(2 * height, 2 * width)
            config = self._conv_config(
                T.TensorMemoryLayout.HEIGHT_SHARDED, False, self._act_block_h(rows, 4 * c_in), grid
            )
        y, (h, w_), (weight, bias) = T.conv_transpose2d(
            input_tensor=x,
            weight_tensor=weight,
            bias_tensor=bias,
            device=self.device,
            in_channels=c_in,
            out_channels=c_out,
            batch_size=1,
            input_height=height,
            input_width=width,
            kernel_size=(2, 2),
            stride=(2, 2),
            padding=(0, 0),
            output_padding=(0, 0),
            dilation=(1, 1),
            groups=1,
            dtype=self._dt(self.formats.decoder_maps),
            conv_config=config,
            compute_config=self._level_compute(2 * height),
            memory_config=None if self.chained else self.dram,
            return_output_dim=True,
            return_weights_and_bias=True,
        )
        self.convs[key + ".convt"] = (weight, bias)
        z = self._conv(y, key + ".conv", 2 * height, 2 * width)
        T.deallocate(y)
        if self.chained and 2 * height == self.plan["finest"]["in_height"]:
            # the finest level's map was placed below y (still live then): moved up, out of the next convs' buffers
            z = T.reallocate(z)
        return z

    def _upsample0(self, x, key: str):
        """Chained decoder, level 0 -> 1: the conv transpose as a matmul to the four output phases (with the
        stack's input 1x1 conv folded in where `_level0_folds` says so), a pixel shuffle (untilize, permute), then
        the resampler's 3x3 conv. A 4x cheaper matmul than conv_transpose2d's (which convolves the zero-stuffed
        map) and no sharded 1024-channel map, whose conv circular buffers would not fit beside the encoder's."""
        T, lv = self.ttnn, self.plan["levels"]
        rows, cols = lv[0]["height"], lv[0]["width"]
        y = T.linear(
            x,
            self.w[key + ".up0.w"],
            bias=self.w[key + ".up0.b"],
            program_config=self.pc[key + ".up0"],
            compute_kernel_config=self.ck_decoder,
            dtype=self._dt(self.formats.activations),
            memory_config=self.act_mem,
        )
        c = y.shape[-1] // 4
        z = T.untilize(y, memory_config=self.act_mem)
        T.deallocate(y)
        z = T.reshape(z, (rows, cols, 2, 2 * c))  # (i, j, a, (b, c))
        s = T.permute(z, (0, 2, 1, 3), memory_config=self.act_mem)  # (i, a, j, (b, c)): rows of the upsampled map
        T.deallocate(z)
        s = T.reshape(s, (1, 1, 4 * rows * cols, c))
        out = self._conv(s, key + ".up.0.conv", 2 * rows, 2 * cols)
        T.deallocate(s)
        return out

    def _level_up(self, x, key: str, i: int):
        """Level i -> i + 1 of a stack: `_upsample0` from the chained decoder's level 0, else `_upsample`."""
        level = self.plan["levels"][i]
        if self.chained and i == 0:
            return self._upsample0(x, key)
        return self._upsample(x, f"{key}.up.{i}", level["height"], level["width"])

    def _add_const(self, x, key: str):
        """x + the constant map `key` (kept in DRAM: read once per forward beats holding a full map in L1)."""
        return self._add(x, self.w[key])

    def _add(self, a, b, dtype=None):
        T = self.ttnn
        if self.chained:
            return T.add(a, b, dtype=dtype, memory_config=a.memory_config())
        return T.add(a, b, dtype=dtype, memory_config=self.dram)

    def _res_block(self, x, key: str, height: int, width: int):
        """relu -> 3x3 conv (+ fused relu) -> 3x3 conv, plus x (MoGe's residual block without norms)."""
        T = self.ttnn
        y = T.relu(x, memory_config=x.memory_config() if self.chained else self.dram)
        z = self._conv(y, key + ".conv1", height, width, relu=True)
        T.deallocate(y)
        y = self._conv(z, key + ".conv2", height, width)
        T.deallocate(z)
        out = self._add(x, y)
        T.deallocate(y)
        return out

    def _stack_level(self, x, key: str, stack: dict, i: int, owned: bool = True):
        """Residual blocks of level i of a stack, each freeing its input (a chained level's maps hold L1; the
        first input only if `owned`), and the level's output (1x1 conv or x itself)."""
        level = self.plan["levels"][i]
        for j in range(stack["res_blocks"][i]):
            y = self._res_block(x, f"{key}.res.{i}.{j}", level["height"], level["width"])
            if owned or j:
                self.ttnn.deallocate(x)
            x = y
        out = self._one_by_one(x, f"{key}.out.{i}", i) if stack["outputs"][i] else x
        return x, out

    def _one_by_one(self, x, key: str, level: int):
        """A 1x1 conv at `level`: a matmul on the level-0 map (and everywhere in the safe graph), else conv2d on
        the sharded map."""
        if not self.chained or level == 0:
            return self._matmul1x1(x, key)
        size = self.plan["levels"][level]
        return self._conv(x, key, size["height"], size["width"])

    def decode(self, level0):
        """Level-0 map -> the finest phase maps (1, 1, in_height * in_width, phase_channels), float32. Consumes
        level0: every map is freed as soon as nothing reads it (the neck's level outputs after the last head)."""
        T, p = self.ttnn, self.plan
        levels = p["levels"]
        last = len(levels) - 1
        x = level0
        neck_out = []
        for i in range(last):
            if i > 0:
                y = self._add_const(x, f"neck.const.{i}")
                T.deallocate(x)
                x = y
            x, out = self._stack_level(x, "neck", p["neck"], i)
            if self.chained and i > 0 and out is x:  # kept for the heads: moved up, out of the way of what follows
                x = out = T.reallocate(x)
            neck_out.append(out)
            if i < last - 1:
                y = self._level_up(x, "neck", i)
                if x is not out:
                    T.deallocate(x)
                x = y
        fin = p["finest"]
        finest = self._conv(x, "finest.neck", fin["in_height"], fin["in_width"], out_dtype=self.formats.finest)
        if x is not neck_out[-1]:
            T.deallocate(x)
        if self.chained:
            finest = T.reallocate(finest)
        for head in p["heads"]:
            key = f"head.{head['name']}"
            h = None  # the head's map, or one of neck_out (then not ours to free)
            for i in range(last):
                if i == 0 and self.level0_folds.get(key):  # the level-0 input conv is inside the upsample's matmul
                    h = self._upsample0(neck_out[0], key)
                    continue
                feature = self._one_by_one(neck_out[i], f"{key}.in.{i}", i) if head["inputs"][i] else neck_out[i]
                if h is None:
                    h = feature
                else:
                    summed = self._add(h, feature)
                    for t in (h, feature):
                        if t is not neck_out[i]:
                            T.deallocate(t)
                    h = summed
                h, _ = self._stack_level(h, key, head, i, owned=h is not neck_out[i])
                if i < last - 1:
                    up = self._level_up(h, key, i)
                    if h is not neck_out[i]:
                        T.deallocate(h)
                    h = up
            part = self._conv(
                h,
                f"finest.{head['name']}",
                fin["in_height"],
                fin["in_width"],
                out_dtype=self.formats.finest,
            )
            if h is not neck_out[-1]:
                T.deallocate(h)
            summed = self._add(finest, part, dtype=self._dt(self.formats.finest))
            T.deallocate(finest)
            T.deallocate(part)
            finest = summed
            if self.chained:  # the head's maps are gone: the accumulator moved up, under the neck's maps
                finest = T.reallocate(finest)
        for t in {id(t): t for t in neck_out}.values():  # level0 too, when it is the neck's level-0 output
            T.deallocate(t)
        if self.config.output == "rows" and not self.finest_tiles:  # untilized on the device: the host reads rows
            rows = T.untilize(finest, memory_config=self.dram)
            T.deallocate(finest)
            finest = rows
        elif self.chained:
            moved = T.to_memory_config(finest, self.dram)
            T.deallocate(finest)
            finest = moved
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
        return {
            "finest": self.to_host(outputs["finest"], shape, cq_id),
            "cls_token": self.to_host(outputs["cls_token"], (self.plan["dim"],), cq_id),
        }

    def describe(self) -> dict:
        return {
            "formats": self.formats.__dict__,
            "config": self.config.__dict__,
            "grid": self.grid,
            "encoder_in_l1": self.encoder_in_l1,
            "decoder_chained": self.chained,
            "oversize": self.oversize,
        }
