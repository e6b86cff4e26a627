"""The patch embedding on the device (`network/vit.py`'s `PatchEmbed`, the position embedding and the prefix
tokens): one matmul of the unfolded patches (`pre.py` on the device, `prepare.host_input` on the host) by the
folded patch kernel (the image normalisation folded in), plus a table that holds the position embedding (and
the patch bias) for the patch rows and the class / register tokens for the prefix rows, which are placed after
the patch rows and whose patch rows are zero (see `prepare.py`). The result is the ViT's residual stream.

A part of `graph.TtnnGraph` (mixed into it): numpy and the injected ttnn only, and it reads the state the graph
sets up (see `graph.py`): `ttnn`, `formats`, `w`, `pc`, `ck_tap` and `act_mem`.
"""

from __future__ import annotations

__all__ = ["PatchEmbed"]


class PatchEmbed:
    """The patch embedding of the device graph (see the module docstring)."""

    def patch_embed(self, x):
        """Patch matrix (1, 1, seq_len, patch_k_padded) -> the residual stream's first value (1, 1, seq_len, dim),
        in the residual format: patches @ folded kernel + token table."""
        T, f, w = self.ttnn, self.formats, self.w
        res, mem = self._dt(f.residual), self.act_mem
        tokens = T.linear(
            x,
            w["patch.w"],
            program_config=self.pc["patch"],
            compute_kernel_config=self.ck_tap,
            dtype=res,
            memory_config=mem,
        )
        embedded = T.add(tokens, w["token_table"], dtype=res, memory_config=mem)
        T.deallocate(tokens)
        return embedded
