"""The shared context of the device graph's parts: what every part (`patch_embed`, `vit_block`, `encoder`,
`decoder`, `heads`) needs and none owns. tt-metal's demos pass such a context in (device, grid, compute configs)
rather than have the parts inherit it: a part is built from its context and its own weights, and runs alone.

* `Formats` / `FORMATS`: what precision each kind of tensor is stored in; `GraphConfig` / `CONFIGS`: everything
  else (placement, fidelities, SDPA's chunks, the decoder's mode); see `graph.py` for the two named graphs.
* `Context`: the ttnn module, the device and its grid, the formats and configuration, where the encoder's
  activations live and whether the decoder is chained in L1 (`placement`, from the token budget), the compute
  kernel configs of each kind of op (`ck_*`), the matmul planner, and the helpers every part uses to make its
  device tensors (`tensor`, `matmul_weights`).
* `MatmulPlanner`: explicit 2D-multicast matmul program configs sized to Blackhole's L1.

numpy and an injected `ttnn` module only, as the rest of the device graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .tiles import TILE
from .tiles import TILE_BYTES as _TILE_BYTES
from .tiles import cdiv as _cdiv

__all__ = [
    "CONFIGS",
    "Context",
    "DECODER_L1_MAP",
    "ENCODER_L1_LIVE",
    "FORMATS",
    "Formats",
    "GraphConfig",
    "L1_BUDGET",
    "L1_BYTES",
    "LOFI_WEIGHT_BITS",
    "MatmulPlanner",
    "SDPA_SCORE_TILES",
    "placement",
    "round_significant",
    "to_host",
]

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
    chunks then planned from the grid (`vit_block.sdpa_chunks`). round_lofi_weights: the weights of a matmul run at
    LoFi are rounded to nearest at the 5 significant bits LoFi's one pass reads of them (`round_significant`), so
    that the pass's cut toward zero loses nothing more (an unbiased error half as large as the cut's).
    coarse_fidelity, coarse_levels: the fidelity of the decoder's steps at its `coarse_levels` coarsest levels (their
    residual blocks, 1x1 convs and the resampler to the next level; "": decoder_fidelity): small maps, where LoFi's
    error is largest and a higher fidelity costs least.
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
    coarse_fidelity: str = ""
    coarse_levels: int = 0

    def __post_init__(self):
        choices = {"placement": ("dram", "l1"), "decoder": ("sliced", "chained"), "output": ("tiles", "rows")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GraphConfig.{name}: expected one of {list(allowed)}, got {getattr(self, name)!r}")
        for name in ("attention", "tap", "mlp", "sdpa", "decoder", "finest", "norm"):
            value = getattr(self, name + "_fidelity") or (self.attention_fidelity if name == "tap" else "")
            if value not in _FIDELITIES:
                raise ValueError(f"GraphConfig.{name}_fidelity: expected one of {sorted(_FIDELITIES)}, got {value!r}")
        if self.coarse_fidelity and self.coarse_fidelity not in _FIDELITIES:
            got = self.coarse_fidelity
            raise ValueError(f"GraphConfig.coarse_fidelity: expected one of {sorted(_FIDELITIES)} or '', got {got!r}")
        if not (isinstance(self.coarse_levels, int) and self.coarse_levels >= 0):
            raise ValueError(f"GraphConfig.coarse_levels: expected an int >= 0, got {self.coarse_levels!r}")
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
        coarse_fidelity="hifi2",  # the decoder's two coarsest levels and their resamplers (issue 47: a level's 0.02)
        coarse_levels=2,
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


class MatmulPlanner:
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


def placement(plan: dict, formats: Formats, config: GraphConfig, num_cores: int) -> tuple:
    """(encoder activations in L1, decoder chained in L1): what the config asks, where it fits. Both sizes follow the
    token budget, not the canvas: the encoder's live tensors at the MLP (two residual-stream tensors, the MLP's hidden
    map, the tap accumulator) must leave each core room for the matmuls' circular buffers; the chained decoder holds
    several maps of the finest level it convolves."""
    p, f = plan, formats
    seq = _cdiv(p["seq_len"], TILE) * TILE
    res, act = _TILE_BYTES[f.residual] / TILE**2, _TILE_BYTES[f.activations] / TILE**2
    live = seq * (3 * p["dim"] * res + p["ffn_dim"] * act) / num_cores
    fin = p["finest"]
    finest_map = fin["in_height"] * fin["in_width"] * p["levels"][-2]["dim"] * 2 / num_cores
    return (
        config.placement == "l1" and live <= ENCODER_L1_LIVE,
        config.decoder == "chained" and finest_map <= DECODER_L1_MAP,
    )


class Context:
    """What the parts share (see the module docstring). `encoder_in_l1`, `chained`: the placement (`placement`);
    `Context.for_plan` works it out from a prepared plan."""

    def __init__(self, ttnn, device, formats: Formats, config: GraphConfig, *, encoder_in_l1: bool, chained: bool):
        T = ttnn
        self.ttnn, self.device, self.formats, self.config = ttnn, device, formats, config
        grid = device.compute_with_storage_grid_size()
        self.grid = (grid.x, grid.y)
        self.num_cores = grid.x * grid.y
        self.dram = T.DRAM_MEMORY_CONFIG
        self.encoder_in_l1, self.chained = encoder_in_l1, chained
        self.act_mem = T.L1_MEMORY_CONFIG if encoder_in_l1 else T.DRAM_MEMORY_CONFIG  # the encoder's activations
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
        self.ck_coarse = compute(c.coarse_fidelity or c.decoder_fidelity)
        self.ck_finest = compute(c.finest_fidelity)
        self.ck_norm = compute(c.norm_fidelity, l1_acc=False)
        self.ck_sdpa = compute(c.sdpa_fidelity, fp32=False, l1_acc=False)
        self.planner = MatmulPlanner(T, grid.x, grid.y, fp32_acc=True, whole_grid=c.whole_grid)

    @classmethod
    def for_plan(cls, ttnn, device, plan: dict, formats: Formats, config: GraphConfig) -> "Context":
        """The context of a graph for `plan` (a `prepare.Prepared` plan): its placement worked out from the token
        budget and the device's grid."""
        grid = device.compute_with_storage_grid_size()
        encoder_in_l1, chained = placement(plan, formats, config, grid.x * grid.y)
        return cls(ttnn, device, formats, config, encoder_in_l1=encoder_in_l1, chained=chained)

    def dt(self, name: str):
        """The ttnn dtype of a format name ("bfloat16", "float32", "bfloat8_b")."""
        return getattr(self.ttnn, name)

    def tensor(self, array: np.ndarray, dtype: str, shape: Optional[tuple] = None, device: bool = True, layout=None):
        """A float32 numpy array as a ttnn tensor in format `dtype` (reshaped to `shape`), tiled unless `layout`
        says otherwise, on the device in DRAM (or on the host with `device=False`)."""
        T = self.ttnn
        a = np.ascontiguousarray(array, dtype=np.float32)
        if shape is not None:
            a = a.reshape(shape)
        layout = T.TILE_LAYOUT if layout is None else layout
        if device:
            return T.Tensor(a, self.dt(dtype), self.device, layout, self.dram)
        return T.Tensor(a, self.dt(dtype), None, layout)

    def matmul_weights(self, fidelity: str):
        """The host-side treatment of the weights of matmuls run at `fidelity`: rounded to what LoFi reads
        (`GraphConfig.round_lofi_weights`), else as they are."""
        if fidelity == "lofi" and self.config.round_lofi_weights:
            return lambda array: round_significant(array, LOFI_WEIGHT_BITS)
        return lambda array: array


def to_host(ttnn, t, shape: tuple, cq_id: int = 0) -> np.ndarray:
    """A device tensor -> float32 numpy array of `shape` (its logical values, reshaped), read on command queue
    `cq_id` (blocking)."""
    T = ttnn
    h = T.from_device(t, queue_id=cq_id)
    if h.layout != T.ROW_MAJOR_LAYOUT:
        h = T.to_layout(h, T.ROW_MAJOR_LAYOUT)
    if h.dtype != T.float32:
        h = T.to_dtype(h, T.float32)
    return np.asarray(h.to_numpy(), dtype=np.float32).reshape(shape)
