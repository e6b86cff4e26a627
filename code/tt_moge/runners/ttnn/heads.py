"""The heads on the device (`network/convstack.py`'s `ConvStack` of the points, normal and mask heads, reading the
neck's level outputs) and the finest level, phase-folded at the level before it (`prepare.phase_fold`): one 3x3
conv per feature map (the neck's and each head's), whose sum over the neck and the heads is the 4 x (3 + 3 + 1)
phase channels of every head's finest output (float32), the constant map aside (`post.py` adds it). Each head's
levels run on `decoder.py`'s level ops.

A part of `graph.TtnnGraph` (mixed into it): numpy and the injected ttnn only, and it reads the state the graph
sets up (see `graph.py`): `ttnn`, `plan`, `formats`, `level0_folds`, and the decoder's level ops (`decoder.py`).
"""

from __future__ import annotations

__all__ = ["Heads"]


class Heads:
    """The heads and the finest folded level of the device graph (see the module docstring)."""

    def head_levels(self, neck_out: list, head: dict):
        """One head's levels 0 .. finest - 1 (`head`: its entry of the plan's "heads"): the neck's level outputs ->
        the head's map at the finest fold's input level, or one of neck_out (then not the caller's to free)."""
        T, p = self.ttnn, self.plan
        last = len(p["levels"]) - 1
        key = f"head.{head['name']}"
        h = None  # the head's map, or one of neck_out (then not ours to free)
        for i in range(last):
            if i == 0 and self.level0_folds.get(key):  # the level-0 input conv is inside the upsample's matmul
                h = self._upsample0(neck_out[0], key)
                continue
            feature = self._one_by_one(neck_out[i], f"{key}.in.{i}", i) if head["inputs"][i] else neck_out[i]
            if h is None:
                h = feature
            else:
                summed = self._add(h, feature)
                for t in (h, feature):
                    if t is not neck_out[i]:
                        T.deallocate(t)
                h = summed
            h, _ = self._stack_level(h, key, head, i, owned=h is not neck_out[i])
            if i < last - 1:
                up = self._level_up(h, key, i)
                if h is not neck_out[i]:
                    T.deallocate(h)
                h = up
        return h

    def finest_conv(self, x, name: str):
        """The phase-folded finest conv of feature map `name` ("neck" or a head's name) on its map at the level
        before the finest: (1, 1, in_height * in_width, C) -> (1, 1, in_height * in_width, phase_channels),
        float32 (the finest format). The neck's kernel carries every head's finest input and output 1x1 convs; a
        head's is zero outside its own output channels."""
        fin = self.plan["finest"]
        return self._conv(x, f"finest.{name}", fin["in_height"], fin["in_width"], out_dtype=self.formats.finest)
