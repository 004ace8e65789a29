"""Usage recorded at the entrypoint, in Redis, one record per request id -- the billing record.

The entrypoint is the one place every request passes (the recipe's HTTP requests, each of its
choices a call of its own, and gRPC ``Generate`` callers with an API key), and it knows what it
handed to the client: the tokens of every ``Tokens`` event it yields. So it records there:

* **open** -- when the request's ``Ready`` goes out (the prompt was admitted and prefill paid
  for; a request refused before it costs nothing and has no record): the hash
  ``{prefix}:{usage}:rec:<tenant digest>:<request id>`` gets tenant, key id, model, route,
  prompt and cached tokens, ``completion_tokens`` 0, ``status`` open, and the record joins the
  sorted set ``{prefix}:{usage}:open`` with a lease.
* **delivered** -- *before* each ``Tokens`` event is yielded, ``completion_tokens`` becomes the
  number of completion tokens the client will then have received (a write-ahead: a process
  killed between the write and the send bills at most that one event more, never less). The
  writes are group-committed: every request's token that arrives while one write is in flight
  goes in the next, one script call for all of them, and each waits for its own (a decode
  step's tokens for 128 streams are one Redis call, not 128).
* **close** -- when the call ends, however it ended: ``status`` (ok, error, cancelled...),
  ``finished_at``, the record leaves the open set and its name is appended to the stream
  ``{prefix}:{usage}:closed`` (what a billing exporter reads; the numbers are in the hash).

**Idempotent per request id.** A failover inside one call is one call (its tokens counted
once, as the client received them). A call with a request id already recorded -- a client's
retry after an entrypoint died -- is the same request: the prompt is kept from the first
call, ``completion_tokens`` is the largest any call delivered (``calls`` counts them), so it
is billed once. Replaying the stream bills nothing twice: the totals live in the hash.

**Nothing lost when a process dies.** Every delivered token is in Redis before it is sent.
The entrypoint renews its open records' leases every ``lease_s / 3``; a record whose lease
ran out (its entrypoint died) is closed by any entrypoint's sweep as ``interrupted`` with the
tokens it had delivered. Redis itself keeps them with its append-only file. While Redis
cannot be reached, requests go on; the final count is written by a retried close
(``deepserve_entrypoint_usage_writes_total{outcome}`` counts what failed).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import Counter
from redis.exceptions import RedisError

log = logging.getLogger("entrypoint")

WRITES = Counter(
    "deepserve_entrypoint_usage_writes_total",
    "usage ledger writes by step and outcome (ok, failed)",
    ["step", "outcome"],
)
LEASE_S = 30.0
RECORD_TTL_S = 7 * 86400  # a closed record's hash; the stream is the export
STREAM_MAXLEN = 1_000_000  # closed-record entries kept (approximately)
CLOSE_ATTEMPTS = 20  # one a second: a Redis restart is seconds
SWEEP_BATCH = 200

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: record, open set. ARGV: lease ms, then field, value pairs (the first call's).
_OPEN = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  local pairs = {}
  for i = 2, #ARGV do pairs[#pairs + 1] = ARGV[i] end
  redis.call('HSET', KEYS[1], unpack(pairs))
  redis.call('HSET', KEYS[1], 'completion_tokens', 0)
end
redis.call('HINCRBY', KEYS[1], 'calls', 1)
redis.call('HSET', KEYS[1], 'status', 'open')
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), KEYS[1])
return 1
"""
)

# KEYS: records. ARGV: each one's completion tokens delivered so far (only ever raises the
# count; a record that is gone -- expired -- is not brought back).
_DELIVERED = """
for i = 1, #KEYS do
  local c = redis.call('HGET', KEYS[i], 'completion_tokens')
  if c and tonumber(ARGV[i]) > tonumber(c) then
    redis.call('HSET', KEYS[i], 'completion_tokens', ARGV[i])
  end
end
return #KEYS
"""

