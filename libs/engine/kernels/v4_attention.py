"""DeepSeek-V4 decode attention over gathered rows, and the CSA indexer's scores.

**Attention** (:func:`sparse_decode_attention`). V4's keys and values are one shared row per
token or compressed entry (``head_dim`` wide, RoPE'd), so every head of a query reads the same
rows: each query ``b`` attends over the rows ``index[b, :]`` of a row pool (its sliding-window
rows and the compressed entries it may see -- for CSA layers only the indexer's picks), ``-1``
marking an unused column, plus a per-head sink logit that takes probability mass and adds no
value::

    s[b, h, j] = sm_scale * q[b, h] . rows[index[b, j]]          index[b, j] >= 0
    out[b, h]  = sum_j exp(s[b, h, j]) rows[index[b, j]] / (exp(sink[h]) + sum_j exp(s[b, h, j]))

in fp32, written in ``q``'s dtype; a query with no rows gives zeros. Stage 1 runs on the grid
``(B, cdiv(H, BLOCK_H), splits)``: a program holds ``BLOCK_H`` heads of one query, so each
gathered row tile (``BLOCK_N`` rows) is loaded once for all of them, and walks its share of the
index columns with an online softmax in base 2, writing the normalized partial output and its
log-sum-exp. Stage 2 (grid ``(B, H)``) merges the splits with the sink as one more term.
Every bound is read on the device: no host synchronization.

**Indexer** (:func:`indexer_scores`). For query ``b`` with indexer queries ``q [B, Hi, Di]``
and head weights ``w [B, Hi]`` (fp32), over the ``counts[b]`` keys starting at
``starts[b]`` of a key pool::

    score[b, t] = scale * sum_h w[b, h] * relu(q[b, h] . keys[starts[b] + t])    t < counts[b]

and ``-inf`` for ``t >= counts[b]`` up to the output's width, without the ``[B, Hi, T]``
intermediate PyTorch would write. Grid ``(B, cdiv(width, BLOCK_T))``; a program loads its key
tile once and walks the heads ``BLOCK_HI`` at a time.

fp32 inputs run under Triton's interpreter (``TRITON_INTERPRET=1``, the unit tests); bf16 on
the GPU (its tests live in ``tests/gpu``: the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_MAX_SPLITS = 16


@triton.jit
def _gather_tile(
    q,
    m_i,
    l_i,
    acc,
    cols,
    end,
    idx_row,
    rows_ptr,
    qk_scale,
    stride_rn,
    D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the rows of index columns ``cols`` (those below ``end``) into the online softmax;
    returns the updated running maxima, sums and unnormalized output."""
    offs_d = tl.arange(0, D)
    idx = tl.load(idx_row + cols, mask=cols < end, other=-1)
    ok = idx >= 0
    k = tl.load(
        rows_ptr + idx.to(tl.int64)[:, None] * stride_rn + offs_d[None, :],
        mask=ok[:, None],
        other=0.0,
    ).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Sizes that change from step to step are not specialized on: one compile serves them all.
