"""One DINOv2 block on the device (`network/vit.py`'s `Block`): layer_norm, fused qkv matmul (attention scale
folded into q), head split, non-causal SDPA writing the heads back side by side, attention output matmul
(LayerScale folded), residual add, layer_norm, FFN matmul with fused GELU, FFN output matmul (LayerScale folded),
residual add. The sequence keeps its true length (not a tile multiple): SDPA masks the padded key rows of the
last tile itself.

A part of `graph.TtnnGraph` (mixed into it): numpy and the injected ttnn only, and it reads the state the graph
sets up (see `graph.py`): `ttnn`, `plan`, `formats`, `w` (the device weights), `pc` (matmul program configs),
`sdpa_config`, the compute configs `ck_*` and `act_mem`.
"""

from __future__ import annotations

__all__ = ["VitBlock"]


class VitBlock:
    """The DINOv2 block of the device graph (see the module docstring)."""

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
