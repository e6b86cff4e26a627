"""The emulator's model of Tenstorrent numerics (tests/ttnn_emulator.py), checked against the rules tt-metal documents:
the matrix engine's fidelity passes (5 bits of SrcA = weights and 7 of SrcB = activations per pass; HiFi2 adds
SrcA's next 5, HiFi3 SrcB's next 4, HiFi4 both), the destination register's bfloat16 accumulation without
fp32_dest_acc_en, the SFPU's approximate exp, layer norm's intermediates, FlashAttention's chunked softmax. The
accuracy of the device graph measured in this emulator (test_ttnn_lowering.py) is only as honest as these."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from .ttnn_emulator import FIDELITY_BITS, TtnnEmulator, approx_exp, fidelity_operands, round_bf16, truncate_bits


def _significant_bits(t: torch.Tensor) -> int:
    """The most significant bits any nonzero value of t uses (implicit bit included)."""
    m, _ = torch.frexp(t[t != 0].double())
    bits = 0
    for k in range(1, 25):
        if torch.all(torch.ldexp(m, torch.full_like(m, k, dtype=torch.int32)).frac() == 0):
            return k
        bits = k
    return bits + 1


def _linear(emulator, x, w, fidelity, fp32=True, program_config=None, dtype="bfloat16"):
    T = emulator
    a = T.Tensor(x.numpy(), getattr(T, dtype), T.open_device(), T.TILE_LAYOUT)
    b = T.Tensor(w.numpy(), T.bfloat16, T.open_device(), T.TILE_LAYOUT)
    ck = (
        None
        if fidelity is None
        else T.init_device_compute_kernel_config(
            "blackhole", math_fidelity=getattr(T.MathFidelity, fidelity), fp32_dest_acc_en=fp32
        )
    )
    out = T.linear(a, b, compute_kernel_config=ck, program_config=program_config, dtype=T.float32)
    return out.data, a.data, b.data


def test_matmul_fidelity_passes():
    v = torch.randn(4096) * 10
    for fidelity, (bits_a, bits_b) in FIDELITY_BITS.items():  # (SrcA = weights, SrcB = activations)
        act, wt = fidelity_operands(v, v, fidelity)
        assert _significant_bits(wt) <= bits_a and _significant_bits(act) <= bits_b
        assert torch.all(act.abs() <= v.abs()) and torch.all(act * v >= 0)  # cut toward zero
    assert torch.equal(truncate_bits(torch.tensor([1.99609375]), 8), torch.tensor([1.9921875]))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=gen), torch.randn(128, 32, generator=gen)
    T = TtnnEmulator()
    hifi4, xb, wb = _linear(T, x, w, "HiFi4")
    assert torch.allclose(hifi4, xb @ wb, rtol=1e-5, atol=1e-5)  # bfloat16 operands: HiFi4 is exact
    lofi, _, _ = _linear(T, x, w, "LoFi")
    assert torch.allclose(lofi, truncate_bits(xb, 7) @ truncate_bits(wb, 5), rtol=1e-5, atol=1e-5)
    hifi2, _, _ = _linear(T, x, w, "HiFi2")
    assert torch.allclose(hifi2, truncate_bits(xb, 7) @ wb, rtol=1e-5, atol=1e-5)  # weights whole, activations 7
    hifi3, _, _ = _linear(T, x, w, "HiFi3")
    assert torch.allclose(hifi3, xb @ truncate_bits(wb, 5), rtol=1e-5, atol=1e-5)
    err = {name: float((y - xb @ wb).abs().max()) for name, y in (("LoFi", lofi), ("HiFi2", hifi2), ("HiFi4", hifi4))}
    assert err["LoFi"] > 3 * err["HiFi2"] > 3 * err["HiFi4"]


def test_ttnn_defaults_when_a_matmul_has_no_compute_config():
    """ttnn 0.81: with a program config and no compute config, a matmul runs LoFi (what tt-metal's ViT relies on);
    without either, HiFi2 for bfloat16 inputs; float32 accumulation when the output is float32."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(64, 32, generator=gen)
    T = TtnnEmulator()
    pc = T.MatmulMultiCoreReuseMultiCastProgramConfig(
        compute_with_storage_grid_size=T.CoreCoord(1, 1),
        in0_block_w=1,
        out_subblock_h=1,
        out_subblock_w=1,
        per_core_M=1,
        per_core_N=1,
    )
    default, _, _ = _linear(T, x, w, None, program_config=pc)
    lofi, _, _ = _linear(T, x, w, "LoFi", fp32=True)
    assert torch.equal(default, lofi)
    plain, _, _ = _linear(T, x, w, None)
    assert torch.equal(plain, _linear(T, x, w, "HiFi2", fp32=True)[0])
    assert not torch.equal(plain, lofi)


def test_bfloat16_destination_register_accumulation():
    """Without fp32_dest_acc_en the running sum is rounded to bfloat16 after every 16-deep step: 256 terms of 2^-12
    added to 1 vanish 16 at a time (16 x 2^-12 is half an ulp of bfloat16 at 1: a tie, rounded to even), but
    not in float32."""
    x = torch.ones(1, 257)
    w = torch.full((257, 1), 2.0**-12)
    w[0, 0] = 1.0
    T = TtnnEmulator()
    fp32, _, _ = _linear(T, x, w, "HiFi4", fp32=True)
    bf16, _, _ = _linear(T, x, w, "HiFi4", fp32=False)
    assert float(fp32) == pytest.approx(1.0625)
    assert float(bf16) == 1.0


def test_the_approximate_exp_is_a_few_percent_off():
    x = torch.linspace(-20, 0, 20001)
    rel = (approx_exp(x) / torch.exp(x.double()) - 1).abs()
    assert 0.01 < float(rel.max()) < 0.07 and float(rel.mean()) < 0.03
    assert 0 <= float(approx_exp(torch.tensor([-200.0]))) < 1e-37  # clamped: no wrapped-around garbage
    T = TtnnEmulator()
    assert torch.equal(T.num.exp(x, approx=False), torch.exp(x))
    assert torch.equal(TtnnEmulator(exact=True).num.exp(x, approx=True), torch.exp(x))


def _layer_norm(emulator, x, fp32):
    T = emulator
    t = T.Tensor(x.numpy(), T.float32, T.open_device(), T.TILE_LAYOUT)
    ck = T.init_device_compute_kernel_config("blackhole", math_fidelity=T.MathFidelity.HiFi4, fp32_dest_acc_en=fp32)
    return T.layer_norm(t, epsilon=1e-6, compute_kernel_config=ck).data


def test_layer_norm_intermediates_follow_the_accumulation_format():
    """A row with a common offset of 10: centred with bfloat16 intermediates (fp32_dest_acc_en off) the
    differences keep 8 bits of 10's scale, in float32 the TF32 operands' 11 (x - mean is an FPU subtract)."""
    gen = torch.Generator().manual_seed(2)
    x = 10.0 + torch.randn(8, 1024, generator=gen)
    ref = F.layer_norm(x.double(), (1024,), eps=1e-6)
    T = TtnnEmulator()
    err32 = float((_layer_norm(T, x, True) - ref).abs().max())
    err16 = float((_layer_norm(T, x, False) - ref).abs().max())
    assert err32 < 0.02 and err16 > 4 * err32
    exact = TtnnEmulator(exact=True)
    assert float((_layer_norm(exact, x, False) - ref).abs().max()) < 1e-4


def _sdpa(emulator, q, k, v, k_chunk, approx, fidelity="HiFi4"):
    T = emulator
    t = [T.Tensor(z.numpy(), T.bfloat16, T.open_device(), T.TILE_LAYOUT) for z in (q, k, v)]
    pc = T.SDPAProgramConfig(
        compute_with_storage_grid_size=T.CoreCoord(13, 10),
        q_chunk_size=32,
        k_chunk_size=k_chunk,
        exp_approx_mode=approx,
    )
    ck = T.init_device_compute_kernel_config("blackhole", math_fidelity=getattr(T.MathFidelity, fidelity))
    out = T.transformer.scaled_dot_product_attention(
        *t, is_causal=False, scale=1.0, program_config=pc, compute_kernel_config=ck
    )
    return out.data, [z.data for z in t]


def test_sdpa_is_flash_attention_with_bfloat16_intermediates():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=gen) * s for s in (0.3, 0.3, 1.0))
    exact, (qe, ke, ve) = _sdpa(TtnnEmulator(exact=True), q, k, v, 64, approx=True)
    ref = torch.softmax(qe @ ke.transpose(-1, -2), -1) @ ve
    assert torch.allclose(exact, ref, atol=1e-5)  # the chunked online softmax is softmax
    device, _ = _sdpa(TtnnEmulator(), q, k, v, 64, approx=False)
    chunked, _ = _sdpa(TtnnEmulator(), q, k, v, 32, approx=False)
    approx, _ = _sdpa(TtnnEmulator(), q, k, v, 64, approx=True)
    e_device, e_approx = float((device - ref).abs().max()), float((approx - ref).abs().max())
    assert 1e-4 < e_device < 0.05 and e_approx > e_device  # bfloat16 tiles cost a little, the fast exp more
    assert not torch.equal(device, chunked)  # the key chunk size is part of the arithmetic


