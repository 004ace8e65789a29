"""Which prefill and decode instance serve a request: liveness from heartbeats, round-robin.

Pure policy (no I/O, no clock of its own): the service feeds it heartbeats and the time, and
asks it for a decision. Liveness is judged by when a heartbeat *arrived* here, on this
process's monotonic clock, never by the sender's wall clock, so clock skew between hosts
cannot make a live instance look dead (or a dead one live).

Choice: round-robin over the live, non-draining, non-excluded instances of the request's
model, per role. The cursor remembers the last instance picked, not a position, so instances
joining or leaving never make the rotation skip or repeat one. Load figures from heartbeats
are up to one heartbeat interval (1 s) old; picking the least loaded instance on such stale
numbers would send a whole burst of requests to the same one, while round-robin spreads any
burst evenly. Length buckets and cache locality come later (they need more than one
prefill pool to matter).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)


class NoInstance(Exception):
    """No live instance can take the request (recoverable: retry once one heartbeats)."""


@dataclass(frozen=True)
class Instance:
    """What one heartbeat says about an instance (the fields routing uses)."""

    instance_id: str
    role: str  # PREFILL or DECODE
    model: str = ""
    address: str = ""  # decode: host:port of its KVTransfer server
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    draining: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")


@dataclass(frozen=True)
class Decision:
    prefill: Instance
    decode: Instance


@dataclass
class _Entry:
    instance: Instance
    last_seen: float


@dataclass
class RoutingPolicy:
    """Table of instances known from heartbeats, and the round-robin choice over it.

    ``clock`` returns seconds (monotonic); tests inject a fake one. An instance whose last
    heartbeat is more than ``heartbeat_timeout`` seconds old is dead: never chosen, and
    forgotten by :meth:`prune`.
    """

    heartbeat_timeout: float = 3.0
    clock: Callable[[], float] = time.monotonic
    _table: dict[tuple[str, str], _Entry] = field(default_factory=dict, init=False)
    _last_pick: dict[tuple[str, str], str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout}")

    # -- heartbeats -------------------------------------------------------------------------
    def observe(self, instance: Instance) -> None:
        """Record a heartbeat, received now."""
        self._table[(instance.role, instance.instance_id)] = _Entry(instance, self.clock())

    def prune(self) -> list[Instance]:
        """Forget dead instances; returns them (for logging)."""
        now = self.clock()
        dead = [k for k, e in self._table.items() if now - e.last_seen > self.heartbeat_timeout]
        return [self._table.pop(k).instance for k in dead]

    def is_live(self, role: str, instance_id: str) -> bool:
        entry = self._table.get((role, instance_id))
        return entry is not None and self.clock() - entry.last_seen <= self.heartbeat_timeout

    def live(self, role: str | None = None) -> list[Instance]:
        """Instances whose last heartbeat is recent enough (draining ones included)."""
        now = self.clock()
        return [e.instance for (r, _), e in sorted(self._table.items())
                if (role is None or r == role) and now - e.last_seen <= self.heartbeat_timeout]

    # -- routing ----------------------------------------------------------------------------
    def route(self, model: str = "", exclude: Iterable[str] = ()) -> Decision:
        """One prefill and one decode instance for a request of ``model`` ("" = any model).

        Raises :class:`NoInstance` with the reason when either role has no candidate. Only
        a successful decision advances the rotation, so a failed one skews nothing.
        """
        excluded = frozenset(exclude)
        prefill_id = self._pick(PREFILL, model, excluded)
        decode_id = self._pick(DECODE, model, excluded)
        self._last_pick[(PREFILL, model)] = prefill_id
        self._last_pick[(DECODE, model)] = decode_id
        return Decision(self._table[(PREFILL, prefill_id)].instance,
                        self._table[(DECODE, decode_id)].instance)

    def _candidates(self, role: str, model: str, excluded: frozenset[str]) -> list[str]:
        out = []
        for inst in self.live(role):
            if inst.draining or inst.instance_id in excluded:
                continue
            if model and inst.model and inst.model != model:
                continue
            if role == DECODE and not inst.address:
                continue  # prefill could not push the KV anywhere
            out.append(inst.instance_id)
        return out  # sorted by instance id (live() sorts)

    def _pick(self, role: str, model: str, excluded: frozenset[str]) -> str:
        ids = self._candidates(role, model, excluded)
        if not ids:
            raise NoInstance(self._why_none(role, model, excluded))
        last = self._last_pick.get((role, model))
        if last is None:
            return ids[0]
        # The first id after the last one picked, wrapping round: stable under churn.
        return ids[bisect.bisect_right(ids, last) % len(ids)]

    def _why_none(self, role: str, model: str, excluded: frozenset[str]) -> str:
        live = [i for i in self.live(role) if not model or not i.model or i.model == model]
        draining = sum(i.draining for i in live)
        skipped = sum(i.instance_id in excluded for i in live)
        what = f"{role} instance" + (f" for model {model!r}" if model else "")
        detail = f"{len(live)} live, {draining} draining, {skipped} excluded"
        return f"no live {what} ({detail}); retry once one is up"
