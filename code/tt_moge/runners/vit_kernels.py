"""The ViT's kernels on the fast runners: `FastBlock`, one DINOv2 block run from its folded weights
(`folding.fold_block`), and the matmuls and attentions it can run with.

The float matmuls are `nn.Linear` (`make_linear`), or oneDNN's linear on weights packed at construction with GELU
fused into the first MLP matmul (`OnednnLinear`). The int8 ones (the CPU's opt-in "int8") are `Int8Linear`
(per-token scales, `torch._int_mm`) or `OnednnInt8Linear` (oneDNN's int8 matmul), both smoothed per input channel
(SmoothQuant). The attention is PyTorch's SDPA, `HeadByHeadAttention` (a few heads at a time into reused buffers)
or the native fused bfloat16 kernel (`cpu_kernels.attention_bf16`). Which one runs is measured at load
(`CpuGraphRunner`, `kernel_choice.py`).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import skip_init

from .cpu_kernels import attention_bf16, dequantize, native_attention_supported, quantize_rows
from .folding import BlockFolds

__all__ = [
    "FastBlock",
    "HeadByHeadAttention",
    "Int8Linear",
    "OnednnInt8Linear",
    "OnednnLinear",
    "INT8_KERNELS",
    "INT8_SMOOTHING",
    "LINEAR_KERNELS",
    "onednn_linear_available",
    "onednn_int8_available",
    "make_linear",
    "ATTENTION_KINDS",
]


def make_linear(weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    """An inference-only nn.Linear in `dtype` holding copies of `weight` (out, in) and `bias`."""
    layer = skip_init(nn.Linear, weight.shape[1], weight.shape[0], device=weight.device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer.requires_grad_(False)


class Int8Linear(nn.Module):
    """y = x W^T + b with int8 weights (one scale per output channel) and int8 activations (one scale per token,
    taken at run time), int32 accumulation (`torch._int_mm`: VNNI dot products on x86), output in `dtype`.

    Faster than the bfloat16 GEMM where the CPU has int8 dot products (VNNI), the quantisation and rescaling
    included, for a larger rounding error than bfloat16's (docs/performance.md has both).

    `act_max` (per input channel, the largest |x| seen in calibration) turns on SmoothQuant-style smoothing
    (Xiao et al. 2023): channel j of x is divided by s_j = act_max_j^alpha / max_i |W_ij|^(1 - alpha) and column j
    of W multiplied by it, which leaves x W^T unchanged but moves outlier channels' range from the activations
    (one int8 scale per token) into the weights (one scale per output channel). With `lib` (the native host
    library) the quantisation and the rescaling are one native pass each (`cpu_kernels`), bit-identical to
    the torch ops.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        dtype: torch.dtype,
        lib=None,
        act_max: Optional[torch.Tensor] = None,
        alpha: float = 0.5,
    ):
        super().__init__()
        weight = weight.float()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = dtype
        self.lib = lib
        weight, inv_smooth = _smoothing(weight, act_max, alpha)
        self.register_buffer("inv_smooth", inv_smooth)  # None: no smoothing
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.register_buffer(
            "weight_t", torch.round(weight / scale[:, None]).to(torch.int8).t().contiguous()
        )  # (in, out)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias.float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x8, token_scale = quantize_rows(x.reshape(-1, shape[-1]), self.lib, self.inv_smooth)
        y = dequantize(
            torch._int_mm(x8, self.weight_t), token_scale, self.weight_scale, self.bias, self.dtype, self.lib
        )
        return y.view(*shape[:-1], self.out_features)


def _smoothing(weight: torch.Tensor, act_max: Optional[torch.Tensor], alpha: float) -> tuple:
    """SmoothQuant (see `Int8Linear`): (the weight with column j times s_j, 1 / s (or None without `act_max`))."""
    if act_max is None:
        return weight, None
    act_max = act_max.float().to(weight.device)
    w_max = weight.abs().amax(dim=0)
    smooth = act_max.clamp_min(1e-12) ** alpha / w_max.clamp_min(1e-12) ** (1 - alpha)
    smooth = torch.where((act_max > 0) & (w_max > 0), smooth, torch.ones_like(smooth))
    return weight * smooth[None, :], 1 / smooth


