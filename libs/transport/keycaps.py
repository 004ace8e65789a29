"""Per-API-key limits held in Redis, so every recipe replica and entrypoint enforces one cap.

The rules are :mod:`libs.gateway.keylimits`' (concurrency counts generations, a token bucket
per key, refusals worded the same); here they run on shared state, each step one Lua script
(atomic on the Redis server, so two replicas never both take the last slot):

* ``{prefix}:cap:{<key id>}:slots`` -- sorted set, slot id -> expiry (ms, Redis's clock), and
  ``{prefix}:cap:{<key id>}:gens`` -- hash, slot id -> generations, ``#`` -> their sum. A slot
  **expires** ``slot_ttl_s`` after it was taken or last renewed; its holder renews every slot
  it holds each ``slot_ttl_s / 3`` (:meth:`KeyCaps.renew_forever`), so a replica that dies
  (kill -9, a lost host) leaks its slots for at most ``slot_ttl_s``: the next script that
  touches the key drops them.
* ``{prefix}:rate:{<key id>}`` -- hash ``level``/``at``: the token bucket, refilled by Redis's
  clock; it expires once it would be full again (an absent bucket is a full one).

The ``{...}`` hash tags keep a key id's keys in one Redis Cluster slot.

**Redis unreachable.** Admission must not turn a Redis outage into an API outage: a request
that cannot reach Redis at :meth:`KeyCaps.enter` is admitted by this process's own
:class:`~libs.gateway.keylimits.KeyLimiter` (the per-replica limits; counted in
``deepserve_keycaps_redis_errors_total``, logged at most every 30 s); a later step of a shared
slot that fails lets the request go on (its slot expires by itself).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from redis.exceptions import RedisError

from libs.common.config import flag
from libs.gateway.keylimits import (
    KeyLimit,
    KeyLimiter,
    KeyLimitPolicy,
    Refusal,
    Slot,
    at_cap,
    key_id,
    n_above_cap,
    no_room,
    parse_key_limits,
    rate_reached,
)

REDIS_ERRORS = Counter(
    "deepserve_keycaps_redis_errors_total",
    "per-key limit steps that could not reach Redis (admitted on this process's own limits)",
    ["step"],
)
SLOT_TTL_S = 30.0  # a dead replica's slots are back this long after its last renewal
_WARN_EVERY_S = 30.0

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: slots (zset), gens (hash). ARGV: slot id, generations, cap, ttl ms.
# -> {1, others} taken (others: generations of the key's other slots), {0, others} refused.
_ACQUIRE = (
    _NOW
    + """
local total = tonumber(redis.call('HGET', KEYS[2], '#') or '0')
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, s in ipairs(gone) do
  total = total - tonumber(redis.call('HGET', KEYS[2], s) or '0')
  redis.call('HDEL', KEYS[2], s)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if total < 0 then total = 0 end
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local want = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local others = total - held
if cap > 0 and others + want > cap then
  redis.call('HSET', KEYS[2], '#', total)
  return {0, others}
end
redis.call('HSET', KEYS[2], ARGV[1], want, '#', others + want)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
redis.call('PEXPIRE', KEYS[2], 2 * ttl)
return {1, others}
"""
)

# KEYS: slots, gens. ARGV: slot id.
_RELEASE = """
local g = redis.call('HGET', KEYS[2], ARGV[1])
if g then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[2], '#', -tonumber(g))
end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""

# KEYS: slots, gens. ARGV: ttl ms, slot ids... -> how many were still held (an expired one is
# not revived: its generations were already given back).
_RENEW = (
    _NOW
    + """
local ttl = tonumber(ARGV[1])
local kept = 0
for i = 2, #ARGV do
  kept = kept + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + ttl, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
redis.call('PEXPIRE', KEYS[2], 2 * ttl)
return kept
"""
)

# KEYS: bucket. ARGV: rate (tokens/min), tokens, 'take' | 'give'.
# take -> {1, 0} reserved (the level may go below 0), {0, wait ms} refused; give -> {1, 0}.
_BUCKET = (
    _NOW
    + """
local rate = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local level = tonumber(redis.call('HGET', KEYS[1], 'level') or rate)
local at = tonumber(redis.call('HGET', KEYS[1], 'at') or now)
level = math.min(rate, level + math.max(0, now - at) * rate / 60000)
local out = {1, 0}
if ARGV[3] == 'take' then
  local need = math.min(n, rate)
  if level < need then
    out = {0, math.ceil((need - level) * 60000 / rate)}
  else
    level = level - n
  end
else
  level = math.min(rate, level + n)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil((rate - level) * 60000 / rate) + 1000)
return out
"""
)


