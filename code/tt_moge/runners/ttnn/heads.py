"""The heads on the device (`network/convstack.py`'s `ConvStack` of the points, normal and mask heads, reading the
neck's level outputs) and the finest level, phase-folded at the level before it (`prepare.phase_fold`): one 3x3
conv per feature map (the neck's and each head's), whose sum over the neck and the heads is the 4 x (3 + 3 + 1)
phase channels of every head's finest output (float32), the constant map aside (`post.py` adds it). Each head's
levels run on `decoder.py`'s level ops.

Parts: `Head` (a `decoder.ConvStack`) and `FinestConv`, each built from the shared context, the shared
`decoder.Convs` and its own weights.
"""

from __future__ import annotations

import numpy as np

from .decoder import Conv, ConvStack

__all__ = ["FinestConv", "Head"]


class Head(ConvStack):
    """One head's coarse levels (`plan`: its entry of the plan's "heads", with `name`)."""

    def forward(self, neck_out: list):
        """The neck's level outputs -> the head's map at the finest fold's input level, or one of neck_out (then
        not the caller's to free)."""
        T = self.ctx.ttnn
        last = len(self.levels) - 1
        h = None  # the head's map, or one of neck_out (then not ours to free)
        for i in range(last):
            if i == 0 and self.level0_fold:  # the level-0 input conv is inside the upsample's matmul
                h = self.upsample0(neck_out[0])
                continue
            feature = self.one_by_one(neck_out[i], f"in.{i}", i) if self.plan["inputs"][i] else neck_out[i]
            if h is None:
                h = feature
            else:
                summed = self.convs.add(h, feature)
                for t in (h, feature):
                    if t is not neck_out[i]:
                        T.deallocate(t)
                h = summed
            h, _ = self.level(h, i, owned=h is not neck_out[i])
            if i < last - 1:
                up = self.level_up(h, i)
                if h is not neck_out[i]:
                    T.deallocate(h)
                h = up
        return h


class FinestConv:
    """The phase-folded finest conv of one feature map ("neck" or a head's name): `weight` (4 C, C_in, 3, 3), the
    neck's carrying every head's finest input and output 1x1 convs, a head's zero outside its own output channels
    (`prepare.prepare_weights`'s "finest.<name>.w"). `height`, `width`: the level before the finest."""

    def __init__(self, ctx, convs, weight: np.ndarray, height: int, width: int):
        self.ctx, self.convs, self.height, self.width = ctx, convs, height, width
        self.conv = Conv(weight)

    def forward(self, x):
        """(1, 1, height * width, C) -> (1, 1, height * width, phase_channels), in the finest format (float32)."""
        return self.convs.conv(x, self.conv, self.height, self.width, out_dtype=self.ctx.formats.finest)
