"""DeepSeek-V4's hyper-connection mixing weights in one launch.

For each token, from its ``(2 + n) * n`` mixing logits ``w`` (fp32; ``n`` = ``hc_mult``
streams), the layer's ``base`` and the three ``scale`` factors::

    pre  = sigmoid(w[:n] * scale[0] + base[:n]) + eps
    post = 2 * sigmoid(w[n:2n] * scale[1] + base[n:2n])
    comb = softmax_j(w[2n:] * scale[2] + base[2n:])  + eps      (an n x n matrix, rows i)
    comb = comb / (column sums + eps), then iters - 1 times: rows, then columns

(Sinkhorn's iterations make ``comb`` doubly stochastic). In PyTorch that is about
``4 * iters + 10`` small launches per hyper-connection -- 20 iterations, two hyper-connections
per layer -- whatever the batch; here it is one, each program holding ``BLOCK_T`` tokens'
matrices in registers (``n`` padded to a power of two, the padding masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def _mix_kernel(
    w_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_tokens,
    eps,
    stride_w,
    N: tl.constexpr,
    NP: tl.constexpr,
    ITERS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    j = tl.arange(0, NP)
    j_ok = j < N
    s_pre = tl.load(scale_ptr).to(tl.float32)
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_comb = tl.load(scale_ptr + 2).to(tl.float32)
    row = w_ptr + t.to(tl.int64)[:, None] * stride_w
    ok2 = t_ok[:, None] & j_ok[None, :]
    pre_w = tl.load(row + j[None, :], mask=ok2, other=0.0)
    post_w = tl.load(row + N + j[None, :], mask=ok2, other=0.0)
    pre_b = tl.load(base_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    post_b = tl.load(base_ptr + N + j, mask=j_ok, other=0.0).to(tl.float32)
    pre = tl.sigmoid(pre_w * s_pre + pre_b[None, :]) + eps
    post = 2.0 * tl.sigmoid(post_w * s_post + post_b[None, :])
    out2 = t.to(tl.int64)[:, None] * N + j[None, :]
    tl.store(pre_ptr + out2, pre, mask=ok2)
    tl.store(post_ptr + out2, post, mask=ok2)

    i3 = tl.arange(0, NP)[None, :, None]
    j3 = tl.arange(0, NP)[None, None, :]
    ok3 = t_ok[:, None, None] & (i3 < N) & (j3 < N)
    cw = tl.load(
        w_ptr + t.to(tl.int64)[:, None, None] * stride_w + 2 * N + i3 * N + j3,
        mask=ok3,
        other=0.0,
    )
    cb = tl.load(base_ptr + 2 * N + i3 * N + j3, mask=(i3 < N) & (j3 < N), other=0.0)
    logits = tl.where(ok3, cw * s_comb + cb.to(tl.float32), float("-inf"))
    top = tl.max(logits, axis=2)
    top = tl.where(top == float("-inf"), 0.0, top)
    e = tl.exp(logits - top[:, :, None])
    den = tl.sum(e, axis=2)
    comb = e / tl.where(den > 0.0, den, 1.0)[:, :, None]
    comb = tl.where(ok3, comb + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    tl.store(comb_ptr + t.to(tl.int64)[:, None, None] * (N * N) + i3 * N + j3, comb, mask=ok3)


def hc_mix(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pre [T, n]``, ``post [T, n]``, ``comb [T, n, n]`` (fp32; module doc) of the mixing
    logits ``mixed [T, (2 + n) * n]`` (fp32)."""
    t = mixed.shape[0]
    if mixed.dim() != 2 or mixed.shape[1] != (2 + n) * n or base.numel() != (2 + n) * n:
        raise ValueError(f"mixing logits {tuple(mixed.shape)} do not fit {n} streams")
    if iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {iters}")
    mixed = mixed.float()
    mixed = mixed if mixed.stride(-1) == 1 else mixed.contiguous()
    pre = torch.empty(t, n, dtype=torch.float32, device=mixed.device)
    post = torch.empty(t, n, dtype=torch.float32, device=mixed.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=mixed.device)
    if t == 0:
        return pre, post, comb
    block_t = 32
    _mix_kernel[(triton.cdiv(t, block_t),)](
        mixed,
        base.contiguous(),
        scale.contiguous(),
        pre,
        post,
        comb,
        t,
        eps,
        mixed.stride(0),
        N=n,
        NP=triton.next_power_of_2(n),
        ITERS=iters,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return pre, post, comb


def hc_mix_reference(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hc_mix` in plain PyTorch (as the V4 model computes it without kernels)."""
    pre_w, post_w, comb_w = torch.split(mixed.float(), [n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = torch.split(base.float(), [n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