# KEYS: record, open set, stream. ARGV: status, finished_at, completion tokens, ttl s, maxlen.
_CLOSE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local c = tonumber(redis.call('HGET', KEYS[1], 'completion_tokens') or '0')
if tonumber(ARGV[3]) > c then redis.call('HSET', KEYS[1], 'completion_tokens', ARGV[3]) end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[2])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'record', KEYS[1], 'status', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS: open set. ARGV: lease ms, records... (still open ones only).
_RENEW = (
    _NOW
    + """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[i])
end
return n
"""
)

# KEYS: open set, stream. ARGV: ttl s, maxlen, batch. -> records closed as interrupted.
_SWEEP = (
    _NOW
    + """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
for _, rec in ipairs(gone) do
  redis.call('ZREM', KEYS[1], rec)
  if redis.call('HGET', rec, 'status') == 'open' then
    redis.call('HSET', rec, 'status', 'interrupted', 'finished_at', tostring(now / 1000))
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'record', rec, 'status', 'interrupted')
    redis.call('EXPIRE', rec, ARGV[1])
  end
end
return #gone
"""
)


@dataclass(frozen=True)
class Opened:
    """What a record starts with (at the request's ``Ready``)."""

    request_id: str
    tenant: str
    key_id: str
    model: str
    route: str
    prompt_tokens: int
    cached_tokens: int


class Ledger(Protocol):
    async def open(self, rec: Opened) -> str:
        """Start (or join) the record of ``rec.request_id``; its name, for the other steps."""

    async def delivered(self, name: str, completion_tokens: int) -> None:
        """The client is about to hold ``completion_tokens`` completion tokens in all."""

    def close(self, name: str, status: str, completion_tokens: int) -> None:
        """The call ended (returns at once; written in the background, retried)."""


def _release(due: dict[str, tuple[int, list[asyncio.Future[None]]]]) -> None:
    for _, waiters in due.values():
        for w in waiters:
            if not w.done():
                w.set_result(None)


def record_name(prefix: str, tenant: str, request_id: str) -> str:
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:16]
    return f"{prefix}:{{usage}}:rec:{digest}:{request_id}"


