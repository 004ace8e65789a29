"""Dispatch and combine: one MoE layer's routed experts spread over the ranks of an EP group.

:class:`EPExperts` takes the place of a layer's :class:`~libs.engine.model.moe.Experts`
(same ``forward(x, weights, idx)``); its ``local`` experts hold this rank's slots only (any
module with :class:`SlotExperts`' members: V2/V3's and V4's experts alike).
Per layer and step, on every rank (a rank without tokens takes part with 0 rows):

1. route: each (token, expert) pair picks a slot holding the expert -- a local replica if
   this rank has one, else replica ``token % replicas`` (deterministic, spreads a hot expert's
   tokens over its replicas);
2. exchange the rows: while the group's agreed token bound for the step (:class:`StepBound`,
   set by the engine once per step) is at most ``fixed_max_tokens``, as fixed-capacity
   buffers with one ``all_to_all_single`` of equal splits -- no host sync, so the layer runs
   inside the decode step's CUDA graph (:mod:`.fixed`); above it (a large prefill chunk), by
   the pair counts: pairs sorted by (rank, slot), counts exchanged (``N x S`` numbers), one
   host sync for the split sizes, then the rows with explicit splits. Every rank takes the
   same path: the bound is the group's;
3. run the local experts on what arrived, grouped by local slot (``Experts``' own math, with
   weight 1 and one expert per row, so each row comes back as the expert's raw output);
4. send the outputs back the same way and combine them at home with the router weights, per
   token in ascending expert order, in fp32 -- the order the single-device reference path
   (:meth:`Experts._grouped`) accumulates in, so N ranks and one device add the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from . import fixed
from .group import EPGroup
from .placement import EMPTY, Placement


class SlotExperts(Protocol):
    """What EP asks of a layer's routed experts: rows by slot (``slots``: the expert each row
    holds, None while it holds all), called as ``(x, weights, idx)`` with ``idx`` row numbers,
    and the slot methods that keep, read and replace rows (:class:`~libs.engine.model.moe.Experts`
    and :class:`~libs.engine.v4.moe.Experts` have them)."""

    slots: tuple[int, ...] | None
    use_kernels: bool

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def keep_slots(self, slots: tuple[int, ...]) -> None: ...

    def slot_state(self) -> list[torch.Tensor]: ...

    def set_slot_state(self, state: list[torch.Tensor], slots: tuple[int, ...]) -> None: ...


@dataclass(frozen=True)
class RouteTable:
    """Where this rank sends each expert's pairs, as device tensors indexed by expert id.

    Global slot ids are ``rank * slots_per_rank + slot``. ``local[e]``: this rank's first slot
    holding ``e`` (global id), or -1; ``replicas[e, i]``: ``e``'s ``i``-th replica (padded by
    repeating the list); ``num_replicas[e]``: how many.
    """

    local: torch.Tensor
    replicas: torch.Tensor
    num_replicas: torch.Tensor
    num_ranks: int
    slots_per_rank: int

    @staticmethod
    def build(placement: Placement, rank: int, device: torch.device) -> RouteTable:
        s = placement.slots_per_rank
        local = [-1] * placement.num_experts
        for slot, e in enumerate(placement.experts_of(rank)):
            if e != EMPTY and local[e] < 0:
                local[e] = rank * s + slot
        reps = [[r * s + slot for r, slot in placement.replicas(e)] for e in range(len(local))]
        # As wide as any placement of this shape can need (the other experts hold a slot
        # each), so a re-placement copies into the same tensors a CUDA graph reads.
        most = placement.num_ranks * s - placement.num_experts + 1
        width = max(most, *(len(x) for x in reps))
        padded = [[x[i % len(x)] for i in range(width)] for x in reps]
        return RouteTable(
            torch.tensor(local, dtype=torch.int64, device=device),
            torch.tensor(padded, dtype=torch.int64, device=device),
            torch.tensor([len(x) for x in reps], dtype=torch.int64, device=device),
            placement.num_ranks,
            s,
        )

    def update(self, new: RouteTable) -> bool:
        """Take ``new``'s routes in place (the tensors stay those a captured graph reads);
        False when the shapes differ (then the caller takes ``new`` itself)."""
        mine = (self.local, self.replicas, self.num_replicas)
        theirs = (new.local, new.replicas, new.num_replicas)
        if any(a.shape != b.shape for a, b in zip(mine, theirs)):
            return False
        for a, b in zip(mine, theirs):
            a.copy_(b)
        return True

    def route(self, idx: torch.Tensor) -> torch.Tensor:
        """Global slot id of each (token, expert) pair of ``idx`` [T, k], flattened [T * k]."""
        flat = idx.reshape(-1)
        token = torch.arange(flat.numel(), device=flat.device) // max(idx.shape[1], 1)
        local = self.local[flat]
        n = self.num_replicas[flat]
        remote = self.replicas[flat, token % n]
        return torch.where(local >= 0, local, remote)


@dataclass
class Dispatch:
    """One layer's pairs in send order: ``order[i]`` is the flat (token, expert) pair sent
    as row ``i``; ``counts`` [N * S] pairs per destination slot; ``rows`` their token rows."""

    order: torch.Tensor
    counts: torch.Tensor
    rows: torch.Tensor


def plan_dispatch(idx: torch.Tensor, table: RouteTable) -> Dispatch:
    dest = table.route(idx)
    order = torch.argsort(dest, stable=True)
    counts = _count(dest, table.num_ranks * table.slots_per_rank)
    k = max(idx.shape[1], 1)
    return Dispatch(order, counts, order // k)


def _count(values: torch.Tensor, n: int) -> torch.Tensor:
    """``bincount(values, minlength=n)`` for values below ``n``, without bincount's host
    sync on CUDA (it reads the maximum back to size its output)."""
    out = torch.zeros(n, dtype=torch.int64, device=values.device)
    return out.index_add_(0, values, torch.ones_like(values))


def combine(
    y_sent: torch.Tensor, plan: Dispatch, weights: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """The routed output per token: ``sum_j weights[t, j] * y(t, j)`` in fp32, ``j`` in
    ascending expert id (as :meth:`Experts._grouped` adds them), returned in ``y``'s dtype.

    ``y_sent``: each pair's expert output in send order (row ``i`` is pair ``plan.order[i]``).
    """
    t, k = idx.shape
    h = y_sent.shape[1]
    pairs = torch.empty_like(y_sent).index_copy_(0, plan.order, y_sent).view(t, k, h)
    return weigh_pairs(pairs, weights, idx)


def weigh_pairs(pairs: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * pairs[t, j]`` in fp32, ``j`` in ascending expert id, in
    ``pairs``' dtype; ``pairs`` [T, k, H]: each (token, expert) pair's raw expert output."""
    t, k, h = pairs.shape
    by_expert = torch.argsort(idx, dim=1, stable=True)
    ys = pairs.gather(1, by_expert.unsqueeze(-1).expand(t, k, h))
    ws = weights.gather(1, by_expert).to(torch.float32)
    # Every product in one launch (fp32(y) * w, rounded as the reference rounds it), then
    # the k adds in expert order: k + 3 launches instead of 3k + 1 (v2-lite k = 6: 9 vs 19).
    prods = ys.to(torch.float32) * ws.unsqueeze(-1)
    out = torch.zeros(t, h, dtype=torch.float32, device=pairs.device)
    for j in range(k):
        out += prods[:, j]
    return out.to(pairs.dtype)


