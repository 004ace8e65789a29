"""Which prefill and decode instance serve a request: liveness, buckets, cache locality, load.

Pure policy (no I/O, no clock of its own): the service feeds it heartbeats and the time, and
asks it for a decision. Liveness is judged by when a heartbeat *arrived* here, on this
process's monotonic clock, never by the sender's wall clock, so clock skew between hosts
cannot make a live instance look dead (or a dead one live).

Prefill, in this order:

1. **Length bucket** (:mod:`.buckets`): only instances the balancer assigned to the request's
   bucket (< 16K, 16K-64K, 64K-256K, >= 256K prompt tokens by default), so a 200K-token prompt
   never queues in front of a stream of short chat turns. Assignment follows demand.
   A bucket worth less than half an instance shares the instances of the next longer bucket
   (when that one is busy and worth more), so a trickle of short prompts holds no instance.
2. **Load cap**: an instance whose recent work is above ``load_cap`` times the mean of the
   candidates takes no new request while another candidate is under the cap, however much
   of the prompt it holds. Recent work is what this policy routed there (tokens to compute
   plus a fixed cost per request), decayed with ``load_half_life``. Without the cap,
   locality piles a hot tenant's new sessions onto the instance that holds its system prompt
   (agent trace of ``deepserve bench route``: busiest instance 1.8x the mean); with it, the
   tenant's next session goes to an instance under the cap, which then holds the prefix too,
   so a hot prefix ends up replicated on as many instances as its traffic needs.
3. **Cache locality, then load**, as one cost in tokens: the prompt tokens the instance would
   have to compute (prompt minus the longest leading run of the request's block hashes its
   heartbeat lists as resident in GPU memory) plus the tokens already queued on it, plus a
   price for being above the mean: ``load_weight`` x prompt tokens x (recent work / mean - 1).
   A long resident prefix therefore beats a somewhat shorter queue, and with equal caches the
   shorter queue wins; when recent work is even the price is zero and locality decides alone.
   The price is relative to the request's size, so a session whose whole context is resident
   stays put (moving it would recompute it all) while a new session, whose cached part is the
   system prompt only, moves off an instance running hot. Costs are compared in whole blocks
   (128 tokens), so near-equal ones tie.
4. **Running requests**, then a tie-break.

Decode: KV memory in use (in 1/32 steps of the total), then running requests, then the
tie-break.

Load figures are up to one heartbeat (1 s) old. Picking the least loaded instance on such
numbers alone would send a whole burst to the same one, so the policy also counts what it
itself routed to each instance since that instance's last heartbeat (requests and prompt
tokens) and adds it to the heartbeat's figures. Ties are broken by a hash of (request id,
instance id), never by a per-process counter: several balancer replicas that saw the same
heartbeats and the same requests make the same choices, and equal instances share a burst
evenly instead of piling onto the first in id order. Recent work, too, is what *this* replica
routed: replicas in one queue group each balance their own share of the requests (a replica
that answered one request more differs until that work decays).

Per decision the policy does O(candidates x leading resident blocks) work, as before, plus
O(candidates) for the load figures (one decayed number per instance).

Every decision says why its instances won (``Decision.reason``, ``Decision.decode_reason``),
for the balancer's metrics; saying it changes no choice. Prefill: ``only_candidate`` (one
instance serves the request's bucket), ``load_cap`` (without the cap an instance above it
would have won), ``cache_hit`` (the winner holds the longest leading run of the prompt among
the candidates, longer than another's: a prefix set it apart), ``least_load`` (otherwise: equal
or no prefixes, or a shorter queue beat a longer prefix). Decode: ``only_candidate``,
``least_load``, or ``same_engine``: the chosen prefill instance is aggregated (it heartbeats
as a decode instance too, under the same id), so it decodes the request itself and its KV
never moves -- whatever the other decode instances' load.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from . import buckets as bk

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)
DIGEST_BYTES = 8  # resident-prefix summaries carry the first 8 bytes of each chain digest
KV_STEPS = 32  # decode KV use is compared in 1/32 of the instance's blocks
# A prefill's fixed cost, counted as tokens of work: ~20 ms of step overhead at ~20K tokens/s.
# Without it a stream of fully cached turns would count as no work at all.
REQUEST_WORK_TOKENS = 400
# Why an instance was chosen (see the module docstring).
ONLY_CANDIDATE = "only_candidate"
LOAD_CAP = "load_cap"
CACHE_HIT = "cache_hit"
LEAST_LOAD = "least_load"
SAME_ENGINE = "same_engine"  # decode: the chosen prefill instance is aggregated (both roles)
PREFILL_REASONS = (ONLY_CANDIDATE, LOAD_CAP, CACHE_HIT, LEAST_LOAD)
DECODE_REASONS = (ONLY_CANDIDATE, LEAST_LOAD, SAME_ENGINE)
ANY_BUCKET = "any"  # bucket label of prefill instances no assignment has placed yet


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
    queued_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    draining: bool = False
    resident: frozenset[bytes] = frozenset()  # first DIGEST_BYTES of resident block digests
    promised_kv_blocks: int = 0  # of the free blocks, what its requests will still grow into

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")

    def resident_run(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` this instance holds in GPU memory."""
        return resident_run(self.resident, block_hashes)


