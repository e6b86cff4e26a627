"""tt-metal's Blackhole high-resolution ViT encoder layer, as ttnn calls: a calibration case of the cost model.

tt-metal publishes the speed of its Blackhole ViT "hiRes" encoder (models/demos/blackhole/vit, later
models/demos/vision/classification/vit/blackhole: tests/test_demo_vit_hiRes_ttnn_inference_perf_e2e_2cq_trace.py,
tests/vit_hiRes_test_infra.py, tt/ttnn_optimized_sharded_vit_hiRes_bh.py): 12 encoder layers, batch 1, traced with
two command queues, at hidden 512 / 1024 / 1536 / 2304 and 1024 / 2048 / 3072 tokens, twelve figures in samples
per second (`PUBLISHED_SAMPLES_PER_S`; the test accepts 10 % either way). `HiresVitLayer` issues the same ops with
the same configurations as one layer of that model, as its source describes them (written here from a reading of
it, not copied; shapes, grids, program configs, formats and fidelities are what the estimate depends on, the
weights are zeros), so that the cost model can be run on the op list the mock P150 produces for it, exactly as for
our graph.

The configuration (`update_model_config` of the model, `vit_hiRes_test_infra.py`): intermediate size 4 x hidden;
16 heads, 12 at hidden >= 2048 (head size 32 / 64 / 96 / 192); activations block-sharded in L1 in bfloat8_b on an
8x8 grid up to hidden 1024 and on 12x8 (12 columns, 8 rows) above; per core M = tokens / 32 / 8 tiles and
d = hidden / 32 / columns tiles. Per layer: layer norm (sharded, HiFi2, no fp32 accumulation), fused QKV matmul
(2D multicast, LoFi: ttnn's default with a program config; in0 block d, N 3d per core), a move to L1 interleaved,
`nlp_create_qkv_heads` to DRAM, SDPA (12x10 grid, 256 / 256 chunks, HiFi4 with fp32 accumulation, exact exp),
`concatenate_heads`, a hop through DRAM back to the block sharding, the output projection, the residual add, a
second layer norm, the MLP (GELU fused into the first matmul: in0 block d/2, N 4d; second: in0 block 2d, N d), the
second residual add, and the model's three `reallocate` calls.

numpy and an injected ttnn only, like graph.py.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LAYERS", "HIDDENS", "TOKENS", "PUBLISHED_SAMPLES_PER_S", "heads", "grid", "HiresVitLayer"]

LAYERS = 12
HIDDENS = (512, 1024, 1536, 2304)
TOKENS = (1024, 2048, 3072)
SDPA_GRID = (12, 10)

# The test's expected samples/s on Blackhole, batch 1, 12 layers: (tokens, hidden) -> samples per second.
PUBLISHED_SAMPLES_PER_S = {
    (1024, 512): 400,
    (1024, 1024): 242,
    (1024, 1536): 167,
    (1024, 2304): 108,
    (2048, 512): 164,
    (2048, 1024): 105,
    (2048, 1536): 76,
    (2048, 2304): 55,
    (3072, 512): 114,
    (3072, 1024): 69,
    (3072, 1536): 48,
    (3072, 2304): 31,
}


def heads(hidden: int) -> int:
    """The model's head count: 16, or 12 from hidden 2048 on."""
    return 12 if hidden >= 2048 else 16


def grid(hidden: int) -> tuple:
    """The block-sharding grid (columns, rows): 8x8 up to hidden 1024, 12 columns x 8 rows above."""
    return (8, 8) if hidden <= 1024 else (12, 8)


class HiresVitLayer:
    """One encoder layer of the model at `seq_len` tokens and `hidden` width on `device` (weights uploaded once by
    the constructor)."""

    def __init__(self, ttnn, device, seq_len: int, hidden: int = 1024):
        T = self.ttnn = ttnn
        self.device = device
        self.seq_len, self.hidden, self.heads = seq_len, hidden, heads(hidden)
        gx, gy = grid(hidden)
        seq_t, dim_t = seq_len // 32, hidden // 32
        self.per_core_m = seq_t // gy
        self.dim_x = dim_t // gx  # K and N tiles per core column
        bfp8 = T.bfloat8_b
        H = hidden

        def weight(k, n):
            return T.Tensor(np.zeros((k, n), np.float32), bfp8, device, T.TILE_LAYOUT, T.DRAM_MEMORY_CONFIG)

        def row(n, dtype=bfp8):
            return T.Tensor(np.zeros((1, n), np.float32), dtype, device, T.TILE_LAYOUT, T.DRAM_MEMORY_CONFIG)

        self.w = {
            "qkv": (weight(H, 3 * H), row(3 * H)),
            "out": (weight(H, H), row(H)),
            "ff1": (weight(H, 4 * H), row(4 * H)),
            "ff2": (weight(4 * H, H), row(H)),
        }
        self.ln = [(row(H, T.bfloat16), row(H, T.bfloat16)) for _ in range(2)]
        cores = T.CoreRangeSet({T.CoreRange(T.CoreCoord(0, 0), T.CoreCoord(gx - 1, gy - 1))})
        self.sharded = T.MemoryConfig(
            T.TensorMemoryLayout.BLOCK_SHARDED,
            T.BufferType.L1,
            T.ShardSpec(cores, [seq_len // gy, H // gx], T.ShardOrientation.ROW_MAJOR),
        )
        d = self.dim_x

        def mm(ibw, n_per_core, subblock_w, gelu=False):
            return T.MatmulMultiCoreReuseMultiCastProgramConfig(
                compute_with_storage_grid_size=T.CoreCoord(gx, gy),
                in0_block_w=ibw,
                out_subblock_h=1,
                out_subblock_w=subblock_w,
                per_core_M=self.per_core_m,
                per_core_N=n_per_core,
                transpose_mcast=False,
                fused_activation=T.UnaryWithParam(T.UnaryOpType.GELU, 1.0) if gelu else None,
            )

        self.pc = {
            "qkv": mm(d, 3 * d, d),
            "out": mm(d, d, d),
            "ff1": mm(d // 2, 4 * d, min(4, 2 * d), gelu=True),
            "ff2": mm(2 * d, d, d),
        }
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
            np.zeros((1, 1, self.seq_len, self.hidden), np.float32),
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
            qkv,
            memory_config=T.DRAM_MEMORY_CONFIG,
            num_heads=self.heads,
            num_kv_heads=self.heads,
            transpose_k_heads=False,
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
