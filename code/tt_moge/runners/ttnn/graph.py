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

Laid out as tt-metal's model demos are: each network part is an object in its own module that owns its
prepared weights and configs and runs alone, built from a small shared context (`context.Context`: ttnn, the
device and its grid, the formats and configuration, the placement, the compute configs, the matmul planner) and
its own weights, and tested alone against its `network/` module (tests/test_ttnn_part_*.py):
`patch_embed.PatchEmbed` (patch matmul + token table; `network/vit.py`'s `PatchEmbed` and embeddings),
`vit_block.VitBlock` (one DINOv2 block; `Block`), `encoder.Encoder` (the patch embedding, the blocks and the taps;
`network/moge2.py`'s encoder), `decoder.Neck` / `heads.Head` (a conv stack's coarse levels: residual blocks,
upsamples, 1x1 convs; `network/convstack.py`'s `ConvStack`), `heads.FinestConv` (the phase-folded finest conv of
one feature map), the convs of all of them run by one shared `decoder.Convs`. `TtnnGraph` builds them from a
`prepare.Prepared` and strings them together (`forward`). `tiles.py` holds the tile sizes they share.

What runs on the device, in order (the folds come from `folding.fold` through `prepare.py`):

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
  and tap matmuls at HiFi2), SDPA at LoFi in the chunks that leave the busiest core the least work
  (`vit_block.sdpa_chunks`), with the approximate exp; the decoder's convs are chained in L1, height-sharded, each
  conv's output feeding the next conv, ReLU and residual add where it lies (no round trip through DRAM, no resharding
  between ops), at LoFi with their weights rounded like the ViT's (HiFi2 at the two coarsest levels and their
  resamplers, HiFi4 at the finest level); the level-0 upsamples are matmuls and a pixel shuffle; the finest maps are
  untilized on the device. Where a token budget's maps would not fit L1, the encoder or the decoder falls back to DRAM
  (`context.placement`). Why each choice, and the accuracy it keeps (measured in the fidelity-aware emulator) and the
  time it buys (the cost model, `cost.py`), are in docs/tenstorrent.md.
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
(`context.MatmulPlanner` for the ViT matmuls: 2D multicast over a grid of up to 13x10 cores, K blocks chosen so the
circular buffers stay under `L1_BUDGET`; SDPA chunked; in the safe graph each 3x3 conv either wholly in L1
(height- or block-sharded) when its input and output fit a per-core budget, or DRAM-sliced by rows).
`oversize=True` replaces the FFN output matmul's config with one that gives each core a block of all the rows
and the whole of K (circular buffers several times the L1 size): the mock device must refuse it (the
negative check).
"""

from __future__ import annotations

from typing import Union

import numpy as np

from .context import (
    CONFIGS,
    DECODER_L1_MAP,
    ENCODER_L1_LIVE,
    FORMATS,
    L1_BUDGET,
    L1_BYTES,
    LOFI_WEIGHT_BITS,
    SDPA_SCORE_TILES,
    Context,
    Formats,
    GraphConfig,
    round_significant,
    to_host,
)
from .decoder import Convs, Neck, stack_weights
from .encoder import Encoder
from .heads import FinestConv, Head

__all__ = [
    "Formats",
    "FORMATS",
    "GraphConfig",
    "CONFIGS",
    "TtnnGraph",
    "L1_BYTES",
    "L1_BUDGET",
    "ENCODER_L1_LIVE",
    "DECODER_L1_MAP",
    "SDPA_SCORE_TILES",
    "LOFI_WEIGHT_BITS",
    "round_significant",
    "level0_folds",
]


def level0_folds(plan: dict) -> dict:
    """Chained decoder: the level-0 upsamples run as matmul + pixel shuffle (`ConvStack.upsample0`): {stack key:
    whether the stack's level-0 input 1x1 conv is folded into it}. A head whose level 0 is only that 1x1 conv (no
    residual blocks, no output conv: MoGe-2's structure) reads the neck's level-0 map through one matmul."""
    folds = {"neck": False}
    for head in plan["heads"]:
        folds[f"head.{head['name']}"] = head["inputs"][0] and head["res_blocks"][0] == 0 and not head["outputs"][0]
    return folds


class TtnnGraph:
    """The fixed-shape MoGe-2 forward on one ttnn device (see the module docstring): the parts built from a
    prepared network and strung together.

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
        self.prepared, self.plan, self.oversize = prepared, prepared.plan, oversize
        self.ctx = ctx = Context.for_plan(ttnn, device, self.plan, formats, config)
        p, a = self.plan, prepared.arrays
        fin = p["finest"]
        self.encoder = Encoder(ctx, prepared, oversize=oversize)
        self.convs = Convs(ctx, fin["in_height"])
        folds = level0_folds(p) if ctx.chained else {}

        def stack(cls, key: str, plan: dict):
            return cls(
                ctx,
                self.convs,
                key,
                stack_weights(a, key),
                plan,
                p["levels"],
                grid_tokens=p["grid_tokens"],
                level0_fold=folds.get(key),
            )

        self.neck = stack(Neck, "neck", p["neck"])
        self.heads = [stack(Head, f"head.{h['name']}", h) for h in p["heads"]]
        self.finest = {
            name: FinestConv(ctx, self.convs, a[f"finest.{name}.w"], fin["in_height"], fin["in_width"])
            for name in ["neck"] + [h["name"] for h in p["heads"]]
        }
        self.finest_tiles = False  # True: keep the finest maps in tiles for the device output side (post.py)
        self.loaded = False

    # the shared context, as the graph's own (the runner, the mock check and the tests read these)
    @property
    def ttnn(self):
        return self.ctx.ttnn

    @ttnn.setter
    def ttnn(self, module) -> None:  # the mock check's queue log wraps it for a while
        self.ctx.ttnn = module

    device = property(lambda self: self.ctx.device)
    formats = property(lambda self: self.ctx.formats)
    config = property(lambda self: self.ctx.config)
    grid = property(lambda self: self.ctx.grid)
    num_cores = property(lambda self: self.ctx.num_cores)
    encoder_in_l1 = property(lambda self: self.ctx.encoder_in_l1)
    chained = property(lambda self: self.ctx.chained)

    def parts(self) -> list:
        """Every part that holds device weights."""
        return [self.encoder, self.neck, *self.heads]

    def tensors(self) -> list:
        """The device tensors of every part's weights (the runner frees them on close)."""
        return [t for part in self.parts() for t in part.tensors()]

    def program_configs(self) -> dict:
        """Every explicit matmul program config of the parts, by "part.name"."""
        e = self.encoder
        configs = {"patch_embed": e.patch_embed.program_config, "tap": e.tap_config}
        for i, block in enumerate(e.blocks):
            configs.update({f"blocks.{i}.{k}": v for k, v in block.program_configs.items()})
        for stack in [self.neck, *self.heads]:
            configs.update({f"{stack.key}.{k}": v for k, v in stack.program_configs.items()})
        return configs

    # --------------------------------------------------------------------------------------------- load
    def load(self, prepare_convs: bool = True) -> None:
        """Upload every part's weights once. With `prepare_convs`, run one forward on a zero input so that ttnn
        prepares the conv weights on the device (later forwards, and a trace, reuse them)."""
        for part in self.parts():
            part.load()
        self.loaded = True
        if prepare_convs:
            p = self.plan
            self.forward(self.upload(np.zeros((p["seq_len"], p["patch_k_padded"]), np.float32)))

    def _input_shape(self) -> tuple:
        p = self.plan
        return (1, 1, p["seq_len"], p["patch_k_padded"])

    def host_tensor(self, patches: np.ndarray):
        """The host patch matrix (`prepare.host_input`) as a host ttnn tensor in the input's dtype and layout."""
        shape = self._input_shape()
        if tuple(np.shape(patches)[-2:]) != shape[2:]:
            raise ValueError(f"patches: expected {shape[2:]}, got {np.shape(patches)}")
        return self.ctx.tensor(patches, self.formats.activations, shape, device=False)

    def upload(self, patches: np.ndarray):
        """The host patch matrix -> the device input (1, 1, seq_len, patch_k_padded), a new device tensor. The
        reference path (the tests, the conv preparation in `load`); the runner's input, written into one
        persistent tensor per trace, is the canvas (`pre.DeviceInput.upload`)."""
        return self.ttnn.to_device(self.host_tensor(patches), self.device, memory_config=self.ctx.dram)

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
        return self.encoder.forward(x)

    def decode(self, level0):
        """Level-0 map -> the finest phase maps (1, 1, in_height * in_width, phase_channels), float32: the neck's
        levels, each head's levels, the finest conv of each feature map, summed. Consumes level0: every map is
        freed as soon as nothing reads it (the neck's level outputs after the last head)."""
        T, chained = self.ttnn, self.chained
        x, neck_out = self.neck.forward(level0)
        finest = self.finest["neck"].forward(x)
        if x is not neck_out[-1]:
            T.deallocate(x)
        if chained:
            finest = T.reallocate(finest)
        for head in self.heads:
            h = head.forward(neck_out)
            part = self.finest[head.plan["name"]].forward(h)
            if h is not neck_out[-1]:
                T.deallocate(h)
            summed = self.convs.add(finest, part, dtype=self.ctx.dt(self.formats.finest))
            T.deallocate(finest)
            T.deallocate(part)
            finest = summed
            if chained:  # the head's maps are gone: the accumulator moved up, under the neck's maps
                finest = T.reallocate(finest)
        for t in {id(t): t for t in neck_out}.values():  # level0 too, when it is the neck's level-0 output
            T.deallocate(t)
        if self.config.output == "rows" and not self.finest_tiles:  # untilized on the device: the host reads rows
            rows = T.untilize(finest, memory_config=self.ctx.dram)
            T.deallocate(finest)
            finest = rows
        elif chained:
            moved = T.to_memory_config(finest, self.ctx.dram)
            T.deallocate(finest)
            finest = moved
        return finest

    # --------------------------------------------------------------------------------------------- read
    def to_host(self, t, shape: tuple, cq_id: int = 0) -> np.ndarray:
        """A device tensor -> float32 numpy array of `shape` (its logical values, reshaped), read on command
        queue `cq_id` (blocking)."""
        return to_host(self.ttnn, t, shape, cq_id)

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
