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

Laid out as tt-metal's model demos are: this module holds the formats, the configurations, the plan (program
configs, placement), the weights' upload and the forward that strings the parts together; each network part
runs in its own module, mixed into `TtnnGraph` and reading the state it sets up, each tested against its
`network/` module (tests/test_ttnn_parts.py): `patch_embed.py` (patch matmul + token table; `network/vit.py`'s
`PatchEmbed` and embeddings), `vit_block.py` (one DINOv2 block; `Block`), `encoder.py` (the blocks and the taps;
`network/moge2.py`'s encoder), `decoder.py` (a conv stack's level: residual blocks, upsample, 1x1 convs; the
neck; `network/convstack.py`), `heads.py` (a head's levels and the finest folded conv). `tiles.py` holds the
tile sizes they share.

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

from .decoder import Decoder
from .encoder import Encoder
from .heads import Heads
from .patch_embed import PatchEmbed
from .prepare import convt_as_matmul
from .tiles import TILE
from .tiles import TILE_BYTES as _TILE_BYTES  # the names the bodies have always used
from .tiles import cdiv as _cdiv
from .vit_block import VitBlock

__all__ = ["Formats", "FORMATS", "GraphConfig", "CONFIGS", "TtnnGraph", "L1_BYTES", "L1_BUDGET"]

L1_BYTES = 1536 * 1024  # Blackhole: L1 per Tensix core
L1_BUDGET = 900 * 1024  # what a matmul's circular buffers may take (the rest: other CBs, kernels, halo, margin)
ENCODER_L1_LIVE = 400 * 1024  # "l1" placement: the encoder's live activations per core above which they go to DRAM
DECODER_L1_MAP = 160 * 1024  # "chained" decoder: one finest-level map per core above which the decoder is sliced
SDPA_SCORE_TILES = 150  # sdpa_even: query x key tiles of a chunk pair (10 x 15 and 5 x 29 fit at 11x10, 9 x 29 not)
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


class TtnnGraph(PatchEmbed, VitBlock, Encoder, Decoder, Heads):
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

    def decode(self, level0):
        """Level-0 map -> the finest phase maps (1, 1, in_height * in_width, phase_channels), float32. Consumes
        level0: every map is freed as soon as nothing reads it (the neck's level outputs after the last head)."""
        T, p = self.ttnn, self.plan
        x, neck_out = self.neck_levels(level0)
        finest = self.finest_conv(x, "neck")
        if x is not neck_out[-1]:
            T.deallocate(x)
        if self.chained:
            finest = T.reallocate(finest)
        for head in p["heads"]:
            h = self.head_levels(neck_out, head)
            part = self.finest_conv(h, head["name"])
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
