"""MoGe-2 rearranged for one canvas size and one token budget, for the fast runners (CPU bf16, CUDA graphs).

`FixedShapeMoGe2(network, canvas_size, num_tokens, dtype)` computes the same function as
`MoGe2Network.forward(canvas, num_tokens)`, with everything that depends only on the weights and the fixed
shape done once at construction:

* the ImageNet normalisation is folded into the patch-embedding conv;
* the class token, register tokens and the position embedding (resized for the token grid) are one
  precomputed prefix / additive table;
* LayerScale is folded into the attention and MLP output projections;
* the encoder's per-layer 1x1 output projections and the neck's first 1x1 input conv are one matrix over the
  four normed intermediate layers (no non-linearity between them); the uv half of that conv and the neck's
  uv input convs of the other levels are constant maps;
* the finest level (no residual blocks there in MoGe-2: last resampler conv, the neck's and each head's 1x1
  convs) is linear, so every head's output there is `conv3x3(head upsample) + conv3x3(neck upsample) +
  constant map`, with the 1x1 convs multiplied into the 3x3 kernels: 7 output channels instead of 4 x 32.

Matrix work runs in `dtype` (bfloat16/float16 on the fast paths), channels-last; the residual stream of the
ViT, the head outputs, the final resize to the canvas and the output activations stay float32. The ViT's float
matmuls are `nn.Linear`, or with `vit_linear="onednn"` oneDNN's linear on weights packed at construction with
GELU fused into the first MLP matmul (`OnednnLinear`). With
`vit_int8` (the CPU's opt-in "int8") the ViT's linear layers are int8 (`Int8Linear`, or `OnednnInt8Linear` with
`vit_int8="onednn"`), smoothed per input channel with
activation ranges calibrated at construction (one `dtype` pass over a synthetic photo at <= 600 tokens). In float32
the result equals the reference network up to float round-off (the folds reassociate sums); the reference
itself (`TorchRunner`) is the exact float32 path.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import skip_init

from ..network import MoGe2Network, token_grid
from ..network.moge2 import remap_points
from ..network.vit import Block
from .cpu_kernels import attention_bf16, dequantize, native_attention_supported, quantize_rows

__all__ = [
    "FixedShapeMoGe2",
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
    "raw_outputs",
    "ATTENTION_KINDS",
    "HEADS",
]

HEADS = ("points", "normal", "mask")
CALIBRATION_TOKENS = 600  # token budget of the int8 calibration forward (at load)


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
    """A DINOv2 block with LayerScale folded into `attn_out` and `ffn_out`, and the attention scale into the q
    rows of `qkv`; matmuls in `dtype`, or int8 with `int8` ("int8" or True: `Int8Linear`, "onednn":
    `OnednnInt8Linear`; smoothed with `act_max`: {linear name: per input channel max |x|}). Attention
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
        block: Block,
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
        self.gelu_fused = linear == "onednn" and not int8 and not hasattr(block.mlp, "w12")

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
        self.num_heads = block.attn.num_heads
        head_dim = block.attn.qkv.in_features // self.num_heads
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
        g1, g2 = block.ls1.gamma.detach().float(), block.ls2.gamma.detach().float()
        dim = block.attn.qkv.in_features
        q_scale = torch.ones(3 * dim, device=g1.device)
        q_scale[:dim] = (dim // self.num_heads) ** -0.5
        self.qkv = make(q_scale[:, None] * block.attn.qkv.weight.float(), q_scale * block.attn.qkv.bias.float(), dtype)
        self.attn_out = make(g1[:, None] * block.attn.proj.weight.float(), g1 * block.attn.proj.bias.float(), dtype)
        mlp = block.mlp
        self.swiglu = hasattr(mlp, "w12")
        if self.swiglu:
            self.ffn_in = make(mlp.w12.weight.float(), mlp.w12.bias.float(), dtype)
            out = mlp.w3
        else:
            act = "gelu" if self.gelu_fused else "none"
            self.ffn_in = make(mlp.fc1.weight.float(), mlp.fc1.bias.float(), dtype, act)
            out = mlp.fc2
        self.ffn_out = make(g2[:, None] * out.weight.float(), g2 * out.bias.float(), dtype)

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


def _to_layout(module: nn.Module, dtype: torch.dtype, channels_last: bool) -> nn.Module:
    module = copy.deepcopy(module).to(dtype).requires_grad_(False)
    return module.to(memory_format=torch.channels_last) if channels_last else module


def _const(t: torch.Tensor, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    t = t.detach().to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t.contiguous()


def _matrix(conv: nn.Module, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (out, in), bias (out,)) of a 1x1 conv, or the identity for nn.Identity (float32, on `device`:
    the network's, so that the folds also build on a GPU)."""
    if isinstance(conv, nn.Identity):
        return torch.eye(channels, device=device), torch.zeros(channels, device=device)
    if not (isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1)):
        raise ValueError(f"expected a 1x1 conv or identity, got {conv}")
    return conv.weight.detach().float()[:, :, 0, 0], conv.bias.detach().float()


def _split_resampler(resampler: nn.Sequential) -> tuple[nn.Module, nn.Conv2d]:
    """A resampler = (upsampling part, final 3x3 replicate-padded conv)."""
    last = resampler[-1]
    if not (isinstance(last, nn.Conv2d) and last.kernel_size == (3, 3) and last.padding_mode == "replicate"):
        raise ValueError(f"the finest-level fold expects a resampler ending in a 3x3 replicate conv, got {resampler}")
    return nn.Sequential(*list(resampler)[:-1]), last


def _fold_kernel(matrix: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """The 3x3 kernel of `matrix @ conv` (a 1x1 conv after a 3x3 conv, without the bias), float32."""
    return torch.einsum("om,mikl->oikl", matrix, conv.weight.detach().float())


class FixedShapeMoGe2(nn.Module):
    """MoGe-2 for one canvas (width, height) and token budget. `forward(canvas)` -> the reference's raw dict.

    canvas: (1, 3, H, W) float32 in [0, 1] on the module's device. Returns float32 `points` (1, H, W, 3),
    `normal` (1, H, W, 3), `mask` (1, H, W) probability, `metric_scale` (1,), as `MoGe2Network.forward`.
    """

    def __init__(
        self,
        network: MoGe2Network,
        canvas_size: tuple,
        num_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        residual_dtype: torch.dtype = torch.float32,
        channels_last: bool = True,
        attention: str = "sdpa",
        vit_int8=False,
        native=None,
        int8_smoothing: Optional[float] = INT8_SMOOTHING,
        vit_linear: str = "aten",
    ):
        super().__init__()
        cfg = network.config
        width, height = (int(v) for v in canvas_size)
        self.canvas_size = (width, height)
        self.dtype = dtype
        self.residual_dtype = residual_dtype
        self.channels_last = channels_last
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        self.attention = attention
        self.vit_int8 = "int8" if vit_int8 is True else vit_int8  # False, or the int8 kernel: INT8_KERNELS
        self.native = native  # the native host library (`cpu_kernels`: fused attention, int8 glue), or None: torch
        self.int8_smoothing = int8_smoothing  # SmoothQuant's alpha for the int8 ViT (None: no smoothing)
        if vit_linear not in LINEAR_KERNELS:
            raise ValueError(f"vit_linear must be one of {LINEAR_KERNELS}, got {vit_linear!r}")
        self.vit_linear = vit_linear  # the ViT's float matmuls: nn.Linear ("aten") or OnednnLinear ("onednn")
        self.remap = cfg.remap_output
        self.aspect = aspect = width / height
        self.rows, self.cols = rows, cols = token_grid(num_tokens, aspect)
        device = next(network.parameters()).device
        with torch.no_grad():
            self._build_encoder(network, rows, cols)
            uv = network.uv_planes(rows, cols, aspect, torch.float32, device)
            self._build_decoder(network, uv)
            self.scale_head = (
                copy.deepcopy(network.scale_head).float().requires_grad_(False)
                if hasattr(network, "scale_head")
                else None
            )

    # ----------------------------------------------------------------------------------------- build
    def _build_encoder(self, network: MoGe2Network, rows: int, cols: int) -> None:
        enc, vit = network.encoder, network.encoder.backbone
        spec = vit.spec
        self.patch = spec.patch_size
        self.layers = list(enc.layers)
        self.num_prefix = 1 + spec.num_register_tokens
        # (x - mean) / std -> patch conv  ==  conv with weight W / std and bias b - sum(W * mean / std)
        proj = vit.patch_embed.proj
        mean, std = enc.image_mean.detach().float().view(-1), enc.image_std.detach().float().view(-1)
        w = proj.weight.detach().float() / std[None, :, None, None]
        b = proj.bias.detach().float() - (w * mean[None, :, None, None]).sum(dim=(1, 2, 3))
        self.patch_embed = skip_init(nn.Conv2d, 3, w.shape[0], spec.patch_size, stride=spec.patch_size, device=w.device)
        self.patch_embed.weight.copy_(w)
        self.patch_embed.bias.copy_(b)
        self.patch_embed = _to_layout(self.patch_embed, self.dtype, self.channels_last)
        pos = vit.position_embedding(rows, cols).detach().float()
        self.register_buffer("token_prefix", self._token_prefix(vit, pos))  # (1, P, C)
        self.register_buffer("patch_pos", pos[:, 1:].to(self.residual_dtype))  # (1, rows*cols, C)
        workspace = HeadByHeadAttention() if self.attention == "heads" else None  # one workspace for all blocks
        blocks = vit.blocks[: max(self.layers) + 1]
        act_max, alpha = [None] * len(blocks), 0.5
        if self.vit_int8 and self.int8_smoothing is not None:
            act_max, alpha = self._activation_maxima(vit, blocks), self.int8_smoothing
        tokens = self.num_prefix + rows * cols
        self.blocks = nn.ModuleList(
            FastBlock(
                blk,
                self.dtype,
                self.attention,
                workspace,
                self.vit_int8,
                self.native,
                a,
                alpha,
                self.num_prefix,
                linear=self.vit_linear,
                tokens=tokens,
            )
            for blk, a in zip(blocks, act_max)
        )
        self.final_norm = copy.deepcopy(vit.norm).float().requires_grad_(False)

    def _token_prefix(self, vit, pos: torch.Tensor) -> torch.Tensor:
        """The class token (+ its position embedding) and the register tokens, (1, P, C) in the residual dtype."""
        prefix = [vit.cls_token.detach().float() + pos[:, :1]]
        if vit.register_tokens is not None:
            prefix.append(vit.register_tokens.detach().float())
        return torch.cat(prefix, dim=1).to(self.residual_dtype)

    def _embed(self, image: torch.Tensor, prefix: torch.Tensor, patch_pos: torch.Tensor) -> torch.Tensor:
        """image (1, 3, rows * patch, cols * patch) in [0, 1] -> the ViT's input tokens (1, P + rows * cols, C)."""
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        patches = self.patch_embed(image.to(self.dtype)).flatten(2).transpose(1, 2)  # (1, rows*cols, C)
        return torch.cat([prefix, patches.to(self.residual_dtype) + patch_pos], dim=1)

    def _activation_maxima(self, vit, blocks) -> list:
        """Calibration of the int8 smoothing: per block, {linear name: per input channel max |x|} of the
        `dtype` graph on a synthetic photo at a reduced token budget (at most CALIBRATION_TOKENS; the channels
        with outliers are the same at every size)."""
        from ..synthetic import synthetic_photo

        rows, cols = token_grid(min(CALIBRATION_TOKENS, self.rows * self.cols), self.aspect)
        pos = vit.position_embedding(rows, cols).detach().float()
        device = self.patch_pos.device
        photo = torch.from_numpy(synthetic_photo((cols * self.patch, rows * self.patch), seed=0))
        tokens = self._embed(
            photo.permute(2, 0, 1)[None].to(device, torch.float32).div(255),
            self._token_prefix(vit, pos),
            pos[:, 1:].to(self.residual_dtype),
        )
        maxima = []
        for block in blocks:
            fast = FastBlock(block, self.dtype)  # SDPA attention: every linear is called as a module
            seen: dict = {}
            hooks = [
                getattr(fast, name).register_forward_pre_hook(
                    lambda module, args, name=name: seen.__setitem__(
                        name, args[0].abs().flatten(0, -2).amax(dim=0).float()
                    )
                )
                for name in FastBlock.LINEARS
            ]
            tokens = fast(tokens)
            for hook in hooks:
                hook.remove()
            maxima.append(seen)
        return maxima

    def _build_decoder(self, network: MoGe2Network, uv: list) -> None:
        neck = network.neck
        levels = self.num_levels = len(neck.res_blocks)
        last = levels - 1
        # Level 0 of the neck: conv1x1(cat(sum_i P_i LN_i + p, uv0)) == [LN_5 | LN_11 | ...] @ W^T + const map.
        in0 = neck.input_blocks[0]
        if not isinstance(in0, nn.Conv2d):
            raise ValueError("the neck's level-0 input must be a 1x1 conv over (features, uv)")
        w_in = in0.weight.detach().float()[:, :, 0, 0]
        feat_dim = w_in.shape[1] - 2
        w_feat, w_uv = w_in[:, :feat_dim], w_in[:, feat_dim:]
        mats, bias = [], in0.bias.detach().float().clone()
        for proj in network.encoder.output_projections:
            p_w, p_b = _matrix(proj, 0, proj.weight.device)
            mats.append(w_feat @ p_w)
            bias += w_feat @ p_b
        self.neck_in0 = make_linear(torch.cat(mats, dim=1), torch.zeros_like(bias), self.dtype)
        uv0 = uv[0][0].flatten(1)  # (2, rows*cols)
        self.register_buffer("neck_in0_const", (w_uv @ uv0 + bias[:, None]).t().contiguous())  # (rows*cols, d0) float32
        # The neck's uv inputs of levels 1..last are constant maps (the last one goes into the finest fold).
        for i in range(1, last):
            self.register_buffer(f"neck_const{i}", _const(neck.input_blocks[i](uv[i]), self.dtype, self.channels_last))
        self.neck = _to_layout(neck, self.dtype, self.channels_last)
        heads = [h for h in HEADS if getattr(network, h + "_head", None) is not None]
        self.head_names = heads
        self.heads = nn.ModuleDict(
            {h: _to_layout(getattr(network, h + "_head"), self.dtype, self.channels_last) for h in heads}
        )
        self._build_finest_fold(network, heads, neck.input_blocks[last](uv[last]).float(), levels)

    def _build_finest_fold(self, network: MoGe2Network, heads: list, neck_const: torch.Tensor, levels: int) -> None:
        last = levels - 1
        neck = network.neck
        for name, stack in [("neck", neck)] + [(h, getattr(network, h + "_head")) for h in heads]:
            if len(stack.res_blocks[last]) != 0:
                raise ValueError(
                    f"the finest-level fold needs no residual blocks at the finest level ({name} has some)"
                )
        n_up, n_conv = _split_resampler(neck.resamplers[last - 1])
        self.neck_up = _to_layout(n_up, self.dtype, self.channels_last)
        on_w, _ = _matrix(neck.output_blocks[last], n_conv.out_channels, n_conv.weight.device)
        kernels_neck, consts = [], []
        self.head_ups = nn.ModuleList()
        self.head_convs = nn.ModuleList()
        zero_neck = torch.zeros(1, n_conv.in_channels, *neck_const.shape[-2:], device=neck_const.device)
        neck_const_out = neck.output_blocks[last](n_conv(zero_neck) + neck_const)  # the neck's finest output at u = 0
        for h in heads:
            stack = getattr(network, h + "_head")
            h_up, h_conv = _split_resampler(stack.resamplers[last - 1])
            ih_w, _ = _matrix(stack.input_blocks[last], h_conv.out_channels, h_conv.weight.device)
            oh_w, _ = _matrix(stack.output_blocks[last], h_conv.out_channels, h_conv.weight.device)
            kernels_neck.append(_fold_kernel(oh_w @ ih_w @ on_w, n_conv))
            conv = skip_init(
                nn.Conv2d,
                h_conv.in_channels,
                oh_w.shape[0],
                3,
                padding=1,
                padding_mode="replicate",
                bias=False,
                device=oh_w.device,
            )
            conv.weight.copy_(_fold_kernel(oh_w, h_conv))
            self.head_ups.append(_to_layout(h_up, self.dtype, self.channels_last))
            self.head_convs.append(_to_layout(conv, self.dtype, self.channels_last))
            zero_head = torch.zeros(1, h_conv.in_channels, *neck_const.shape[-2:], device=neck_const.device)
            consts.append(stack.output_blocks[last](h_conv(zero_head) + stack.input_blocks[last](neck_const_out)))
        self.head_channels = [k.shape[0] for k in kernels_neck]
        conv = skip_init(
            nn.Conv2d,
            n_conv.in_channels,
            sum(self.head_channels),
            3,
            padding=1,
            padding_mode="replicate",
            bias=False,
            device=n_conv.weight.device,
        )
        conv.weight.copy_(torch.cat(kernels_neck))
        self.neck_fold_conv = _to_layout(conv, self.dtype, self.channels_last)
        const = torch.cat(consts, dim=1).float()  # (1, sum out, H_L, W_L)
        self.register_buffer(
            "finest_const", const.contiguous(memory_format=torch.channels_last) if self.channels_last else const
        )

    # --------------------------------------------------------------------------------------- forward
    def _nchw(self, tokens: torch.Tensor, channels: int) -> torch.Tensor:
        """(rows*cols, C) row-major tokens -> (1, C, rows, cols) (a channels-last view, or a contiguous copy)."""
        x = tokens.view(1, self.rows, self.cols, channels).permute(0, 3, 1, 2)
        return x if self.channels_last else x.contiguous()

    def encode(self, canvas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """canvas (1, 3, H, W) float32 -> neck level-0 input (1, d0, rows, cols) in `dtype`, class token (1, C)
        float32."""
        size = (self.rows * self.patch, self.cols * self.patch)
        x = F.interpolate(canvas, size, mode="bilinear", align_corners=False, antialias=True)
        tokens = self._embed(x, self.token_prefix, self.patch_pos)
        taps = {}
        wanted = set(self.layers)
        for i, block in enumerate(self.blocks):
            tokens = block(tokens)
            if i in wanted:
                taps[i] = self.final_norm(tokens)
        cls_token = taps[self.layers[-1]][:, 0].float()
        stacked = torch.cat([taps[i][0, self.num_prefix :].to(self.dtype) for i in self.layers], dim=1)
        level0 = (self.neck_in0(stacked).float() + self.neck_in0_const).to(self.dtype)
        return self._nchw(level0, level0.shape[1]), cls_token

    def decode(self, level0: torch.Tensor) -> torch.Tensor:
        """Neck + heads -> (1, sum of head channels, H_L, W_L) float32 maps at the finest level."""
        last = self.num_levels - 1
        neck = self.neck
        x = level0
        neck_out = []
        for i in range(last):
            if i > 0:
                x = x + getattr(self, f"neck_const{i}")
            x = neck.res_blocks[i](x)
            neck_out.append(neck.output_blocks[i](x))
            if i < last - 1:
                x = neck.resamplers[i](x)
        y = self.finest_const + self.neck_fold_conv(self.neck_up(x)).float()
        parts = []
        for name, up, conv in zip(self.head_names, self.head_ups, self.head_convs):
            head = self.heads[name]
            h = None
            for i in range(last):
                feature = head.input_blocks[i](neck_out[i])
                h = feature if h is None else h + feature
                h = head.res_blocks[i](h)
                if i < last - 1:
                    h = head.resamplers[i](h)
            parts.append(conv(up(h)).float())
        return y + torch.cat(parts, dim=1)

    def forward(self, canvas: torch.Tensor) -> dict:
        height, width = canvas.shape[-2:]
        if (width, height) != self.canvas_size:
            raise ValueError(
                f"canvas: this graph runs {self.canvas_size[0]}x{self.canvas_size[1]}, got {width}x{height}"
            )
        level0, cls_token = self.encode(canvas)
        maps = F.interpolate(self.decode(level0), (height, width), mode="bilinear", align_corners=False)
        out = raw_outputs(maps, self.head_names, self.head_channels, self.remap)
        if self.scale_head is not None:
            out["metric_scale"] = self.scale_head(cls_token).squeeze(1).exp()
        return out


def raw_outputs(maps: torch.Tensor, head_names: list, head_channels: list, remap: str) -> dict:
    """The heads' stacked maps at the canvas (1, sum of channels, H, W) -> the reference's raw dict: `points`
    (1, H, W, 3) after the output remap, `normal` (1, H, W, 3) unit, `mask` (1, H, W) probability."""
    out: dict = {}
    start = 0
    for name, channels in zip(head_names, head_channels):
        out[name] = maps[:, start : start + channels]
        start += channels
    out["points"] = remap_points(out["points"].permute(0, 2, 3, 1), remap).contiguous()
    if "normal" in out:
        # channels-last first: normalising the permuted view takes a slow strided reduction (several times the
        # whole remap); the result differs from it only in float round-off
        out["normal"] = F.normalize(out["normal"].permute(0, 2, 3, 1).contiguous(), dim=-1)
    if "mask" in out:
        out["mask"] = out["mask"][:, 0].sigmoid()
    return out