@triton.jit(
    do_not_specialize=[
        "num_cols",
        "cols_per_split",
        "stride_ib",
        "stride_pb",
        "stride_ps",
        "stride_lb",
    ]
)
def _sparse_stage1(
    q_ptr,
    rows_ptr,
    index_ptr,
    part_ptr,
    lse_ptr,
    qk_scale,
    num_heads,
    num_cols,
    cols_per_split,
    stride_qb,
    stride_qh,
    stride_rn,
    stride_ib,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):
    """One (query, head block, split): online softmax over the split's index columns."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_d = tl.arange(0, D)
    q = tl.load(
        q_ptr + pid_b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    start = pid_s * cols_per_split
    end = tl.minimum(start + cols_per_split, num_cols)
    offs_n = tl.arange(0, BLOCK_N)
    idx_row = index_ptr + pid_b * stride_ib
    if WHILE_LOOP:  # Triton's interpreter on numpy >= 2.4 rejects tensor bounds in range()
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _gather_tile(
                q, m_i, l_i, acc, n0 + offs_n, end, idx_row, rows_ptr, qk_scale, stride_rn,
                D, DOT_PRECISION,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _gather_tile(
                q, m_i, l_i, acc, n0 + offs_n, end, idx_row, rows_ptr, qk_scale, stride_rn,
                D, DOT_PRECISION,
            )  # fmt: skip
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = part_ptr + pid_b * stride_pb + offs_h[:, None] * stride_ph + pid_s * stride_ps
    tl.store(o_ptrs + offs_d[None, :], o, mask=mask_h[:, None])
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + pid_b * stride_lb + offs_h * stride_lh + pid_s, lse, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh"])
def _sparse_combine(
    part_ptr,
    lse_ptr,
    sink_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Merge one (query, head)'s splits by their base-2 log-sum-exp, the sink one more term
    of the denominator."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    lse = tl.load(
        lse_ptr + pid_b * stride_lb + pid_h * stride_lh + offs_s,
        mask=offs_s < num_splits,
        other=float("-inf"),
    )
    sink = tl.load(sink_ptr + pid_h).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(lse, axis=0), sink)
    w = tl.exp2(lse - m)
    w = w / (tl.sum(w, axis=0) + tl.exp2(sink - m))
    base = part_ptr + pid_b * stride_pb + pid_h * stride_ph
    acc = tl.zeros([D], dtype=tl.float32)
    for s in tl.static_range(SPLITS_P2):
        w_s = tl.sum(tl.where(offs_s == s, w, 0.0), axis=0)  # 0 past num_splits
        acc += w_s * tl.load(base + s * stride_ps + offs_d, mask=(offs_d < D) & (s < num_splits))
    tl.store(
        out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_d, acc.to(out_ptr.dtype.element_ty)
    )


def unsupported(head_dim: int, index_head_dim: int) -> str | None:
    """Why these kernels cannot take a V4 model of these widths (None: they can; every
    DeepSeek-V4 config can: 512 and 128)."""
    bad = [
        f"{name} {v}"
        for name, v in (("head_dim", head_dim), ("index_head_dim", index_head_dim))
        if not _fits(v)
    ]
    return f"the V4 kernels need powers of two >= 16, got {', '.join(bad)}" if bad else None


def _fits(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def _num_splits(batch: int, head_blocks: int, cols: int, block_n: int, device: torch.device) -> int:
    """Splits of the index columns so stage 1 fills the GPU (one on the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, sms // max(1, batch * head_blocks))
    return max(1, min(want, _MAX_SPLITS, triton.cdiv(cols, block_n)))


def sparse_decode_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    sinks: torch.Tensor,
    sm_scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, H, D]`` over ``rows [N, D]`` gathered by ``index [B, K]`` (int32,
    ``-1`` unused), with ``sinks [H]`` (module doc). Returns ``[B, H, D]`` in ``q``'s dtype."""
    b, h, d = q.shape
    if rows.dim() != 2 or rows.shape[1] != d or index.dim() != 2 or index.shape[0] != b:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, rows {tuple(rows.shape)}, "
            f"index {tuple(index.shape)}"
        )
    if not _fits(d):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    out = torch.empty_like(q)
    if b == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    index = index.to(torch.int32).contiguous()
    sinks = sinks.float().contiguous()
    cols = max(1, index.shape[1])
    block_h = max(16, min(triton.next_power_of_2(h), 32 if d > 256 else 64))
    block_n = 32 if d > 256 else 64
    head_blocks = triton.cdiv(h, block_h)
    splits = num_splits or _num_splits(b, head_blocks, cols, block_n, q.device)
    per_split = triton.cdiv(triton.cdiv(cols, splits), block_n) * block_n
    part = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _sparse_stage1[(b, head_blocks, splits)](
        q,
        rows,
        index,
        part,
        lse,
        sm_scale * _LOG2E,
        h,
        index.shape[1],
        per_split,
        q.stride(0),
        q.stride(1),
        rows.stride(0),
        index.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        D=d,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        WHILE_LOOP=_INTERPRET,
        num_warps=8 if d > 256 else 4,
        num_stages=2,
    )
    _sparse_combine[(b, h)](
        part,
        lse,
        sinks,
        out,
        splits,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        D=d,
        SPLITS_P2=triton.next_power_of_2(splits),
    )
    return out


