"""The encoder on the device (`network/moge2.py`'s `DINOv2Encoder` after its resize and normalisation, which
`pre.py` and the patch kernel hold): the patch embedding (`patch_embed.PatchEmbed`), the DINOv2 blocks
(`vit_block.VitBlock`) and, at each tap, the final layer_norm and a matmul by that tap's share of the folded
"output projection + neck level-0 conv" matrix, accumulated; the class token is the last tap's normed prefix row.

A part: built from the shared `context.Context` and the encoder's weights (a `prepare.Prepared`'s), which it and
its patch embedding and blocks own on the device.
"""

from __future__ import annotations

from .patch_embed import PatchEmbed
from .vit_block import VitBlock, sdpa_config

__all__ = ["Encoder"]


class Encoder:
    """The encoder (see the module docstring): `patch_embed`, `blocks`, the final norm and the taps' projections.
    `oversize`: the mock's negative check (every block's FFN output config too large for L1)."""

    def __init__(self, ctx, prepared, *, oversize: bool = False):
        p, a, f = prepared.plan, prepared.arrays, ctx.formats
        self.ctx = ctx
        self.seq_len, self.dim, self.grid_tokens = p["seq_len"], p["dim"], p["grid_tokens"]
        self.neck_in0_dim, self.final_ln_eps, self.taps = p["neck_in0_dim"], p["final_ln_eps"], list(p["taps"])
        self.patch_embed = PatchEmbed.from_prepared(ctx, prepared)
        sdpa = sdpa_config(ctx, p["seq_len"], p["num_heads"])  # one for every block (the same sequence)
        self.blocks = [
            VitBlock.from_prepared(ctx, prepared, i, oversize=oversize, sdpa=sdpa) for i in range(p["blocks"])
        ]
        self.arrays = {k: a[k] for k in ("final_norm.w", "final_norm.b", "neck_in0.const")}
        self.arrays.update({f"tap.{k}.w": a[f"neck_in0.{k}.w"] for k in range(len(self.taps))})
        self.tap_config = ctx.planner.config(
            p["seq_len"], p["dim"], p["neck_in0_dim"], in0=f.residual, in1=f.decoder_weights, out=f.residual
        )
        self.w: dict = {}

    def load(self) -> None:
        ctx, f, c, a = self.ctx, self.ctx.formats, self.ctx.config, self.arrays
        self.patch_embed.load()
        for block in self.blocks:
            block.load()
        for part in ("w", "b"):
            self.w[f"final_norm.{part}"] = ctx.tensor(a[f"final_norm.{part}"], f.residual, (1, -1))
        tap = ctx.matmul_weights(c.tap_fidelity or c.attention_fidelity)
        for k in range(len(self.taps)):
            self.w[f"tap.{k}.w"] = ctx.tensor(tap(a[f"tap.{k}.w"]), f.decoder_weights)
        const = a["neck_in0.const"]
        self.w["neck_in0.const"] = ctx.tensor(const, f.residual, (1, 1) + const.shape)

    def tensors(self) -> list:
        own = list(self.w.values()) + self.patch_embed.tensors()
        return own + [t for block in self.blocks for t in block.tensors()]

    def forward(self, x) -> tuple:
        """Patch matrix -> (level-0 map (1, 1, rows * cols, d0), class token (1, 1, 1, dim))."""
        ctx, w = self.ctx, self.w
        T, f = ctx.ttnn, ctx.formats
        res, mem = ctx.dt(f.residual), ctx.act_mem
        tokens = self.patch_embed.forward(x)
        acc, cls_token = None, None
        for i, block in enumerate(self.blocks):
            tokens = block.forward(tokens)
            if i in self.taps:
                k = self.taps.index(i)
                h = T.layer_norm(
                    tokens,
                    weight=w["final_norm.w"],
                    bias=w["final_norm.b"],
                    epsilon=self.final_ln_eps,
                    compute_kernel_config=ctx.ck_norm,
                    memory_config=mem,
                )
                y = T.linear(
                    h,
                    w[f"tap.{k}.w"],
                    program_config=self.tap_config,
                    compute_kernel_config=ctx.ck_tap,
                    dtype=res,
                    memory_config=mem,
                )
                if i == self.taps[-1]:
                    r = self.grid_tokens
                    cls_token = T.slice(h, (0, 0, r, 0), (1, 1, r + 1, self.dim), memory_config=ctx.dram)
                T.deallocate(h)
                if acc is None:
                    acc = y
                else:
                    summed = T.add(acc, y, dtype=res, memory_config=mem)
                    T.deallocate(acc)
                    T.deallocate(y)
                    acc = summed
        T.deallocate(tokens)
        rows = T.slice(acc, (0, 0, 0, 0), (1, 1, self.grid_tokens, self.neck_in0_dim), memory_config=mem)
        T.deallocate(acc)
        level0 = T.add(
            rows, w["neck_in0.const"], dtype=ctx.dt(f.activations), memory_config=mem if ctx.chained else ctx.dram
        )
        T.deallocate(rows)
        return level0, cls_token
