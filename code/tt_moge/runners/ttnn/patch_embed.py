"""The patch embedding on the device (`network/vit.py`'s `PatchEmbed`, the position embedding and the prefix
tokens): one matmul of the unfolded patches (`pre.py` on the device, `prepare.host_input` on the host) by the
folded patch kernel (the image normalisation folded in), plus a table that holds the position embedding (and
the patch bias) for the patch rows and the class / register tokens for the prefix rows, which are placed after
the patch rows and whose patch rows are zero (see `prepare.py`). The result is the ViT's residual stream.

A part: built from the shared `context.Context` and its own weights, which it owns on the device.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PatchEmbed"]


class PatchEmbed:
    """The patch embedding (see the module docstring). `weight`: the folded patch kernel (patch_k_padded, dim);
    `table`: the token table (seq_len, dim), float32 numpy (`prepare.prepare_weights`'s "patch.w", "token_table")."""

    def __init__(self, ctx, weight: np.ndarray, table: np.ndarray):
        f = ctx.formats
        self.ctx, self.arrays = ctx, {"weight": weight, "table": table}
        seq_len, k, dim = table.shape[0], weight.shape[0], weight.shape[1]
        self.program_config = ctx.planner.config(
            seq_len, k, dim, in0=f.activations, in1=f.decoder_weights, out=f.residual
        )
        self.w: dict = {}

    @classmethod
    def from_prepared(cls, ctx, prepared) -> "PatchEmbed":
        a = prepared.arrays
        return cls(ctx, a["patch.w"], a["token_table"])

    def load(self) -> None:
        """The kernel (in the decoder weights' format, rounded as the tap matmuls' fidelity reads it) and the table
        (residual format) to the device."""
        ctx, f, c = self.ctx, self.ctx.formats, self.ctx.config
        tap = ctx.matmul_weights(c.tap_fidelity or c.attention_fidelity)
        self.w["weight"] = ctx.tensor(tap(self.arrays["weight"]), f.decoder_weights)
        table = self.arrays["table"]
        self.w["table"] = ctx.tensor(table, f.residual, (1, 1) + table.shape)

    def forward(self, x):
        """Patch matrix (1, 1, seq_len, patch_k_padded) -> the residual stream's first value (1, 1, seq_len, dim),
        in the residual format: patches @ folded kernel + token table."""
        ctx = self.ctx
        T = ctx.ttnn
        res, mem = ctx.dt(ctx.formats.residual), ctx.act_mem
        tokens = T.linear(
            x,
            self.w["weight"],
            program_config=self.program_config,
            compute_kernel_config=ctx.ck_tap,
            dtype=res,
            memory_config=mem,
        )
        embedded = T.add(tokens, self.w["table"], dtype=res, memory_config=mem)
        T.deallocate(tokens)
        return embedded

    def tensors(self) -> list:
        """The device tensors this part owns."""
        return list(self.w.values())
