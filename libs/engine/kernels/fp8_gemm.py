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
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-tile ``scale [..., R, C]`` repeated to one value per element ``[..., rows, cols]``."""
    s = scale.repeat_interleave(FP8_BLOCK, -2)[..., :rows, :]
    return s.repeat_interleave(FP8_BLOCK, -1)[..., :cols]


def quantize_fp8_blocks(w: torch.Tensor) -> Fp8Weight:
    """``w [..., N, K]`` to e4m3 with one ``amax / 448`` scale per 128x128 tile (all-zero
    tiles: scale 1). Round to nearest even; ``q * scale`` never exceeds the tile's amax."""
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


def quantize_fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` to ``(e4m3 [M, K], fp32 scales [M, ceil(K/128)])``, one per token and
    128-channel group (``amax / 448``; an all-zero group gets scale 1)."""
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


def fp8_linear_reference(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with ``x`` quantized per token group, both operands dequantized
    to fp32, the product cast to ``x.dtype``. ``x [..., K]``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_tokens(x2)
    xd = xq.to(torch.float32) * xs.repeat_interleave(FP8_BLOCK, -1)[:, : xq.shape[1]]
    out = xd @ dequantize_fp8_blocks(w).T
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).view(*lead, -1)


@triton.jit
def _fp8_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,  # e4m3 [M, K]
    as_ptr,  # fp32 [M, KB]
    b_ptr,  # e4m3 [N, K]
    bs_ptr,  # fp32 [NB, KB]
    c_ptr,  # out [M, N]
    bias_ptr,
    M,
    N,
    K: tl.constexpr,  # a handful of model widths: one compile each, a constant loop
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of ``C``; BLOCK_K == 128 and BLOCK_N divides 128, so each
    K step meets one weight scale (a scalar) and one activation scale per row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    nb = (pid_n * BLOCK_N) // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rn[None, :] * stride_bn + k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        a_s = tl.load(as_ptr + rm * stride_asm + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + nb * stride_bsn + kb)
        acc += part * (a_s[:, None] * b_s)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _block_m(m: int) -> int:
    """Decode batches (a few rows) take 16-row tiles, prefill 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: Fp8Weight,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher: ``(xq * xs) @ (w.q * w.scale).T`` for quantized ``xq [M, K]``, ``xs [M, KB]``
    and a 2-D ``w`` (``[N, K]``); fp32 accumulation, ``out_dtype`` result ``[M, N]``."""
    m, k = xq.shape
    n = w.q.shape[0]
    if w.q.shape[1] != k or xq.stride(-1) != 1 or w.q.stride(-1) != 1:
        raise ValueError(f"fp8_gemm: x {tuple(xq.shape)} vs w {tuple(w.q.shape)} (K-contiguous)")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    block_m, block_n = _block_m(m), 64 if m <= 64 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    xs = xs.contiguous()
    scale = w.scale.contiguous()
    _fp8_gemm_kernel[grid](
        xq,
        xs,
        w.q,
        scale,
        out,
        bias if bias is not None else out,
        m,
        n,
        k,
        xq.stride(0),
        xs.stride(0),
        w.q.stride(0),
        scale.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        UPCAST=_INTERPRET,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=FP8_BLOCK,
        num_warps=4,
        num_stages=3,
    )
    return out


def fp8_linear(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, kernel: bool | None = None
) -> torch.Tensor:
    """Wrapper: ``x [..., K] @ w.T (+ bias)`` in ``x.dtype``. ``kernel``: the Triton GEMM
    (None: on CUDA), else :func:`fp8_linear_reference`."""
    if kernel is None:
        kernel = x.is_cuda
    if not kernel:
        return fp8_linear_reference(x, w, bias)
    lead = x.shape[:-1]
    xq, xs = quantize_fp8_tokens(x.reshape(-1, x.shape[-1]))
    return fp8_gemm(xq.contiguous(), xs, w, x.dtype, bias).view(*lead, -1)