class OnednnInt8Linear(nn.Module):
    """y = x W^T + b through oneDNN's int8 matmul (`torch.ops.onednn.qlinear_pointwise`, the kernel of PyTorch's
    own x86 int8 inference path: AMX-INT8 tiles where the CPU has them, else VNNI or AVX2 u8 x s8 products):
    weights int8, one scale per output channel, packed once for the CPU; activations uint8 with one scale and
    zero point per tensor, taken at run time; int32 accumulation; bias and output in `dtype` (bfloat16 or
    float32) inside the kernel.

    One scale per tensor instead of `Int8Linear`'s one per token: the GEMM is then one oneDNN call with its
    scales applied inside, the form oneDNN's AMX and VNNI kernels run fastest. Outlier channels would cost the
    other channels their levels, so the same SmoothQuant smoothing (`act_max`, `alpha`) moves their range
    into the weights first. The class and register tokens (`prefix_rows`, the first rows of each image) differ
    in range from the patch tokens, and the class token alone feeds the scale head: they get a scale (and a
    oneDNN call) of their own. Whether this kernel, `Int8Linear` or a plain `dtype` GEMM runs is measured at load
    (`CpuGraphRunner`); each is held to the same accuracy limits (tests/test_runners.py).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        dtype: torch.dtype,
        act_max: Optional[torch.Tensor] = None,
        alpha: float = 0.5,
        prefix_rows: int = 0,
    ):
        super().__init__()
        self.prefix_rows = prefix_rows
        weight, inv_smooth = _smoothing(weight.float(), act_max, alpha)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = dtype
        self.register_buffer("inv_smooth", inv_smooth)
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero", torch.zeros(self.out_features, dtype=torch.int32))
        self.register_buffer("bias_out", bias.to(dtype).clone())  # added in the output's dtype by the kernel
        # oneDNN's packed layout for this CPU (an opaque tensor: kept out of the state dict)
        self.packed = torch.ops.onednn.qlinear_prepack(torch.round(weight / scale[:, None]).to(torch.int8), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, K) or (B, N, K); with `prefix_rows` = P, the first P tokens (of each image) get a scale of
        their own."""
        p = self.prefix_rows
        if p and x.shape[-2] > p:
            if x.dim() == 2:
                return torch.cat([self._linear(x[:p]), self._linear(x[p:])])
            if x.dim() == 3:
                b, n = x.shape[:2]
                head, tail = self._linear(x[:, :p].reshape(b * p, -1)), self._linear(x[:, p:].reshape(-1, x.shape[-1]))
                return torch.cat([head.view(b, p, -1), tail.view(b, n - p, -1)], dim=1)
        return self._linear(x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        if self.inv_smooth is not None:
            x = x * self.inv_smooth
        low, high = (float(v) for v in torch.aminmax(x))
        low, high = min(low, 0.0), max(high, 0.0)
        scale = max(high - low, 1e-12) / 255
        zero = int(round(-low / scale))
        q = torch.round(x * (1 / scale)).add_(zero).clamp_(0, 255).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(
            q,
            scale,
            zero,
            self.packed,
            self.weight_scale,
            self.weight_zero,
            self.bias_out,
            1.0,
            0,
            self.dtype,
            "none",
            [],
            "",
        )
        return y.view(*shape[:-1], self.out_features)


class OnednnLinear(nn.Module):
    """y = act(x W^T + b) in `dtype` through oneDNN's matmul with the weight packed once for this CPU
    (`torch.ops.mkldnn._linear_pointwise` on a `_reorder_linear_weight`: the kernel PyTorch's own CPU compiler
    calls for frozen weights). Against `nn.Linear` it saves re-laying the weight out for the CPU's blocked
    kernels on every call, and with `activation="gelu"` the exact GELU (as `F.gelu`) runs in the matmul's output
    stage instead of another pass over the (N, 4C) activations. The packed weight is an opaque oneDNN tensor:
    kept out of the state dict, and the module cannot be deep-copied. Whether it or `nn.Linear` runs the ViT is
    measured at load (`CpuGraphRunner`, choice point "vit_linear")."""

    ACTIVATIONS = ("none", "gelu")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        dtype: torch.dtype,
        activation: str = "none",
        batch_size: Optional[int] = None,
    ):
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"activation must be one of {self.ACTIVATIONS}, got {activation!r}")
        self.out_features, self.in_features = weight.shape
        self.activation = activation
        self.register_buffer("bias", bias.detach().to(dtype).clone())
        # batch_size: the token count the weight's blocking is chosen for (None: oneDNN's default)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), batch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [], "none")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


