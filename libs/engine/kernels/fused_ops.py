"""Small fused kernels for the per-token work around the GEMMs: RMSNorm (optionally after the
residual add) and rotary embedding.

In a decode step these run once per layer on a few hundred rows; as PyTorch ops each is 6 to
10 launches (dtype casts, pow, mean, rsqrt, products, slicing), which at a few microseconds
each add up to milliseconds per step. Each kernel here is one launch and rounds exactly where
the PyTorch reference rounds (:class:`libs.engine.model.layers.RMSNorm`,
:meth:`libs.engine.model.rope.Rotary.apply`), so results match it up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    eps,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream, rounded
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual) * weight, x + residual)`` for ``x`` [rows, dim] (residual optional:
    then the second result is ``x``). Rows may be strided; the last dim must be contiguous."""
    rows, dim = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    if rows:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            summed,
            eps,
            dim,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            summed.stride(0),
            HAS_RES=residual is not None,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return out, summed


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    hmask = heads[:, None] < n_heads
    c = tl.load(cos_ptr + t * stride_c + i)[None, :]
    s = tl.load(sin_ptr + t * stride_c + i)[None, :]
    if INTERLEAVE:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + HALF
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(base + first[None, :], mask=hmask, other=0.0)
    x2 = tl.load(base + second[None, :], mask=hmask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = x1f * c - x2f * s
    o2 = x2f * c + x1f * s
    obase = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    tl.store(obase + first[None, :], o1.to(x1.dtype), mask=hmask)
    tl.store(obase + second[None, :], o2.to(x1.dtype), mask=hmask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding of ``x`` [tokens, heads, dim] or [tokens, dim] (any token/head strides,
    contiguous last dim) with fp32 ``cos``/``sin`` [tokens, dim // 2]; a new contiguous tensor."""
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(1) if squeeze else x
    t, h, d = x3.shape
    assert x3.stride(-1) == 1 and d % 2 == 0
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        block_h = min(triton.next_power_of_2(h), 16)
        _rope_kernel[(t, triton.cdiv(h, block_h))](
            x3,
            cos,
            sin,
            out,
            h,
            x3.stride(0),
            x3.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            HALF=d // 2,
            INTERLEAVE=interleave,
            BLOCK_H=block_h,
            num_warps=1,
        )
    return out.squeeze(1) if squeeze else out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the input dtype
    tl.store(
        out_ptr + row * stride_out + cols,
        (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
        mask=mask,
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2 * n] = [gate | up] (contiguous last dim)."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out
