"""What an engine reports about its load (heartbeats, metrics): the :class:`EngineStats`
snapshot the engine thread takes after each iteration, and the measures it is made of.

``queued_tokens`` is what the engine will compute for its waiting requests -- a request's
leading blocks already resident in this engine's prefix cache are not counted
(:class:`WaitingWork` looks them up once per request, not per snapshot);
``promised_kv_blocks`` and ``held_requests`` are what the held requests will still take of
the free KV blocks and which requests those are (:class:`HeldRequests`); ``tokens_per_s`` is
the measured marginal compute rate (:class:`ComputeRate`); ``busy_fraction`` the share of the
last :data:`BUSY_WINDOW_S` seconds the engine spent stepping (:class:`BusyMeter`). Everything
here runs on the engine thread except reading a finished snapshot.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from libs.common.request_key import request_key
from libs.engine.engine import Engine
from libs.engine.ep.eplb import Balance
from libs.engine.speculative import SpecStats


@dataclass(frozen=True)
class EngineStats:
    """Load of the engine after its latest iteration (what heartbeats report)."""

    running: int = 0
    waiting: int = 0
    # Tokens the engine will compute for its waiting requests: prompt/recompute tokens not
    # computed yet, less each one's leading blocks resident in this engine's prefix cache. The
    # rest of a running request's chunked prompt is left out: with it counted, an H100 run held
    # the door far longer (agent 32: 16 requests waited 7.0 s at admission; agent 256: 80 of
    # 635 refused) under the prefill queue limit (2 s of work), which was sized without it.
    queued_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    steps: int = 0
    # First RESIDENT_DIGEST_BYTES of chain digests resident in GPU memory, most recent first
    # (running requests' blocks, then recently released cached ones); at most RESIDENT_SUMMARY.
    resident_prefixes: tuple[bytes, ...] = ()
    # What one more prompt token costs here, as tokens per second: the inverse slope of step
    # time over step tokens of the recent steps (ComputeRate; 0 until a step of
    # >= RATE_MIN_TOKENS ran).
    tokens_per_s: float = 0.0
    # With EP and EPLB: the experts' balance over the ranks (Engine.ep_balance; the engine
    # recomputes it once per count sync, every 25 steps by default). None: no EPLB here.
    ep_balance: Balance | None = None
    # Since start (the engine's own counters): requests preempted, and prompt tokens looked up
    # in / found in this engine's prefix cache (Engine.prefix_cache_queries / _hits).
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding (libs/engine/speculative.py SpecStats), since start: requests whose
    # drafts a step verified (one per request and step), drafts made, verified, accepted.
    spec_verifications: int = 0
    spec_drafted: int = 0
    spec_verified: int = 0
    spec_accepted: int = 0
    # Fraction of the last BUSY_WINDOW_S seconds of wall time the engine spent stepping, as of
    # when this object was read from EngineLoop.stats (0..1).
    busy_fraction: float = 0.0
    # KV blocks the held requests (waiting and running) will still take from free_kv_blocks as
    # they grow to prompt + max_tokens, and request_key() of each of them (HeldRequests).
    promised_kv_blocks: int = 0
    held_requests: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks not free (held by requests; cached free ones count as
        free, they are reused on demand): vLLM's ``kv_cache_usage_perc``, in [0, 1]."""
        if not self.total_kv_blocks:
            return 0.0
        return (self.total_kv_blocks - self.free_kv_blocks) / self.total_kv_blocks


RATE_MIN_TOKENS = 256
RATE_STEPS = 64  # steps behind the measured rate
RATE_MAX_OVER_AVERAGE = 20.0  # the marginal rate is held within this many times the average
RESIDENT_SUMMARY = 8192  # digests per heartbeat: 64 KiB, i.e. 1M prompt tokens of prefixes
RESIDENT_REFRESH_S = 0.5  # the summary is rebuilt at most this often (heartbeats: every 1 s)
RESIDENT_DIGEST_BYTES = 8
# The busy fraction's window: one heartbeat interval, so each heartbeat says how busy the
# engine was since the one before -- a longer mean lags a burst (after an idle spell a 5 s mean
# read ~0.5 while the engine had been stepping without a pause for a second or two).
BUSY_WINDOW_S = 1.0


