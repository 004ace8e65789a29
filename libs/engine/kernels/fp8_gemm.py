"""Block-scaled FP8 linears: DeepSeek-V3's weight format, per-token activation scales.

Format (the released checkpoints' ``weight`` + ``weight_scale_inv``), for ``w [..., N, K]``:

* ``q`` (``torch.float8_e4m3fn``, same shape) and ``scale`` (fp32 ``[..., ceil(N/128),
  ceil(K/128)]``) with ``w ~ q * scale`` per 128x128 tile (partial tiles at the edges use the
  same scale). Despite the ``_inv`` in the checkpoint name the stored number multiplies: it is
  the inverse of the quantization factor, ``amax(tile) / 448``.
* activations are quantized on the fly, one fp32 scale per token and 128-channel group
  (``amax / 448``), so ``x @ w.T = sum_kb (xq_kb @ q_kb.T) * xs[:, kb] * scale[nb, kb]``.

:func:`fp8_linear` picks the Triton kernel (CUDA, or forced; Hopper's FP8 tensor cores: one
``tl.dot`` on e4m3 operands per 128-wide K step, the two scales applied to that step's fp32
partial sum) or :func:`fp8_linear_reference` (plain PyTorch: the same quantized operands
dequantized to fp32 and multiplied; correct, not fast -- the CPU path).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite e4m3fn magnitude
FP8_DTYPE = torch.float8_e4m3fn
# Triton's interpreter has no e4m3 dot: there the operands are widened to fp32 first (exact).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Fp8Weight:
    """A block-quantized weight ``[..., N, K]`` (layout: module doc)."""

    q: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # float32 [..., ceil(N/128), ceil(K/128)]

    @property
    def shape(self) -> torch.Size:
        """The shape of the weight this encodes."""
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-tile ``scale [..., R, C]`` repeated to one value per element ``[..., rows, cols]``."""
    s = scale.repeat_interleave(FP8_BLOCK, -2)[..., :rows, :]
    return s.repeat_interleave(FP8_BLOCK, -1)[..., :cols]


# The fp32 working copy quantize_fp8_blocks makes at most at once: a stacked expert weight of
# DeepSeek-V3's width (256 x 4096 x 7168) is 28 GiB in fp32, twice that with the scaled tiles,
# more than an 80 GB card has beside the weights; matrix by matrix it stays under this bound.
QUANTIZE_CHUNK_BYTES = 1 << 30


