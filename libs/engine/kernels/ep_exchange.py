"""EP's fixed-shape dispatch and combine (:mod:`libs.engine.ep.fixed`) in four Triton launches
instead of ~50 small PyTorch ops per MoE layer.

Inside the decode step's CUDA graph each of those ops is a node of a few microseconds, so at
decode batch sizes the layer's bookkeeping, not its bytes, set the price of EP over the
single-device layer. The kernels compute exactly what the PyTorch functions compute (the unit
tests compare them bit for bit):

1. :func:`route_and_slots` (two launches, one program per chunk of 64 pairs each): each
   pair's global slot (:meth:`RouteTable.route`), whether its token is real
   (:meth:`StepBound.real_pairs`), its row in the send buffer
   (:func:`~libs.engine.ep.fixed.rows_of`: the pairs before it to the same rank -- within its
   chunk counted by the first launch, in earlier chunks summed from their per-rank counts by
   the second), the buffer's slot field of every row (``S``, "no expert", unless a real pair
   lands there) and the layer's load counter. (One program walking the chunks in turn took
   181 us a layer at batch 256 on an H100: a chain of dependent loads per chunk.)
2. :func:`pack_rows` (one program per pair and hidden block): the pair's token row into its
   buffer row;
3. :func:`combine_rows` (one program per token and hidden block): the token's ``k`` returned
   outputs, masked where the token is padding, times the router weights in fp32 and added in
   ascending expert id -- :func:`~libs.engine.ep.moe.weigh_pairs`' order and roundings
   (no fused multiply-add: ``enable_fp_fusion=False``).

No host synchronisation; every size is the caller's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 64  # pairs per routing program
_FILL = 1024  # buffer rows per step of the slot fill


# Never specialised to 1: the while loop below starts from total_rows times 0, a tensor.
# (while loops: Triton's interpreter on numpy >= 2.4 rejects runtime bounds in range())
@triton.jit(do_not_specialize=["num_pairs", "total_rows"])
def _route_count_kernel(  # type: ignore[no-untyped-def]
    idx_ptr,
    local_ptr,
    rep_ptr,
    nrep_ptr,
    dest_ptr,
    inner_ptr,
    count_ptr,
    slot_ptr,
    num_pairs,
    total_rows,
    rep_width,
    slot_stride,
    K: tl.constexpr,
    S: tl.constexpr,
    N_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program per chunk of pairs: each pair's global slot and its place among the
    chunk's pairs to the same rank, the chunk's pairs per rank; and a share of the buffer's
    rows told "no expert" (the next launch writes the real pairs' over them)."""
    c = tl.program_id(0)
    step = tl.num_programs(0) * FILL
    start = c * FILL + total_rows * 0
    while start < total_rows:
        r = start + tl.arange(0, FILL)
        tl.store(
            slot_ptr + r.to(tl.int64) * slot_stride,
            tl.full((FILL,), S, tl.int64),
            mask=r < total_rows,
        )
        start += step
    i = tl.arange(0, CHUNK)
    p = c * CHUNK + i
    m = p < num_pairs
    e = tl.load(idx_ptr + p, mask=m, other=0).to(tl.int64)
    token = p // K
    loc = tl.load(local_ptr + e, mask=m, other=0)
    n = tl.load(nrep_ptr + e, mask=m, other=1)
    rem = tl.load(rep_ptr + e * rep_width + token % n, mask=m, other=0)
    dest = tl.where(loc >= 0, loc, rem)
    rank = dest // S
    same = (rank[:, None] == rank[None, :]) & (i[None, :] < i[:, None]) & m[None, :]
    tl.store(dest_ptr + p, dest, mask=m)
    tl.store(inner_ptr + p, tl.sum(same.to(tl.int64), axis=1), mask=m)
    ranks = tl.arange(0, N_P2)
    hit = (rank[:, None] == ranks[None, :]) & m[:, None]
    tl.store(count_ptr + c * N_P2 + ranks, tl.sum(hit.to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["num_pairs", "cap"])
def _route_rows_kernel(  # type: ignore[no-untyped-def]
    idx_ptr,
    dest_ptr,
    inner_ptr,
    count_ptr,
    live_ptr,
    rows_ptr,
    real_ptr,
    slot_ptr,
    load_ptr,
    num_pairs,
    cap,
    slot_stride,
    K: tl.constexpr,
    S: tl.constexpr,
    N_P2: tl.constexpr,
    C_P2: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per chunk: the pairs of earlier chunks per rank (their counts summed), so
    each pair's buffer row; whether its token is real; its row's slot field; the load."""
    c = tl.program_id(0)
    ranks = tl.arange(0, N_P2)
    earlier = tl.arange(0, C_P2)
    counts = tl.load(
        count_ptr + earlier[:, None] * N_P2 + ranks[None, :],
        mask=(earlier < c)[:, None],
        other=0,
    )
    before = tl.sum(counts, axis=0)  # [N_P2]: earlier chunks' pairs per rank
    p = c * CHUNK + tl.arange(0, CHUNK)
    m = p < num_pairs
    dest = tl.load(dest_ptr + p, mask=m, other=0)
    rank = dest // S
    base = tl.sum(tl.where(rank[:, None] == ranks[None, :], before[None, :], 0), axis=1)
    row = rank * cap + base + tl.load(inner_ptr + p, mask=m, other=0)
    if HAS_LIVE:
        real = (p // K < tl.load(live_ptr)).to(tl.int64)
    else:
        real = tl.full((CHUNK,), 1, tl.int64)
    tl.store(rows_ptr + p, row, mask=m)
    tl.store(real_ptr + p, real, mask=m)
    tl.store(slot_ptr + row * slot_stride, tl.where(real != 0, dest % S, S), mask=m)
    e = tl.load(idx_ptr + p, mask=m, other=0).to(tl.int64)
    tl.atomic_add(load_ptr + e, real, mask=m)


@triton.jit
def _pack_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    rows_ptr,
    buf_ptr,
    x_stride,
    buf_stride,
    hidden,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    p = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = h < hidden
    row = tl.load(rows_ptr + p)
    v = tl.load(x_ptr + (p // K).to(tl.int64) * x_stride + h, mask=m)
    tl.store(buf_ptr + row * buf_stride + h, v, mask=m)


@triton.jit
def _combine_kernel(  # type: ignore[no-untyped-def]
    y_ptr,
    rows_ptr,
    real_ptr,
    idx_ptr,
    w_ptr,
    out_ptr,
    y_stride,
    out_stride,
    hidden,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = h < hidden
    j = tl.arange(0, K_P2)
    mk = j < K
    e = tl.load(idx_ptr + t * K + j, mask=mk, other=0).to(tl.int64)
    # Each pair's place in ascending expert order, ties in slot order (a stable argsort).
    before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (j[None, :] < j[:, None]))
    place = tl.sum((before & mk[None, :]).to(tl.int32), axis=1)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for r in tl.static_range(K):
        q = tl.sum(tl.where((place == r) & mk, j, 0), axis=0)
        row = tl.load(rows_ptr + t * K + q)
        real = tl.load(real_ptr + t * K + q)
        w = tl.load(w_ptr + t * K + q).to(tl.float32)
        y = tl.load(y_ptr + row * y_stride + h, mask=m & (real != 0), other=0.0)
        acc = acc + y.to(tl.float32) * w
    if OUT_BF16:  # round to nearest even by hand (the interpreter's own cast truncates)
        nan = tl.full((BLOCK_H,), 0x7FC00000, tl.uint32)
        bits = tl.where(acc != acc, nan, acc.to(tl.uint32, bitcast=True))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        res = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        res = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + h, res, mask=m)


def _block(hidden: int) -> int:
    return min(triton.next_power_of_2(hidden), 4096)


def route_and_slots(
    idx: torch.Tensor,
    local: torch.Tensor,
    replicas: torch.Tensor,
    num_replicas: torch.Tensor,
    live: torch.Tensor | None,
    slot: torch.Tensor,
    load: torch.Tensor,
    num_ranks: int,
    slots_per_rank: int,
    cap: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each pair's buffer row [P] int64, 1 where its token is real [P] int64) for ``idx``
    [T, k]; fills ``slot`` (the buffer's slot field, [rows] int64, any row stride) and adds the
    real pairs to ``load`` [E] int64."""
    flat = idx.reshape(-1).contiguous()
    p = flat.numel()
    dev = idx.device
    rows = torch.empty(p, dtype=torch.int64, device=dev)
    real = torch.empty(p, dtype=torch.int64, device=dev)
    dest = torch.empty(p, dtype=torch.int64, device=dev)
    inner = torch.empty(p, dtype=torch.int64, device=dev)
    chunks = max(1, triton.cdiv(p, _CHUNK))  # one program at least: it fills the slot field
    n_p2 = triton.next_power_of_2(num_ranks)
    counts = torch.empty(chunks * n_p2, dtype=torch.int64, device=dev)
    k, s = max(idx.shape[1], 1), slots_per_rank
    _route_count_kernel[(chunks,)](
        flat, local, replicas, num_replicas, dest, inner, counts, slot,
        p, slot.shape[0], replicas.stride(0), slot.stride(0),
        K=k, S=s, N_P2=n_p2, CHUNK=_CHUNK, FILL=_FILL, num_warps=4,
    )  # fmt: skip
    _route_rows_kernel[(chunks,)](
        flat, dest, inner, counts, live if live is not None else rows, rows, real, slot, load,
        p, cap, slot.stride(0),
        K=k, S=s, N_P2=n_p2, C_P2=triton.next_power_of_2(chunks),
        HAS_LIVE=live is not None, CHUNK=_CHUNK, num_warps=4,
    )  # fmt: skip
    return rows, real


def pack_rows(x: torch.Tensor, rows: torch.Tensor, k: int, hidden_rows: torch.Tensor) -> None:
    """``hidden_rows[rows[p]] = x[p // k]`` for every pair ``p`` (``hidden_rows``: the send
    buffer's hidden part, [rows, H] in ``x``'s dtype, any row stride)."""
    if rows.numel() == 0:
        return
    h = x.shape[1]
    block = _block(h)
    _pack_kernel[(rows.numel(), triton.cdiv(h, block))](
        x, rows, hidden_rows, x.stride(0), hidden_rows.stride(0), h, K=k, BLOCK_H=block
    )


def combine_rows(
    y: torch.Tensor,
    rows: torch.Tensor,
    real: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """``sum_j weights[t, j] * y[rows[t*k + j]]`` over the pairs whose token is real, in fp32,
    ``j`` in ascending expert id, returned [T, H] in ``y``'s dtype (:func:`weigh_pairs` of the
    pairs' rows)."""
    t, k = idx.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    if t == 0:
        return out
    block = _block(h)
    _combine_kernel[(t, triton.cdiv(h, block))](
        y,
        rows,
        real,
        idx.contiguous(),
        weights.contiguous(),
        out,
        y.stride(0),
        out.stride(0),
        h,
        K=k,
        K_P2=triton.next_power_of_2(k),
        BLOCK_H=block,
        OUT_BF16=y.dtype == torch.bfloat16,
        enable_fp_fusion=False,
    )
    return out