def test_sdpa_emulated_in_query_blocks_is_the_whole_computation(monkeypatch):
    """The attention is emulated FLASH_ROWS query rows at a time (for speed); each row's arithmetic does not depend
    on the others, so blocks of any size give the same bits as all rows at once."""
    from . import ttnn_emulator

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=gen) * s for s in (0.3, 0.3, 1.0))
    blocked, _ = _sdpa(TtnnEmulator(), q, k, v, 64, approx=True)  # 128 + 72 rows
    monkeypatch.setattr(ttnn_emulator, "FLASH_ROWS", 1000)
    whole, _ = _sdpa(TtnnEmulator(), q, k, v, 64, approx=True)
    assert ttnn_emulator.FLASH_ROWS > q.shape[-2] and torch.equal(blocked, whole)


def test_conv_fidelity_matches_the_matmul_rule():
    gen = torch.Generator().manual_seed(4)
    T = TtnnEmulator()
    x = round_bf16(torch.randn(1, 1, 6 * 7, 32, generator=gen))
    w = torch.randn(16, 32, 3, 3, generator=gen)
    wt = T.Tensor(w.numpy(), T.float32, None, T.ROW_MAJOR_LAYOUT)
    xt = T.Tensor(x.numpy(), T.bfloat16, T.open_device(), T.TILE_LAYOUT)

    def run(fidelity):
        ck = T.init_device_compute_kernel_config(
            "blackhole", math_fidelity=getattr(T.MathFidelity, fidelity), fp32_dest_acc_en=True
        )
        cfg = T.Conv2dConfig(weights_dtype=T.bfloat16, padding_mode=T.PaddingMode.Zeros)
        return T.conv2d(
            input_tensor=xt,
            weight_tensor=wt,
            device=T.open_device(),
            in_channels=32,
            out_channels=16,
            batch_size=1,
            input_height=6,
            input_width=7,
            kernel_size=(3, 3),
            padding=(1, 1),
            conv_config=cfg,
            compute_config=ck,
            dtype=T.float32,
        ).data

    img = x.reshape(1, 6, 7, 32).permute(0, 3, 1, 2)
    wb = round_bf16(w)
    ref_lofi = (
        F.conv2d(truncate_bits(img, 7), truncate_bits(wb, 5), padding=1).permute(0, 2, 3, 1).reshape(1, 1, 42, 16)
    )
    assert torch.allclose(run("LoFi"), ref_lofi, atol=1e-4)
    ref = F.conv2d(img, wb, padding=1).permute(0, 2, 3, 1).reshape(1, 1, 42, 16)
    assert torch.allclose(run("HiFi4"), ref, atol=1e-4)
    assert not np.allclose(run("HiFi2").numpy(), ref.numpy(), atol=1e-4)
    assert math.isfinite(float(run("HiFi2").abs().max()))


