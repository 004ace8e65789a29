"""Batch invariance: a row's result never depends on the other rows of the call.

Libraries pick their algorithm by the whole problem's shape. cuBLAS (and MKL on the CPU)
run a decode batch of 1 through a GEMV or a split-K kernel and a batch of 64 through a tiled
GEMM, and the order in which a row's ``K`` products are summed changes with them; PyTorch's
CPU kernels even compute ``sigmoid``/``exp`` of the same number differently in a 16-element
tensor and a 128-element one. So a request's logits move in the last bits with the requests
beside it. This module fixes the order:

* :func:`matmul_nt` with ``kernel=True`` (Triton: CUDA, or Triton's interpreter): one launch
  config for every shape. A program owns a ``BLOCK_M x BLOCK_N`` tile and walks ``K`` in
  ``BLOCK_K`` steps from 0 upward, accumulating ``tl.dot`` products in fp32 -- no split-K, no
  shape-dependent tiles, so row ``m`` of the output is the same function of row ``m`` of
  ``a`` at any ``M`` and any place in the batch (rows past ``M`` are masked to zero);
* :func:`matmul_nt` with ``kernel=False`` (PyTorch, the CPU path): the rows go through
  ``F.linear`` in fixed 16-row calls, the last padded with zeros, so the library sees one
  shape (within one shape MKL sums every row alike);
* :func:`rows_fixed`: any row-wise PyTorch function (elementwise maths, a softmax over the
  last dim, a norm) applied in fixed 64-row calls on CPU tensors; on CUDA PyTorch computes
  each element with the same code at any size, so it is called directly.

``matmul_nt`` computes ``a @ w^T`` for ``a [B, M, K]`` and ``w [B, N, K]`` (any strides; ``B``
the heads of MLA's absorbed products, 1 for a linear layer) into ``[B, M, N]`` in ``a``'s dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# One config for every shape (changing it changes results, not correctness). 64-row tiles
# keep Hopper's 64-row MMA for decode and prefill alike.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
_CHUNK_ROWS = 16  # the PyTorch path's fixed GEMM call shape
_FIXED_ROWS = 64  # rows_fixed's call shape


@triton.jit
def _matmul_nt_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    M,
    N,
    stride_ab,
    stride_am,
    stride_ak,
    stride_wb,
    stride_wn,
    stride_wk,
    stride_cb,
    stride_cm,
    stride_cn,
    K: tl.constexpr,  # a layer's width: one compile per layer shape, none per batch
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + pid_b * stride_ab + offs_m[:, None] * stride_am
    w_cols = w_ptr + pid_b * stride_wb + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            a_rows + kk[None, :] * stride_ak,
            mask=(offs_m[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_cols + kk[:, None] * stride_wk,
            mask=(kk[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    tl.store(
        c_ptr + pid_b * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


def _check(a: torch.Tensor, w: torch.Tensor) -> None:
    if a.dim() != 3 or w.dim() != 3 or a.shape[0] != w.shape[0] or a.shape[2] != w.shape[2]:
        raise ValueError(
            f"matmul_nt takes a [B, M, K] and w [B, N, K], got {tuple(a.shape)} and "
            f"{tuple(w.shape)}"
        )
    if a.dtype != w.dtype:
        raise ValueError(f"a is {a.dtype} but w is {w.dtype}")


def matmul_nt(a: torch.Tensor, w: torch.Tensor, *, kernel: bool) -> torch.Tensor:
    """``a [B, M, K] @ w[B, N, K]^T -> [B, M, N]`` (``a``'s dtype), each row summed in one
    fixed order (see the module docstring). ``kernel``: the Triton kernel, else PyTorch."""
    _check(a, w)
    b, m, _ = a.shape
    n = w.shape[1]
    out = torch.empty(b, m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if not kernel:
        for i in range(b):
            wi = w[i].contiguous()
            for r0 in range(0, m, _CHUNK_ROWS):
                rows = pad_rows(a[i, r0 : r0 + _CHUNK_ROWS], _CHUNK_ROWS)
                out[i, r0 : r0 + _CHUNK_ROWS] = F.linear(rows.contiguous(), wi)[: m - r0]
        return out
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M), b)
    _matmul_nt_kernel[grid](
        a,
        w,
        out,
        m,
        n,
        *a.stride(),
        *w.stride(),
        *out.stride(),
        K=a.shape[2],
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=3,
    )
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, kernel: bool
) -> torch.Tensor:
    """``F.linear`` with a batch-invariant product: ``x [..., K]``, ``weight [N, K]``."""
    lead = x.shape[:-1]
    y = matmul_nt(x.reshape(1, -1, x.shape[-1]), weight[None], kernel=kernel)[0]
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])


def rows_fixed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (row ``i`` of the result depends on row ``i`` of ``x``
    only; ``fn(0)`` finite), computed so each row's result is the same in any batch: on the
    CPU ``fn`` sees fixed 64-row slices, the last padded with zeros."""
    n = x.shape[0]
    if x.is_cuda or n == 0:
        return fn(x)
    outs = []
    for r0 in range(0, n, _FIXED_ROWS):
        part = pad_rows(x[r0 : r0 + _FIXED_ROWS], _FIXED_ROWS)
        outs.append(fn(part.contiguous())[: n - r0])
    return torch.cat(outs)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (the fixed call shapes above)."""
    if x.shape[0] == rows:
        return x
    return torch.cat((x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))))
