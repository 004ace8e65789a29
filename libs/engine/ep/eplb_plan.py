"""EPLB's planning: where each routed expert should live, and how even a placement is (policy:
numpy, no torch, no I/O).

* :func:`place` turns one layer's window loads into a :class:`Placement`: the redundant slots
  go to the experts with the highest load per replica (an expert's tokens are split evenly
  over its replicas), then the replicas are packed onto the ranks, ``slots_per_rank`` each and
  at most one replica of an expert per rank, to make the busiest rank as light as possible
  (longest-processing-time greedy, then swaps that lighten the busiest rank). Given the
  placement in service, it also builds an incremental candidate (change only the replica
  counts that changed, then swap) and keeps the old placement as a candidate, and returns the
  candidate that moves the fewest slots among those within ``tolerance`` of the best max/mean:
  loads that barely move, move no weights.
* :func:`rank_loads` / :func:`max_mean` / :func:`layers_max_mean` measure a placement against
  loads; :func:`moved_slots` counts what a re-placement copies.

The bookkeeping that calls them step by step is :mod:`.eplb`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .placement import EMPTY, Placement

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]


def slots_per_rank(num_experts: int, num_ranks: int, redundant: int) -> int:
    """Slots per rank as :meth:`Placement.contiguous` lays them out."""
    return math.ceil(num_experts / num_ranks) + redundant


# ---------------------------------------------------------------------------- measuring


def share_matrix(placement: Placement) -> Floats:
    """``M[e, r]``: the share of expert ``e``'s tokens that rank ``r`` computes (its tokens
    split evenly over its replicas), so rank loads are ``loads @ M``."""
    m = np.zeros((placement.num_experts, placement.num_ranks))
    for r, slots in enumerate(placement.rank_slots):
        for e in slots:
            if e != EMPTY:
                m[e, r] += 1.0
    out: Floats = m / m.sum(axis=1, keepdims=True)
    return out


def rank_loads(placement: Placement, loads: ArrayLike) -> Floats:
    """Tokens each rank computes: ``loads`` is ``(experts,)`` or ``(steps, experts)``."""
    x = np.asarray(loads, dtype=np.float64)
    if x.shape[-1] != placement.num_experts:
        raise ValueError(f"loads have {x.shape[-1]} experts, placement {placement.num_experts}")
    out: Floats = x @ share_matrix(placement)
    return out


def imbalance(loads_by_rank: ArrayLike) -> Floats:
    """Max over mean along the last axis (1.0 where nothing ran)."""
    x = np.asarray(loads_by_rank, dtype=np.float64)
    mean = x.mean(axis=-1)
    out: Floats = np.where(mean > 0, x.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)
    return out


def max_mean(placement: Placement, loads: ArrayLike) -> float:
    """Busiest rank's load over the mean rank load for one layer's per-expert ``loads``: the
    step waits for the busiest rank, so this is the MoE time over the balanced time."""
    return float(imbalance(rank_loads(placement, loads)))


def layers_max_mean(placements: Sequence[Placement], loads: ArrayLike) -> float:
    """Max/mean over all MoE layers of a step: the sum over layers of the busiest rank's load
    over the sum of the mean rank loads (each layer waits for its busiest rank, so this is
    the routed experts' time over the balanced time; 1.0 where nothing ran)."""
    x = np.asarray(loads, dtype=np.float64)
    if len(placements) != x.shape[0]:
        raise ValueError(f"{len(placements)} placements for {x.shape[0]} layers of loads")
    busiest = mean = 0.0
    for placement, row in zip(placements, x, strict=True):
        by_rank = rank_loads(placement, row)
        busiest += float(by_rank.max())
        mean += float(by_rank.mean())
    return busiest / mean if mean > 0 else 1.0


def moved_slots_per_rank(old: Placement, new: Placement) -> Ints:
    """Slots of each rank whose expert changed: each is one expert's weights copied in."""
    a, b = np.array(old.rank_slots), np.array(new.rank_slots)
    if a.shape != b.shape:
        raise ValueError(f"placements differ in shape: {a.shape} vs {b.shape}")
    out: Ints = ((a != b) & (b != EMPTY)).sum(axis=1).astype(np.int64)
    return out


def moved_slots(old: Placement, new: Placement) -> int:
    return int(moved_slots_per_rank(old, new).sum())


# ---------------------------------------------------------------------------- placing


def replica_counts(loads: ArrayLike, num_ranks: int, total_slots: int) -> Ints:
    """One replica per expert, then each extra slot to the expert with the highest load per
    replica (at most one replica per rank, so at most ``num_ranks``)."""
    x = np.asarray(loads, dtype=np.float64)
    n = len(x)
    if total_slots < n:
        raise ValueError(f"{total_slots} slots cannot hold {n} experts")
    counts = np.ones(n, dtype=np.int64)
    heap = [(-float(x[e]), e) for e in range(n)]
    heapq.heapify(heap)
    for _ in range(total_slots - n):
        while heap and counts[heap[0][1]] >= num_ranks:
            heapq.heappop(heap)
        if not heap:
            break  # every expert on every rank: the rest stay EMPTY
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(x[e]) / counts[e], e))
    return counts