def test_the_output_sides_ops_follow_the_float32_and_fidelity_rules():
    """The ops the device's input and output sides add (runners/ttnn/pre.py, post.py): a float32 operand reaches a
    matmul as TF32 (so a float32 map loses bits that its bfloat16 split keeps); float32 pairs subtract and multiply
    exactly (the SFPU), mixed pairs go through the FPU (TF32 operands; multiplies with the fidelity passes); a
    tilize with a dtype rounds; exp / rsqrt / sigmoid are float32; a pad of nothing hands back its input."""
    T = TtnnEmulator()
    dev = T.open_device()
    gen = torch.Generator().manual_seed(7)
    x = (torch.rand(64, 64, generator=gen) + 0.5).float()
    w = torch.eye(64)

    def dev_t(a, dtype="float32", layout=None):
        return T.Tensor(a.numpy(), getattr(T, dtype), dev, layout or T.TILE_LAYOUT)

    ck = T.init_device_compute_kernel_config("blackhole", math_fidelity=T.MathFidelity.HiFi4, fp32_dest_acc_en=True)
    plain = T.matmul(dev_t(x), dev_t(w, "bfloat16"), dtype=T.float32, compute_kernel_config=ck).data
    assert 0 < (plain - x).abs().max() <= x.abs().max() * 2.0**-10  # TF32: the float32 map is truncated
    hi = round_bf16(x)
    lo = round_bf16(x - hi)
    split = T.matmul(
        dev_t(torch.cat([hi, lo], 1), "bfloat16"),
        dev_t(torch.cat([w, w], 0), "bfloat16"),
        dtype=T.float32,
        compute_kernel_config=ck,
    ).data
    assert (split - x).abs().max() <= x.abs().max() * 2.0**-16  # bfloat16 parts are exact at HiFi4
    y = x + 1e-3
    assert torch.equal(T.subtract(dev_t(y), dev_t(x)).data, y - x)  # float32 pair: exact
    mixed = T.subtract(dev_t(y), dev_t(x, "bfloat16")).data
    assert torch.equal(mixed, truncate_bits(y, 11) - round_bf16(x))  # TF32 operands
    assert torch.equal(T.multiply(dev_t(y), dev_t(x)).data, y * x)
    assert not torch.equal(T.multiply(dev_t(y), dev_t(x, "bfloat16")).data, y * round_bf16(x))  # FPU passes
    rows = dev_t(x, layout=T.ROW_MAJOR_LAYOUT)
    tiled = T.to_layout(rows, T.TILE_LAYOUT, dtype=T.bfloat16)
    assert tiled.dtype == T.bfloat16 and torch.equal(tiled.data, round_bf16(x))
    for op, ref in ((T.exp, torch.exp), (T.rsqrt, torch.rsqrt), (T.sigmoid, torch.sigmoid)):
        assert torch.equal(op(dev_t(x)).data, ref(x))
    assert T.pad(rows, ((0, 0), (0, 0)), value=0.0) is rows


