"""Prefill length buckets and which prefill instances serve which bucket (pure, no I/O).

The balancer owns the assignment; instances are not told (their ``bucket`` heartbeat field is
ignored). The rule, re-evaluated every ``interval`` seconds and whenever the set of live prefill
instances of a model changes:

* demand per bucket = prompt tokens routed into it, decayed with a ``half_life`` (60 s);
* every bucket with demand gets at least one instance (the busiest first when there are fewer
  instances than busy buckets); the rest are shared in proportion to demand (largest
  remainder, ties to the shorter bucket);
* except a *rare* bucket, worth less than ``MIN_SHARE`` of an instance, when the next longer
  bucket is busy and not rare: it gets none, and its requests go to that bucket's instances
  (the policy falls back to the nearest longer bucket). An instance reserved for a trickle
  would idle: on the agent trace of ``deepserve bench route`` the < 16K bucket is 2% of the
  requests and held one instance of eight at half the mean load. Only the adjacent bucket
  is shared, so a short prompt never waits behind one more than a bucket longer (< 16K
  behind 16K-64K, not behind 100K documents); a rare bucket next to an idle or rare one, or
  the longest, keeps its instance, so rare long documents stay isolated;
* instances, sorted by id, fill the buckets in bucket order, so the assignment is a pure
  function of (live ids, demand snapshot): two replicas that saw the same traffic agree, and
  a replica that restarts recomputes it at once.

A request whose bucket has no usable instance (none assigned, or all excluded/draining) goes
to the nearest longer bucket that has one, else to any instance of its model: buckets shape
the load, they never refuse it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_BOUNDS = (16_384, 65_536, 262_144)  # < 16K, 16K-64K, 64K-256K, >= 256K tokens
MIN_SHARE = 0.5  # of one instance's worth of demand; below it a bucket may share (see above)


def parse_bounds(text: str) -> tuple[int, ...]:
    """``"16384,65536,262144"`` -> bounds; ValueError unless positive and increasing."""
    try:
        bounds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(
            f"prefill buckets must be comma-separated token counts, got {text!r}"
        ) from None
    check_bounds(bounds)
    return bounds


def check_bounds(bounds: Sequence[int]) -> None:
    if any(b <= 0 for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"prefill bucket bounds must be positive and increasing, got {list(bounds)}"
        )


def bucket_of(prompt_tokens: int, bounds: Sequence[int]) -> int:
    """Index of the bucket a prompt of ``prompt_tokens`` falls in (bucket i: < bounds[i])."""
    return bisect.bisect_right(bounds, prompt_tokens)


def bucket_names(bounds: Sequence[int]) -> list[str]:
    def k(n: int) -> str:
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)

    names = [f"<{k(bounds[0])}"] if bounds else ["all"]
    names += [f"{k(a)}-{k(b)}" for a, b in itertools.pairwise(bounds)]
    if bounds:
        names.append(f">={k(bounds[-1])}")
    return names


def shares(demand: Sequence[float], n: int) -> list[int]:
    """Instances per bucket for ``n`` instances and per-bucket ``demand`` (sum n if any demand)."""
    out = [0] * len(demand)
    total = sum(d for d in demand if d > 0)
    if total <= 0 or n <= 0:
        return out
    busy = [i for i, d in enumerate(demand) if d > 0]
    rare = {i for i in busy if demand[i] * n < MIN_SHARE * total}  # shares the next bucket's
    busy = [i for i in busy if i not in rare or i + 1 not in busy or i + 1 in rare]
    if n <= len(busy):
        for i in sorted(busy, key=lambda i: (-demand[i], i))[:n]:
            out[i] = 1
        return out
    for i in busy:
        out[i] = 1
    spare = n - len(busy)
    total = sum(demand[i] for i in busy)
    want = {i: spare * demand[i] / total for i in busy}
    for i in busy:
        out[i] += math.floor(want[i])
    left = n - sum(out)
    for i in sorted(busy, key=lambda i: (-(want[i] - math.floor(want[i])), i))[:left]:
        out[i] += 1
    return out


def assign(ids: Sequence[str], demand: Sequence[float]) -> dict[str, int]:
    """Bucket of each instance id (ids absent: serve any bucket, i.e. there is no demand)."""
    counts = shares(demand, len(ids))
    order = sorted(ids)
    out: dict[str, int] = {}
    pos = 0
    for bucket, c in enumerate(counts):
        for iid in order[pos : pos + c]:
            out[iid] = bucket
        pos += c
    return out


@dataclass
class Demand:
    """Per-bucket prompt tokens, exponentially decayed with ``half_life`` seconds."""

    buckets: int
    half_life: float = 60.0
    _value: list[float] = field(default_factory=list, init=False)
    _at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._value = [0.0] * self.buckets

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            f = 0.5 ** ((now - self._at) / self.half_life)
            self._value = [v * f for v in self._value]
        self._at = now if self._at is None else max(self._at, now)

    def add(self, bucket: int, tokens: int, now: float) -> None:
        self._decay(now)
        self._value[bucket] += max(tokens, 1)

    def snapshot(self, now: float) -> tuple[float, ...]:
        self._decay(now)
        return tuple(self._value)
