"""The conv decoder's levels on the device (`network/convstack.py`'s `ConvStack` levels: `ResidualConvBlock`, the
resamplers, the 1x1 input / output convs), for the neck (`neck_levels`) and, through `heads.py`, each head;
channels-last (1, 1, H*W, C) tiles: constant uv maps added, residual blocks (ReLU, 3x3 conv with fused ReLU, 3x3
conv, add), 2x2 stride-2 conv-transpose resamplers followed by 3x3 convs (the level-0 one as a matmul and a pixel
shuffle in the chained decoder), 1x1 convs as matmuls (or conv2d on sharded maps), and `_conv`, which runs every
conv of the decoder (the finest folded one too), placed as the configuration says. Every 3x3 conv pads by edge
replication, as MoGe does (ttnn's `PaddingMode.Replicate`).

A part of `graph.TtnnGraph` (mixed into it): numpy and the injected ttnn only, and it reads the state the graph
sets up (see `graph.py`): `ttnn`, `device`, `plan`, `formats`, `config`, `w`, `pc`, `convs` / `conv_shapes`
(conv weights, prepared by ttnn on the first forward), the compute configs `ck_*`, `act_mem`, `dram`, `grid`,
`num_cores`, `chained`, `level0_folds` and `_shardings`.
"""

from __future__ import annotations

from typing import Optional

from .tiles import TILE
from .tiles import TILE_BYTES as _TILE_BYTES  # the names the bodies have always used
from .tiles import cdiv as _cdiv

__all__ = ["Decoder", "CONV_L1_PER_CORE", "CONV_WEIGHTS_PER_CORE", "CONV_WINDOW_BUDGET"]

CONV_L1_PER_CORE = 160 * 1024  # safe graph: a 3x3 conv's input + output per core below which it runs wholly in L1
CONV_WEIGHTS_PER_CORE = 384 * 1024  # chained decoder: a height-sharded conv's weights (all of them, on every core)
CONV_WINDOW_BUDGET = 128 * 1024  # chained decoder: a conv's im2col block (act_block_h rows x kh kw C_in values)


class Decoder:
    """The conv decoder of the device graph (see the module docstring)."""

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

    def neck_levels(self, level0) -> tuple:
        """The neck's levels 0 .. finest - 1 (`ConvStack` without its last resampler, which the finest fold holds):
        level-0 map -> (the neck's map at the finest fold's input level, the neck's outputs per level, which the
        heads read). Consumes level0 (or keeps it as the neck's level-0 output)."""
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
        return x, neck_out
