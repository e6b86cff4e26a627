"""One DINOv2 block on the device (`network/vit.py`'s `Block`): layer_norm, fused qkv matmul (attention scale
folded into q), head split, non-causal SDPA writing the heads back side by side, attention output matmul
(LayerScale folded), residual add, layer_norm, FFN matmul with fused GELU, FFN output matmul (LayerScale folded),
residual add. The sequence keeps its true length (not a tile multiple): SDPA masks the padded key rows of the
last tile itself.

A part: built from the shared `context.Context` and its own weights (`prepare.block_arrays` of one `Block`), which
it owns on the device; `sdpa_config` plans SDPA's chunks for a sequence on the context's grid.
"""

from __future__ import annotations

from .context import SDPA_SCORE_TILES
from .tiles import TILE
from .tiles import cdiv as _cdiv

__all__ = ["VitBlock", "sdpa_chunks", "sdpa_config", "BLOCK_WEIGHTS"]

# the arrays of one block (`prepare.block_arrays`): the norms' weights and biases, the four matmuls' (in, out)
# weights and biases
BLOCK_WEIGHTS = tuple(f"{n}.{p}" for n in ("norm1", "norm2", "qkv", "attn_out", "ffn_in", "ffn_out") for p in "wb")


def sdpa_chunks(ctx, seq_len: int, num_heads: int) -> tuple:
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
    cfg = ctx.config
    tiles = _cdiv(seq_len, TILE)
    q_max, k_max = max(1, cfg.sdpa_q_chunk // TILE), max(1, cfg.sdpa_k_chunk // TILE)
    if not cfg.sdpa_even:
        return min(q_max, tiles) * TILE, min(k_max, tiles) * TILE
    per_head = min(tiles, max(1, ctx.num_cores // num_heads))
    best = None
    for k_tiles in range(1, min(k_max, tiles) + 1):
        k_chunks = _cdiv(tiles, k_tiles)
        for q_tiles in range(1, min(q_max, tiles) + 1):
            if q_tiles * k_tiles > SDPA_SCORE_TILES and (q_tiles, k_tiles) != (1, 1):
                continue
            passes = _cdiv(_cdiv(tiles, q_tiles), per_head)  # the busiest core's query chunks
            work = passes * q_tiles * (k_chunks * k_tiles + k_chunks - 1)
            key = (work, passes) if ctx.encoder_in_l1 else (passes, work)
            if best is None or key + (-q_tiles,) < best[0]:
                best = (key + (-q_tiles,), q_tiles, k_tiles)
    return best[1] * TILE, best[2] * TILE


def sdpa_config(ctx, seq_len: int, num_heads: int):
    """SDPA's program config on the context's whole grid, its chunks from `sdpa_chunks`."""
    T = ctx.ttnn
    q_chunk, k_chunk = sdpa_chunks(ctx, seq_len, num_heads)
    return T.SDPAProgramConfig(
        compute_with_storage_grid_size=T.CoreCoord(*ctx.grid),
        q_chunk_size=q_chunk,
        k_chunk_size=k_chunk,
        exp_approx_mode=ctx.config.sdpa_exp_approx,
    )


class VitBlock:
    """One DINOv2 block (see the module docstring). `weights`: `BLOCK_WEIGHTS` as float32 numpy (matmul weights
    (in, out), the attention scale folded into q, LayerScale into the output projections); `seq_len` tokens,
    `num_heads`, `ln_eps`. `oversize`: the mock's negative check (an FFN output config whose circular buffers
    cannot fit). `sdpa`: an SDPA program config to share (else planned here)."""

    def __init__(
        self,
        ctx,
        weights: dict,
        *,
        seq_len: int,
        num_heads: int,
        ln_eps: float,
        oversize: bool = False,
        sdpa=None,
    ):
        missing = set(BLOCK_WEIGHTS) - set(weights)
        if missing:
            raise ValueError(f"VitBlock: weights missing {sorted(missing)}")
        f, mm = ctx.formats, ctx.planner.config
        self.ctx, self.arrays = ctx, {k: weights[k] for k in BLOCK_WEIGHTS}
        self.seq_len, self.num_heads, self.ln_eps = seq_len, num_heads, ln_eps
        n, c = seq_len, weights["qkv.w"].shape[0]
        ffn = weights["ffn_in.w"].shape[1]
        self.dim = c
        self.program_configs = {
            "qkv": mm(n, c, 3 * c, in0=f.residual, in1=f.vit_weights, out=f.activations),
            "attn_out": mm(n, c, c, in0=f.activations, in1=f.vit_weights, out=f.residual),
            "ffn_in": mm(n, c, ffn, in0=f.residual, in1=f.vit_weights, out=f.activations, gelu=True),
            "ffn_out": mm(n, ffn, c, in0=f.activations, in1=f.vit_weights, out=f.residual, whole_k=oversize),
        }
        self.sdpa_config = sdpa if sdpa is not None else sdpa_config(ctx, seq_len, num_heads)
        self.w: dict = {}

    @classmethod
    def from_prepared(cls, ctx, prepared, i: int, **kwargs) -> "VitBlock":
        """Block i of a `prepare.Prepared`."""
        p, a = prepared.plan, prepared.arrays
        weights = {k: a[f"blocks.{i}.{k}"] for k in BLOCK_WEIGHTS}
        return cls(ctx, weights, seq_len=p["seq_len"], num_heads=p["num_heads"], ln_eps=p["ln_eps"], **kwargs)

    def load(self) -> None:
        """The norms (residual format), the matmul weights (the ViT weights' format, rounded to what LoFi reads
        where they run at LoFi) and their biases (activations' format) to the device."""
        ctx, f, c, a = self.ctx, self.ctx.formats, self.ctx.config, self.arrays
        attention, mlp = ctx.matmul_weights(c.attention_fidelity), ctx.matmul_weights(c.mlp_fidelity)
        for norm in ("norm1", "norm2"):
            for part in ("w", "b"):
                self.w[f"{norm}.{part}"] = ctx.tensor(a[f"{norm}.{part}"], f.residual, (1, -1))
        for name in ("qkv", "attn_out", "ffn_in", "ffn_out"):
            weights = mlp if name.startswith("ffn") else attention
            self.w[name + ".w"] = ctx.tensor(weights(a[name + ".w"]), f.vit_weights)
            self.w[name + ".b"] = ctx.tensor(a[name + ".b"], f.activations, (1, -1))

    def tensors(self) -> list:
        return list(self.w.values())

    def forward(self, x):
        """The residual stream x (1, 1, seq_len, dim) (residual format) -> the new stream (x is freed)."""
        ctx, w = self.ctx, self.w
        T, f = ctx.ttnn, ctx.formats
        res, act, mem = ctx.dt(f.residual), ctx.dt(f.activations), ctx.act_mem
        n, c = self.seq_len, self.dim
        h = T.layer_norm(
            x,
            weight=w["norm1.w"],
            bias=w["norm1.b"],
            epsilon=self.ln_eps,
            compute_kernel_config=ctx.ck_norm,
            memory_config=mem,
        )
        qkv = T.linear(
            h,
            w["qkv.w"],
            bias=w["qkv.b"],
            program_config=self.program_configs["qkv"],
            compute_kernel_config=ctx.ck_attention,
            dtype=act,
            memory_config=mem,
        )
        T.deallocate(h)
        q, k, v = T.transformer.split_query_key_value_and_split_heads(
            T.reshape(qkv, (1, n, 3 * c)), num_heads=self.num_heads, transpose_key=False, memory_config=mem
        )
        T.deallocate(qkv)
        a = T.transformer.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=False,
            scale=1.0,
            program_config=self.sdpa_config,
            compute_kernel_config=ctx.ck_sdpa,
            output_concat_heads=True,
            memory_config=mem,
        )  # (1, 1, n, c); the scale is folded into q
        for t in (q, k, v):
            T.deallocate(t)
        o = T.linear(
            a,
            w["attn_out.w"],
            bias=w["attn_out.b"],
            program_config=self.program_configs["attn_out"],
            compute_kernel_config=ctx.ck_attention,
            dtype=res,
            memory_config=mem,
        )
        T.deallocate(a)
        x1 = T.add(x, o, dtype=res, memory_config=mem)
        T.deallocate(o)
        T.deallocate(x)
        h = T.layer_norm(
            x1,
            weight=w["norm2.w"],
            bias=w["norm2.b"],
            epsilon=self.ln_eps,
            compute_kernel_config=ctx.ck_norm,
            memory_config=mem,
        )
        g = T.linear(
            h,
            w["ffn_in.w"],
            bias=w["ffn_in.b"],
            program_config=self.program_configs["ffn_in"],
            compute_kernel_config=ctx.ck_mlp,
            dtype=act,
            memory_config=mem,
        )
        T.deallocate(h)
        o = T.linear(
            g,
            w["ffn_out.w"],
            bias=w["ffn_out.b"],
            program_config=self.program_configs["ffn_out"],
            compute_kernel_config=ctx.ck_mlp,
            dtype=res,
            memory_config=mem,
        )
        T.deallocate(g)
        x2 = T.add(x1, o, dtype=res, memory_config=mem)
        T.deallocate(o)
        T.deallocate(x1)
        return x2
