"""Fused MoE Triton kernels (run through Triton's interpreter on CPU) against plain PyTorch.

The kernels are compared with ``fused_moe_reference``; the reference itself is compared with the
model's own ``Experts.forward`` so both cannot be wrong the same way.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from libs.engine.config import ModelConfig
from libs.engine.kernels.fp8_gemm import Fp8Weight, dequantize_fp8_blocks, quantize_fp8_blocks
from libs.engine.kernels.fused_moe import (
    Fp4Weight,
    _align,
    _e2m1_halves,
    default_config,
    dequantize_fp4,
    fused_moe,
    fused_moe_reference,
    quantize_fp4,
)
from libs.engine.model.moe import Experts

E = 8
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(E, h, i, generator=g) / i**0.5
    return w13, w2


def _routing(
    t: int, k: int, seed: int = 0, skewed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, weights, ids: distinct random experts per token, or (skewed) expert 3 in every
    token's first slot, the other slots from {5, 6}, so experts 0, 1, 2, 4, 7 get nothing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 64, generator=g)
    if skewed:
        rest = torch.stack([torch.tensor([5, 6])[torch.randperm(2, generator=g)] for _ in range(t)])
        ids = torch.cat([torch.full((t, 1), 3), rest[:, : k - 1]], dim=1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1
    return x, weights, ids


def test_reference_matches_model_experts() -> None:
    cfg = ModelConfig(
        n_routed_experts=E,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        hidden_size=64,
        moe_intermediate_size=128,
    )
    experts = Experts(cfg, torch.float32, torch.device("cpu"))
    w13, w2 = _weights(64, 128)
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    for skewed in (False, True):
        x, weights, ids = _routing(37, 3, seed=1, skewed=skewed)
        ref = fused_moe_reference(x, w13, w2, weights, ids)
        assert _rel(ref, experts(x, weights, ids)) < 1e-5


def test_align_covers_every_pair_once_in_its_experts_blocks() -> None:
    _, _, ids = _routing(37, 3, seed=2, skewed=True)
    block_m = 16
    sorted_ids, expert_ids, total, num_blocks = _align(ids, E, block_m)
    flat = ids.reshape(-1)
    n = flat.numel()
    assert sorted_ids.numel() == num_blocks * block_m >= n + E * (block_m - 1)
    valid = sorted_ids < n
    assert sorted(sorted_ids[valid].tolist()) == list(range(n))
    rows = torch.arange(sorted_ids.numel())
    assert bool((rows[valid] < total.item()).all())
    block_expert = expert_ids.long()[rows[valid] // block_m]
    assert torch.equal(block_expert, flat[sorted_ids[valid].long()])
    counts = torch.bincount(flat, minlength=E)
    assert total.item() == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize(
    ("t", "k", "e", "block_m", "mode"),
    [
        (1, 2, 8, 16, "random"),
        (37, 3, 8, 16, "random"),
        (37, 3, 8, 16, "skewed"),
        (64, 6, 64, 16, "random"),
        (256, 6, 64, 64, "random"),
        (40, 8, 256, 16, "skewed"),
        (300, 4, 16, 32, "one_expert"),
        (1100, 2, 8, 16, "random"),
    ],
)
def test_align_kernel_matches_sort(t: int, k: int, e: int, block_m: int, mode: str) -> None:
    """The one-launch Triton alignment gives buffers identical to the argsort path, including
    experts without tokens, one expert in every token, and more pairs than one 1024-chunk."""
    g = torch.Generator().manual_seed(t * e)
    if mode == "skewed":  # a few experts take everything, most get nothing
        ids = torch.randint(0, 3, (t, k), generator=g) * (e // 3)
    elif mode == "one_expert":
        ids = torch.cat(
            [torch.full((t, 1), e - 1), torch.randint(0, e - 1, (t, k - 1), generator=g)], dim=1
        )
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    for dtype in (torch.int64, torch.int32):
        got = _align(ids.to(dtype), e, block_m, method="kernel")
        want = _align(ids.to(dtype), e, block_m, method="sort")
        assert got[3] == want[3]
        for a, b in zip(got[:3], want[:3], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


@triton.jit
def _decode_probe(byte_ptr, lo_ptr, hi_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.arange(0, N)
    lo, hi = _e2m1_halves(tl.load(byte_ptr + offs))
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


def test_e2m1_decode_all_nibbles() -> None:
    """Every byte value: both nibbles decode to ``code * 2**-14`` exactly (e2m1 table, signs)."""
    table = torch.cat([E2M1, -E2M1])
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo, hi = torch.empty(256), torch.empty(256)
    _decode_probe[(1,)](byte, lo, hi, N=256)
    codes = torch.arange(256)
    assert torch.equal(lo * 16384, table[codes % 16])
    assert torch.equal(hi * 16384, table[codes // 16])


@pytest.mark.parametrize(
    ("t", "k", "i", "skewed"),
    [
        (1, 2, 64, False),
        (5, 3, 128, False),
        (37, 2, 64, False),
        (37, 3, 128, True),
    ],
)
def test_fused_moe_fp32_matches_reference(t: int, k: int, i: int, skewed: bool) -> None:
    w13, w2 = _weights(64, i, seed=t)
    x, weights, ids = _routing(t, k, seed=t, skewed=skewed)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert _rel(fused_moe(x, w13, w2, weights, ids), ref) < 1e-3


def test_fused_moe_uneven_shapes_and_configs() -> None:
    """Hidden/intermediate sizes that are not tile multiples, int32 ids, several tilings."""
    g = torch.Generator().manual_seed(3)
    h, i, t, k = 80, 48, 9, 2
    w13 = torch.randn(E, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(E, h, i, generator=g) / i**0.5
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, k, generator=g)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    for cfg in (
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4},
    ):
        cfg |= {"num_warps": 4, "num_stages": 2}
        assert _rel(fused_moe(x, w13, w2, weights, ids, config=cfg), ref) < 1e-3


def test_fused_moe_bf16() -> None:
    """Loose bound: Triton's interpreter truncates fp32 -> bf16 (a GPU rounds to nearest)."""
    w13, w2 = _weights(64, 64, seed=4)
    x, weights, ids = _routing(5, 2, seed=4)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    out = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < 2e-2


