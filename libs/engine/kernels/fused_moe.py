"""Fused MoE for the routed experts in Triton: bf16 weights, FP4 (e2m1) with block scales, or
FP8 (e4m3, DeepSeek's 128x128 block scales, :mod:`.fp8_gemm`) with FP8 activations.

Pipeline (no host synchronisation anywhere, so it can be captured in a CUDA graph):

1. Alignment (device only, like vLLM's ``moe_align_block_size``; one Triton launch for up to
   ``ALIGN_KERNEL_MAX_PAIRS`` pairs: per expert a histogram prefix and in-order ranks by cumsum,
   no argsort; a torch argsort path beyond): the ``T*k``
   (token, slot) pairs are sorted by expert; each expert's segment is padded to a multiple of
   ``BLOCK_M`` inside a fixed buffer of ``T*k + E*(BLOCK_M-1)`` rows (rounded up to whole
   blocks). ``sorted_ids[row]`` holds the flat pair index ``token*k + slot`` (``T*k`` marks a
   padding row), ``expert_ids[block]`` the expert of each M-block, and a one-element device
   tensor the padded total. Both kernels launch a grid sized for the maximum; programs whose
   M-block starts beyond the padded total return at once.
2. Kernel 1 (per M-block x N-tile): ``[gate | up] = x[token(row)] @ w13[e]^T`` as one GEMM whose
   B tile gathers ``BLOCK_N/2`` gate rows ``n`` and the matching up rows ``n + I``; the epilogue
   writes ``silu(gate) * up`` to an intermediate ``[padded_rows, I]`` in ``x.dtype``.
3. Kernel 2: ``inter[row] @ w2[e]^T`` times the routing weight of the pair, stored at row
   ``token*k + slot`` of a ``[T*k, H]`` buffer; ``out = buffer.view(T, k, H).sum(1)``.
   Both GEMMs accumulate in fp32.

FP4 format (:class:`Fp4Weight`), for a weight ``w [E, N, K]`` with ``K % 64 == 0``:

* element codes are e2m1 nibbles ``s e e m``: sign bit 3, exponent bits 2..1, mantissa bit 0;
  magnitude ``m * 0.5`` when ``e == 0`` else ``2**(e-1) * (1 + m/2)``, i.e. codes 0..7 are
  0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives;
* ``packed[e, n, 32*g + j]`` (uint8) holds element ``64*g + j`` in its low nibble and element
  ``64*g + 32 + j`` in its high nibble (``g`` the 64-wide K group, ``0 <= j < 32``), so a
  64-wide K step splits into two contiguous 32-element halves, each covered by one scale;
* ``scales[e, n, b]`` (bf16) scales the 32 elements ``32*b .. 32*b + 31``; ``w ~ code * scale``.
  bf16 rather than fp32 because decode is bandwidth-bound: a bf16 scale costs 1/16 byte per
  weight (12.5% on top of the 0.5 byte nibble), an fp32 one twice that. Quantization divides
  by the bf16-rounded scale, so the stored scale is exactly the one the codes were fitted to
  (a block's largest value may then exceed ``6 * scale`` by < 0.4% and saturates at code 7).
  The kernels decode with integer masks only (:func:`_e2m1_halves`: both nibbles of a byte
  become fp16 bit patterns of ``code * 2**-14``, widened exactly to fp32), multiply by
  ``scale * 2**14`` in fp32 (so exactly ``code * scale``) and round it to the activation dtype
before   ``tl.dot``: two dots per 64-wide group, low nibbles against ``x[:, 64g : 64g+32]``, high
  nibbles against ``x[:, 64g+32 : 64g+64]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fp8_gemm import (
    FP8_BLOCK,
    Fp8Weight,
    dequantize_fp8_blocks,
    dequantize_fp8_tokens,
    quantize_fp8_tokens,
)

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive e2m1 magnitudes: bucketize gives the magnitude code directly.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_GROUP = 64
_SCALE_BLOCK = 32
# Elements of one fp32 working chunk when (de)quantizing: bounds temporary memory (~1 GiB).
_CHUNK_ELEMENTS = 1 << 26
# Triton's interpreter (CPU tests) computes bf16 tl.dot wrongly; there both operands go in as fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Fp4Weight:
    """FP4 (e2m1) expert weights, one bf16 scale per 32 elements along K (layout: module doc)."""

    packed: torch.Tensor  # uint8 [E, N, K // 2]
    scales: torch.Tensor  # bf16 [E, N, K // 32]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)`` of the weight this encodes."""
        e, n, half_k = self.packed.shape
        return e, n, 2 * half_k

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes plus scales."""
        return self.packed.nbytes + self.scales.nbytes


def quantize_fp4(w: torch.Tensor) -> Fp4Weight:
    """Quantize ``w [E, N, K]`` to e2m1 with per-32-element scales ``amax / 6`` (round to nearest,
    ties toward the smaller magnitude). Works in expert chunks to bound temporary memory."""
    if w.dim() != 3:
        raise ValueError(f"quantize_fp4 expects [E, N, K], got shape {tuple(w.shape)}")
    e, n, k = w.shape
    if k % _FP4_GROUP:
        raise ValueError(f"quantize_fp4 needs K to be a multiple of {_FP4_GROUP}, got K={k}")
    packed = torch.empty(e, n, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(e, n, k // _SCALE_BLOCK, dtype=torch.bfloat16, device=w.device)
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=w.device)
    chunk = max(1, _CHUNK_ELEMENTS // (n * k))
    for lo in range(0, e, chunk):
        wc = w[lo : lo + chunk].to(torch.float32).reshape(-1, n, k // _SCALE_BLOCK, _SCALE_BLOCK)
        scale = (wc.abs().amax(dim=-1) / 6.0).to(torch.bfloat16)
        divisor = scale.to(torch.float32).masked_fill(scale == 0, 1.0).unsqueeze(-1)
        q = wc / divisor
        code = torch.bucketize(q.abs(), bounds, out_int32=True).to(torch.uint8)
        code |= ((q < 0) & (code > 0)).to(torch.uint8) << 3
        halves = code.view(-1, n, k // _FP4_GROUP, 2, _SCALE_BLOCK)
        pairs = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)
        packed[lo : lo + chunk] = pairs.view(-1, n, k // 2)
        scales[lo : lo + chunk] = scale
    return Fp4Weight(packed, scales)


def dequantize_fp4(q: Fp4Weight, dtype: torch.dtype) -> torch.Tensor:
    """Reference decode of :class:`Fp4Weight` to ``[E, N, K]``: ``code * scale`` in fp32, cast."""
    e, n, k = q.shape
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=q.packed.device)
    table = torch.cat([table, -table])
    out = torch.empty(e, n, k, dtype=dtype, device=q.packed.device)
    chunk = max(1, _CHUNK_ELEMENTS // (n * k))
    for lo in range(0, e, chunk):
        p = q.packed[lo : lo + chunk].view(-1, n, k // _FP4_GROUP, 1, _SCALE_BLOCK).to(torch.int64)
        codes = torch.cat([p & 15, p >> 4], dim=3).view(-1, n, k // _SCALE_BLOCK, _SCALE_BLOCK)
        vals = table[codes] * q.scales[lo : lo + chunk].to(torch.float32).unsqueeze(-1)
        out[lo : lo + chunk] = vals.view(-1, n, k).to(dtype)
    return out


def expert_weight(w: torch.Tensor | Fp4Weight | Fp8Weight, e: int) -> torch.Tensor:
    """Expert ``e`` of ``w`` in fp32 (FP4/FP8 decoded)."""
    if isinstance(w, Fp4Weight):
        one = Fp4Weight(w.packed[e : e + 1], w.scales[e : e + 1])
        return dequantize_fp4(one, torch.float32)[0]
    if isinstance(w, Fp8Weight):
        return dequantize_fp8_blocks(Fp8Weight(w.q[e], w.scale[e]))
    return w[e].to(torch.float32)


def _fp8_activations(a: torch.Tensor) -> torch.Tensor:
    """``a`` as the FP8 kernels see it: quantized per row and 128 channels, back in fp32."""
    return dequantize_fp8_tokens(*quantize_fp8_tokens(a, kernel=False))


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor | Fp4Weight | Fp8Weight,
    w2: torch.Tensor | Fp4Weight | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Plain-PyTorch routed experts in fp32 (FP4/FP8 weights decoded one expert at a time; with
    FP8 the activations are quantized as :func:`fused_moe` does, ``silu(gate) * up`` after a
    round trip through ``x.dtype``; ``swiglu_limit`` as :func:`fused_moe` takes it)."""
    t, k = topk_ids.shape
    fp8 = isinstance(w13, Fp8Weight)
    xf = _fp8_activations(x) if fp8 else x.to(torch.float32)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = F.linear(xf[tokens], expert_weight(w13, e)).chunk(2, dim=-1)
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        h = F.silu(gate) * up
        if fp8:
            h = _fp8_activations(h.to(x.dtype))
        y = F.linear(h, expert_weight(w2, e))
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].to(torch.float32)[:, None])
    return out.to(x.dtype)