class KeyCaps:
    """Per-key admission for one process (the async form of
    :class:`~libs.gateway.keylimits.KeyLimiter`'s contract): :meth:`enter` before the request
    is read, :meth:`widen` and :meth:`reserve` once its ``n`` and size are known, :meth:`leave`
    once it ended (idempotent). ``redis``: a ``redis.asyncio`` client whose state every
    replica shares, or None for this process's own state."""

    def __init__(
        self,
        policy: KeyLimitPolicy,
        redis: Any | None = None,
        *,
        prefix: str = "ds",
        slot_ttl_s: float = SLOT_TTL_S,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not slot_ttl_s > 0:
            raise ValueError(f"slot_ttl_s must be > 0 seconds, got {slot_ttl_s}")
        self.policy, self.redis, self.prefix = policy, redis, prefix
        self.ttl_ms = int(slot_ttl_s * 1000)
        self.local = KeyLimiter(policy, clock)
        self.log = log or logging.getLogger("keycaps")
        self.held: dict[str, Slot] = {}  # shared slots this process holds (renewed)
        self._warned_at = float("-inf")
        if redis is not None:
            self._acquire = redis.register_script(_ACQUIRE)
            self._release = redis.register_script(_RELEASE)
            self._renew = redis.register_script(_RENEW)
            self._bucket = redis.register_script(_BUCKET)

    @property
    def shared(self) -> bool:
        return self.redis is not None

    def _keys(self, kid: str) -> list[str]:
        return [f"{self.prefix}:cap:{{{kid}}}:slots", f"{self.prefix}:cap:{{{kid}}}:gens"]

    def _failed(self, step: str, exc: Exception) -> None:
        REDIS_ERRORS.labels(step).inc()
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            self.log.warning(
                "per-key limits: Redis unreachable at %s (%s); this process's own limits apply",
                step,
                exc,
            )

    async def enter(self, kid: str) -> Slot | Refusal:
        """One generation of ``kid``'s concurrency, or the refusal at its cap."""
        if self.redis is None:
            return self.local.enter(kid)
        cap = self.policy.of(kid).concurrency
        slot = Slot(kid, shared=True)
        try:
            ok, others = await self._acquire(
                keys=self._keys(kid), args=[slot.slot_id, 1, cap, self.ttl_ms]
            )
        except RedisError as exc:
            self._failed("enter", exc)
            return self.local.enter(kid)
        if not ok:
            return at_cap(cap)
        self.held[slot.slot_id] = slot
        return slot

    async def widen(self, slot: Slot, generations: int) -> Refusal | None:
        """``slot`` holds ``generations`` (its request's ``n``) from now on, or the refusal;
        a refusal leaves it holding what it held."""
        if not slot.shared:
            return self.local.widen(slot, generations)
        if generations <= slot.generations or not slot.open:
            return None
        cap = self.policy.of(slot.kid).concurrency
        if cap and generations > cap:
            return n_above_cap(cap, generations)
        try:
            ok, others = await self._acquire(
                keys=self._keys(slot.kid), args=[slot.slot_id, generations, cap, self.ttl_ms]
            )
        except RedisError as exc:
            self._failed("widen", exc)
            return None
        if not ok:
            return no_room(
                cap, int(others) + slot.generations, generations - slot.generations, generations
            )
        slot.generations = generations
        return None

    async def reserve(self, slot: Slot, tokens: int) -> Refusal | None:
        """Reserve ``tokens`` under the key's token rate, or the refusal (nothing reserved)."""
        if not slot.shared:
            return self.local.reserve(slot, tokens)
        rate = self.policy.of(slot.kid).tokens_per_min
        if not rate or not slot.open:
            return None
        try:
            ok, wait_ms = await self._bucket(
                keys=[f"{self.prefix}:rate:{{{slot.kid}}}"], args=[rate, tokens, "take"]
            )
        except RedisError as exc:
            self._failed("reserve", exc)
            return None
        if not ok:
            return rate_reached(rate, tokens, int(wait_ms) / 1000)
        slot.reserved += tokens
        return None

    async def leave(self, slot: Slot, used: int | None = None) -> None:
        """The request ended; ``used``: what it cost (prompt + completion), None when unknown
        (its reservation stays charged). Only the first call counts."""
        if not slot.shared:
            self.local.leave(slot, used)
            return
        if not slot.open:
            return
        slot.open = False
        self.held.pop(slot.slot_id, None)
        rate = self.policy.of(slot.kid).tokens_per_min
        try:
            await self._release(keys=self._keys(slot.kid), args=[slot.slot_id])
            if rate and slot.reserved and used is not None and used != slot.reserved:
                await self._bucket(
                    keys=[f"{self.prefix}:rate:{{{slot.kid}}}"],
                    args=[rate, slot.reserved - used, "give"],
                )
        except RedisError as exc:
            self._failed("leave", exc)  # the slot expires by itself

    async def renew(self) -> int:
        """Push back the expiry of every slot this process holds; how many were still held."""
        by_kid: dict[str, list[str]] = {}
        for slot in list(self.held.values()):
            by_kid.setdefault(slot.kid, []).append(slot.slot_id)
        kept = 0
        for kid, ids in by_kid.items():
            try:
                kept += int(await self._renew(keys=self._keys(kid), args=[self.ttl_ms, *ids]))
            except RedisError as exc:
                self._failed("renew", exc)
        return kept

    async def renew_forever(self, stop: asyncio.Event) -> None:
        """Renew every ``slot_ttl_s / 3`` until ``stop`` is set (a background task)."""
        if self.redis is None:
            return
        every = self.ttl_ms / 3000
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            if not stop.is_set():
                await self.renew()


@dataclass(frozen=True)
class SharedState:
    """Where the per-key limits live: ``redis_url`` ("" -- this process's own state, so R
    replicas allow R times a key's limits) and how long a slot outlives its last renewal."""

    redis_url: str = ""
    slot_ttl_s: float = SLOT_TTL_S

    def __post_init__(self) -> None:
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "--redis-url must be a redis://, rediss:// or unix:// URL, got "
                f"{self.redis_url.split('@')[-1]!r}"
            )
        if not self.slot_ttl_s >= 3:
            raise ValueError(
                f"--key-slot-ttl must be >= 3 seconds (renewed every third of it), got "
                f"{self.slot_ttl_s}"
            )