class RedisLedger:
    """:class:`Ledger` on Redis (see the module doc). ``owner``: this entrypoint's id (kept in
    the record, for operators)."""

    def __init__(
        self, redis: Any, owner: str, *, prefix: str = "ds", lease_s: float = LEASE_S
    ) -> None:
        self.redis, self.owner, self.prefix = redis, owner, prefix
        self.lease_ms = int(lease_s * 1000)
        self.open_set = f"{prefix}:{{usage}}:open"
        self.stream = f"{prefix}:{{usage}}:closed"
        self.live: set[str] = set()  # records this process has open (renewed)
        self._open = redis.register_script(_OPEN)
        self._delivered = redis.register_script(_DELIVERED)
        self._close = redis.register_script(_CLOSE)
        self._renew = redis.register_script(_RENEW)
        self._sweep = redis.register_script(_SWEEP)
        self._tasks: set[asyncio.Task[None]] = set()
        # group commit of ``delivered``: record -> (count, its waiters), and the flusher
        self._due: dict[str, tuple[int, list[asyncio.Future[None]]]] = {}
        self._flusher: asyncio.Task[None] | None = None

    async def open(self, rec: Opened) -> str:
        name = record_name(self.prefix, rec.tenant, rec.request_id)
        fields: list[Any] = []
        for k, v in (
            ("request_id", rec.request_id),
            ("tenant", rec.tenant),
            ("key_id", rec.key_id),
            ("model", rec.model),
            ("route", rec.route),
            ("prompt_tokens", rec.prompt_tokens),
            ("cached_tokens", rec.cached_tokens),
            ("started_at", f"{time.time():.3f}"),
            ("owner", self.owner),
        ):
            fields += [k, v]
        self.live.add(name)
        opening = self._open(keys=[name, self.open_set], args=[self.lease_ms, *fields])
        await self._step("open", opening)
        return name

    async def delivered(self, name: str, completion_tokens: int) -> None:
        """Returns once a write holding at least ``completion_tokens`` for ``name`` is done
        (or failed: counted and logged; the request goes on)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        count, waiters = self._due.get(name, (0, []))
        self._due[name] = (max(count, completion_tokens), [*waiters, done])
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush_delivered())
        await done

    async def _flush_delivered(self) -> None:
        """Writes what is due in one call; what came in meanwhile goes in the next."""
        due: dict[str, tuple[int, list[asyncio.Future[None]]]] = {}
        try:
            while self._due:
                due, self._due = self._due, {}
                names = list(due)
                try:
                    await self._delivered(keys=names, args=[due[n][0] for n in names])
                    WRITES.labels("delivered", "ok").inc(len(names))
                except (RedisError, OSError) as exc:
                    WRITES.labels("delivered", "failed").inc(len(names))
                    log.warning("usage ledger delivered failed: %s", exc)
                _release(due)
        finally:  # cancelled (shutdown): nobody waits forever
            _release(due)
            _release(self._due)
            self._due, self._flusher = {}, None

    def close(self, name: str, status: str, completion_tokens: int) -> None:
        task = asyncio.get_running_loop().create_task(
            self._close_retried(name, status, completion_tokens)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_retried(self, name: str, status: str, completion_tokens: int) -> None:
        args = [status, f"{time.time():.3f}", completion_tokens, RECORD_TTL_S, STREAM_MAXLEN]
        for attempt in range(CLOSE_ATTEMPTS):
            try:
                await self._close(keys=[name, self.open_set, self.stream], args=args)
                WRITES.labels("close", "ok").inc()
                self.live.discard(name)
                return
            except RedisError as exc:
                WRITES.labels("close", "failed").inc()
                if attempt == 0:
                    log.warning("usage record %s: close failed (%s); retrying", name, exc)
                await asyncio.sleep(1.0)
        log.error("usage record %s not closed: Redis unreachable; the sweep will close it", name)

    async def _step(self, step: str, call: Any) -> None:
        try:
            await call
            WRITES.labels(step, "ok").inc()
        except RedisError as exc:
            WRITES.labels(step, "failed").inc()
            log.warning("usage ledger %s failed: %s", step, exc)

    async def maintain(self) -> int:
        """Renew this process's open records, close others' expired ones; how many closed."""
        if self.live:
            await self._renew(keys=[self.open_set], args=[self.lease_ms, *self.live])
        closed = await self._sweep(
            keys=[self.open_set, self.stream], args=[RECORD_TTL_S, STREAM_MAXLEN, SWEEP_BATCH]
        )
        return int(closed)

    async def maintain_forever(self, stop: asyncio.Event) -> None:
        every = self.lease_ms / 3000
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass
            try:
                closed = await self.maintain()
                if closed:
                    log.warning("usage: %d records of dead entrypoints closed", closed)
            except RedisError as exc:
                WRITES.labels("maintain", "failed").inc()
                log.warning("usage ledger upkeep failed: %s", exc)

    async def flush(self, timeout: float) -> None:
        """Shutdown: wait for pending closes."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


class MemoryLedger:
    """:class:`Ledger` in this process (tests, and embedders with no Redis): the same merge
    rules, nothing survives the process."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}

    async def open(self, rec: Opened) -> str:
        name = record_name("mem", rec.tenant, rec.request_id)
        r = self.records.setdefault(name, {**rec.__dict__, "completion_tokens": 0, "calls": 0})
        r["calls"] += 1
        r["status"] = "open"
        return name

    async def delivered(self, name: str, completion_tokens: int) -> None:
        r = self.records[name]
        r["completion_tokens"] = max(r["completion_tokens"], completion_tokens)

    def close(self, name: str, status: str, completion_tokens: int) -> None:
        r = self.records.get(name)
        if r is not None:
            r["completion_tokens"] = max(r["completion_tokens"], completion_tokens)
            r["status"] = status