class WaitingWork:
    """Tokens an engine will compute for its waiting requests (engine thread only).

    A waiting request that has not started computes its prompt less the leading full blocks
    its prefix-cache lookup will find (:meth:`Scheduler._admit_prefix
    <libs.engine.scheduler.Scheduler._admit_prefix>` does the same lookup on admission). The
    lookup runs once per request, when it is first seen waiting, and is remembered until it
    leaves the waiting queue, so a snapshot costs O(waiting) dictionary reads. The figure can
    be off in two ways, both bounded by one stay in the queue: blocks evicted after the lookup
    (counted as resident) and blocks another request computed after it (counted as work).
    A request preempted back into the queue is looked up afresh.
    """

    def __init__(self) -> None:
        self._resident: dict[str, int] = {}  # request id -> resident prompt tokens

    def tokens(self, engine: Engine) -> int:
        bm = engine.blocks
        total, seen = 0, {}
        for r in engine.scheduler.waiting:
            if r.num_computed or r.blocks:  # holds KV already: it continues from there
                total += len(r.token_ids) - r.num_computed
                continue
            resident = self._resident.get(r.request_id)
            if resident is None:
                hashes = r.full_block_hashes(bm.block_size, len(r.token_ids) - 1)
                resident = len(bm.match_prefix(hashes)) * bm.block_size
            seen[r.request_id] = resident
            total += len(r.token_ids) - resident
        self._resident = seen  # those that left the queue are forgotten
        return total