def _pack_fused(
    x: torch.Tensor,
    idx: torch.Tensor,
    table: RouteTable,
    live: torch.Tensor | None,
    load: torch.Tensor,
    cap: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`RouteTable.route`, :func:`.fixed.rows_of`, :func:`.fixed.pack` and the load
    count in two Triton launches (:mod:`libs.engine.kernels.ep_exchange`, the same bytes):
    (the send buffer, each pair's row in it, 1 where the pair's token is real)."""
    from ..kernels.ep_exchange import pack_rows, route_and_slots

    off, width = fixed.row_bytes(x.shape[1], x.dtype)
    buf = torch.empty(table.num_ranks * cap, width, dtype=torch.uint8, device=x.device)
    slot = buf[:, off:].view(torch.int64).squeeze(1)
    s = table.slots_per_rank
    rows, real = route_and_slots(
        idx, table.local, table.replicas, table.num_replicas, live, slot, load,
        table.num_ranks, s, cap,
    )  # fmt: skip
    pack_rows(x, rows, idx.shape[1], buf[:, : x.shape[1] * x.dtype.itemsize].view(x.dtype))
    return buf, rows, real


class EPExperts(nn.Module):
    """A MoE layer's routed experts over an EP group; ``local`` holds this rank's slots.

    ``load``: tokens routed to each expert by this rank's router since the layer was built
    (home-side counts, a device tensor that only grows: readers keep their own mark, as
    :meth:`take_load` and EPLB do, so one counter serves both with one launch per layer).
    """

    def __init__(
        self,
        local: SlotExperts,
        group: EPGroup,
        placement: Placement,
        shape: fixed.StepBound | None = None,
    ) -> None:
        super().__init__()
        if local.slots != placement.experts_of(group.rank):
            raise ValueError(
                f"rank {group.rank}: experts hold slots {local.slots}, the placement says "
                f"{placement.experts_of(group.rank)}"
            )
        self.local = local
        self.group = group
        self.placement = placement
        device = next(local.parameters()).device
        self.table = RouteTable.build(placement, group.rank, device)
        self.load = torch.zeros(placement.num_experts, dtype=torch.int64, device=device)
        self._taken = torch.zeros_like(self.load)
        # The group's agreed bound for the step (shared by the runtime's layers): picks the
        # fixed-shape or the variable-size exchange and sizes the fixed buffers.
        self.shape = shape or fixed.StepBound()
        # The fixed exchange's bookkeeping as Triton kernels (True), as PyTorch ops (False), or
        # None: kernels on a GPU that runs the experts' kernels. Both give the same bytes.
        self.fused_exchange: bool | None = None

    def set_placement(self, placement: Placement) -> None:
        """Route by ``placement`` from now on (``local`` must already hold its slots); with
        the same slots per rank the routes change in place (captured graphs follow)."""
        self.placement = placement
        table = RouteTable.build(placement, self.group.rank, self.load.device)
        if not self.table.update(table):
            self.table = table

    def take_load(self) -> torch.Tensor:
        """Tokens per expert since the last call (or the start)."""
        now = self.load.clone()
        out = now - self._taken
        self._taken = now
        return out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.shape.fixed(x.shape[0]):
            return self._forward_fixed(x, weights, idx)
        self._count_load(idx)
        return self._forward_variable(x, weights, idx)

    @property
    def fused(self) -> bool:
        """Whether the fixed exchange's bookkeeping runs as Triton kernels: ``fused_exchange``
        if set, else on a GPU whose experts run their kernels."""
        if self.fused_exchange is not None:
            return self.fused_exchange
        return self.local.use_kernels and self.load.is_cuda

    def _count_load(self, idx: torch.Tensor) -> torch.Tensor:
        real = self.shape.real_pairs(idx)  # a graph's padding rows are no one's load
        self.load.index_add_(0, idx.reshape(-1), real)
        return real

    def _forward_fixed(
        self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        """Fixed-capacity buffers, one exchange each way, no host sync (:mod:`.fixed`)."""
        n, s = self.table.num_ranks, self.table.slots_per_rank
        t, k = idx.shape
        cap = fixed.capacity(self.shape.bound(t), k, s)
        if cap == 0:  # the group agreed: no rank has a token
            return torch.zeros_like(x)
        splits = [cap] * n
        fused = self.fused
        if fused:
            buf, rows, real = _pack_fused(x, idx, self.table, self.shape.live, self.load, cap)
        else:
            real = self._count_load(idx)
            dest = self.table.route(idx)
            rows = fixed.rows_of(dest, n, s, cap)
            buf = fixed.pack(x, dest, rows, k, n * cap, s, real)
        got = self.group.all_to_all(buf, splits, splits)
        x_recv, slot = fixed.unpack(got, x.shape[1], x.dtype)
        y_back = self.group.all_to_all(self._run_fixed(x_recv, slot), splits, splits)
        if fused:
            from ..kernels.ep_exchange import combine_rows

            return combine_rows(y_back, rows, real, idx, weights)
        pairs = y_back.index_select(0, rows).view(t, k, x.shape[1])
        # A graph's padding rows got nothing back (no expert ran them): zeros, not garbage.
        pairs = torch.where(real.view(t, k, 1).bool(), pairs, 0)
        return weigh_pairs(pairs, weights, idx)

    def _forward_variable(
        self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        """Exchanges sized by the counts: one host sync and three collectives per layer."""
        group, n, s = self.group, self.table.num_ranks, self.table.slots_per_rank
        plan = plan_dispatch(idx, self.table)
        recv_counts = group.exchange_counts(plan.counts)
        # One host sync per layer: the split sizes (the price of variable-size exchanges).
        both = torch.stack((plan.counts.view(n, s).sum(1), recv_counts.view(n, s).sum(1)))
        send_splits, recv_splits = both.tolist()
        x_recv = group.all_to_all(x.index_select(0, plan.rows), send_splits, recv_splits)
        y_recv = self._run_local(x_recv, recv_counts, sum(recv_splits))
        y_sent = group.all_to_all(y_recv, recv_splits, send_splits)
        return combine(y_sent, plan, weights, idx)

    def _run_fixed(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Each arrived row through its slot's expert; padding rows (slot ``S``) are not run
        and come back as garbage that no rank reads. The fused kernel skips them itself (no
        host sync); the PyTorch experts (which sync on their own counts anyway) get the
        real rows only, in arrival order -- the rows the variable-size exchange gives them."""
        ones = torch.ones(slot.shape, dtype=torch.float32, device=x.device)
        if self.local.use_kernels:
            out: torch.Tensor = self.local(x, ones, slot)
            return out
        live = (slot.squeeze(1) < self.table.slots_per_rank).nonzero().squeeze(1)
        y = torch.zeros_like(x)
        if live.numel():
            y[live] = self.local(x[live], ones[live], slot[live])
        return y

    def _run_local(self, x: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
        """Each arrived row through its slot's expert (rows come by source rank, then slot)."""
        if rows == 0:
            return x
        s = self.table.slots_per_rank
        slot_ids = torch.arange(s, device=x.device).repeat(self.table.num_ranks)
        slot = torch.repeat_interleave(slot_ids, counts, output_size=rows).unsqueeze(1)
        ones = torch.ones(slot.shape, dtype=torch.float32, device=x.device)
        out: torch.Tensor = self.local(x, ones, slot)
        return out