def _pow2_at_least(v: float) -> int:
    """Smallest power of two >= ``v`` (1 for ``v <= 1``)."""
    p = 1
    while p < v:
        p *= 2
    return p


def default_config(
    t: int, k: int, e: int, n: int, kdim: int, fp4: bool, fp8: bool = False
) -> dict[str, int]:
    """Launch config for ``T`` tokens, top-``k`` of ``E`` experts; ``n``/``kdim`` are w13's
    ``2I``/``H``. Decode (few rows per expert) uses an M-block covering an expert's rows with
    50% headroom for routing imbalance, so each hit expert's weights stream about once;
    prefill uses 128x128 tiles. FP4 decode uses 128-wide N tiles: each program re-reads its
    M-block's activation rows (``BLOCK_M * K * 2`` bytes, from L2) for only ``BLOCK_N * K / 2``
    weight bytes, so 64-wide tiles would move more activation than weight bytes."""
    rows_per_expert = t * k / e
    if fp8:
        # FP8 steps K by its 128-wide scale tiles; e4m3 tiles are half the bytes of bf16 ones,
        # so prefill keeps 128x128 tiles with a deeper pipeline. Decode as for bf16.
        if rows_per_expert >= 96:
            return {
                "BLOCK_M": 128,
                "BLOCK_N": 128,
                "BLOCK_K": FP8_BLOCK,
                "GROUP_M": 8,
                "num_warps": 8,
                "num_stages": 4,
            }
        return {
            "BLOCK_M": 16 if rows_per_expert <= 12 else 32,
            "BLOCK_N": 64,
            "BLOCK_K": FP8_BLOCK,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4,
            "SWAP_AB": True,
        }
    if rows_per_expert >= 96:
        return {
            "BLOCK_M": 128,
            "BLOCK_N": 128,
            "BLOCK_K": 64,
            "GROUP_M": 8,
            "num_warps": 8,
            "num_stages": 3 if fp4 else 4,
        }
    # Decode: measured inside CUDA graphs on an H200 (bench_fused_moe.py --quick; V2-Lite and
    # V3 at T = 64 and 256). Weights as the A operand (SWAP_AB) and 16/32-row token tiles win
    # for bf16 (V2-Lite T=256: 0.287 ms vs 0.351 ms with 64-row tiles); FP4 swaps only once an
    # expert has more than a 16-row tile of tokens.
    bk = 128 if kdim % 128 == 0 else 64
    block_m = 16 if rows_per_expert <= 12 else 32
    if fp4:
        if block_m == 16:
            return {
                "BLOCK_M": 16,
                "BLOCK_N": 64,
                "BLOCK_K": bk,
                "GROUP_M": 1,
                "num_warps": 4,
                "num_stages": 4,
            }
        return {
            "BLOCK_M": 32,
            "BLOCK_N": 128,
            "BLOCK_K": 64,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4,
            "SWAP_AB": True,
        }
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": 64,
        "BLOCK_K": bk,
        "GROUP_M": 1,
        "num_warps": 4,
        "num_stages": 4,
        "SWAP_AB": True,
    }


