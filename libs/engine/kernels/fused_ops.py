"""Small fused kernels for the per-token work around the GEMMs: RMSNorm (optionally after the
residual add), rotary embedding, SiLU·up, and MLA's latent path (norm + rope + cache write).

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
def _rms_scaled(x, w, n_cols, eps):  # type: ignore[no-untyped-def]
    """RMSNorm of one row ``x`` (zeros past ``n_cols``) times ``w``, in fp32, rounded where the
    PyTorch reference rounds: the normalized row in ``x``'s dtype before the weight."""
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    return (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rope_pairs(i, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):  # type: ignore[no-untyped-def]
    """The element pairs rotary embedding turns: adjacent (interleaved) or half a row apart."""
    if INTERLEAVE:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + HALF
    return first, second


@triton.jit
def _rotate(x1, x2, c, s):  # type: ignore[no-untyped-def]
    """One rotary turn of the pairs ``(x1, x2)`` in fp32."""
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return x1f * c - x2f * s, x2f * c + x1f * s


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
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _rms_scaled(x, w, n_cols, eps)
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
    first, second = _rope_pairs(i, HALF, INTERLEAVE)
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(base + first[None, :], mask=hmask, other=0.0)
    x2 = tl.load(base + second[None, :], mask=hmask, other=0.0)
    o1, o2 = _rotate(x1, x2, c, s)
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


@triton.jit
def _latent_write_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    out_ptr,
    cache_ptr,
    eps,
    stride_x,
    stride_c,
    stride_out,
    stride_cache,
    R: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    """One token: RMSNorm of the latent and rotary embedding of the key (the helpers
    ``_rms_norm_kernel`` and ``_rope_kernel`` use), both written to the step's latents and to
    the cache slot."""
    row = tl.program_id(0)
    cols = tl.arange(0, R)
    c = tl.load(x_ptr + row * stride_x + cols)
    latent = _rms_scaled(c, tl.load(w_ptr + cols), R, eps).to(c.dtype)
    i = tl.arange(0, HALF)
    first, second = _rope_pairs(i, HALF, INTERLEAVE)
    first, second = R + first, R + second
    cs = tl.load(cos_ptr + row * stride_c + i)
    sn = tl.load(sin_ptr + row * stride_c + i)
    x1 = tl.load(x_ptr + row * stride_x + first)
    x2 = tl.load(x_ptr + row * stride_x + second)
    o1, o2 = _rotate(x1, x2, cs, sn)
    o1, o2 = o1.to(c.dtype), o2.to(c.dtype)
    out = out_ptr + row * stride_out
    tl.store(out + cols, latent)
    tl.store(out + first, o1)
    tl.store(out + second, o2)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    dst = cache_ptr + slot * stride_cache
    kind = cache_ptr.dtype.element_ty
    tl.store(dst + cols, latent.to(kind))
    tl.store(dst + first, o1.to(kind))
    tl.store(dst + second, o2.to(kind))


def latent_write(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    slots: torch.Tensor,
    cache_kv: torch.Tensor,
) -> torch.Tensor:
    """MLA's latent path after ``kv_a_proj`` in one launch: ``kv_a`` [tokens, R + P] (any row
    stride) becomes ``[RMSNorm(c) | rope(k_pe)]`` [tokens, R + P] in ``kv_a``'s dtype, which is
    also stored at cache rows ``slots`` of ``cache_kv`` [slots, R + P] (a bf16/fp32 cache).
    The same numbers as ``RMSNorm``, ``Rotary.apply``, ``torch.cat`` and ``LayerCache.write``
    on the kernel path, in one launch instead of four."""
    t, width = kv_a.shape
    r = norm_weight.shape[0]
    half = (width - r) // 2
    assert kv_a.stride(-1) == 1 and cache_kv.stride(-1) == 1 and cache_kv.shape[1] == width
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, width), dtype=kv_a.dtype, device=kv_a.device)
    if t:
        _latent_write_kernel[(t,)](
            kv_a,
            norm_weight,
            cos,
            sin,
            slots,
            out,
            cache_kv,
            eps,
            kv_a.stride(0),
            cos.stride(0),
            out.stride(0),
            cache_kv.stride(0),
            R=r,
            HALF=half,
            INTERLEAVE=interleave,
            num_warps=4 if r >= 256 else 1,
        )
    return out