def _weights(slots: Ints, loads: Floats) -> Floats:
    """Load of each slot: its expert's load over the expert's replica count (EMPTY: 0)."""
    counts = np.bincount(slots[slots != EMPTY], minlength=len(loads)).astype(np.float64)
    per = np.append(loads / np.maximum(counts, 1.0), 0.0)  # index -1 (EMPTY) -> 0
    out: Floats = per[slots]
    return out


def _presence(slots: Ints, num_experts: int) -> NDArray[np.bool_]:
    """``on[r, e]``: rank ``r`` holds expert ``e``; column ``-1`` (EMPTY) is always False."""
    on = np.zeros((slots.shape[0], num_experts + 1), dtype=bool)
    for r in range(slots.shape[0]):
        on[r, slots[r]] = True
    on[:, -1] = False
    return on


def _pack(loads: Floats, counts: Ints, num_ranks: int, per_rank: int) -> Ints:
    """Longest processing time first: heaviest replica to the lightest rank with a free slot
    that does not hold the expert yet."""
    order = sorted(
        ((loads[e] / counts[e], e) for e in range(len(loads)) for _ in range(counts[e])),
        key=lambda t: (-t[0], t[1]),
    )
    slots = np.full((num_ranks, per_rank), EMPTY, dtype=np.int64)
    fill = np.zeros(num_ranks, dtype=np.int64)
    load = np.zeros(num_ranks)
    on = np.zeros((num_ranks, len(loads)), dtype=bool)
    for w, e in order:
        free = fill < per_rank
        ok = free & ~on[:, e]
        cand = np.flatnonzero(ok if ok.any() else free)  # no such rank: a wasted duplicate
        r = int(cand[np.argmin(load[cand])])
        slots[r, fill[r]] = e
        fill[r] += 1
        load[r] += w
        on[r, e] = True
    return slots


def _improve(slots: Ints, loads: Floats, max_swaps: int, stop_at: float = 1.0) -> Ints:
    """Swap one slot of the busiest rank with one slot of another rank while that lightens
    the busiest rank without making the other one as busy (EMPTY slots swap too: a move),
    until no swap helps or max/mean is at most ``stop_at``."""
    slots = slots.copy()
    w = _weights(slots, loads)
    rl = w.sum(axis=1)
    on = _presence(slots, len(loads))
    eps = 1e-9 * max(float(rl.max()), 1e-300)
    mean = float(rl.mean())
    for _ in range(max_swaps):
        m = int(np.argmax(rl))
        if rl[m] <= stop_at * mean:
            break
        gap = rl[m] - rl  # (R,)
        d = w[m][:, None, None] - w[None, :, :]  # (S_m, R, S): load moved from m to r
        ok = (d > eps) & (d < gap[None, :, None] - eps)
        ok[:, m, :] = False
        ok &= ~on[:, slots[m]].T[:, :, None]  # m's expert already on r
        ok &= ~on[m][slots][None, :, :]  # r's expert already on m
        if not ok.any():
            break
        worst = np.maximum(rl[m] - d, rl[None, :, None] + d)
        i, r, j = np.unravel_index(np.argmin(np.where(ok, worst, np.inf)), d.shape)
        slots[m, i], slots[r, j] = slots[r, j], slots[m, i]
        w[m, i], w[r, j] = w[r, j], w[m, i]
        rl[m] -= d[i, r, j]
        rl[r] += d[i, r, j]
        for q in (m, r):  # a rank may hold a wasted duplicate: recount its row
            on[q] = False
            on[q, slots[q]] = True
        on[:, -1] = False
    return slots