class HeldRequests:
    """What the requests an engine holds still claim (engine thread only).

    Each waiting or running request will grow to ``min(prompt + max_tokens, max_model_len)``
    tokens; the blocks that takes beyond those it holds now are *promised* -- free in
    ``free_kv_blocks`` but not free for a new request. A waiting request that holds no block
    yet is promised all of its blocks, its prefix-cache hits included (they may sit among the
    free cached blocks; the few that another request holds are counted twice, erring towards
    waiting). The keys (:func:`~libs.common.request_key.request_key`) tell the entrypoint
    which of the requests it sent these figures already count; they are remembered per
    request id, so a snapshot costs O(held) dictionary reads.
    """

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}

    def of(self, engine: Engine) -> tuple[int, tuple[int, ...]]:
        """(promised KV blocks, keys of the held requests)."""
        sched = engine.scheduler
        size, limit = engine.blocks.block_size, sched.config.max_model_len
        promised, keys, seen = 0, [], {}
        for r in itertools.chain(sched.waiting, sched.running):
            key = self._keys.get(r.request_id)
            if key is None:
                key = request_key(r.request_id)
            seen[r.request_id] = key
            keys.append(key)
            final = min(r.num_prompt_tokens + r.params.max_tokens, limit)
            promised += max(-(-final // size) - len(r.blocks), 0)
        self._keys = seen  # those that left are forgotten
        return promised, tuple(keys)


class ComputeRate:
    """What one more token costs this engine: the slope of step time over step tokens.

    A step's time is a fixed part (launches, host work, the weights read once) plus a part
    that grows with its tokens; queued prompt tokens add only the second, since the engine
    steps anyway for the requests it runs. With the last :data:`RATE_STEPS` steps spread
    over token counts (the largest at least twice the smallest and :data:`RATE_MIN_TOKENS`
    above it), the rate is the inverse least-squares slope, kept between the plain average
    (tokens / seconds of the steps of >= ``RATE_MIN_TOKENS`` tokens) and
    :data:`RATE_MAX_OVER_AVERAGE` times it; without that spread, the average itself (0 until
    such a step ran). Engine thread only."""

    def __init__(self, steps: int = 64) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=steps)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._steps.append((tokens, seconds))

    def tokens_per_s(self) -> float:
        big = [(n, s) for n, s in self._steps if n >= RATE_MIN_TOKENS]
        if not big:
            return 0.0
        average = sum(n for n, _ in big) / sum(s for _, s in big)
        ns = [n for n, _ in self._steps]
        if len(ns) < 8 or max(ns) < 2 * min(ns) or max(ns) - min(ns) < RATE_MIN_TOKENS:
            return average
        mean_n = sum(ns) / len(ns)
        mean_s = sum(s for _, s in self._steps) / len(ns)
        var = sum((n - mean_n) ** 2 for n in ns)
        cov = sum((n - mean_n) * (s - mean_s) for n, s in self._steps)
        if cov <= 0:  # time does not grow with tokens here: noise; the average holds
            return average
        return min(max(var / cov, average), RATE_MAX_OVER_AVERAGE * average)


class BusyMeter:
    """Fraction of wall time spent stepping over the last ``window`` seconds (since start,
    while younger), a step in progress counted up to now. :meth:`begin` / :meth:`end` on the
    engine thread, :meth:`fraction` from any thread."""

    def __init__(
        self, window: float = BUSY_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window, self.clock = window, clock
        self._lock = threading.Lock()
        self._spans: deque[tuple[float, float]] = deque()  # finished steps (start, end)
        self._sum = 0.0  # their total length
        self._since: float | None = None  # the step in progress began then
        self._started = clock()

    def begin(self) -> None:
        with self._lock:
            self._since = self.clock()

    def end(self, count: bool = True) -> None:
        """The step begun ended (``count`` False: it was no step after all, e.g. an idle
        EP poll)."""
        with self._lock:
            since, self._since = self._since, None
            if since is None or not count:
                return
            now = self.clock()
            self._spans.append((since, now))
            self._sum += now - since
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._spans and self._spans[0][1] <= now - self.window:
            start, end = self._spans.popleft()
            self._sum -= end - start

    def fraction(self) -> float:
        with self._lock:
            now = self.clock()
            low = now - self.window
            self._trim(now)
            busy = self._sum
            if self._spans:
                busy -= max(0.0, low - self._spans[0][0])  # its part before the window
            if self._since is not None:
                busy += now - max(self._since, low)
            span = min(self.window, now - self._started)
            return 0.0 if span <= 0 else min(1.0, max(0.0, busy / span))


def resident_summary(engine: Engine, limit: int = RESIDENT_SUMMARY) -> tuple[bytes, ...]:
    """Bounded summary of the prefixes this engine holds (cost O(limit), any pool size)."""
    out: dict[bytes, None] = {}
    for r in engine.scheduler.running:
        for h in r.block_hashes[: r.num_registered]:
            if len(out) >= limit:
                break
            out[h[:RESIDENT_DIGEST_BYTES]] = None
    for h in engine.blocks.recent_names(limit - len(out)) if len(out) < limit else ():
        out[h[:RESIDENT_DIGEST_BYTES]] = None
    return tuple(out)


def engine_stats(
    engine: Engine,
    steps: int = 0,
    tokens_per_s: float = 0.0,
    resident: tuple[bytes, ...] | None = None,
    work: WaitingWork | None = None,
    held: HeldRequests | None = None,
) -> EngineStats:
    """Snapshot of ``engine``'s load; call on the engine thread only. ``work`` and ``held``:
    the loop's memory of waiting requests' resident prefixes and of request keys (None:
    looked up now)."""
    sched = engine.scheduler
    queued = (work or WaitingWork()).tokens(engine)
    promised, keys = (held or HeldRequests()).of(engine)
    spec = engine.speculative.stats if engine.speculative is not None else SpecStats()
    return EngineStats(
        len(sched.running),
        len(sched.waiting),
        queued,
        engine.blocks.num_free,
        engine.blocks.num_blocks,
        steps,
        resident_summary(engine) if resident is None else resident,
        tokens_per_s,
        engine.ep_balance(),
        sched.num_preemptions,
        engine.prefix_cache_queries,
        engine.prefix_cache_hits,
        spec.verifications,
        spec.drafted,
        spec.verified,
        spec.accepted,
        promised_kv_blocks=promised,
        held_requests=keys,
    )
