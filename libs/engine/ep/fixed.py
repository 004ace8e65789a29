"""Fixed-shape dispatch and combine: the EP exchange with no host sync (DeepEP's low-latency shape).

Every rank sends every rank (itself included) a buffer of ``capacity`` rows, whatever it routes
there, so one ``all_to_all_single`` with equal splits moves them and nothing host-visible
depends on the routing: a step replays inside a CUDA graph, and a rank with no tokens sends
only padding. ``capacity`` comes from the group's agreed token bound for the step
(:class:`StepBound`): ``tokens * min(top_k, slots_per_rank)`` -- a token's pairs go to
distinct slots (the router picks distinct experts; a rank holds an expert in one routed slot),
so no rank can receive more and nothing overflows.

A row of the buffer is bytes: the hidden row, then (8-byte aligned) the int64 local slot of
the destination rank that runs it. Padding rows carry slot ``S`` (``slots_per_rank``): "no
expert", which :class:`~libs.engine.model.moe.Experts` and the fused kernel skip (no GEMM
reads them; their outputs are garbage nobody reads). Their hidden bytes are left
uninitialised: they are never computed.

Per layer: route -> :func:`rows_of` (each pair's row in the send buffer) -> :func:`pack` ->
one exchange -> :func:`unpack` -> local experts -> one exchange back -> each pair's output
read at the row it was sent from. Rows from a source arrive at a slot in that source's pair
order, sources in rank order: the order the variable-size exchange delivers them in, so the
experts see the very same rows and the outputs match it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The group's agreed tokens above which a step takes the variable-size exchange instead (a
# prefill chunk: capacity rows are sent to every rank, so the fixed buffers grow with N).
DEFAULT_FIXED_MAX_TOKENS = 512
_META = 8  # bytes per row for the local slot (int64)


@dataclass
class StepBound:
    """What every rank of the group agrees on before a forward (one per runtime, shared by its
    layers): ``tokens``, the bound on any rank's tokens this step (0: none agreed, each layer
    takes its own row count -- a group of one, a graph being captured); ``fixed_max_tokens``:
    bounds above it take the variable-size path."""

    tokens: int = 0
    fixed_max_tokens: int = DEFAULT_FIXED_MAX_TOKENS
    # This rank's real rows this step, on the device ([1] int64; None: every row is real).
    # A CUDA graph runs padding rows after them; their pairs are sent as padding (no expert
    # runs them) and not counted as load. Filled before each forward, read inside the graph.
    live: torch.Tensor | None = None

    def real_pairs(self, idx: torch.Tensor) -> torch.Tensor:
        """1 for each (token, expert) pair of ``idx`` [T, k] whose token is real, else 0
        (int64, flat pair order)."""
        flat = idx.reshape(-1)
        if self.live is None:
            return torch.ones_like(flat)
        token = torch.arange(flat.numel(), device=flat.device) // max(idx.shape[1], 1)
        return (token < self.live).to(torch.int64)

    def bound(self, rows: int) -> int:
        """The token bound of a layer seeing ``rows`` rows: the agreed one, at least ``rows``."""
        return max(rows, self.tokens)

    def fixed(self, rows: int) -> bool:
        return self.bound(rows) <= self.fixed_max_tokens


def capacity(tokens: int, top_k: int, slots_per_rank: int) -> int:
    """Rows per (source, destination) rank pair for ``tokens`` tokens of ``top_k`` experts."""
    return tokens * min(top_k, slots_per_rank)


def rows_of(dest: torch.Tensor, num_ranks: int, slots_per_rank: int, cap: int) -> torch.Tensor:
    """Each pair's row in the send buffer: ``rank * cap + (pairs before it to that rank)``.

    ``dest`` [P]: global slot ids (``rank * slots_per_rank + slot``), pairs in flat order.
    Device ops only: a one-hot running count per rank (P x N int64; decode: 512 pairs x 64
    ranks = 256 KB)."""
    rank = dest // slots_per_rank
    ranks = torch.arange(num_ranks, device=dest.device)
    hits = (rank.unsqueeze(1) == ranks).to(torch.int64)
    before = hits.cumsum(0).gather(1, rank.unsqueeze(1)).squeeze(1) - 1
    return rank * cap + before


def row_bytes(hidden: int, dtype: torch.dtype) -> tuple[int, int]:
    """(offset of the slot field, bytes per row) of a buffer row."""
    h = hidden * dtype.itemsize
    off = -(-h // _META) * _META
    return off, off + _META


def pack(
    x: torch.Tensor,
    dest: torch.Tensor,
    rows: torch.Tensor,
    top_k: int,
    total_rows: int,
    slots_per_rank: int,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """The send buffer [total_rows, row bytes] uint8: pair ``p``'s token row and local slot at
    row ``rows[p]``; every other row, and a pair whose ``real`` is 0, holds slot
    ``slots_per_rank`` (no expert)."""
    off, width = row_bytes(x.shape[1], x.dtype)
    buf = torch.empty(total_rows, width, dtype=torch.uint8, device=x.device)
    hidden = buf[:, : x.shape[1] * x.dtype.itemsize].view(x.dtype)
    slot = buf[:, off:].view(torch.int64).squeeze(1)
    slot.fill_(slots_per_rank)
    if rows.numel():
        token = torch.arange(rows.numel(), device=x.device) // top_k
        hidden.index_copy_(0, rows, x.index_select(0, token))
        local = dest % slots_per_rank
        if real is not None:
            local = torch.where(real.bool(), local, slots_per_rank)
        slot.index_copy_(0, rows, local)
    return buf


def unpack(buf: torch.Tensor, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden rows [R, hidden] in ``dtype``, local slot per row [R, 1] int64) of a buffer
    (views: the fused MoE reads the rows at the buffer's stride)."""
    off, _ = row_bytes(hidden, dtype)
    return buf[:, : hidden * dtype.itemsize].view(dtype), buf[:, off:].view(torch.int64)