def resident_run(resident: frozenset[bytes], block_hashes: Sequence[bytes]) -> int:
    """Leading blocks of ``block_hashes`` whose digests a resident summary lists."""
    n = 0
    for h in block_hashes:
        if h[:DIGEST_BYTES] not in resident:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Decision:
    prefill: Instance
    decode: Instance
    bucket: int = 0
    resident_blocks: int = 0  # leading blocks resident on the chosen prefill instance
    reason: str = LEAST_LOAD  # why the prefill instance won (PREFILL_REASONS)
    decode_reason: str = LEAST_LOAD  # why the decode instance won (DECODE_REASONS)


@dataclass(frozen=True)
class BucketLoad:
    """Live prefill instances serving one bucket and the work on them: the heartbeat's
    figures plus what this policy routed there since that heartbeat."""

    instances: int = 0
    queued_tokens: int = 0
    requests: int = 0  # running + waiting + routed since the heartbeat


@dataclass
class _Work:
    """Work routed to one instance, decayed exponentially (value as of ``at``)."""

    value: float = 0.0
    at: float = 0.0

    def now(self, now: float, half_life: float) -> float:
        return self.value * math.exp2(-max(now - self.at, 0.0) / half_life)

    def add(self, tokens: float, now: float, half_life: float) -> None:
        self.value, self.at = self.now(now, half_life) + tokens, now


@dataclass
class _Entry:
    instance: Instance
    last_seen: float
    sent_requests: int = 0  # routed here by this policy since the last heartbeat
    sent_tokens: int = 0


def tie_break(request_id: str, instance_id: str) -> bytes:
    """Deterministic per (request, instance), the same in every process (no ``hash()``)."""
    return hashlib.blake2b(f"{request_id}\x00{instance_id}".encode(), digest_size=8).digest()