def test_fused_moe_writes_all_of_out() -> None:
    w13, w2 = _weights(64, 64, seed=5)
    x, weights, ids = _routing(5, 2, seed=5, skewed=True)
    out = torch.full((5, 64), float("nan"))
    got = fused_moe(x, w13, w2, weights, ids, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert bool(out.isfinite().all())
    assert _rel(out, fused_moe_reference(x, w13, w2, weights, ids)) < 1e-3


def test_fp4_byte_layout() -> None:
    """Byte j of a 64-wide group: element j in the low nibble, element j + 32 in the high one."""
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (1, 1, 128), generator=g)
    codes[..., ::32] = 7  # each 32-block holds +6, so its scale is exactly 1
    signs = torch.where(codes >= 8, -1.0, 1.0)
    w = signs * E2M1[codes % 8]
    q = quantize_fp4(w)
    assert q.packed.dtype == torch.uint8 and q.shape == (1, 1, 128)
    codes = torch.where(w == 0, 0, codes)  # -0 is stored as +0
    lo = torch.arange(32)
    expect = torch.cat(
        [codes[..., 64 * j + lo] | (codes[..., 64 * j + 32 + lo] << 4) for j in range(2)], dim=-1
    )
    assert torch.equal(q.packed.long(), expect)
    assert torch.equal(q.scales.float(), torch.ones(1, 1, 4))


def test_fp4_round_trip_exact_on_grid() -> None:
    g = torch.Generator().manual_seed(7)
    shape = (3, 16, 128)
    vals = E2M1[torch.randint(0, 8, shape, generator=g)]
    vals *= torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    vals[..., ::32] = 6.0 * torch.where(torch.rand(3, 16, 4, generator=g) < 0.5, -1.0, 1.0)
    scale = 2.0 ** torch.randint(-8, 4, (3, 16, 4), generator=g).float()
    w = vals * scale.repeat_interleave(32, dim=-1)
    q = quantize_fp4(w)
    assert torch.equal(q.scales.float(), scale)
    assert torch.equal(dequantize_fp4(q, torch.float32), w)
    assert q.nbytes == 3 * 16 * (64 + 4 * 2)


def test_fp4_random_error_within_e2m1_bound() -> None:
    w = torch.randn(4, 32, 256, generator=torch.Generator().manual_seed(8))
    q = quantize_fp4(w)
    err = (dequantize_fp4(q, torch.float32) - w).abs().view(4, 32, 8, 32)
    amax = w.abs().view(4, 32, 8, 32).amax(-1, keepdim=True)
    # Nearest e2m1 value: at most half the widest gap (4 -> 6) = one scale = amax / 6.
    assert bool((err <= amax / 6 * 1.01).all())
    assert 0 < _rel(dequantize_fp4(q, torch.float32), w) < 0.15


def test_quantize_rejects_k_not_multiple_of_64() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_fp4(torch.randn(2, 4, 96))