def _relabel(fresh: Ints, prev: Ints) -> Ints:
    """Give each packed rank the old rank it shares the most experts with, and keep each
    expert in the local slot it already had there: packing is blind to rank numbers."""
    n, e_max = fresh.shape[0], int(max(fresh.max(), prev.max())) + 2
    hf = np.stack([np.bincount(row + 1, minlength=e_max)[1:] for row in fresh])
    hp = np.stack([np.bincount(row + 1, minlength=e_max)[1:] for row in prev])
    overlap = np.minimum(hf[:, None, :], hp[None, :, :]).sum(axis=2)  # (fresh, old)
    target = np.full(n, -1, dtype=np.int64)
    taken = np.zeros(n, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        b, r = divmod(int(flat), n)
        if target[b] < 0 and not taken[r]:
            target[b], taken[r] = r, True
    out = np.full_like(fresh, EMPTY)
    for b, r in enumerate(target):
        out[r] = _arrange(list(fresh[b]), prev[r])
    return out


def _arrange(experts: list[int], prev_row: Ints) -> Ints:
    row = np.full(len(prev_row), EMPTY, dtype=np.int64)
    rest = list(experts)
    for j, e in enumerate(prev_row):
        if e != EMPTY and e in rest:
            row[j] = e
            rest.remove(e)
    free = [j for j in range(len(row)) if row[j] == EMPTY]
    for j, e in zip(free, rest, strict=False):
        row[j] = e
    return row


def _incremental(prev: Ints, loads: Floats, counts: Ints) -> Ints:
    """The old placement with only the replica counts that changed: surplus replicas leave
    the busiest ranks, new ones go to the lightest ranks with a freed slot."""
    slots = prev.copy()
    have = np.bincount(slots[slots != EMPTY], minlength=len(loads))
    rl = _weights(slots, loads).sum(axis=1)
    for e in np.flatnonzero(have > counts):
        ranks = sorted(np.flatnonzero((slots == e).any(axis=1)), key=lambda r: -rl[r])
        for r in ranks[: have[e] - counts[e]]:
            slots[r, int(np.flatnonzero(slots[r] == e)[0])] = EMPTY
    rl = _weights(slots, loads).sum(axis=1)
    adds = sorted(
        (e for e in np.flatnonzero(have < counts) for _ in range(counts[e] - have[e])),
        key=lambda e: (-loads[e] / counts[e], e),
    )
    for e in adds:
        _add_replica(slots, rl, int(e), loads[e] / counts[e])
    return slots


def _add_replica(slots: Ints, rl: Floats, e: int, w: float) -> None:
    """Put a replica of ``e`` in a free slot of the lightest rank without ``e``; when every
    rank with a free slot already holds ``e``, first move another expert into that free slot."""
    holds = (slots == e).any(axis=1)
    ok = np.flatnonzero((slots == EMPTY).any(axis=1) & ~holds)
    if len(ok):
        r = int(ok[np.argmin(rl[ok])])
        slots[r, int(np.flatnonzero(slots[r] == EMPTY)[0])] = e
        rl[r] += w
        return
    for r1 in np.flatnonzero((slots == EMPTY).any(axis=1)):  # holds e
        for r2 in np.flatnonzero(~holds)[np.argsort(rl[~holds], kind="stable")]:
            for j, f in enumerate(slots[r2]):
                if f != EMPTY and not (slots[r1] == f).any():
                    slots[r1, int(np.flatnonzero(slots[r1] == EMPTY)[0])] = f
                    slots[r2, j] = e
                    return
    raise AssertionError(f"no slot for another replica of expert {e}")  # counts <= ranks


def place(
    loads: ArrayLike,
    num_ranks: int,
    slots_per_rank: int,
    previous: Placement | None = None,
    *,
    tolerance: float = 0.01,
    max_swaps: int | None = None,
) -> Placement:
    """A placement of ``len(loads)`` experts for one MoE layer whose window saw ``loads``
    tokens per expert. With ``previous`` (the placement in service, same shape), the result
    is the candidate (previous, previous with changed replica counts, fresh) that moves the
    fewest slots among those within ``tolerance`` of the lowest max/mean; same loads in,
    ``previous`` out. Deterministic."""
    x = np.asarray(loads, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"loads must be a non-empty vector, got shape {x.shape}")
    if (x < 0).any() or not np.isfinite(x).all():
        raise ValueError("loads must be finite and >= 0")
    num_experts = len(x)
    if num_ranks * slots_per_rank < num_experts:
        raise ValueError(
            f"{num_ranks} ranks x {slots_per_rank} slots cannot hold {num_experts} experts"
        )
    swaps = max_swaps if max_swaps is not None else 4 * num_ranks * slots_per_rank
    counts = replica_counts(x, num_ranks, num_ranks * slots_per_rank)
    fresh = _improve(_pack(x, counts, num_ranks, slots_per_rank), x, swaps)
    if previous is None or (previous.num_experts, previous.num_ranks, previous.slots_per_rank) != (
        num_experts,
        num_ranks,
        slots_per_rank,
    ):
        return _to_placement(num_experts, fresh)
    prev = np.array(previous.rank_slots, dtype=np.int64)
    cands = [prev, _relabel(fresh, prev)]
    # Swap only until close to the fresh packing: each swap copies two experts' weights.
    goal = float(imbalance(_weights(fresh, x).sum(axis=1))) + tolerance / 2
    cands.append(_improve(_incremental(prev, x, counts), x, swaps, stop_at=goal))
    ratios = [float(imbalance(_weights(c, x).sum(axis=1))) for c in cands]
    moves = [int(((c != prev) & (c != EMPTY)).sum()) for c in cands]
    best = min(ratios)
    pick = min(
        (i for i in range(len(cands)) if ratios[i] <= best + tolerance),
        key=lambda i: (moves[i], ratios[i]),
    )
    if pick == 0:
        return previous
    return _to_placement(num_experts, cands[pick])


def _to_placement(num_experts: int, slots: Ints) -> Placement:
    return Placement(num_experts, tuple(tuple(int(e) for e in row) for row in slots))
