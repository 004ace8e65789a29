"""EPLB's bookkeeping: the load each routed expert saw, and when to re-place (policy: numpy, no
torch, no I/O).

* :class:`EplbConfig`: the window and the re-placement interval (DeepSeek's decode and prefill
  defaults), and the redundant slots per rank.
* :class:`LoadTracker` sums per-expert token counts of every MoE layer over a sliding window
  of the last ``window_steps`` steps (a ring of per-step counts plus a running sum).
* :class:`Eplb` ties the tracker to the planning (:mod:`.eplb_plan`) as a step function for
  the engine: ``step(counts)`` records one step and, every ``rebalance_every`` steps, returns
  a :class:`Rebalance` (new placements, one per MoE layer, and how many slots each changed);
  the engine copies the weights. :meth:`Eplb.balance` is the gauge a service publishes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from .eplb_plan import (
    Ints,
    imbalance,
    layers_max_mean,
    max_mean,
    moved_slots,
    moved_slots_per_rank,
    place,
    rank_loads,
    share_matrix,
    slots_per_rank,
)
from .placement import Placement

# The planning functions are part of EPLB's face: callers import them from here too.
__all__ = [
    "Balance",
    "Eplb",
    "EplbConfig",
    "LoadTracker",
    "Rebalance",
    "imbalance",
    "layers_max_mean",
    "max_mean",
    "moved_slots",
    "moved_slots_per_rank",
    "place",
    "rank_loads",
    "share_matrix",
    "slots_per_rank",
]


@dataclass(frozen=True)
class EplbConfig:
    """Decode defaults (DeepSeek's): a 1,000-step window, re-placement every 10,000 steps,
    one redundant slot per rank. :meth:`prefill`: 100 / 1,000 steps, four per rank."""

    window_steps: int = 1_000
    rebalance_every: int = 10_000
    redundant_per_rank: int = 1
    # A placement that moves fewer slots wins if its max/mean is within this of the best one
    # (0.01: one point of imbalance is worth less than copying weights around).
    tolerance: float = 0.01

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {self.window_steps}")
        if self.rebalance_every < 1:
            raise ValueError(f"rebalance_every must be >= 1, got {self.rebalance_every}")
        if self.redundant_per_rank < 0:
            raise ValueError(f"redundant_per_rank must be >= 0, got {self.redundant_per_rank}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")

    @classmethod
    def decode(cls) -> EplbConfig:
        return cls()

    @classmethod
    def prefill(cls) -> EplbConfig:
        return cls(window_steps=100, rebalance_every=1_000, redundant_per_rank=4)

    @classmethod
    def named(cls, name: str) -> EplbConfig:
        """``decode`` or ``prefill`` (the engine option's spelling)."""
        if name not in ("decode", "prefill"):
            raise ValueError(f"eplb must be decode, prefill or an EplbConfig, got {name!r}")
        return cls.decode() if name == "decode" else cls.prefill()

    def sync_interval(self, cap: int = 32) -> int:
        """Steps whose load counts an engine sums locally before one all-reduce: the largest
        divisor of both ``window_steps`` and ``rebalance_every`` not above ``cap``, so a
        window of whole chunks is exactly ``window_steps`` steps and re-placements fall on the
        same steps as with per-step counts (decode and prefill defaults: 25)."""
        g = math.gcd(self.window_steps, self.rebalance_every)
        return max(d for d in range(1, min(g, cap) + 1) if g % d == 0)

    def in_chunks(self, k: int) -> EplbConfig:
        """This config counted in chunks of ``k`` steps (``k`` divides both intervals)."""
        if self.window_steps % k or self.rebalance_every % k:
            raise ValueError(
                f"{k} steps do not divide window {self.window_steps} and interval "
                f"{self.rebalance_every}"
            )
        return EplbConfig(
            self.window_steps // k,
            self.rebalance_every // k,
            self.redundant_per_rank,
            self.tolerance,
        )


class LoadTracker:
    """Per-expert token counts of each MoE layer summed over the last ``window_steps`` steps.

    Memory is ``window_steps x layers x experts`` int32 (DeepSeek-V3 decode: 1,000 x 58 x 256,
    59 MB), held by the one process that decides placements."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int) -> None:
        if num_layers < 1 or num_experts < 1 or window_steps < 1:
            raise ValueError(
                f"need layers, experts, window >= 1, got {num_layers}, {num_experts}, "
                f"{window_steps}"
            )
        self._ring = np.zeros((window_steps, num_layers, num_experts), dtype=np.int32)
        self._sum = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._steps = 0

    @property
    def steps(self) -> int:
        """Steps recorded since the start."""
        return self._steps

    @property
    def window_len(self) -> int:
        """Steps the window holds now: ``min(steps, window_steps)``."""
        return min(self._steps, self._ring.shape[0])

    def record(self, counts: ArrayLike) -> None:
        """One step: ``counts[layer, expert]`` tokens routed to each expert (all ranks)."""
        c = np.asarray(counts)
        if c.shape != self._sum.shape:
            raise ValueError(f"counts must have shape {self._sum.shape}, got {c.shape}")
        if (c < 0).any() or (c > np.iinfo(np.int32).max).any():
            raise ValueError("counts must be in [0, 2**31)")
        slot = self._steps % self._ring.shape[0]
        self._sum += c
        self._sum -= self._ring[slot]
        self._ring[slot] = c
        self._steps += 1

    def loads(self) -> Ints:
        """``[layer, expert]`` tokens over the window (a copy)."""
        return self._sum.copy()


@dataclass(frozen=True)
class Rebalance:
    """New placements to apply after ``step`` (one per MoE layer) and the slots each changed.
    ``before`` / ``after``: :func:`layers_max_mean` of the window that decided it, under the
    old and the new placements."""

    step: int
    placements: tuple[Placement, ...]
    moved_slots: tuple[int, ...]
    before: float = 1.0
    after: float = 1.0


@dataclass(frozen=True)
class Balance:
    """How evenly the ranks share the routed experts' work now (a gauge for a service).

    ``max_mean``: :func:`layers_max_mean` of the window's loads under the placements in
    force (1.0: perfectly even; 1.3: the step waits 30 % longer on its MoE layers than an
    even split would); ``per_layer``: :func:`max_mean` of each MoE layer; ``window_steps``:
    the steps those loads cover; ``rebalances`` / ``moved_slots``: re-placements so far that
    moved weights, and the slots they moved; ``last``: the latest re-placement, if any."""

    max_mean: float
    per_layer: tuple[float, ...]
    window_steps: int
    rebalances: int
    moved_slots: int
    last: Rebalance | None


class Eplb:
    """Tracker plus re-placement as one step function. Starts from ``initial`` (default: the
    contiguous placement with the configured redundant slots per rank)."""

    def __init__(
        self,
        config: EplbConfig,
        num_layers: int,
        num_experts: int,
        num_ranks: int,
        initial: Sequence[Placement] | None = None,
        steps_per_record: int = 1,
    ) -> None:
        """``steps_per_record``: engine steps each :meth:`step` call covers (an engine that
        records chunks of steps passes ``config`` counted in chunks, :meth:`EplbConfig.
        in_chunks`); reported steps and window lengths are in engine steps."""
        self.config = config
        self.steps_per_record = steps_per_record
        self.tracker = LoadTracker(num_layers, num_experts, config.window_steps)
        if initial is None:
            base = Placement.contiguous(num_experts, num_ranks, config.redundant_per_rank)
            initial = [base] * num_layers
        if len(initial) != num_layers:
            raise ValueError(f"need {num_layers} initial placements, got {len(initial)}")
        self._placements = tuple(initial)
        self.num_ranks = num_ranks
        self._rebalances = 0
        self._moved = 0
        self._last: Rebalance | None = None

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._placements

    def step(self, counts: ArrayLike) -> Rebalance | None:
        """Record one step's ``counts[layer, expert]``; every ``rebalance_every`` steps,
        return the new placements (already in force for the next step's bookkeeping)."""
        self.tracker.record(counts)
        if self.tracker.steps % self.config.rebalance_every:
            return None
        loads = self.tracker.loads()
        new = tuple(
            place(
                loads[layer],
                self.num_ranks,
                old.slots_per_rank,
                old,
                tolerance=self.config.tolerance,
            )
            for layer, old in enumerate(self._placements)
        )
        moved = tuple(moved_slots(o, n) for o, n in zip(self._placements, new, strict=True))
        before = layers_max_mean(self._placements, loads)
        self._placements = new
        step = self.tracker.steps * self.steps_per_record
        out = Rebalance(step, new, moved, before, layers_max_mean(new, loads))
        if sum(moved):
            self._rebalances += 1
            self._moved += sum(moved)
            self._last = out
        return out

    def balance(self) -> Balance:
        """The gauge: the window's loads under the placements in force (O(layers x slots)
        Python: read it per scrape, not per step)."""
        loads = self.tracker.loads()
        per_layer = tuple(max_mean(p, row) for p, row in zip(self._placements, loads, strict=True))
        return Balance(
            layers_max_mean(self._placements, loads),
            per_layer,
            self.tracker.window_len * self.steps_per_record,
            self._rebalances,
            self._moved,
            self._last,
        )
