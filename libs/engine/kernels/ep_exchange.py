"""EP's fixed-shape dispatch and combine (:mod:`libs.engine.ep.fixed`) in three Triton launches
instead of ~50 small PyTorch ops per MoE layer.

Inside the decode step's CUDA graph each of those ops is a node of a few microseconds, so at
decode batch sizes the layer's bookkeeping, not its bytes, set the price of EP over the
single-device layer. The kernels compute exactly what the PyTorch functions compute (the unit
tests compare them bit for bit):

1. :func:`route_and_slots` (one program): each pair's global slot (:meth:`RouteTable.route`),
   whether its token is real (:meth:`StepBound.real_pairs`), its row in the send buffer
   (:func:`~libs.engine.ep.fixed.rows_of`: a running count per destination rank, kept in
   registers over chunks of pairs), the buffer's slot field of every row (``S``, "no expert",
   unless a real pair lands there) and the layer's load counter;
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

_CHUNK = 64  # pairs per step of the routing program's running count
_FILL = 1024  # buffer rows per step of its slot fill


# Never specialised to 1: the while loops below start from them times 0, a tensor.
@triton.jit(do_not_specialize=["num_pairs", "total_rows", "cap"])
def _route_kernel(  # type: ignore[no-untyped-def]
    idx_ptr,
    local_ptr,
    rep_ptr,
    nrep_ptr,
    live_ptr,
    rows_ptr,
    real_ptr,
    slot_ptr,
    load_ptr,
    num_pairs,
    total_rows,
    cap,
    rep_width,
    slot_stride,
    K: tl.constexpr,
    S: tl.constexpr,
    N_P2: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    # Every row says "no expert" first; real pairs overwrite theirs below (same program).
    # (while loops: Triton's interpreter on numpy >= 2.4 rejects runtime bounds in range())
    start = total_rows * 0
    while start < total_rows:
        r = start + tl.arange(0, FILL)
        tl.store(
            slot_ptr + r.to(tl.int64) * slot_stride,
            tl.full((FILL,), S, tl.int64),
            mask=r < total_rows,
        )
        start += FILL
    tl.debug_barrier()
    live = tl.load(live_ptr) if HAS_LIVE else 0
    ranks = tl.arange(0, N_P2)
    seen = tl.zeros((N_P2,), tl.int64)  # pairs so far per destination rank
    i = tl.arange(0, CHUNK)
    start = num_pairs * 0
    while start < num_pairs:
        p = start + i
        m = p < num_pairs
        e = tl.load(idx_ptr + p, mask=m, other=0).to(tl.int64)
        token = p // K
        loc = tl.load(local_ptr + e, mask=m, other=0)
        n = tl.load(nrep_ptr + e, mask=m, other=1)
        rem = tl.load(rep_ptr + e * rep_width + token % n, mask=m, other=0)
        dest = tl.where(loc >= 0, loc, rem)
        rank = dest // S
        if HAS_LIVE:
            real = (token < live).to(tl.int64)
        else:
            real = tl.full((CHUNK,), 1, tl.int64)
        # Earlier pairs of this chunk to the same rank, then those of earlier chunks.
        same = (rank[:, None] == rank[None, :]) & (i[None, :] < i[:, None]) & m[None, :]
        inner = tl.sum(same.to(tl.int64), axis=1)
        hit = (rank[:, None] == ranks[None, :]) & m[:, None]
        base = tl.sum(tl.where(hit, seen[None, :], 0), axis=1)
        seen += tl.sum(hit.to(tl.int64), axis=0)
        row = rank * cap + base + inner
        tl.store(rows_ptr + p, row, mask=m)
        tl.store(real_ptr + p, real, mask=m)
        tl.store(slot_ptr + row * slot_stride, tl.where(real != 0, dest % S, S), mask=m)
        tl.atomic_add(load_ptr + e, real, mask=m)
        start += CHUNK


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
    rows = torch.empty(p, dtype=torch.int64, device=idx.device)
    real = torch.empty(p, dtype=torch.int64, device=idx.device)
    _route_kernel[(1,)](
        flat,
        local,
        replicas,
        num_replicas,
        live if live is not None else rows,
        rows,
        real,
        slot,
        load,
        p,
        slot.shape[0],
        cap,
        replicas.stride(0),
        slot.stride(0),
        K=max(idx.shape[1], 1),
        S=slots_per_rank,
        N_P2=triton.next_power_of_2(num_ranks),
        HAS_LIVE=live is not None,
        CHUNK=_CHUNK,
        FILL=_FILL,
        num_warps=4,
    )
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
