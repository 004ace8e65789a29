"""Which routed expert each slot of each rank holds (no torch, no I/O).

An engine instance of ``N`` ranks keeps the same number of expert *slots* on every rank
(fixed-size weight buffers, so a re-placement copies weights into existing slots). A slot holds
one expert or is empty (``EMPTY``); an expert may sit in several slots (redundant replicas of a
hot expert). Every expert must have at least one slot. EPLB (``libs/engine/ep/eplb.py``) computes
placements; the MoE dispatch (``libs/engine/ep/moe.py``) reads :meth:`Placement.replicas`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

EMPTY = -1


@dataclass(frozen=True)
class Placement:
    num_experts: int
    rank_slots: tuple[tuple[int, ...], ...]  # rank -> the expert id of each local slot

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not self.rank_slots:
            raise ValueError("a placement needs at least one rank")
        sizes = {len(s) for s in self.rank_slots}
        if len(sizes) != 1:
            raise ValueError(f"every rank must have the same number of slots, got {sorted(sizes)}")
        for r, slots in enumerate(self.rank_slots):
            for e in slots:
                if e != EMPTY and not 0 <= e < self.num_experts:
                    raise ValueError(
                        f"rank {r}: slot holds expert {e}, outside [0, {self.num_experts})"
                    )
        missing = set(range(self.num_experts)) - {e for s in self.rank_slots for e in s}
        if missing:
            raise ValueError(f"experts without a slot: {sorted(missing)[:8]}")

    @property
    def num_ranks(self) -> int:
        return len(self.rank_slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.rank_slots[0])

    @cached_property
    def _replicas(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for r, slots in enumerate(self.rank_slots):
            for s, e in enumerate(slots):
                if e != EMPTY:
                    out[e].append((r, s))
        return tuple(tuple(x) for x in out)

    def replicas(self, expert: int) -> tuple[tuple[int, int], ...]:
        """The (rank, local slot) pairs holding ``expert``, at least one."""
        return self._replicas[expert]

    def experts_of(self, rank: int) -> tuple[int, ...]:
        return self.rank_slots[rank]

    @staticmethod
    def contiguous(num_experts: int, num_ranks: int, redundant: int = 0) -> Placement:
        """Experts in order, as evenly as the counts allow (the first ``E mod N`` ranks one
        more); ``redundant`` extra slots per rank; spare slots are filled with replicas of the
        experts in order (harmless: any replica gives the same answer) so no slot is idle."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if redundant < 0:
            raise ValueError(f"redundant must be >= 0, got {redundant}")
        base, extra = divmod(num_experts, num_ranks)
        per_rank = base + (1 if extra else 0) + redundant
        ranks: list[list[int]] = []
        e = 0
        for r in range(num_ranks):
            n = base + (1 if r < extra else 0)
            ranks.append(list(range(e, e + n)))
            e += n
        spare = 0
        for slots in ranks:
            while len(slots) < per_rank:
                slots.append(spare % num_experts)
                spare += 1
        return Placement(num_experts, tuple(tuple(s) for s in ranks))
