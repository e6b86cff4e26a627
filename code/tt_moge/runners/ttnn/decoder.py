"""The conv decoder's levels on the device (`network/convstack.py`'s `ConvStack` levels: `ResidualConvBlock`, the
resamplers, the 1x1 input / output convs), for the neck (`Neck`) and, through `heads.py`, each head; channels-last
(1, 1, H*W, C) tiles: constant uv maps added, residual blocks (ReLU, 3x3 conv with fused ReLU, 3x3 conv, add),
2x2 stride-2 conv-transpose resamplers followed by 3x3 convs (the level-0 one as a matmul and a pixel shuffle in
the chained decoder), 1x1 convs as matmuls (or conv2d on sharded maps). Every 3x3 conv pads by edge replication,
as MoGe does (ttnn's `PaddingMode.Replicate`).

Three kinds of object:

* `Convs`: how the decoder runs a conv (placement, configs, the level's fidelity), shared by the neck, the heads
  and the finest fold: in the chained decoder every map of one size shares one height sharding (`sharding`), so
  that adds, ReLUs and the next conv take each other's outputs as they lie;
* `Conv`: one conv's weights, which ttnn prepares on the device on its first forward;
* `ConvStack` (and `Neck`): a conv stack's coarse levels, built from the shared context, the `Convs` and the
  stack's own weights (`prepare.stack_arrays` of one `ConvStack`), which it owns.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .prepare import convt_as_matmul
from .tiles import TILE
from .tiles import TILE_BYTES as _TILE_BYTES
from .tiles import cdiv as _cdiv

__all__ = [
    "Conv",
    "Convs",
    "ConvStack",
    "Neck",
    "CONV_L1_PER_CORE",
    "CONV_WEIGHTS_PER_CORE",
    "CONV_WINDOW_BUDGET",
    "stack_weights",
]

CONV_L1_PER_CORE = 160 * 1024  # safe graph: a 3x3 conv's input + output per core below which it runs wholly in L1
CONV_WEIGHTS_PER_CORE = 384 * 1024  # chained decoder: a height-sharded conv's weights (all of them, on every core)
CONV_WINDOW_BUDGET = 128 * 1024  # chained decoder: a conv's im2col block (act_block_h rows x kh kw C_in values)


def stack_weights(arrays: dict, key: str) -> dict:
    """The weights of stack `key` ("neck", "head.points", ...) among a `prepare.Prepared`'s arrays, without the
    prefix ("res.1.0.conv1.w", "in.0.w", "up.2.convt.w", "const.1", ...)."""
    prefix = key + "."
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


class Conv:
    """One conv's weights: float32 numpy (OIHW; (in, out, kh, kw) for a conv transpose) until its first forward,
    then the tensors ttnn prepared from them on the device (`conv2d(..., return_weights_and_bias=True)`), which
    the later forwards and a trace reuse."""

    def __init__(self, weight: np.ndarray, bias: Optional[np.ndarray] = None):
        self.shape = tuple(np.shape(weight))
        self.weight = np.asarray(weight, np.float32)
        self.bias = None if bias is None else np.asarray(bias, np.float32)

    def inputs(self, ctx, fidelity: str) -> tuple:
        """(weight, bias) for ttnn's conv at `fidelity`: before the first forward, host float32 row-major tensors
        (the weights rounded to what LoFi reads when it runs at LoFi: `Context.matmul_weights`)."""
        if not isinstance(self.weight, np.ndarray):
            return self.weight, self.bias
        T = ctx.ttnn
        weight = ctx.tensor(
            ctx.matmul_weights(fidelity)(self.weight), "float32", device=False, layout=T.ROW_MAJOR_LAYOUT
        )
        bias = None
        if self.bias is not None:
            bias = ctx.tensor(self.bias, "float32", (1, 1, 1, -1), device=False, layout=T.ROW_MAJOR_LAYOUT)
        return weight, bias


class Convs:
    """How the decoder runs its convs (see the module docstring). `finest_height`: the rows of the level the
    phase-folded finest conv reads (its convs run at `finest_fidelity`, the coarser ones' at `decoder_fidelity`)."""

    def __init__(self, ctx, finest_height: int):
        self.ctx, self.finest_height = ctx, finest_height
        self._shardings: dict = {}  # chained decoder: (height, width) -> (core grid, shard rows)

    def placement(self, height: int, width: int, c_in: int, c_out: int, out_dtype: str) -> tuple:
        """Safe graph: (shard layout, slice config) of a 3x3 conv: wholly in L1 when its input and output take at
        most CONV_L1_PER_CORE per core (block-sharded for wide inputs, height-sharded otherwise), else DRAM-sliced
        by rows into as many slices as that budget needs. Chained decoder: height-sharded, wholly in L1."""
        ctx = self.ctx
        T = ctx.ttnn
        if ctx.chained:  # height-sharded: every core holds all the weights; block-sharded when they are large
            weights = 9 * _cdiv(c_in, TILE) * _cdiv(c_out, TILE) * _TILE_BYTES[ctx.formats.decoder_weights]
            wide = weights > CONV_WEIGHTS_PER_CORE
            return (
                T.TensorMemoryLayout.BLOCK_SHARDED if wide else T.TensorMemoryLayout.HEIGHT_SHARDED,
                T.Conv2dL1FullSliceConfig,
            )
        pixels = height * width
        act = _TILE_BYTES[ctx.formats.activations] / (TILE * TILE)
        out = _TILE_BYTES[out_dtype] / (TILE * TILE)
        per_core = (pixels * c_in * act + pixels * _cdiv(c_out, TILE) * TILE * out) / ctx.num_cores
        shard = T.TensorMemoryLayout.BLOCK_SHARDED if c_in > 256 else T.TensorMemoryLayout.HEIGHT_SHARDED
        if per_core <= CONV_L1_PER_CORE:
            return shard, T.Conv2dL1FullSliceConfig
        slices = min(height, _cdiv(int(per_core), CONV_L1_PER_CORE))
        return T.TensorMemoryLayout.HEIGHT_SHARDED, T.Conv2dSliceConfig(
            slice_type=T.Conv2dDRAMSliceHeight, num_slices=slices
        )

    def conv_config(self, shard, relu: bool, act_block_h: int = 0, core_grid=None):
        T = self.ctx.ttnn
        extra = {} if core_grid is None else {"core_grid": core_grid, "override_sharding_config": True}
        return T.Conv2dConfig(
            weights_dtype=self.ctx.dt(self.ctx.formats.decoder_weights),
            shard_layout=shard,
            padding_mode=T.PaddingMode.Replicate,
            activation=T.UnaryWithParam(T.UnaryOpType.RELU) if relu else None,
            deallocate_activation=False,
            output_layout=T.TILE_LAYOUT,
            act_block_h_override=act_block_h,
            **extra,
        )

    def sharding(self, height: int, width: int) -> tuple:
        """Chained decoder: (core grid, shard rows) that every map of this size shares (so that adds, ReLUs and
        the next conv take each other's outputs as they lie): height-sharded, the shard a whole number of tiles,
        chosen among the heights near pixels / cores for one with a large divisor (the act blocks must divide
        it: `act_block_h`)."""
        key = (height, width)
        if key not in self._shardings:
            ctx = self.ctx
            tiles = _cdiv(height * width, TILE)
            least = _cdiv(tiles, ctx.num_cores)
            candidates = range(least, max(least, int(least * 1.3)) + 1)
            shard = min(candidates, key=lambda s: s * (1 + 1 / max(d for d in range(1, min(s, 8) + 1) if s % d == 0)))
            cores = _cdiv(tiles, shard)
            grid = ctx.ttnn.num_cores_to_corerangeset(cores, ctx.ttnn.CoreCoord(*ctx.grid), True)
            self._shardings[key] = (grid, shard * TILE)
        return self._shardings[key]

    @staticmethod
    def act_block_h(rows: int, window: int) -> int:
        """The largest act block (rows, a multiple of 32 dividing the shard's rows) whose im2col block of `window`
        values per row (kh kw C_in, bfloat16) fits CONV_WINDOW_BUDGET: the default (all the shard's rows) needs
        more L1 than a chained level leaves."""
        best = TILE
        for h in range(TILE, rows + 1, TILE):
            if rows % h == 0 and h * window * 2 <= CONV_WINDOW_BUDGET:
                best = h
        return best

    def _kind(self, height: int, level: Optional[int]) -> str:
        config = self.ctx.config
        if height == self.finest_height:
            return "finest"
        if config.coarse_fidelity and level is not None and level < config.coarse_levels:
            return "coarse"
        return "decoder"

    def fidelity(self, height: int, level: Optional[int] = None) -> str:
        """The fidelity of a decoder step whose output has `height` rows, a step of stack level `level` (its
        residual blocks, 1x1 convs, or its resampler to the next level): at the finest level (the one the
        phase-folded finest conv reads) `finest_fidelity`, at the `coarse_levels` coarsest `coarse_fidelity`,
        elsewhere `decoder_fidelity`."""
        config = self.ctx.config
        kind = self._kind(height, level)
        return {"finest": config.finest_fidelity, "coarse": config.coarse_fidelity}.get(kind, config.decoder_fidelity)

    def compute(self, height: int, level: Optional[int] = None):
        """The compute config of a decoder step (`fidelity`)."""
        ctx = self.ctx
        return {"finest": ctx.ck_finest, "coarse": ctx.ck_coarse}.get(self._kind(height, level), ctx.ck_decoder)

    def conv(
        self,
        x,
        conv: Conv,
        height: int,
        width: int,
        relu: bool = False,
        out_dtype: Optional[str] = None,
        level: Optional[int] = None,
    ):
        """A replicate-padded 3x3 conv (or a 1x1 conv, by the weight's shape) over (1, 1, height * width, C_in)
        -> (1, 1, height * width, C_out): DRAM in and out in the safe graph, L1 height-sharded when chained. `level`:
        the stack level whose step it is (`fidelity`)."""
        ctx = self.ctx
        T = ctx.ttnn
        weight, bias = conv.inputs(ctx, self.fidelity(height, level))
        c_out, c_in, _, k = conv.shape
        out_dtype = out_dtype or ctx.formats.decoder_maps
        shard, slicing = self.placement(height, width, c_in, c_out, out_dtype)
        if ctx.chained and shard == T.TensorMemoryLayout.HEIGHT_SHARDED:
            grid, rows = self.sharding(height, width)
            config = self.conv_config(shard, relu, self.act_block_h(rows, k * k * c_in), grid)
        else:
            config = self.conv_config(shard, relu)
        y, (h, w_), (conv.weight, conv.bias) = T.conv2d(
            input_tensor=x,
            weight_tensor=weight,
            bias_tensor=bias,
            device=ctx.device,
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
            dtype=ctx.dt(out_dtype),
            conv_config=config,
            compute_config=self.compute(height, level),
            slice_config=slicing,
            memory_config=None if ctx.chained else ctx.dram,
            return_output_dim=True,
            return_weights_and_bias=True,
        )
        return y

    def conv_transpose(self, x, conv: Conv, height: int, width: int, level: Optional[int] = None):
        """The 2x2 stride-2 conv transpose of a resampler of stack level `level`: (height, width) -> (2 height,
        2 width)."""
        ctx = self.ctx
        T = ctx.ttnn
        weight, bias = conv.inputs(ctx, self.fidelity(2 * height, level))
        c_in, c_out = conv.shape[:2]
        config = self.conv_config(None, False)
        if ctx.chained:  # on the next level's cores, as its maps are (conv_transpose2d shards its output)
            grid, rows = self.sharding(2 * height, 2 * width)
            config = self.conv_config(
                T.TensorMemoryLayout.HEIGHT_SHARDED, False, self.act_block_h(rows, 4 * c_in), grid
            )
        y, (h, w_), (conv.weight, conv.bias) = T.conv_transpose2d(
            input_tensor=x,
            weight_tensor=weight,
            bias_tensor=bias,
            device=ctx.device,
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
            dtype=ctx.dt(ctx.formats.decoder_maps),
            conv_config=config,
            compute_config=self.compute(2 * height, level),
            memory_config=None if ctx.chained else ctx.dram,
            return_output_dim=True,
            return_weights_and_bias=True,
        )
        return y

    def add(self, a, b, dtype=None):
        """a + b where a lies (chained: its sharding), or in DRAM."""
        T = self.ctx.ttnn
        if self.ctx.chained:
            return T.add(a, b, dtype=dtype, memory_config=a.memory_config())
        return T.add(a, b, dtype=dtype, memory_config=self.ctx.dram)


class ConvStack:
    """The coarse levels (0 .. finest - 1) of a conv stack, the neck's or a head's (see the module docstring).

    ctx: the shared `context.Context`; convs: the shared `Convs`; key: the stack's name ("neck", "head.points");
    weights: its arrays (`stack_weights`, `prepare.stack_arrays`); plan: its plan (res_blocks, inputs, outputs);
    levels: the graph's levels ({height, width, dim}); grid_tokens: the level-0 map's pixels. level0_fold (the
    chained decoder): the level-0 upsample runs as a matmul to the four phases, with the stack's level-0 input 1x1
    conv folded into it when True (a head whose level 0 is only that conv)."""

    def __init__(
        self,
        ctx,
        convs: Convs,
        key: str,
        weights: dict,
        plan: dict,
        levels: list,
        *,
        grid_tokens: int,
        level0_fold: Optional[bool] = None,
    ):
        self.ctx, self.convs, self.key, self.plan, self.levels = ctx, convs, key, plan, levels
        self.arrays, self.grid_tokens, self.level0_fold = weights, grid_tokens, level0_fold
        f = ctx.formats
        self.conv: dict = {}  # name -> Conv (3x3 convs, conv transposes; 1x1 convs on sharded maps)
        self.matmuls: list = []  # names of the 1x1 convs run as matmuls
        self.program_configs: dict = {}
        for name, array in weights.items():
            if not name.endswith(".w"):
                continue
            base = name[:-2]
            if array.ndim == 4:
                self.conv[base] = Conv(array, weights.get(base + ".b"))
            elif ctx.chained and not base.endswith(".0"):  # 1x1 convs on sharded maps: conv2d's own
                self.conv[base] = Conv(array.T[:, :, None, None], weights[base + ".b"])
            elif not (base == "in.0" and level0_fold):  # folded: the level-0 upsample's matmul holds it
                self.matmuls.append(base)
                if ctx.chained:  # on the level-0 map (the token grid), with an explicit config
                    self.program_configs[base] = ctx.planner.config(
                        grid_tokens, *array.shape, in0=f.activations, in1=f.decoder_weights, out=f.activations
                    )
        if level0_fold is not None:
            before = (weights["in.0.w"], weights["in.0.b"]) if level0_fold else None
            self.up0 = convt_as_matmul(weights["up.0.convt.w"], weights["up.0.convt.b"], before)
            c_in, c_out = self.up0[0].shape[0], self.up0[0].shape[1] // 4
            self.program_configs["up0"] = ctx.planner.config(
                grid_tokens, c_in, 4 * c_out, in0=f.activations, in1=f.decoder_weights, out=f.activations
            )
        self.w: dict = {}

    def load(self) -> None:
        """The 1x1 convs run as matmuls and the level-0 upsample's matmul to the device (weights rounded to what
        LoFi reads when the decoder runs at LoFi); the other convs stay on the host until their first forward."""
        ctx, f = self.ctx, self.ctx.formats
        for name in self.matmuls:
            weights = ctx.matmul_weights(self.convs.fidelity(*self._where(name)))
            self.w[name + ".w"] = ctx.tensor(weights(self.arrays[name + ".w"]), f.decoder_weights)
            self.w[name + ".b"] = ctx.tensor(self.arrays[name + ".b"], f.activations, (1, -1))
        if self.level0_fold is not None:
            w, b = self.up0
            weights = ctx.matmul_weights(self.convs.fidelity(self.levels[1]["height"], 0))
            self.w["up0.w"] = ctx.tensor(weights(w), f.decoder_weights)
            self.w["up0.b"] = ctx.tensor(b, f.activations, (1, -1))

    def tensors(self) -> list:
        return list(self.w.values())

    def _where(self, name: str) -> tuple:
        """(rows, level) of a 1x1 conv ("in.<level>", "out.<level>")."""
        level = int(name.rsplit(".", 1)[1])
        return self.levels[level]["height"], level

    # -------------------------------------------------------------------------------------------- levels
    def matmul1x1(self, x, name: str):
        """A 1x1 conv over (1, 1, pixels, C) as a matmul (the safe graph's, and the heads' level-0 inputs)."""
        ctx = self.ctx
        return ctx.ttnn.linear(
            x,
            self.w[name + ".w"],
            bias=self.w[name + ".b"],
            program_config=self.program_configs.get(name),  # set at load in the chained decoder; else ttnn chooses
            compute_kernel_config=self.convs.compute(*self._where(name)),
            dtype=ctx.dt(ctx.formats.activations),
            memory_config=ctx.act_mem if ctx.chained else ctx.dram,
        )

    def one_by_one(self, x, name: str, level: int):
        """A 1x1 conv at `level`: a matmul on the level-0 map (and everywhere in the safe graph), else conv2d on
        the sharded map."""
        if not self.ctx.chained or level == 0:
            return self.matmul1x1(x, name)
        size = self.levels[level]
        return self.convs.conv(x, self.conv[name], size["height"], size["width"], level=level)

    def res_block(self, x, name: str, height: int, width: int, level: Optional[int] = None):
        """relu -> 3x3 conv (+ fused relu) -> 3x3 conv, plus x (MoGe's residual block without norms)."""
        T, chained = self.ctx.ttnn, self.ctx.chained
        y = T.relu(x, memory_config=x.memory_config() if chained else self.ctx.dram)
        z = self.convs.conv(y, self.conv[name + ".conv1"], height, width, relu=True, level=level)
        T.deallocate(y)
        y = self.convs.conv(z, self.conv[name + ".conv2"], height, width, level=level)
        T.deallocate(z)
        out = self.convs.add(x, y)
        T.deallocate(y)
        return out

    def level(self, x, i: int, owned: bool = True) -> tuple:
        """Residual blocks of level i, each freeing its input (a chained level's maps hold L1; the first input
        only if `owned`), and the level's output (1x1 conv or x itself) -> (x, output)."""
        size = self.levels[i]
        for j in range(self.plan["res_blocks"][i]):
            y = self.res_block(x, f"res.{i}.{j}", size["height"], size["width"], level=i)
            if owned or j:
                self.ctx.ttnn.deallocate(x)
            x = y
        out = self.one_by_one(x, f"out.{i}", i) if self.plan["outputs"][i] else x
        return x, out

    def upsample(self, x, i: int):
        """Level i -> i + 1 by the resampler: conv transpose 2x2 stride 2, then its 3x3 conv."""
        T, size = self.ctx.ttnn, self.levels[i]
        height, width = size["height"], size["width"]
        y = self.convs.conv_transpose(x, self.conv[f"up.{i}.convt"], height, width, level=i)
        z = self.convs.conv(y, self.conv[f"up.{i}.conv"], 2 * height, 2 * width, level=i)
        T.deallocate(y)
        if self.ctx.chained and 2 * height == self.convs.finest_height:
            # the finest level's map was placed below y (still live then): moved up, out of the next convs' buffers
            z = T.reallocate(z)
        return z

    def upsample0(self, x):
        """Chained decoder, level 0 -> 1: the conv transpose as a matmul to the four output phases (with the
        stack's input 1x1 conv folded in where `level0_fold` says so), a pixel shuffle (untilize, permute), then
        the resampler's 3x3 conv. A 4x cheaper matmul than conv_transpose2d's (which convolves the zero-stuffed
        map) and no sharded 1024-channel map, whose conv circular buffers would not fit beside the encoder's."""
        ctx = self.ctx
        T = ctx.ttnn
        rows, cols = self.levels[0]["height"], self.levels[0]["width"]
        y = T.linear(
            x,
            self.w["up0.w"],
            bias=self.w["up0.b"],
            program_config=self.program_configs["up0"],
            compute_kernel_config=self.convs.compute(2 * rows, 0),
            dtype=ctx.dt(ctx.formats.activations),
            memory_config=ctx.act_mem,
        )
        c = y.shape[-1] // 4
        z = T.untilize(y, memory_config=ctx.act_mem)
        T.deallocate(y)
        z = T.reshape(z, (rows, cols, 2, 2 * c))  # (i, j, a, (b, c))
        s = T.permute(z, (0, 2, 1, 3), memory_config=ctx.act_mem)  # (i, a, j, (b, c)): rows of the upsampled map
        T.deallocate(z)
        s = T.reshape(s, (1, 1, 4 * rows * cols, c))
        out = self.convs.conv(s, self.conv["up.0.conv"], 2 * rows, 2 * cols, level=0)
        T.deallocate(s)
        return out

    def level_up(self, x, i: int):
        """Level i -> i + 1: `upsample0` from the chained decoder's level 0, else `upsample`."""
        if self.ctx.chained and i == 0:
            return self.upsample0(x)
        return self.upsample(x, i)


class Neck(ConvStack):
    """The neck: its coarse levels, and the constant uv maps added at levels 1 .. finest - 1 (`const.i`)."""

    def load(self) -> None:
        ctx = self.ctx
        for i in range(1, len(self.levels) - 1):
            const = self.arrays[f"const.{i}"]
            self.w[f"const.{i}"] = ctx.tensor(const, ctx.formats.activations, (1, 1) + const.shape)
        super().load()

    def forward(self, level0) -> tuple:
        """The neck's levels 0 .. finest - 1 (`ConvStack` without its last resampler, which the finest fold holds):
        level-0 map -> (the neck's map at the finest fold's input level, the neck's outputs per level, which the
        heads read). Consumes level0 (or keeps it as the neck's level-0 output)."""
        T = self.ctx.ttnn
        last = len(self.levels) - 1
        x = level0
        neck_out = []
        for i in range(last):
            if i > 0:  # + the constant map (kept in DRAM: read once per forward beats holding a full map in L1)
                y = self.convs.add(x, self.w[f"const.{i}"])
                T.deallocate(x)
                x = y
            x, out = self.level(x, i)
            if self.ctx.chained and i > 0 and out is x:  # kept for the heads: moved up, out of the way of what follows
                x = out = T.reallocate(x)
            neck_out.append(out)
            if i < last - 1:
                y = self.level_up(x, i)
                if x is not out:
                    T.deallocate(x)
                x = y
        return x, neck_out