def add_key_limit_flags(p: argparse.ArgumentParser) -> None:
    """The per-key limit flags (the recipe's and the entrypoint's: one meaning in both)."""
    flag(
        p,
        "--key-max-concurrency",
        type=int,
        default=500,
        help="generations in flight at once per API key (a request with n counts n), then 429 "
        "(0: no cap; with API keys only)",
    )
    flag(
        p,
        "--key-tokens-per-min",
        type=int,
        default=0,
        help="token rate per API key: prompt + max_tokens reserved at admission, the unused "
        "part given back at the end, then 429 (0: no limit)",
    )
    flag(
        p,
        "--key-limits",
        default="",
        help="per-key overrides, KEYID=CONCURRENCY[:TOKENS_PER_MIN],... where KEYID is the "
        "first 8 hex digits of the key's SHA-256 (never the key)",
    )
    flag(
        p,
        "--redis-url",
        default="",
        env="REDIS_URL",
        help="Redis holding the per-key limits that every recipe replica and entrypoint "
        "shares (and the entrypoint's usage ledger); '': this process's own state",
    )
    flag(
        p,
        "--key-slot-ttl",
        type=float,
        default=SLOT_TTL_S,
        help="seconds a concurrency slot of a process that died stays taken (live ones are "
        "renewed every third of it)",
    )


def key_limit_policy(args: argparse.Namespace, keys: Mapping[str, str]) -> KeyLimitPolicy:
    """The key limits of the flags; ValueError for a bad value or an override that names no
    configured key (a typo would otherwise leave that key at the default silently)."""
    try:
        default = KeyLimit(args.key_max_concurrency, args.key_tokens_per_min)
    except ValueError as exc:
        raise ValueError(f"--key-max-concurrency / --key-tokens-per-min: {exc}") from None
    policy = KeyLimitPolicy(default, parse_key_limits(args.key_limits))
    known = {key_id(k) for k in keys}
    unknown = sorted(set(policy.overrides) - known)
    if unknown:
        raise ValueError(
            f"--key-limits names key ids of no configured API key: {', '.join(unknown)}"
        )
    return policy


def shared_state_from(args: argparse.Namespace) -> SharedState:
    return SharedState(args.redis_url, args.key_slot_ttl)


def open_redis(url: str) -> Any:
    """A ``redis.asyncio`` client for ``url`` that gives up on a silent server within 1 s
    (admission falls back rather than hang)."""
    from redis.asyncio import Redis

    return Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