def sparse_decode_attention_reference(
    q: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """:func:`sparse_decode_attention` in plain PyTorch (fp32)."""
    ok = index >= 0
    keys = rows.float()[index.clamp(min=0).long()]  # [B, K, D]
    s = torch.einsum("bhd,bkd->bhk", q.float(), keys) * sm_scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(s.shape[0], -1, 1)
    both = torch.cat([s, sink], dim=-1)
    p = torch.softmax(both - both.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", p, keys).to(q.dtype)


@triton.jit(do_not_specialize=["width", "stride_ob"])
def _indexer_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    starts_ptr,
    counts_ptr,
    out_ptr,
    scale,
    width,
    stride_qb,
    stride_qh,
    stride_wb,
    stride_kn,
    stride_ob,
    HI: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    count = tl.load(counts_ptr + pid_b)
    start = tl.load(starts_ptr + pid_b).to(tl.int64)
    ok = offs_t < count
    offs_d = tl.arange(0, D)
    k = tl.load(
        keys_ptr + (start + offs_t.to(tl.int64))[:, None] * stride_kn + offs_d[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for h0 in tl.static_range(0, HI, BLOCK_HI):
        offs_h = h0 + tl.arange(0, BLOCK_HI)
        mask_h = offs_h < HI
        q = tl.load(
            q_ptr + pid_b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None],
            other=0.0,
        ).to(k.dtype)
        w = tl.load(w_ptr + pid_b * stride_wb + offs_h, mask=mask_h, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_HI, BLOCK_T]
        total += tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
    total = tl.where(ok, total * scale, float("-inf"))
    tl.store(out_ptr + pid_b * stride_ob + offs_t, total, mask=offs_t < width)


def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """The indexer's scores ``[B, width]`` (fp32; module doc): ``q [B, Hi, Di]``,
    ``w [B, Hi]`` fp32, ``keys [N, Di]``, ``starts``/``counts [B]`` int32."""
    b, hi, d = q.shape
    if keys.dim() != 2 or keys.shape[1] != d or w.shape != (b, hi):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, w {tuple(w.shape)}, keys {tuple(keys.shape)}"
        )
    if not _fits(d):
        raise ValueError(f"index_head_dim must be a power of two >= 16, got {d}")
    out = torch.empty(b, width, dtype=torch.float32, device=q.device)
    if b == 0 or width == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    w = w.float().contiguous()
    block_t = 64
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _indexer_kernel[(b, triton.cdiv(width, block_t))](
        q,
        w,
        keys,
        starts.to(torch.int32).contiguous(),
        counts.to(torch.int32).contiguous(),
        out,
        scale,
        width,
        q.stride(0),
        q.stride(1),
        w.stride(0),
        keys.stride(0),
        out.stride(0),
        HI=hi,
        D=d,
        BLOCK_T=block_t,
        BLOCK_HI=max(16, min(triton.next_power_of_2(hi), 32)),
        DOT_PRECISION=precision,
        num_warps=4,
    )
    return out


def indexer_scores_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """:func:`indexer_scores` in plain PyTorch (fp32)."""
    out = torch.full((q.shape[0], width), float("-inf"), device=q.device)
    for b in range(q.shape[0]):
        s, n = int(starts[b]), int(counts[b])
        k = keys[s : s + n].float()
        sc = torch.relu(torch.einsum("hd,td->ht", q[b].float(), k))
        out[b, :n] = (sc * w[b].float()[:, None]).sum(0) * scale
    return out
