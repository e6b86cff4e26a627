"""tt-metal's Blackhole high-resolution ViT encoder layer, as ttnn calls: the cost model's calibration case.

tt-metal publishes the speed of its Blackhole ViT demo (models/demos/blackhole/vit, "hiRes" variant: 12 encoder
layers, hidden 1024, 16 heads, MLP 4096, batch 1, traced with two command queues): 242 / 105 / 69 samples per
second at 1024 / 2048 / 3072 tokens, i.e. 4.1 / 9.5 / 14.5 ms (`cost.PUBLISHED_HIRES_VIT_MS`). `layer` issues the
same ops with the same configurations as that demo's layer, as its source describes them (written here from that
description; shapes, grids, program configs, formats and fidelities are what the estimate depends on, the weights
are zeros): so that the cost model can be run on the op list the mock P150 produces for it, exactly as for our
graph, and its estimate compared with the published times.

Per layer, everything but attention lives in L1, block-sharded on an 8x8 grid, in bfloat8_b:
layer norm (sharded, HiFi2, no fp32 accumulation), fused QKV matmul (2D multicast, LoFi: the default with a
program config), a move to L1 interleaved, `nlp_create_qkv_heads` to DRAM, SDPA (12x10 grid, 256 / 256 chunks,
HiFi4 with fp32 accumulation, exact exp), `concatenate_heads`, a hop through DRAM back to the 8x8 block
sharding, the output projection, the residual add, a second layer norm, the MLP (GELU fused into the first
matmul), the second residual add, and the demo's three `reallocate` calls.

numpy and an injected ttnn only, like graph.py.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HIDDEN", "HEADS", "LAYERS", "HiresVitLayer"]

HIDDEN, HEADS, LAYERS = 1024, 16, 12
GRID = (8, 8)  # the demo's block-sharding grid for hidden <= 1024
SDPA_GRID = (12, 10)


class HiresVitLayer:
    """One encoder layer of the demo at `seq_len` tokens on `device` (weights uploaded once by the constructor)."""

    def __init__(self, ttnn, device, seq_len: int):
        T = self.ttnn = ttnn
        self.device = device
        self.seq_len = seq_len
        gx, gy = GRID
        seq_t, dim_t = seq_len // 32, HIDDEN // 32
        self.per_core_m = seq_t // gy
        self.dim_x = dim_t // gx  # K and N tiles per core column
        bfp8 = T.bfloat8_b

        def weight(k, n):
            return T.Tensor(np.zeros((k, n), np.float32), bfp8, device, T.TILE_LAYOUT, T.DRAM_MEMORY_CONFIG)

        def row(n, dtype=bfp8):
            return T.Tensor(np.zeros((1, n), np.float32), dtype, device, T.TILE_LAYOUT, T.DRAM_MEMORY_CONFIG)

        self.w = {
            "qkv": (weight(HIDDEN, 3 * HIDDEN), row(3 * HIDDEN)),
            "out": (weight(HIDDEN, HIDDEN), row(HIDDEN)),
            "ff1": (weight(HIDDEN, 4 * HIDDEN), row(4 * HIDDEN)),
            "ff2": (weight(4 * HIDDEN, HIDDEN), row(HIDDEN)),
        }
        self.ln = [(row(HIDDEN, T.bfloat16), row(HIDDEN, T.bfloat16)) for _ in range(2)]
        grid = T.CoreRangeSet({T.CoreRange(T.CoreCoord(0, 0), T.CoreCoord(gx - 1, gy - 1))})
        self.sharded = T.MemoryConfig(
            T.TensorMemoryLayout.BLOCK_SHARDED,
            T.BufferType.L1,
            T.ShardSpec(grid, [seq_len // gy, HIDDEN // gx], T.ShardOrientation.ROW_MAJOR),
        )
        d = self.dim_x

        def mm(ibw, n_per_core, gelu=False):
            return T.MatmulMultiCoreReuseMultiCastProgramConfig(
                compute_with_storage_grid_size=T.CoreCoord(gx, gy),
                in0_block_w=ibw,
                out_subblock_h=1,
                out_subblock_w=min(4, n_per_core),
                per_core_M=self.per_core_m,
                per_core_N=n_per_core,
                transpose_mcast=False,
                fused_activation=T.UnaryWithParam(T.UnaryOpType.GELU, 1.0) if gelu else None,
            )

        self.pc = {"qkv": mm(d, 3 * d), "out": mm(d, d), "ff1": mm(d // 2, 4 * d, gelu=True), "ff2": mm(2 * d, d)}
        self.ln_pc = T.LayerNormShardedMultiCoreProgramConfig(
            compute_with_storage_grid_size=T.CoreCoord(gx, gy),
            subblock_w=d,
            block_h=self.per_core_m,
            block_w=d,
            inplace=False,
        )
        arch = device.arch()
        self.ln_ck = T.init_device_compute_kernel_config(
            arch, math_fidelity=T.MathFidelity.HiFi2, math_approx_mode=True, fp32_dest_acc_en=False, packer_l1_acc=True
        )
        self.sdpa_pc = T.SDPAProgramConfig(
            compute_with_storage_grid_size=T.CoreCoord(*SDPA_GRID),
            q_chunk_size=256,
            k_chunk_size=256,
            exp_approx_mode=False,
        )
        self.sdpa_ck = T.init_device_compute_kernel_config(
            arch, math_fidelity=T.MathFidelity.HiFi4, math_approx_mode=False, fp32_dest_acc_en=True, packer_l1_acc=True
        )

    def input(self):
        """The layer's input: (1, 1, seq_len, hidden) bfloat8_b, block-sharded in L1 (what the perf test feeds)."""
        T = self.ttnn
        x = T.Tensor(
            np.zeros((1, 1, self.seq_len, HIDDEN), np.float32),
            T.bfloat8_b,
            self.device,
            T.TILE_LAYOUT,
            T.DRAM_MEMORY_CONFIG,
        )
        return T.to_memory_config(x, self.sharded)

    def _linear(self, x, name):
        T = self.ttnn
        w, b = self.w[name]
        return T.linear(
            x,
            w,
            bias=b,
            program_config=self.pc[name],
            memory_config=T.L1_BLOCK_SHARDED_MEMORY_CONFIG,
            dtype=T.bfloat8_b,
        )

    def _norm(self, x, i):
        T = self.ttnn
        weight, bias = self.ln[i]
        return T.layer_norm(
            x,
            weight=weight,
            bias=bias,
            memory_config=T.L1_BLOCK_SHARDED_MEMORY_CONFIG,
            program_config=self.ln_pc,
            compute_kernel_config=self.ln_ck,
        )

    def __call__(self, x):
        T = self.ttnn
        h = self._norm(x, 0)
        qkv = self._linear(h, "qkv")
        T.deallocate(h)
        qkv = T.to_memory_config(qkv, T.L1_MEMORY_CONFIG)
        q, k, v = T.experimental.nlp_create_qkv_heads(
            qkv, memory_config=T.DRAM_MEMORY_CONFIG, num_heads=HEADS, num_kv_heads=HEADS, transpose_k_heads=False
        )
        T.deallocate(qkv)
        v = T.reallocate(v)
        ctx = T.transformer.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=False,
            program_config=self.sdpa_pc,
            compute_kernel_config=self.sdpa_ck,
            memory_config=T.L1_MEMORY_CONFIG,
        )
        for t in (q, k, v):
            T.deallocate(t)
        ctx = T.transformer.concatenate_heads(ctx, memory_config=T.L1_MEMORY_CONFIG)
        ctx = T.to_memory_config(ctx, T.DRAM_MEMORY_CONFIG)
        ctx = T.to_memory_config(ctx, self.sharded)
        o = self._linear(ctx, "out")
        T.deallocate(ctx)
        o = T.reallocate(o)
        x1 = T.add(o, x, memory_config=T.L1_BLOCK_SHARDED_MEMORY_CONFIG, dtype=T.bfloat8_b)
        T.deallocate(o)
        T.deallocate(x)
        x1 = T.reallocate(x1)
        h = self._norm(x1, 1)
        g = self._linear(h, "ff1")
        T.deallocate(h)
        f = self._linear(g, "ff2")
        T.deallocate(g)
        x2 = T.add(f, x1, memory_config=T.L1_BLOCK_SHARDED_MEMORY_CONFIG, dtype=T.bfloat8_b)
        T.deallocate(f)
        T.deallocate(x1)
        return x2