@pytest.mark.parametrize(("t", "k", "skewed"), [(1, 2, False), (37, 3, True)])
def test_fused_moe_fp4_matches_reference(t: int, k: int, skewed: bool) -> None:
    w13, w2 = _weights(64, 128, seed=9)
    q13, q2 = quantize_fp4(w13), quantize_fp4(w2)
    x, weights, ids = _routing(t, k, seed=9, skewed=skewed)
    ref = fused_moe_reference(
        x, dequantize_fp4(q13, torch.float32), dequantize_fp4(q2, torch.float32), weights, ids
    )
    out = torch.full((t, 64), float("nan"))
    fused_moe(x, q13, q2, weights, ids, out=out)
    assert _rel(out, ref) < 1e-3
    assert _rel(fused_moe_reference(x, q13, q2, weights, ids), ref) < 1e-6
    cfg = {
        "BLOCK_M": 16,
        "BLOCK_N": 32,
        "BLOCK_K": 128,
        "GROUP_M": 2,
        "num_warps": 4,
        "num_stages": 2,
    }
    assert _rel(fused_moe(x, q13, q2, weights, ids, config=cfg), ref) < 1e-3


def test_fp4_mixed_with_bf16_weight_and_bad_block_k() -> None:
    w13, w2 = _weights(64, 64, seed=10)
    q13 = quantize_fp4(w13)
    x, weights, ids = _routing(5, 2, seed=10)
    ref = fused_moe_reference(x, q13, w2, weights, ids)
    assert isinstance(q13, Fp4Weight)
    assert _rel(fused_moe(x, q13, w2, weights, ids), ref) < 1e-3
    cfg = default_config(5, 2, E, 128, 64, True) | {"BLOCK_K": 32}
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe(x, q13, w2, weights, ids, config=cfg)


def test_default_config_decode_and_prefill() -> None:
    decode = default_config(1, 8, 256, 4096, 7168, fp4=False)
    assert decode["BLOCK_M"] == 16
    assert default_config(64, 8, 64, 2816, 2048, fp4=True)["BLOCK_M"] == 8 * 2
    fp4 = default_config(256, 6, 64, 2816, 2048, fp4=True)
    assert (fp4["BLOCK_M"], fp4["BLOCK_N"], fp4["BLOCK_K"], fp4["SWAP_AB"]) == (32, 128, 64, True)
    assert default_config(256, 6, 64, 2816, 2048, fp4=False)["SWAP_AB"]
    prefill = default_config(4096, 8, 256, 4096, 7168, fp4=False)
    assert (prefill["BLOCK_M"], prefill["BLOCK_N"], prefill["BLOCK_K"], prefill["num_warps"]) == (
        128,
        128,
        64,
        8,
    )


@pytest.mark.parametrize(
    ("block_m", "block_n", "block_k", "skewed"),
    [
        (16, 32, 32, False),
        (32, 64, 64, True),
        (16, 64, 128, True),
    ],
)
def test_fused_moe_swap_ab_fp32(block_m: int, block_n: int, block_k: int, skewed: bool) -> None:
    """SWAP_AB (weights as tl.dot's A operand, transposed tiles) on bf16-path (fp32) weights,
    including sizes that are not tile multiples."""
    g = torch.Generator().manual_seed(11)
    h, i = (80, 48) if block_k == 32 else (64, 128)
    w13 = torch.randn(E, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(E, h, i, generator=g) / i**0.5
    x, weights, ids = _routing(23, 3, seed=11, skewed=skewed)
    x = torch.randn(23, h, generator=g)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    cfg = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": 1,
        "num_warps": 4,
        "num_stages": 3,
        "SWAP_AB": True,
    }
    out = torch.full((23, h), float("nan"))
    fused_moe(x, w13, w2, weights, ids, out=out, config=cfg)
    assert _rel(out, ref) < 1e-3


@pytest.mark.parametrize(
    ("block_m", "block_n", "block_k", "skewed"),
    [
        (16, 64, 64, False),
        (32, 32, 128, True),
    ],
)
def test_fused_moe_swap_ab_fp4(block_m: int, block_n: int, block_k: int, skewed: bool) -> None:
    w13, w2 = _weights(64, 128, seed=12)
    q13, q2 = quantize_fp4(w13), quantize_fp4(w2)
    x, weights, ids = _routing(19, 3, seed=12, skewed=skewed)
    ref = fused_moe_reference(x, q13, q2, weights, ids)
    cfg = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": 1,
        "num_warps": 4,
        "num_stages": 4,
        "SWAP_AB": True,
    }
    out = torch.full((19, 64), float("nan"))
    fused_moe(x, q13, q2, weights, ids, out=out, config=cfg)
    assert _rel(out, ref) < 1e-3
    # Uneven K for the down projection (I = 192 with BLOCK_K 128) and FP4 w13 + fp32 w2.
    w13b, w2b = _weights(64, 192, seed=13)
    q13b, q2b = quantize_fp4(w13b), quantize_fp4(w2b)
    ref = fused_moe_reference(x, q13b, w2b, weights, ids)
    assert _rel(fused_moe(x, q13b, w2b, weights, ids, config=cfg), ref) < 1e-3
    ref = fused_moe_reference(x, q13b, q2b, weights, ids)
    assert _rel(fused_moe(x, q13b, q2b, weights, ids, config=cfg), ref) < 1e-3