# --batch-invariant: the launch config for every T (64-row M-blocks keep Hopper's 64-row MMA).
INVARIANT_CONFIG = {
    "BLOCK_M": 64,
    "BLOCK_N": 64,
    "BLOCK_K": 64,
    "GROUP_M": 8,
    "num_warps": 4,
    "num_stages": 3,
}


@triton.jit
def _tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):  # type: ignore[no-untyped-def]
    """Grouped (L2-friendly) program order: GROUP_M M-blocks share each sweep over N."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _e2m1_halves(byte):  # type: ignore[no-untyped-def]
    """Both nibbles of packed bytes (any int type, 0..255) as fp32 ``code * 2**-14``.

    No per-element conversion from int or select: one multiply spreads the byte into two 16-bit
    lanes of a uint32 (``byte << 9 | byte << 21``), masks keep each nibble's ``e e m`` bits at
    fp16 bits 11..9 and put its sign at bit 15, so each lane is the fp16 bit pattern of
    ``code * 2**-14`` exactly (exponent field ``e``; ``e == 0`` is the fp16 subnormal
    ``m * 2**-15``). fp16 -> fp32 is exact (subnormals included); the caller folds ``2**14``
    into the scale.
    """
    x = byte.to(tl.uint32) * 0x200200
    h = (x & 0x0E000E00) | ((x << 3) & 0x80008000)
    lo = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):  # type: ignore[no-untyped-def]
    """``acc + a @ b`` (operands widened to fp32 first when UPCAST)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _dot8(a, b, UPCAST: tl.constexpr):  # type: ignore[no-untyped-def]
    """``a @ b`` of e4m3 tiles in fp32 (Hopper's FP8 tensor cores; the interpreter has no e4m3
    dot, so there the operands are widened to fp32 first: exact products)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _matmul_rows(
    acc,
    a_rows,
    as_rows,
    a_ok,
    w_rows,
    s_rows,
    n_ok,  # type: ignore[no-untyped-def]
    K: tl.constexpr,
    FP4: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``acc[BM, BN] += A[a_rows, :K] @ W[w_rows, :K]^T``.

    ``a_rows``/``w_rows`` are per-row base pointers (last dim contiguous); for FP4, ``w_rows``
    points at packed bytes and ``s_rows`` at the rows' scales. For FP8 (BLOCK_K == 128) both
    operands are e4m3: ``as_rows`` points at each activation row's per-128-channel scales and
    ``s_rows`` at each weight row's 128x128-tile scales (its tile row); every 128-wide K step is
    one fresh e4m3 dot, scaled and added to ``acc`` in fp32.
    """
    if FP8:
        offs_k = tl.arange(0, BLOCK_K)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            kk = kb * BLOCK_K + offs_k
            if EVEN_K:
                a = tl.load(a_rows[:, None] + kk[None, :], mask=a_ok[:, None], other=0.0)
                b = tl.load(w_rows[None, :] + kk[:, None], mask=n_ok[None, :], other=0.0)
            else:
                k_ok = kk < K
                a = tl.load(
                    a_rows[:, None] + kk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0
                )
                b = tl.load(
                    w_rows[None, :] + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
                )
            part = _dot8(a, b, UPCAST)
            a_s = tl.load(as_rows + kb, mask=a_ok, other=0.0)
            w_s = tl.load(s_rows + kb, mask=n_ok, other=0.0)
            acc += part * (a_s[:, None] * w_s[None, :])
    elif FP4:
        j = tl.arange(0, 32)
        # Step over packed bytes (32 per 64-wide group) so offsets keep their divisibility.
        for kp in range(0, K // 2, BLOCK_K // 2):
            for g in tl.static_range(BLOCK_K // 64):
                kb = kp + g * 32  # first byte of the group
                kg = 2 * kb  # its first element
                if EVEN_K:
                    a_mask = a_ok[:, None]
                    b_mask = n_ok[None, :]
                    s_mask = n_ok
                else:
                    a_mask = a_ok[:, None] & (kg < K)
                    b_mask = n_ok[None, :] & (kg < K)
                    s_mask = n_ok & (kg < K)
                a_lo = tl.load(a_rows[:, None] + (kg + j)[None, :], mask=a_mask, other=0.0)
                a_hi = tl.load(a_rows[:, None] + (kg + 32 + j)[None, :], mask=a_mask, other=0.0)
                byte = tl.load(w_rows[None, :] + (kb + j)[:, None], mask=b_mask, other=0)
                # 2**14 undoes the decode's fp16 exponent offset (exact: a power of two).
                s_lo = tl.load(s_rows + kb // 16, mask=s_mask, other=0.0).to(tl.float32) * 16384.0
                s_hi = (
                    tl.load(s_rows + kb // 16 + 1, mask=s_mask, other=0.0).to(tl.float32) * 16384.0
                )
                c_lo, c_hi = _e2m1_halves(byte)
                w_lo = (c_lo * s_lo[None, :]).to(a_lo.dtype)
                w_hi = (c_hi * s_hi[None, :]).to(a_lo.dtype)
                acc = _dot(a_lo, w_lo, acc, PRECISION, UPCAST)
                acc = _dot(a_hi, w_hi, acc, PRECISION, UPCAST)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                a = tl.load(a_rows[:, None] + kk[None, :], mask=a_ok[:, None], other=0.0)
                b = tl.load(w_rows[None, :] + kk[:, None], mask=n_ok[None, :], other=0.0)
            else:
                k_ok = kk < K
                a = tl.load(
                    a_rows[:, None] + kk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0
                )
                b = tl.load(
                    w_rows[None, :] + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
                )
            acc = _dot(a, b.to(a.dtype), acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _matmul_rows_t(
    acc,
    a_rows,
    as_rows,
    a_ok,
    w_rows,
    s_rows,
    n_ok,  # type: ignore[no-untyped-def]
    K: tl.constexpr,
    FP4: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Swap-AB form of :func:`_matmul_rows`: ``acc[BN, BM] += W[w_rows, :K] @ A[a_rows, :K]^T``.

    The (decoded) weight tile is the A operand of ``tl.dot`` (which Hopper's wgmma can take from
    registers) and the gathered activation rows, loaded K-major as ``[BK, BM]``, the B operand.
    """
    if FP8:
        offs_k = tl.arange(0, BLOCK_K)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            kk = kb * BLOCK_K + offs_k
            if EVEN_K:
                a = tl.load(a_rows[None, :] + kk[:, None], mask=a_ok[None, :], other=0.0)
                w = tl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_ok = kk < K
                a = tl.load(
                    a_rows[None, :] + kk[:, None], mask=a_ok[None, :] & k_ok[:, None], other=0.0
                )
                w = tl.load(
                    w_rows[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
                )
            part = _dot8(w, a, UPCAST)
            a_s = tl.load(as_rows + kb, mask=a_ok, other=0.0)
            w_s = tl.load(s_rows + kb, mask=n_ok, other=0.0)
            acc += part * (w_s[:, None] * a_s[None, :])
    elif FP4:
        j = tl.arange(0, 32)
        for kp in range(0, K // 2, BLOCK_K // 2):
            for g in tl.static_range(BLOCK_K // 64):
                kb = kp + g * 32
                kg = 2 * kb
                if EVEN_K:
                    a_mask = a_ok[None, :]
                    w_mask = n_ok[:, None]
                    s_mask = n_ok
                else:
                    a_mask = a_ok[None, :] & (kg < K)
                    w_mask = n_ok[:, None] & (kg < K)
                    s_mask = n_ok & (kg < K)
                a_lo = tl.load(a_rows[None, :] + (kg + j)[:, None], mask=a_mask, other=0.0)
                a_hi = tl.load(a_rows[None, :] + (kg + 32 + j)[:, None], mask=a_mask, other=0.0)
                byte = tl.load(w_rows[:, None] + (kb + j)[None, :], mask=w_mask, other=0)
                s_lo = tl.load(s_rows + kb // 16, mask=s_mask, other=0.0).to(tl.float32) * 16384.0
                s_hi = (
                    tl.load(s_rows + kb // 16 + 1, mask=s_mask, other=0.0).to(tl.float32) * 16384.0
                )
                c_lo, c_hi = _e2m1_halves(byte)
                w_lo = (c_lo * s_lo[:, None]).to(a_lo.dtype)
                w_hi = (c_hi * s_hi[:, None]).to(a_lo.dtype)
                acc = _dot(w_lo, a_lo, acc, PRECISION, UPCAST)
                acc = _dot(w_hi, a_hi, acc, PRECISION, UPCAST)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                a = tl.load(a_rows[None, :] + kk[:, None], mask=a_ok[None, :], other=0.0)
                w = tl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_ok = kk < K
                a = tl.load(
                    a_rows[None, :] + kk[:, None], mask=a_ok[None, :] & k_ok[:, None], other=0.0
                )
                w = tl.load(
                    w_rows[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
                )
            acc = _dot(w.to(a.dtype), a, acc, PRECISION, UPCAST)
    return acc


# Row counts vary with the batch; specializing on their divisibility would only add recompiles.
@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _gate_up_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    inter_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    num_pairs,
    top_k,
    I,  # noqa: E741 - the intermediate size, as the other kernels name it
    num_pid_m,
    limit,
    stride_xm,
    stride_xsm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_im,
    K: tl.constexpr,
    FP4: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
    CLAMP: tl.constexpr = False,
):  # type: ignore[no-untyped-def]
    """inter[row, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for one tile (with
    ``CLAMP``: the gate clamped to at most ``limit``, the up value to +-``limit``, as
    DeepSeek-V4's SwiGLU does)."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = _tile_ids(num_pid_m, tl.cdiv(I, HALF_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    # Columns 0..HALF_N-1 of the tile are gate rows n, the rest the up rows I + n.
    c = tl.arange(0, BLOCK_N)
    n = pid_n * HALF_N + (c % HALF_N)
    n_ok = n < I
    w_n = n + (c // HALF_N) * I
    # A weight row's scales: per row (FP4) or per 128-row tile (FP8).
    s_n = w_n // 128 if FP8 else w_n
    offs_n = pid_n * HALF_N + tl.arange(0, HALF_N)
    if SWAP_AB:  # acc^T: rows 0..HALF_N-1 gate rows n, the rest up rows I + n
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_t = _matmul_rows_t(
            acc_t,
            x_ptr + tokens * stride_xm,
            xs_ptr + tokens * stride_xsm,
            row_ok,
            w_ptr + expert * stride_we + w_n.to(tl.int64) * stride_wn,
            s_ptr + expert * stride_se + s_n.to(tl.int64) * stride_sn,
            n_ok,
            K,
            FP4,
            FP8,
            BLOCK_K,
            EVEN_K,
            PRECISION,
            UPCAST,
        )
        gate_t, up_t = tl.split(tl.permute(tl.reshape(acc_t, (2, HALF_N, BLOCK_M)), (1, 2, 0)))
        if CLAMP:
            gate_t = tl.minimum(gate_t, limit)
            up_t = tl.minimum(tl.maximum(up_t, -limit), limit)
        h_t = gate_t / (1.0 + tl.exp(-gate_t)) * up_t
        ptrs_t = inter_ptr + offs_m.to(tl.int64)[None, :] * stride_im + offs_n[:, None]
        tl.store(ptrs_t, h_t.to(inter_ptr.dtype.element_ty), mask=(offs_n < I)[:, None])
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _matmul_rows(
            acc,
            x_ptr + tokens * stride_xm,
            xs_ptr + tokens * stride_xsm,
            row_ok,
            w_ptr + expert * stride_we + w_n.to(tl.int64) * stride_wn,
            s_ptr + expert * stride_se + s_n.to(tl.int64) * stride_sn,
            n_ok,
            K,
            FP4,
            FP8,
            BLOCK_K,
            EVEN_K,
            PRECISION,
            UPCAST,
        )
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1)))
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate / (1.0 + tl.exp(-gate)) * up
        ptrs = inter_ptr + offs_m.to(tl.int64)[:, None] * stride_im + offs_n[None, :]
        tl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=(offs_n < I)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _down_kernel(
    inter_ptr,
    is_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    num_pairs,
    H,
    num_pid_m,
    stride_im,
    stride_ism,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    K: tl.constexpr,
    FP4: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):  # type: ignore[no-untyped-def]
    """out[pair, n] = weight[pair] * (inter[row] . w2[e, n]) for one tile."""
    pid_m, pid_n = _tile_ids(num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    s_n = offs_n // 128 if FP8 else offs_n
    weight = tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    if SWAP_AB:  # acc^T [BLOCK_N, BLOCK_M]: weight rows x pair columns
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_t = _matmul_rows_t(
            acc_t,
            inter_ptr + offs_m.to(tl.int64) * stride_im,
            is_ptr + offs_m.to(tl.int64) * stride_ism,
            row_ok,
            w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn,
            s_ptr + expert * stride_se + s_n.to(tl.int64) * stride_sn,
            n_ok,
            K,
            FP4,
            FP8,
            BLOCK_K,
            EVEN_K,
            PRECISION,
            UPCAST,
        )
        acc_t = acc_t * weight[None, :]
        ptrs_t = out_ptr + pairs.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs_t, acc_t.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & n_ok[:, None])
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _matmul_rows(
            acc,
            inter_ptr + offs_m.to(tl.int64) * stride_im,
            is_ptr + offs_m.to(tl.int64) * stride_ism,
            row_ok,
            w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn,
            s_ptr + expert * stride_se + s_n.to(tl.int64) * stride_sn,
            n_ok,
            K,
            FP4,
            FP8,
            BLOCK_K,
            EVEN_K,
            PRECISION,
            UPCAST,
        )
        acc = acc * weight[:, None]
        ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# Pairs up to which alignment runs as one Triton launch (each of its E programs reads every id
# twice); larger (prefill) batches use the sort-based torch path, ~30 torch ops. Up to an
# aggregated engine's 8,192-token steps (x top-6 or top-8): its agent steps of ~2.7K tokens sat
# just past the earlier 16,384, and the sort path's launches took 25% of its host-bound engine
# thread (py-spy, H100). The kernel's device time at these sizes: scripts/gpu/bench_align.py.
ALIGN_KERNEL_MAX_PAIRS = 65536
ALIGN_INTERPRETED_MAX_PAIRS = 16384  # off CUDA (Triton's interpreter) the kernel is slow
_ALIGN_BLOCK = 1024


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    num_pairs,
    num_rows,
    NUM_EXPERTS: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):  # type: ignore[no-untyped-def]
    """Program ``e`` places expert ``e``'s pairs (in pair order) and padding in ``sorted_ids``
    and writes its blocks' ``expert_ids``; the last program also writes ``total`` and fills the
    unused tail (padding rows, expert ``E - 1``) exactly like the sort-based path."""
    e = tl.program_id(0)
    # Loops with runtime bounds are ``while`` loops: Triton's interpreter (CPU tests) keeps scalars
    # as 1-element arrays, which ``range`` rejects.
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    c0 = 0
    while c0 < num_pairs:
        ok = c0 + offs < num_pairs
        ids = tl.load(ids_ptr + c0 + offs, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_POW2, mask=ok & (ids < NUM_EXPERTS))
        c0 += BLOCK
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ex = tl.arange(0, E_POW2)
    start = tl.sum(tl.where(ex < e, padded, 0), axis=0)
    count = tl.sum(tl.where(ex == e, counts, 0), axis=0)
    end = start + tl.sum(tl.where(ex == e, padded, 0), axis=0)
    run = tl.sum(tl.zeros((BLOCK,), dtype=tl.int32), axis=0)
    c0 = 0
    while c0 < num_pairs:
        ok = c0 + offs < num_pairs
        ids = tl.load(ids_ptr + c0 + offs, mask=ok, other=0).to(tl.int32)
        hit = (ids == e) & ok
        rank = run + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(sorted_ids_ptr + start + rank, c0 + offs, mask=hit)
        run += tl.sum(hit.to(tl.int32), axis=0)
        c0 += BLOCK
    pad = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + pad, tl.full((BLOCK_M,), 0, tl.int32) + num_pairs, mask=pad < end)
    b0 = start // BLOCK_M
    while b0 < end // BLOCK_M:
        blk = b0 + offs
        tl.store(
            expert_ids_ptr + blk, tl.full((BLOCK,), 0, tl.int32) + e, mask=blk < end // BLOCK_M
        )
        b0 += BLOCK
    if e == NUM_EXPERTS - 1:
        total = tl.sum(padded, axis=0)
        tl.store(total_ptr, total.to(tl.int64))
        r0 = total
        while r0 < num_rows:
            r = r0 + offs
            r_ok = r < num_rows
            tl.store(sorted_ids_ptr + r, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=r_ok)
            tl.store(
                expert_ids_ptr + r // BLOCK_M,
                tl.full((BLOCK,), NUM_EXPERTS - 1, tl.int32),
                mask=r_ok & (r % BLOCK_M == 0),
            )
            r0 += BLOCK


def _align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    method: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Sort (token, slot) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    A pair whose id is ``num_experts`` has no expert (an expert-parallel padding row,
    :mod:`libs.engine.ep.fixed`): it is placed in no block, so no GEMM reads it and its output row
    is never written. Returns ``sorted_ids`` (int32, flat pair index per padded row, ``T*k`` for
    padding; within an expert pairs keep their flat order), ``expert_ids`` (int32, expert per
    M-block, ``E - 1`` past the end), ``total`` (int64 [1], padded row count) and the number of
    M-blocks the buffers hold. Device ops only. ``method``: ``"kernel"`` (one Triton launch,
    histogram + per-expert prefix ranks; the default up to ``ALIGN_KERNEL_MAX_PAIRS`` pairs on
    CUDA, ``ALIGN_INTERPRETED_MAX_PAIRS`` elsewhere) or
    ``"sort"`` (torch ops around a stable argsort); both give identical buffers.
    """
    m = topk_ids.numel()
    if method is None:
        limit = ALIGN_KERNEL_MAX_PAIRS if topk_ids.is_cuda else ALIGN_INTERPRETED_MAX_PAIRS
        method = "kernel" if m <= limit else "sort"
    num_blocks = triton.cdiv(m + num_experts * (block_m - 1), block_m)
    dev = topk_ids.device
    if method == "kernel":
        ids = topk_ids.reshape(-1)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        total = torch.empty(1, dtype=torch.int64, device=dev)
        _align_kernel[(num_experts,)](
            ids,
            sorted_ids,
            expert_ids,
            total,
            m,
            num_blocks * block_m,
            NUM_EXPERTS=num_experts,
            E_POW2=_pow2_at_least(num_experts),
            BLOCK_M=block_m,
            BLOCK=_ALIGN_BLOCK,
            num_warps=4,
        )
        return sorted_ids, expert_ids, total, num_blocks
    if method != "sort":
        raise ValueError(f"unknown alignment method {method!r}")
    flat = topk_ids.reshape(-1).to(torch.int64)
    live = flat < num_experts  # no-expert pairs sort last and land in a dropped extra row
    key = flat.clamp(max=num_experts - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, live.to(torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first_row = padded_end - padded - (counts.cumsum(0) - counts)  # padded start - unpadded start
    order = torch.argsort(flat, stable=True)
    dest = first_row[key[order]] + torch.arange(m, device=dev)
    dest = torch.where(live[order], dest, num_blocks * block_m)
    sorted_ids = torch.full((num_blocks * block_m + 1,), m, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:-1]
    block_start = torch.arange(0, num_blocks * block_m, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:], num_blocks


def _operands(w: torch.Tensor | Fp4Weight | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(weight, FP4 codes or e4m3 values; scales or a dummy; "bf16" | "fp4" | "fp8")."""
    if isinstance(w, Fp4Weight):
        if w.packed.stride(-1) != 1 or w.scales.stride(-1) != 1:
            raise ValueError("Fp4Weight tensors must be contiguous along K")
        return w.packed, w.scales, "fp4"
    if isinstance(w, Fp8Weight):
        if w.q.stride(-1) != 1 or w.scale.stride(-1) != 1 or w.q.dim() != 3:
            raise ValueError("Fp8Weight expert tensors must be [E, N, K], contiguous along K")
        return w.q, w.scale, "fp8"
    if w.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous along K")
    return w, w, "bf16"


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | Fp4Weight | Fp8Weight,
    w2: torch.Tensor | Fp4Weight | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    swiglu_limit: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Routed experts: ``sum_j w[t,j] * (silu(x Wg^T) * (x Wu^T)) W2^T`` of expert ``ids[t,j]``
    (``swiglu_limit``: DeepSeek-V4's clamped SwiGLU, ``silu(min(g, L)) * clamp(u, -L, L)``).

    ``x [T, H]`` (bf16/fp32), ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (tensors, :class:`Fp4Weight` or,
    both or neither, :class:`Fp8Weight`), ``topk_weights [T, k]`` fp32, ``topk_ids [T, k]`` int
    (``E``: no expert, for expert-parallel padding rows with ``k == 1``: no GEMM reads the row and
    its output is left unwritten, garbage the caller never reads). Returns ``[T, H]`` in ``x.dtype``
    (written into ``out`` when given). No host synchronisation. With FP8 weights the activations are
    quantized as DeepSeek's FP8 inference does (per token and 128 channels,
    :func:`quantize_fp8_tokens`): ``x`` before kernel 1, the ``silu(gate) * up`` rows (kept in
    ``x.dtype``) before kernel 2.

    ``config`` (default :func:`default_config`) sets ``BLOCK_M`` (rows per M-block, also the
    alignment padding), ``BLOCK_N`` (GEMM tile width; in kernel 1 it holds ``BLOCK_N/2`` gate and
    ``BLOCK_N/2`` up columns), ``BLOCK_K`` (a multiple of 64 for FP4, 128 for FP8), ``GROUP_M``
    (M-blocks per grouped sweep over N), ``num_warps``, ``num_stages``, and optionally
    ``SWAP_AB`` (default False; needs ``BLOCK_M >= 16``): compute each tile transposed,
    ``W_tile @ X_tile^T``, so the (decoded) weights are ``tl.dot``'s A operand, for decode where
    an expert has few rows; both kernels use the same values.

    ``invariant``: batch-invariant (``--batch-invariant``): one config for every ``T``
    (:data:`INVARIANT_CONFIG`, so each pair's products are summed in the same order whatever
    else is routed) and a token's ``k`` expert outputs added in slot order.
    """
    t, hidden = x.shape
    k = topk_ids.shape[1]
    e, two_i, h13 = w13.shape
    e2, h2, inter_dim = w2.shape
    if (
        h13 != hidden
        or h2 != hidden
        or two_i != 2 * inter_dim
        or e2 != e
        or topk_ids.shape[0] != t
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, topk_weights {tuple(topk_weights.shape)}, "
            f"topk_ids {tuple(topk_ids.shape)}"
        )
    if out is None:
        out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    w13_t, s13, kind13 = _operands(w13)
    w2_t, s2, kind2 = _operands(w2)
    fp8 = kind13 == "fp8"
    if fp8 != (kind2 == "fp8"):
        raise ValueError("FP8 experts need both w13 and w2 as Fp8Weight")
    fp4 = "fp4" in (kind13, kind2)
    if invariant and (fp4 or fp8 or config is not None):
        raise ValueError("invariant fused_moe takes bf16/fp32 experts and its own config")
    if invariant:
        cfg = INVARIANT_CONFIG
    else:
        cfg = config or default_config(t, k, e, two_i, hidden, fp4, fp8)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if fp4 and bk % _FP4_GROUP:
        raise ValueError(f"FP4 weights need BLOCK_K to be a multiple of {_FP4_GROUP}, got {bk}")
    if fp8 and bk != FP8_BLOCK:
        raise ValueError(f"FP8 weights need BLOCK_K == {FP8_BLOCK} (their scale tile), got {bk}")
    if fp8 or x.stride(1) != 1:  # rows may be strided (EP's receive buffer), elements not
        x = x.contiguous()
    sorted_ids, expert_ids, total, num_pid_m = _align(topk_ids, e, bm)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    swap = bool(cfg.get("SWAP_AB", False))
    if swap and bm < 16:
        raise ValueError(f"SWAP_AB needs BLOCK_M >= 16 (tl.dot dims), got {bm}")
    launch = {
        "num_warps": cfg["num_warps"],
        "num_stages": cfg["num_stages"],
        "PRECISION": precision,
        "UPCAST": _INTERPRET,
        "SWAP_AB": swap,
    }
    if fp8:
        xa, xs = quantize_fp8_tokens(x, kernel=True)
    else:
        xa, xs = x, x
    inter = torch.empty(num_pid_m * bm, inter_dim, dtype=x.dtype, device=x.device)
    grid1 = (num_pid_m * triton.cdiv(inter_dim, bn // 2),)
    _gate_up_kernel[grid1](
        xa,
        xs,
        w13_t,
        s13,
        inter,
        sorted_ids,
        expert_ids,
        total,
        t * k,
        k,
        inter_dim,
        num_pid_m,
        0.0 if swiglu_limit is None else float(swiglu_limit),
        xa.stride(0),
        xs.stride(0),
        w13_t.stride(0),
        w13_t.stride(1),
        s13.stride(0),
        s13.stride(1),
        inter.stride(0),
        K=hidden,
        FP4=kind13 == "fp4",
        FP8=fp8,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg["GROUP_M"],
        EVEN_K=hidden % bk == 0,
        CLAMP=swiglu_limit is not None,
        **launch,
    )
    if fp8:
        ia, i_s = quantize_fp8_tokens(inter, kernel=True)
    else:
        ia, i_s = inter, inter
    # One slot per row (EP's received rows): the pairs are the rows, written in place.
    direct = k == 1 and not invariant and out.is_contiguous()
    pair_out = out if direct else torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    grid2 = (num_pid_m * triton.cdiv(hidden, bn),)
    _down_kernel[grid2](
        ia,
        i_s,
        w2_t,
        s2,
        pair_out,
        topk_weights.reshape(-1).contiguous(),
        sorted_ids,
        expert_ids,
        total,
        t * k,
        hidden,
        num_pid_m,
        ia.stride(0),
        i_s.stride(0),
        w2_t.stride(0),
        w2_t.stride(1),
        s2.stride(0),
        s2.stride(1),
        pair_out.stride(0),
        K=inter_dim,
        FP4=kind2 == "fp4",
        FP8=fp8,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg["GROUP_M"],
        EVEN_K=inter_dim % bk == 0,
        **launch,
    )
    if direct:
        return out
    pairs = pair_out.view(t, k, hidden)
    if invariant:  # slot order, in fp32: torch.sum's reduction plan depends on T
        acc = pairs[:, 0].float()
        for j in range(1, k):
            acc += pairs[:, j]
        out.copy_(acc)
    else:
        torch.sum(pairs, dim=1, out=out)
    return out
