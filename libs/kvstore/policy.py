"""Where a block's shards go, and which blocks retention removes. Pure functions, no I/O.

* **Placement**: each of a block's ``k + m`` shards goes to a distinct target, chosen by
  rendezvous (highest-random-weight) hashing of the block digest, so every kvstore process
  computes the same targets without coordination and adding a target moves only ~1/N of the
  blocks. The order of the chosen targets is the shard order, so data shards (read on every
  healthy ``Get``) spread over all targets instead of always landing on the first ten.
* **Retention**: a block expires ``ttl[class]`` seconds after its last use (chat 7 days, agent
  3 days by default). A block whose parent is gone can never be reached by a lookup (lookups walk
  a chain from its first block), so it is reclaimed too. Under a capacity limit the least
  recently used blocks go first, but only chain *tails*: a block is evicted only once no stored
  block names it as parent, so a prefix never disappears under a suffix that still needs it.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DAY_S = 86_400.0
DEFAULT_TTLS: Mapping[str, float] = {"chat": 7 * DAY_S, "agent": 3 * DAY_S}


def place(block: bytes, targets: Sequence[str], n: int) -> list[str]:
    """The ``n`` distinct targets of ``block``'s shards, in shard order.

    Deterministic across processes and hosts (SHA-256, never Python's ``hash()``).
    Raises ``ValueError`` when fewer than ``n`` distinct targets exist.
    """
    distinct = list(dict.fromkeys(targets))
    if len(distinct) < n:
        raise ValueError(
            f"erasure coding needs {n} distinct storage targets, {len(distinct)} given"
        )

    def weight(t: str) -> bytes:
        return hashlib.sha256(block + b"\0" + t.encode()).digest()

    return sorted(distinct, key=weight, reverse=True)[:n]


@dataclass(frozen=True)
class Retention:
    """TTL per traffic class (seconds since last use) and the capacity limit (bytes; 0: none)."""

    ttls: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TTLS))
    capacity_bytes: int = 0
    default_class: str = "chat"

    def __post_init__(self) -> None:
        for cls, ttl in self.ttls.items():
            if ttl <= 0:
                raise ValueError(f"TTL of traffic class {cls!r} must be > 0 seconds, got {ttl}")
        if self.default_class not in self.ttls:
            raise ValueError(f"default traffic class {self.default_class!r} has no TTL")
        if self.capacity_bytes < 0:
            raise ValueError(
                f"capacity must be >= 0 bytes (0: unlimited), got {self.capacity_bytes}"
            )

    def ttl(self, traffic_class: str) -> float:
        return self.ttls.get(traffic_class, self.ttls[self.default_class])

    def expired(self, traffic_class: str, last_access: float, now: float) -> bool:
        return now - last_access >= self.ttl(traffic_class)


@dataclass(frozen=True)
class BlockInfo:
    """What retention needs of one stored block (hex digests; ``parent`` "" for a first block)."""

    hash: str
    parent: str
    size: int
    traffic_class: str
    last_access: float


@dataclass(frozen=True)
class Reclaim:
    """Blocks to remove and why; ``expired``, ``unreachable`` and ``evicted`` are disjoint."""

    expired: tuple[str, ...]
    unreachable: tuple[str, ...]
    evicted: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return self.expired + self.unreachable + self.evicted


def plan_reclaim(blocks: Sequence[BlockInfo], policy: Retention, now: float) -> Reclaim:
    """Which blocks to remove at ``now``: expired ones, then unreachable ones, then LRU tails
    until the rest fits ``policy.capacity_bytes``."""
    by_hash = {b.hash: b for b in blocks}
    expired = [b.hash for b in blocks if policy.expired(b.traffic_class, b.last_access, now)]
    gone = set(expired)
    unreachable = _unreachable(by_hash, gone)
    gone.update(unreachable)
    live = [b for b in blocks if b.hash not in gone]
    evicted: list[str] = []
    if policy.capacity_bytes:
        evicted = _evict_tails(live, policy.capacity_bytes)
    return Reclaim(tuple(expired), tuple(unreachable), tuple(evicted))


def _unreachable(by_hash: Mapping[str, BlockInfo], gone: set[str]) -> list[str]:
    """Blocks whose ancestor chain is broken (a parent missing or already going), in chain order."""
    memo: dict[str, bool] = {}

    def reachable(h: str) -> bool:
        path = []
        while h not in memo:
            b = by_hash.get(h)
            if b is None or h in gone:
                memo[h] = False
                break
            if not b.parent:
                memo[h] = True
                break
            path.append(h)
            h = b.parent
        ok = memo[h]
        for p in path:
            memo[p] = ok
        return ok

    return [h for h in by_hash if h not in gone and not reachable(h)]


def _evict_tails(live: Sequence[BlockInfo], capacity: int) -> list[str]:
    """Least recently used leaves first until the bytes fit; a parent becomes a leaf once its
    last child is evicted. Ties in last use go to the deeper block (the tail)."""
    used = sum(b.size for b in live)
    if used <= capacity:
        return []
    children: dict[str, int] = {}
    for b in live:
        if b.parent:
            children[b.parent] = children.get(b.parent, 0) + 1
    by_hash = {b.hash: b for b in live}
    depth = _depths(by_hash)
    heap = [(b.last_access, -depth[b.hash], b.hash) for b in live if not children.get(b.hash)]
    heapq.heapify(heap)
    out: list[str] = []
    while used > capacity and heap:
        _, _, h = heapq.heappop(heap)
        b = by_hash[h]
        out.append(h)
        used -= b.size
        if b.parent in children:
            children[b.parent] -= 1
            if children[b.parent] == 0:
                p = by_hash[b.parent]
                heapq.heappush(heap, (p.last_access, -depth[p.hash], p.hash))
    return out


def _depths(by_hash: Mapping[str, BlockInfo]) -> dict[str, int]:
    depth: dict[str, int] = {}
    for h in by_hash:
        path = []
        while h in by_hash and h not in depth:
            path.append(h)
            h = by_hash[h].parent
        d = depth.get(h, -1)
        for p in reversed(path):
            d += 1
            depth[p] = d
    return depth


class LoadOrCompute:
    """Whether fetching cached prefix blocks beats computing them again, at measured rates.

    Loading costs ``bytes / load rate`` (the kvstore's observed throughput, starting from
    ``load_bytes_per_s``); computing costs ``tokens / compute rate`` (the engine's observed
    prefill throughput; unknown until measured, and then loading is tried). Both rates are
    exponential moving averages, so a slow kvstore or a fast GPU shifts the choice.
    """

    def __init__(self, load_bytes_per_s: float = 1e9, smoothing: float = 0.2) -> None:
        if load_bytes_per_s <= 0 or not 0 < smoothing <= 1:
            raise ValueError("load_bytes_per_s must be > 0 and smoothing in (0, 1]")
        self.load_bytes_per_s = load_bytes_per_s
        self.compute_tokens_per_s: float | None = None
        self.smoothing = smoothing

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.load_bytes_per_s = self._mix(self.load_bytes_per_s, nbytes / seconds)

    def observe_compute(self, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            self.compute_tokens_per_s = self._mix(self.compute_tokens_per_s, tokens_per_s)

    def worth_loading(self, n_blocks: int, bytes_per_block: int, block_size: int) -> bool:
        if n_blocks <= 0:
            return False
        if self.compute_tokens_per_s is None:
            return True
        load_s = n_blocks * bytes_per_block / self.load_bytes_per_s
        compute_s = n_blocks * block_size / self.compute_tokens_per_s
        return load_s < compute_s