@dataclass
class RoutingPolicy:
    """Table of instances known from heartbeats, and the choice over it.

    ``clock`` returns seconds (monotonic); tests inject a fake one. An instance whose last
    heartbeat is more than ``heartbeat_timeout`` seconds old is dead: never chosen, and
    forgotten by :meth:`prune`. ``bucket_bounds`` split prompt lengths into buckets; the
    assignment of prefill instances to buckets is re-evaluated every ``rebalance_interval``
    seconds from demand decayed with ``demand_half_life``. ``load_cap`` (>= 1; ``inf``: off)
    and ``load_weight`` (>= 0; 0: off) trade prefix hits for even load, on work routed in the
    last ``load_half_life`` seconds or so (see the module docstring); the defaults hold the
    agent trace of ``deepserve bench route`` to max/mean busy time <= 1.15 at 0.97 of the
    locality-only oracle's hit rate.
    """

    heartbeat_timeout: float = 3.0
    clock: Callable[[], float] = time.monotonic
    bucket_bounds: tuple[int, ...] = bk.DEFAULT_BOUNDS
    block_size: int = 128
    rebalance_interval: float = 10.0
    demand_half_life: float = 60.0
    load_cap: float = 1.15
    load_weight: float = 2.0
    load_half_life: float = 30.0
    _work: dict[str, _Work] = field(default_factory=dict, init=False)
    _table: dict[tuple[str, str], _Entry] = field(default_factory=dict, init=False)
    _demand: dict[str, bk.Demand] = field(default_factory=dict, init=False)
    _assigned: dict[str, tuple[float, tuple[str, ...], dict[str, int]]] = field(
        default_factory=dict, init=False
    )

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout}")
        bk.check_bounds(self.bucket_bounds)
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.rebalance_interval > 0 or not self.demand_half_life > 0:
            raise ValueError("rebalance_interval and demand_half_life must be > 0 seconds")
        if not self.load_cap >= 1.0:
            raise ValueError(f"load_cap must be >= 1 (x the mean; inf: off), got {self.load_cap}")
        if not self.load_weight >= 0.0:
            raise ValueError(f"load_weight must be >= 0 (0: off), got {self.load_weight}")
        if not self.load_half_life > 0:
            raise ValueError(f"load_half_life must be > 0 seconds, got {self.load_half_life}")

    # -- heartbeats -------------------------------------------------------------------------
    def observe(self, instance: Instance) -> None:
        """Record a heartbeat, received now (it supersedes what was routed there before it)."""
        self._table[(instance.role, instance.instance_id)] = _Entry(instance, self.clock())

    def prune(self) -> list[Instance]:
        """Forget dead instances; returns them (for logging)."""
        now = self.clock()
        dead = [k for k, e in self._table.items() if now - e.last_seen > self.heartbeat_timeout]
        for role, iid in dead:
            if role == PREFILL:
                self._work.pop(iid, None)
        return [self._table.pop(k).instance for k in dead]

    def is_live(self, role: str, instance_id: str) -> bool:
        entry = self._table.get((role, instance_id))
        return entry is not None and self.clock() - entry.last_seen <= self.heartbeat_timeout

    def live(self, role: str | None = None) -> list[Instance]:
        """Instances whose last heartbeat is recent enough (draining ones included)."""
        return [e.instance for e in self._live_entries(role)]

    def _live_entries(self, role: str | None) -> list[_Entry]:
        now = self.clock()
        return [
            e
            for (r, _), e in sorted(self._table.items())
            if (role is None or r == role) and now - e.last_seen <= self.heartbeat_timeout
        ]

    # -- buckets ----------------------------------------------------------------------------
    def assignment(self, model: str = "") -> dict[str, int]:
        """Bucket index of each live prefill instance of ``model`` (absent: any bucket)."""
        now = self.clock()
        ids = tuple(
            e.instance.instance_id
            for e in self._live_entries(PREFILL)
            if _serves(e.instance, model)
        )
        cached = self._assigned.get(model)
        if cached is not None and cached[1] == ids and now - cached[0] < self.rebalance_interval:
            return cached[2]
        demand = self._demand_of(model).snapshot(now)
        out = bk.assign(ids, demand)
        self._assigned[model] = (now, ids, out)
        return out

    def _demand_of(self, model: str) -> bk.Demand:
        d = self._demand.get(model)
        if d is None:
            d = self._demand[model] = bk.Demand(len(self.bucket_bounds) + 1, self.demand_half_life)
        return d

    # -- routing ----------------------------------------------------------------------------
    def route(
        self,
        model: str = "",
        exclude: Iterable[str] = (),
        *,
        request_id: str = "",
        prompt_tokens: int = 0,
        block_hashes: Sequence[bytes] = (),
    ) -> Decision:
        """One prefill and one decode instance for a request of ``model`` ("" = any model).

        Raises :class:`NoInstance` with the reason when either role has no candidate; a
        failed decision changes no state.
        """
        excluded = frozenset(exclude)
        bucket = bk.bucket_of(prompt_tokens, self.bucket_bounds)
        pre = self._candidates(PREFILL, model, excluded)
        dec = self._candidates(DECODE, model, excluded)
        if not pre:
            raise NoInstance(self._why_none(PREFILL, model, excluded))
        if not dec:
            raise NoInstance(self._why_none(DECODE, model, excluded))
        self._demand_of(model).add(bucket, prompt_tokens, self.clock())
        p, reason = self._pick_prefill(
            self._of_bucket(pre, bucket, model), request_id, prompt_tokens, block_hashes
        )
        same = [e for e in dec if e.instance.instance_id == p.instance.instance_id]
        if same:  # an aggregated instance decodes what it prefilled: its KV never moves
            d, decode_reason = same[0], SAME_ENGINE
        else:
            d = min(dec, key=lambda e: self._decode_key(e, request_id))
            decode_reason = ONLY_CANDIDATE if len(dec) == 1 else LEAST_LOAD
        resident = p.instance.resident_run(block_hashes)
        to_compute = max(prompt_tokens - resident * self.block_size, 0)
        p.sent_requests += 1
        p.sent_tokens += to_compute
        d.sent_requests += 1
        work = self._work.setdefault(p.instance.instance_id, _Work())
        work.add(to_compute + REQUEST_WORK_TOKENS, self.clock(), self.load_half_life)
        return Decision(p.instance, d.instance, bucket, resident, reason, decode_reason)

    def _of_bucket(self, pre: list[_Entry], bucket: int, model: str) -> list[_Entry]:
        """Instances of ``bucket``, else of the nearest longer bucket that has any, else all."""
        assigned = self.assignment(model)
        for b in range(bucket, len(self.bucket_bounds) + 1):
            mine = [e for e in pre if assigned.get(e.instance.instance_id) == b]
            if mine:
                return mine
        return pre

    def _pick_prefill(
        self, cands: list[_Entry], request_id: str, prompt_tokens: int, hashes: Sequence[bytes]
    ) -> tuple[_Entry, str]:
        """The winner and why it won (the reason is read off the same keys and prefixes; it
        never changes the choice)."""
        now = self.clock()
        recent = {e.instance.instance_id: self._recent(e.instance.instance_id, now) for e in cands}
        mean = sum(recent.values()) / len(cands)
        pool = cands
        if mean > 0:
            under = [e for e in cands if recent[e.instance.instance_id] <= self.load_cap * mean]
            pool = under or cands  # never empty: the least loaded is at most the mean

        runs = {id(e): e.instance.resident_run(hashes) for e in cands}  # once per candidate
        keys = {
            id(e): self._prefill_key(
                e,
                request_id,
                prompt_tokens,
                runs[id(e)],
                recent[e.instance.instance_id] / mean - 1.0 if mean > 0 else 0.0,
            )
            for e in cands
        }
        best = min(pool, key=lambda e: keys[id(e)])
        if len(cands) == 1:
            return best, ONLY_CANDIDATE
        if len(pool) < len(cands) and min(cands, key=lambda e: keys[id(e)]) is not best:
            return best, LOAD_CAP
        pool_runs = [runs[id(e)] for e in pool]
        if runs[id(best)] == max(pool_runs) > min(pool_runs):
            return best, CACHE_HIT
        return best, LEAST_LOAD

    def _recent(self, instance_id: str, now: float) -> float:
        w = self._work.get(instance_id)
        return w.now(now, self.load_half_life) if w is not None else 0.0

    def _prefill_key(
        self,
        e: _Entry,
        request_id: str,
        prompt_tokens: int,
        resident_blocks: int,
        over_mean: float,
    ) -> tuple[int, int, bytes]:
        inst = e.instance
        to_compute = max(prompt_tokens - resident_blocks * self.block_size, 0)
        price = self.load_weight * prompt_tokens * max(over_mean, 0.0)
        cost = to_compute + inst.queued_tokens + e.sent_tokens + int(price)
        return (
            cost // self.block_size,
            inst.running + inst.waiting + e.sent_requests,
            tie_break(request_id, inst.instance_id),
        )

    def _decode_key(self, e: _Entry, request_id: str) -> tuple[int, int, bytes]:
        inst = e.instance
        total = max(inst.total_kv_blocks, 1)
        free = inst.free_kv_blocks - inst.promised_kv_blocks  # what no request has a claim on
        used = min(max(total - free, 0), total) if inst.total_kv_blocks else 0
        return (
            used * KV_STEPS // total,
            inst.running + inst.waiting + e.sent_requests,
            tie_break(request_id, inst.instance_id),
        )

    def _candidates(self, role: str, model: str, excluded: frozenset[str]) -> list[_Entry]:
        out = []
        for e in self._live_entries(role):
            inst = e.instance
            if inst.draining or inst.instance_id in excluded or not _serves(inst, model):
                continue
            if role == DECODE and not inst.address:
                continue  # prefill could not push the KV anywhere
            out.append(e)
        return out

    def placed_buckets(self) -> dict[str, str]:
        """The bucket name of each live prefill instance (``ANY_BUCKET``: no assignment has
        placed it yet). Reads the assignments routing made last and computes none, so asking
        (a scrape) never moves a rebalance."""
        placed: dict[str, int] = {}
        for model in sorted(self._assigned):
            for iid, index in self._assigned[model][2].items():
                placed.setdefault(iid, index)
        names = bk.bucket_names(self.bucket_bounds)
        return {
            e.instance.instance_id: ANY_BUCKET
            if (b := placed.get(e.instance.instance_id)) is None
            else names[b]
            for e in self._live_entries(PREFILL)
        }

    def bucket_load(self) -> dict[str, BucketLoad]:
        """Per bucket name (``ANY_BUCKET``: live prefill instances no assignment has placed
        yet), its live prefill instances and the work on them (:meth:`placed_buckets`)."""
        placed = self.placed_buckets()
        names = bk.bucket_names(self.bucket_bounds)
        out = {name: BucketLoad() for name in [*names, ANY_BUCKET]}
        for e in self._live_entries(PREFILL):
            name = placed[e.instance.instance_id]
            cur, inst = out[name], e.instance
            out[name] = BucketLoad(
                cur.instances + 1,
                cur.queued_tokens + inst.queued_tokens + e.sent_tokens,
                cur.requests + inst.running + inst.waiting + e.sent_requests,
            )
        return out

    def _why_none(self, role: str, model: str, excluded: frozenset[str]) -> str:
        live = [i for i in self.live(role) if _serves(i, model)]
        draining = sum(i.draining for i in live)
        skipped = sum(i.instance_id in excluded for i in live)
        what = f"{role} instance" + (f" for model {model!r}" if model else "")
        detail = f"{len(live)} live, {draining} draining, {skipped} excluded"
        return f"no live {what} ({detail}); retry once one is up"


def _serves(inst: Instance, model: str) -> bool:
    return not model or not inst.model or inst.model == model