def quantize_fp8_blocks(w: torch.Tensor) -> Fp8Weight:
    """``w [..., N, K]`` to e4m3 with one ``amax / 448`` scale per 128x128 tile (all-zero
    tiles: scale 1). Round to nearest even; ``q * scale`` never exceeds the tile's amax.
    A stacked weight is quantized a few matrices at a time (``QUANTIZE_CHUNK_BYTES`` of fp32
    work), so the transient memory does not grow with the number of experts."""
    *lead, n, k = w.shape
    count = math.prod(lead)
    per = max(1, QUANTIZE_CHUNK_BYTES // max(1, _blocks(n) * _blocks(k) * FP8_BLOCK**2 * 4))
    if count > per:
        flat = w.reshape(count, n, k)
        q = torch.empty(count, n, k, dtype=FP8_DTYPE, device=w.device)
        scale = torch.empty(count, _blocks(n), _blocks(k), dtype=torch.float32, device=w.device)
        for i in range(0, count, per):
            part = _quantize_blocks(flat[i : i + per])
            q[i : i + per], scale[i : i + per] = part.q, part.scale
        return Fp8Weight(q.view(*lead, n, k), scale.view(*lead, _blocks(n), _blocks(k)))
    return _quantize_blocks(w)


def _quantize_blocks(w: torch.Tensor) -> Fp8Weight:
    *lead, n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    wf = torch.zeros(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    wf[..., :n, :k] = w.to(torch.float32)
    tiles = wf.view(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k].contiguous()
    return Fp8Weight(q, scale)


def dequantize_fp8_blocks(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per tile (the checkpoint convention), in fp32, cast to ``dtype``."""
    n, k = w.q.shape[-2:]
    return (w.q.to(torch.float32) * _expand(w.scale.to(torch.float32), n, k)).to(dtype)


def quantize_fp8_tokens(
    x: torch.Tensor, kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` to ``(e4m3 [M, K], fp32 scales [M, ceil(K/128)])``, one per token and
    128-channel group (``amax / 448``; an all-zero group gets scale 1). ``kernel``: one Triton
    launch (None: on CUDA) instead of the plain PyTorch ops; the same numbers."""
    if kernel is None:
        kernel = x.is_cuda
    if kernel:
        return _quantize_tokens_triton(x)
    m, k = x.shape
    kb = _blocks(k)
    pad = kb * FP8_BLOCK - k
    xf = x.to(torch.float32)
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    groups = xf.view(m, kb, FP8_BLOCK)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * FP8_BLOCK)[:, :k], scale


def dequantize_fp8_tokens(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_fp8_tokens`' output back in fp32 ``[M, K]``: each group times its scale."""
    return q.to(torch.float32) * scale.repeat_interleave(FP8_BLOCK, -1)[:, : q.shape[1]]


@triton.jit
def _quantize_tokens_kernel(  # type: ignore[no-untyped-def]
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, BLOCK_R: tl.constexpr
):
    """Program (row block, group): one 128-channel group of ``BLOCK_R`` rows to e4m3 and their
    scales. The division and the round-to-nearest-even cast (the hardware's) match
    :func:`quantize_fp8_tokens`' torch ops. ``q_ptr`` may be fp32: the values before the cast
    (the interpreter's own e4m3 cast rounds wrongly, so there the host casts)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    offs = kb * 128 + tl.arange(0, 128)
    ok = (rows[:, None] < M) & (offs[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(
        q_ptr + rows[:, None] * stride_qm + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=ok
    )
    tl.store(s_ptr + rows * stride_sm + kb, scale, mask=rows < M)


def _quantize_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    kb = _blocks(k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float32 if _INTERPRET else FP8_DTYPE, device=x.device)
    scale = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m:
        # 16 rows x 128 channels a program (4 warps): the one-row programs this replaced spent
        # 214 us on a 16K x 2048 bf16 input on the H200, about 8x its bytes' time.
        rows = 16
        _quantize_tokens_kernel[(triton.cdiv(m, rows), kb)](
            x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), BLOCK_R=rows, num_warps=4
        )
    return (q.to(FP8_DTYPE) if _INTERPRET else q), scale


def fp8_linear_reference(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with ``x`` quantized per token group, both operands dequantized
    to fp32, the product cast to ``x.dtype``. ``x [..., K]``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = dequantize_fp8_tokens(*quantize_fp8_tokens(x2, kernel=False)) @ dequantize_fp8_blocks(w).T
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).view(*lead, -1)


@triton.jit
def _fp8_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,  # e4m3 [M, K]; with QUANT_A the unquantized activations (bf16/fp32)
    as_ptr,  # fp32 [M, KB] (unused with QUANT_A)
    b_ptr,  # e4m3 [N, K]
    bs_ptr,  # fp32 [NB, KB]
    c_ptr,  # out [M, N], or fp32 partial sums [SPLIT_K, M, N]
    bias_ptr,
    M,
    N,
    K: tl.constexpr,  # a handful of model widths: one compile each, a constant loop
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    stride_cs,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT_A: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of ``C`` over one of ``SPLIT_K`` runs of K blocks;
    BLOCK_K == 128, so each K step meets one activation scale per row and one weight scale per
    128 columns. ``QUANT_A``: the activations arrive unquantized and each K step quantizes its
    [BLOCK_M, 128] tile exactly as :func:`quantize_fp8_tokens` does (same numbers, no separate
    launch; it pays only for a few rows, see :data:`FUSE_QUANT_MAX_M`).
    Tiles go in GROUP_M-row sweeps (L2 reuse of B). With SPLIT_K > 1 each split stores its
    fp32 partial sum (:func:`_fp8_split_reduce` adds them)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    KB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER_SPLIT: tl.constexpr = (KB + SPLIT_K - 1) // SPLIT_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, PER_SPLIT):
        kb = split * PER_SPLIT + i
        k = kb * BLOCK_K + rk
        k_ok = k < K  # also false for a last split's blocks past KB
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        in_k = kb < KB
        if QUANT_A:
            af = a.to(tl.float32)
            amax = tl.max(tl.abs(af), axis=1)
            a_s = tl.where(amax > 0, amax / 448.0, 1.0)
            a = tl.clamp(af / a_s[:, None], -448.0, 448.0).to(b_ptr.dtype.element_ty)
        else:
            a_s = tl.load(as_ptr + rm * stride_asm + kb, mask=m_ok & in_k, other=0.0)
        b = tl.load(
            b_ptr + rn[None, :] * stride_bn + k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if BLOCK_N <= 128:  # one weight scale for the tile (a vector here costs the prefill 25%)
            b_s1 = tl.load(
                bs_ptr + (pid_n * BLOCK_N // 128) * stride_bsn + kb, mask=in_k, other=0.0
            )
            acc += part * (a_s[:, None] * b_s1)
        else:
            b_s = tl.load(bs_ptr + (rn // 128) * stride_bsn + kb, mask=n_ok & in_k, other=0.0)
            acc += part * (a_s[:, None] * b_s[None, :])
    c = c_ptr + split * stride_cs + rm[:, None] * stride_cm + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(c, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_split_reduce(  # type: ignore[no-untyped-def]
    part_ptr,
    bias_ptr,
    c_ptr,
    MN,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``c = sum_s part[s] (+ bias)`` in a fixed order (reproducible), cast to c's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


# An H200's SMs; small-M (decode) GEMMs aim at two programs per SM streaming weights.
_NUM_SMS = 132
_TARGET_PROGRAMS = 2 * _NUM_SMS
# Up to this many rows fp8_linear quantizes the activations inside the GEMM (QUANT_A); above
# it one quantizer launch first. Measured in CUDA graphs on the H200 (scripts/gpu/
# bench_fp8_gemm.py, V2-Lite's dense shapes): fused wins 0.2-0.6 us at 1 row, loses at 64 rows
# (o_proj 8.7 vs 6.9 us) and at 256 by 2-3x (q_proj 32 vs 10 us), as every tile column
# re-quantizes its rows.
FUSE_QUANT_MAX_M = 16


def _gemm_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tiles for ``[m, k] @ [n, k]^T``. Prefill-sized M: 128x128 tiles, 8 warps, 4 stages (e4m3
    tiles are 16 KB), grouped sweeps -- once they make at least one wave of programs. Smaller
    problems are bound by weight bandwidth: 16-64-row tiles, and K split (in whole 128-blocks)
    until about two programs per SM stream weights."""
    if m > 64 and -(-m // 128) * -(-n // 128) >= _NUM_SMS:
        return {
            "BLOCK_M": 128,
            "BLOCK_N": 128,
            "GROUP_M": 8,
            "SPLIT_K": 1,
            "num_warps": 8,
            "num_stages": 4,
        }
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = -(-m // block_m) * -(-n // 64)
    kb = _blocks(k)
    split = 1
    while tiles * split * 2 <= _TARGET_PROGRAMS and split * 2 <= kb:
        split *= 2
    # Even runs of K blocks: a split that would hold none is not launched.
    while split > 1 and -(-kb // split) * (split - 1) >= kb:
        split //= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": 64,
        "GROUP_M": 1 if m <= 64 else 8,
        "SPLIT_K": split,
        "num_warps": 4,
        "num_stages": 3,
    }


def fp8_gemm(
    x: torch.Tensor,
    xs: torch.Tensor | None,
    w: Fp8Weight,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Launcher: ``(x * xs) @ (w.q * w.scale).T`` for quantized ``x [M, K]``, ``xs [M, KB]``
    and a 2-D ``w`` (``[N, K]``); fp32 accumulation, ``out_dtype`` result ``[M, N]``. With
    ``xs`` None, ``x`` is unquantized (bf16/fp32) and the kernel quantizes it per token group
    as :func:`quantize_fp8_tokens` would (QUANT_A). ``config``: :func:`_gemm_config`'s keys
    (tests force split-K and tile shapes)."""
    m, k = x.shape
    n = w.q.shape[0]
    if w.q.shape[1] != k or x.stride(-1) != 1 or w.q.stride(-1) != 1:
        raise ValueError(f"fp8_gemm: x {tuple(x.shape)} vs w {tuple(w.q.shape)} (K-contiguous)")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or _gemm_config(m, n, k)
    block_m, block_n, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]
    if block_n < FP8_BLOCK and FP8_BLOCK % block_n:
        raise ValueError(f"fp8_gemm: a BLOCK_N under {FP8_BLOCK} must divide it, got {block_n}")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)
    quant_a = xs is None
    xs = x if xs is None else xs.contiguous()  # QUANT_A: a dummy pointer, never read
    scale = w.scale.contiguous()
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _fp8_gemm_kernel[grid](
        x,
        xs,
        w.q,
        scale,
        target,
        bias if bias is not None else out,
        m,
        n,
        k,
        x.stride(0),
        xs.stride(0),
        w.q.stride(0),
        scale.stride(0),
        target.stride(-2),
        m * n,
        HAS_BIAS=bias is not None,
        UPCAST=_INTERPRET,
        QUANT_A=quant_a,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=FP8_BLOCK,
        GROUP_M=cfg["GROUP_M"],
        SPLIT_K=split,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split > 1:
        block = 1024
        _fp8_split_reduce[(triton.cdiv(m * n, block),)](
            target,
            bias if bias is not None else out,
            out,
            m * n,
            n,
            HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=block,
            num_warps=4,
        )
    return out


def fp8_linear(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    kernel: bool | None = None,
    fuse_quant: bool | None = None,
) -> torch.Tensor:
    """Wrapper: ``x [..., K] @ w.T (+ bias)`` in ``x.dtype``. ``kernel``: the Triton GEMM
    (None: on CUDA), else :func:`fp8_linear_reference`. ``fuse_quant``: quantize the
    activations inside the GEMM (None: up to :data:`FUSE_QUANT_MAX_M` rows, except under
    Triton's interpreter, whose e4m3 cast rounds wrongly); else one quantizer launch first.
    Both give the same numbers."""
    if kernel is None:
        kernel = x.is_cuda
    if not kernel:
        return fp8_linear_reference(x, w, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if fuse_quant is None:
        fuse_quant = not _INTERPRET and x2.shape[0] <= FUSE_QUANT_MAX_M
    xq, xs = (x2, None) if fuse_quant else quantize_fp8_tokens(x2, kernel=True)
    return fp8_gemm(xq.contiguous(), xs, w, x.dtype, bias).view(*lead, -1)
