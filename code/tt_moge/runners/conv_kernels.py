"""The decoder's residual blocks through oneDNN's fused convolutions (the CPU graph's choice point "res_block").

A MoGe-2 residual block is `x + conv3x3(relu(conv3x3(relu(x))))` with replicate padding (no norms in MoGe-2's
released models). `torch.nn` runs it as six passes over the map: ReLU, pad, conv, ReLU, pad, conv, and the add.
`OnednnResBlock` runs the second ReLU in the first conv's output stage and the residual add in the second's
(`torch.ops.mkldnn._convolution_pointwise`, the kernels PyTorch's own CPU compiler calls), the sum taken in the
convolution's float32 accumulators before rounding to the graph's dtype. Whether it or the plain block runs is
measured at load (`CpuGraphRunner`); the ONNX export and the CUDA graph keep the plain modules.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..network.convstack import ResidualConvBlock

__all__ = ["RES_BLOCK_KERNELS", "OnednnResBlock", "fusable", "fuse_res_blocks", "onednn_conv_available"]

RES_BLOCK_KERNELS = ("aten", "onednn")  # the decoder's residual blocks: as torch.nn runs them, or OnednnResBlock

_PAD = (1, 1, 1, 1)
_ONE, _NONE = [1, 1], [0, 0]


def onednn_conv_available() -> bool:
    """Whether this torch has oneDNN's fused convolutions (builds with oneDNN: every x86 wheel)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def _conv3x3_replicate(m: nn.Module) -> bool:
    return (
        isinstance(m, nn.Conv2d)
        and m.kernel_size == (3, 3)
        and m.padding == (1, 1)
        and m.padding_mode == "replicate"
        and m.stride == (1, 1)
        and m.dilation == (1, 1)
        and m.groups == 1
    )


def fusable(block: nn.Module) -> bool:
    """Whether `block` is a residual block OnednnResBlock computes: no norms, ReLU, 3x3 replicate convs."""
    if not isinstance(block, ResidualConvBlock) or not isinstance(block.skip_connection, nn.Identity):
        return False
    kinds = list(block.layers)
    return (
        len(kinds) == 6
        and all(isinstance(kinds[i], nn.Identity) for i in (0, 3))
        and all(isinstance(kinds[i], nn.ReLU) for i in (1, 4))
        and all(_conv3x3_replicate(kinds[i]) for i in (2, 5))
    )


class OnednnResBlock(nn.Module):
    """`block` (a `fusable` residual block) as pad(relu(x)) -> conv+ReLU -> pad -> conv+x, in the block's dtype."""

    def __init__(self, block: nn.Module):
        super().__init__()
        if not fusable(block):
            raise ValueError(f"OnednnResBlock needs a residual block of ReLUs and 3x3 replicate convs, got {block}")
        first, second = block.layers[2], block.layers[5]
        self.w1, self.w2 = (nn.Parameter(c.weight.detach().clone(), requires_grad=False) for c in (first, second))
        self.b1, self.b2 = (
            nn.Parameter(c.bias.detach().clone(), requires_grad=False) if c.bias is not None else None
            for c in (first, second)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(torch.relu(x), _PAD, mode="replicate")
        h = torch.ops.mkldnn._convolution_pointwise(h, self.w1, self.b1, _NONE, _ONE, _ONE, 1, "relu", [], "")
        h = F.pad(h, _PAD, mode="replicate")
        return torch.ops.mkldnn._convolution_pointwise.binary(
            h, x, self.w2, self.b2, _NONE, _ONE, _ONE, 1, "add", None, None, [], None
        )


def fuse_res_blocks(module: nn.Module) -> int:
    """Replace, in place, every `fusable` residual block inside `module`'s Sequentials by an OnednnResBlock
    (its weights as they are: dtype and memory format). Returns how many were replaced."""
    count = 0
    for seq in [m for m in module.modules() if isinstance(m, nn.Sequential)]:
        for i, block in enumerate(seq):
            if fusable(block):
                seq[i] = OnednnResBlock(block)
                count += 1
    return count