def test_swap_ab_rejects_block_m_below_16() -> None:
    w13, w2 = _weights(64, 64, seed=14)
    x, weights, ids = _routing(3, 2, seed=14)
    cfg = {
        "BLOCK_M": 8,
        "BLOCK_N": 32,
        "BLOCK_K": 64,
        "GROUP_M": 1,
        "num_warps": 4,
        "num_stages": 2,
        "SWAP_AB": True,
    }
    with pytest.raises(ValueError, match="SWAP_AB"):
        fused_moe(x, w13, w2, weights, ids, config=cfg)


# -- FP8 experts (e4m3 weights with 128x128 block scales, FP8 activations) ------------------------


def _fp8_case(
    t: int, k: int, h: int, i: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, Fp8Weight, Fp8Weight, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(E, h, i, generator=g) / i**0.5
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1
    return x, quantize_fp8_blocks(w13), quantize_fp8_blocks(w2), weights, ids


_FP8_TILES = {"BLOCK_K": 128, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize(
    ("t", "k", "h", "i", "config"),
    [
        (5, 2, 256, 128, None),  # decode default: swap-AB, 16-row tiles
        (37, 3, 200, 136, None),  # K and I not multiples of 128 (masked tails, partial tiles)
        (40, 2, 256, 256, {"BLOCK_M": 32, "BLOCK_N": 64} | _FP8_TILES),  # plain tiles
        (40, 2, 256, 256, {"BLOCK_M": 16, "BLOCK_N": 32, "SWAP_AB": True} | _FP8_TILES),
    ],
)
def test_fused_moe_fp8_matches_reference(
    t: int, k: int, h: int, i: int, config: dict[str, int] | None
) -> None:
    """In fp32 the kernels see exactly the reference's quantized operands (interpreter: e4m3
    dots on widened operands), so only summation order differs; against unquantized experts
    the error is FP8's (3 mantissa bits on weights and activations)."""
    x, q13, q2, weights, ids = _fp8_case(t, k, h, i, seed=t + h)
    ref = fused_moe_reference(x, q13, q2, weights, ids)
    out = torch.full((t, h), float("nan"))
    fused_moe(x, q13, q2, weights, ids, out=out, config=config)
    assert _rel(out, ref) < 1e-5
    exact = fused_moe_reference(
        x, dequantize_fp8_blocks(q13), dequantize_fp8_blocks(q2), weights, ids
    )
    assert 1e-3 < _rel(ref, exact) < 0.05  # the activations' quantization is there, and small


def test_fused_moe_fp8_bf16_and_the_model_experts() -> None:
    """bf16 activations: the kernels and the model's reference FP8 experts agree within what
    bf16 rounding of the intermediate (before its FP8 quantization) moves."""
    cfg = ModelConfig(
        n_routed_experts=E,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        hidden_size=256,
        moe_intermediate_size=128,
    )
    x, q13, q2, weights, ids = _fp8_case(9, 2, 256, 128, seed=3, dtype=torch.bfloat16)
    experts = Experts(cfg, torch.bfloat16, torch.device("cpu"))
    experts.fp8 = (q13, q2)
    ref = fused_moe_reference(x, q13, q2, weights, ids)
    assert _rel(experts(x, weights, ids), ref) < 0.02
    experts.use_kernels = True
    assert _rel(experts(x, weights, ids), ref) < 0.04


def test_fused_moe_fp8_rejects_mixed_weights_and_bad_block_k() -> None:
    x, q13, q2, weights, ids = _fp8_case(5, 2, 128, 128, seed=4)
    with pytest.raises(ValueError, match="both"):
        fused_moe(x, q13, dequantize_fp8_blocks(q2), weights, ids)
    cfg = default_config(5, 2, E, 256, 128, fp4=False, fp8=True) | {"BLOCK_K": 64}
    with pytest.raises(ValueError, match="BLOCK_K == 128"):
        fused_moe(x, q13, q2, weights, ids, config=cfg)