def test_fused_activations_run_in_float32_in_order():
    """The unary steps the output side fuses into its ops (runners/ttnn/post.py): a binary op's input activations
    on each operand, then the op, then its `activations` in order (the normals' inverse length in one add); a
    matmul's `activation` on its float32 result (the mask's sigmoid); an activation the emulator does not know is
    an error, not a no-op."""
    T = TtnnEmulator()
    dev = T.open_device()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 64, 64, generator=gen).unbind(0)

    def dev_t(x):
        return T.Tensor(x.numpy(), T.float32, dev, T.TILE_LAYOUT)

    U, op = T.UnaryOpType, T.UnaryWithParam
    square = [op(U.SQUARE)]
    inv = T.add(
        dev_t(a),
        dev_t(b),
        input_tensor_a_activations=square,
        input_tensor_b_activations=square,
        activations=[op(U.MAXIMUM, 0.5), op(U.RSQRT)],
    ).data
    assert torch.allclose(inv, torch.rsqrt((a * a + b * b).clamp(min=0.5)), rtol=1e-6)
    assert torch.allclose(T.multiply(dev_t(a), dev_t(b), input_tensor_b_activations=[op(U.EXP)]).data, a * b.exp())
    ck = T.init_device_compute_kernel_config("blackhole", math_fidelity=T.MathFidelity.HiFi4, fp32_dest_acc_en=True)
    y = T.matmul(dev_t(a), dev_t(torch.eye(64)), dtype=T.float32, compute_kernel_config=ck, activation="sigmoid").data
    assert torch.allclose(y, torch.sigmoid(truncate_bits(a, 11)), atol=1e-6)
    with pytest.raises(ValueError, match="not emulated"):
        T.add(dev_t(a), dev_t(b), activations=[op(U.MAXIMUM)])  # MAXIMUM needs its parameter