LINEAR_KERNELS = ("aten", "onednn")  # the ViT's float matmuls: nn.Linear, or OnednnLinear (packed, GELU fused)


def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's packed float linear (builds with oneDNN: every x86 wheel)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


INT8_SMOOTHING = 0.5  # SmoothQuant's alpha for the int8 ViT: the share of each input channel's range moved to weights
INT8_KERNELS = ("int8", "onednn")  # Int8Linear (per-token scales, torch._int_mm), OnednnInt8Linear


def onednn_int8_available() -> bool:
    """Whether this torch has oneDNN's int8 linear operators (builds with oneDNN: every x86 wheel)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


class HeadByHeadAttention:
    """Multi-head softmax attention a few heads at a time, into preallocated buffers (the CPU path where the
    fused native attention, `cpu_kernels.attention_bf16`, cannot run: no AVX512-BF16, MOGE_HOST=torch, float32).

    On CPU this beats PyTorch's flash-attention kernel in bfloat16 (docs/performance.md): the score matrices of
    `heads_per_step` heads stay in the L3 cache, both matmuls go to oneDNN's bfloat16 GEMM on transposed views (q, k,
    v come from one transposed qkv projection, so no head is copied), and reusing the buffers saves the page faults of
    fresh allocations of the score matrices. Several heads per step keep the number of parallel regions low: one head
    per step was slower on 2 threads than on 1 on a loaded machine. Softmax over `dtype` scores accumulates in
    float32. The 1/sqrt(head_dim) scale must be folded into q. Not re-entrant: one forward at a time per instance.
    """

    def __init__(self, heads_per_step: int = 8):
        self.heads_per_step = heads_per_step
        self._buffers: Optional[tuple] = None

    def __call__(self, qkv_t: torch.Tensor, num_heads: int) -> torch.Tensor:
        """qkv_t (3 * C, N): rows [q | k | v], each head_dim rows per head -> attention output (N, C)."""
        three_c, n = qkv_t.shape
        c = three_c // 3
        dim = c // num_heads
        step = max(1, min(self.heads_per_step, num_heads))
        while num_heads % step:
            step -= 1
        key = (num_heads, step, n, dim, qkv_t.dtype, qkv_t.device)
        if self._buffers is None or self._buffers[0] != key:
            scores = torch.empty(step, n, n, dtype=qkv_t.dtype, device=qkv_t.device)
            out = torch.empty(num_heads, n, dim, dtype=qkv_t.dtype, device=qkv_t.device)
            self._buffers = (key, scores, torch.empty_like(scores), out)
        _, scores, probs, out = self._buffers
        q_t, k_t, v_t = (qkv_t[part * c : (part + 1) * c].view(num_heads, dim, n) for part in range(3))
        for h in range(0, num_heads, step):
            torch.bmm(q_t[h : h + step].transpose(1, 2), k_t[h : h + step], out=scores)
            torch.ops.aten._softmax.out(scores, -1, False, out=probs)
            torch.bmm(probs, v_t[h : h + step].transpose(1, 2), out=out[h : h + step])
        return out.transpose(0, 1).reshape(n, c)


ATTENTION_KINDS = ("sdpa", "heads", "native")


class FastBlock(nn.Module):
    """A DINOv2 block from its folds (`folding.BlockFolds`: LayerScale folded into `attn_out` and `ffn_out`, the
    attention scale into the q rows of `qkv`); matmuls in `dtype`, or int8 with `int8` ("int8" or True:
    `Int8Linear`, "onednn": `OnednnInt8Linear`; smoothed with `act_max`: {linear name: per input channel max
    |x|}). Attention
    (`attention`): "sdpa" (PyTorch), "heads" (`HeadByHeadAttention`, batch 1, with the shared `workspace`) or
    "native" (the fused bfloat16 kernel of `lib`, batch 1). The float matmuls (`linear`): "aten" (`nn.Linear`,
    GELU after it) or "onednn" (`OnednnLinear`: packed weights, GELU fused into `ffn_in`; `tokens` is the token
    count they are packed for).

    The residual stream `x` (B, N, C) stays in its own dtype (float32 by default): every block adds small
    updates to it, and bfloat16 would round them away. LayerNorm runs on it in that dtype.
    """

    LINEARS = ("qkv", "attn_out", "ffn_in", "ffn_out")

    def __init__(
        self,
        block: BlockFolds,
        dtype: torch.dtype,
        attention: str = "sdpa",
        workspace: Optional[HeadByHeadAttention] = None,
        int8=False,
        lib=None,
        act_max: Optional[dict] = None,
        alpha: float = 0.5,
        prefix_rows: int = 0,
        linear: str = "aten",
        tokens: Optional[int] = None,
    ):
        super().__init__()
        names = iter(self.LINEARS)  # the order of the make() calls below
        if linear not in LINEAR_KERNELS:
            raise ValueError(f"linear must be one of {LINEAR_KERNELS}, got {linear!r}")
        self.gelu_fused = linear == "onednn" and not int8 and not block.swiglu

        int8 = "int8" if int8 is True else int8  # True: the original int8 kernel (Int8Linear)
        if int8 and int8 not in INT8_KERNELS:
            raise ValueError(f"int8 must be False or one of {INT8_KERNELS}, got {int8!r}")

        def make(weight, bias, dt, activation="none"):
            if not int8:
                if linear == "onednn":
                    return OnednnLinear(weight, bias, dt, activation, tokens)
                return make_linear(weight, bias, dt)
            seen = None if act_max is None else act_max[next(names)]
            if int8 == "onednn":
                return OnednnInt8Linear(weight, bias, dt, seen, alpha, prefix_rows)
            return Int8Linear(weight, bias, dt, lib, seen, alpha)

        self.dtype = dtype
        self.num_heads = block.num_heads
        head_dim = block.qkv[0].shape[1] // self.num_heads
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if attention == "native" and not (dtype == torch.bfloat16 and native_attention_supported(lib, head_dim)):
            raise ValueError(
                "attention='native' needs bfloat16, heads of 64 and the native library built with AVX512-BF16"
            )
        self.attention = attention
        self.workspace = workspace or (HeadByHeadAttention() if attention == "heads" else None)
        self.lib = lib
        self.norm1 = copy.deepcopy(block.norm1).float()
        self.norm2 = copy.deepcopy(block.norm2).float()
        self.qkv = make(*block.qkv, dtype)
        self.attn_out = make(*block.attn_out, dtype)
        self.swiglu = block.swiglu
        self.ffn_in = make(*block.ffn_in, dtype, "gelu" if self.gelu_fused else "none")
        self.ffn_out = make(*block.ffn_out, dtype)

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        """Normed tokens (B, N, C) in `dtype` -> attention output before `attn_out`, (B, N, C)."""
        b, n, c = h.shape
        if self.attention == "native" and b == 1:
            return attention_bf16(self.qkv(h[0]), self.num_heads, self.lib)[None]
        if self.attention == "heads" and b == 1:
            if isinstance(self.qkv, nn.Linear):
                qkv_t = torch.addmm(self.qkv.bias[:, None], self.qkv.weight, h[0].t())  # (3C, N), no copy
            else:
                qkv_t = self.qkv(h[0]).t().contiguous()
            return self.workspace(qkv_t, self.num_heads)[None]
        q, k, v = self.qkv(h).view(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(1, 2).reshape(b, n, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_out(self.attend(self.norm1(x).to(self.dtype)))
        h = self.ffn_in(self.norm2(x).to(self.dtype))
        if self.swiglu:
            h1, h2 = h.chunk(2, dim=-1)
            h = F.silu(h1) * h2
        elif not self.gelu_fused:
            h = F.gelu(h)
        return x + self.ffn_out(h)
