"""The encoder on the device (`network/moge2.py`'s `DINOv2Encoder` after its resize and normalisation, which
`pre.py` and the patch kernel hold): the patch embedding, the DINOv2 blocks (`vit_block.py`) and, at each tap,
the final layer_norm and a matmul by that tap's share of the folded "output projection + neck level-0 conv"
matrix, accumulated; the class token is the last tap's normed prefix row.

A part of `graph.TtnnGraph` (mixed into it): numpy and the injected ttnn only, and it reads the state the graph
sets up (see `graph.py`): `ttnn`, `plan`, `formats`, `w`, `pc`, the compute configs `ck_*`, `act_mem`, `dram`,
`chained`, and the graph's other parts: `patch_embed` (`patch_embed.py`) and `block` (`vit_block.py`).
"""

from __future__ import annotations

__all__ = ["Encoder"]


class Encoder:
    """The encoder of the device graph (see the module docstring)."""

    def encode(self, x) -> tuple:
        """Patch matrix -> (level-0 map (1, 1, rows * cols, d0), class token (1, 1, 1, dim))."""
        T, p, f, w = self.ttnn, self.plan, self.formats, self.w
        res, mem = self._dt(f.residual), self.act_mem
        tokens = self.patch_embed(x)
        taps = p["taps"]
        acc, cls_token = None, None
        for i in range(p["blocks"]):
            tokens = self.block(tokens, i)
            if i in taps:
                k = taps.index(i)
                h = T.layer_norm(
                    tokens,
                    weight=w["final_norm.w"],
                    bias=w["final_norm.b"],
                    epsilon=p["final_ln_eps"],
                    compute_kernel_config=self.ck_norm,
                    memory_config=mem,
                )
                y = T.linear(
                    h,
                    w[f"neck_in0.{k}.w"],
                    program_config=self.pc["tap"],
                    compute_kernel_config=self.ck_tap,
                    dtype=res,
                    memory_config=mem,
                )
                if i == taps[-1]:
                    r = p["grid_tokens"]
                    cls_token = T.slice(h, (0, 0, r, 0), (1, 1, r + 1, p["dim"]), memory_config=self.dram)
                T.deallocate(h)
                if acc is None:
                    acc = y
                else:
                    summed = T.add(acc, y, dtype=res, memory_config=mem)
                    T.deallocate(acc)
                    T.deallocate(y)
                    acc = summed
        T.deallocate(tokens)
        rows = T.slice(acc, (0, 0, 0, 0), (1, 1, p["grid_tokens"], p["neck_in0_dim"]), memory_config=mem)
        T.deallocate(acc)
        level0 = T.add(
            rows, w["neck_in0.const"], dtype=self._dt(f.activations), memory_config=mem if self.chained else self.dram
        )
        T.deallocate(rows)
        return level0, cls_token
