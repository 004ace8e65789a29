"""Per-API-key limits, as policy with no I/O: a concurrency cap and a token rate.

Concurrency counts **generations**, not requests: a request takes one slot when it comes
(:meth:`KeyLimiter.enter`, before its body is read) and, once its ``n`` is known, as many as
it runs generations (:meth:`KeyLimiter.widen`): a key capped at 4 runs 4 generations at once,
whether as 4 requests or one with ``n=4``. A request with ``n`` above the cap can never run
under that key and is refused naming the cap; one that could but not now is refused like any
request past the cap.

A key is named by its **key id**, the first 8 hex digits of its SHA-256 (:func:`key_id`), never
by the key itself, so limits can be configured, logged and stored without the secret. Every key
gets the default :class:`KeyLimit`; ``--key-limits KEYID=CONC[:TOKENS_PER_MIN],...`` overrides
it per key (DeepSeek caps concurrency per account at 500 for V4-Pro and 2,500 for
V4.1-Flash).

The token rate is a bucket per key holding at most ``tokens_per_min`` tokens, refilled at
``tokens_per_min / 60`` per second. A request **reserves** ``prompt + max_tokens`` at admission
(what it may cost at most, known before any token is generated) and is admitted when the bucket
holds ``min(reservation, capacity)`` -- so a request larger than a minute's budget still runs
once the bucket is full, and then leaves the bucket in debt. When it ends, the unused part of
the reservation (``reserved - used``) is given back, so the bucket is charged what the request
really cost; a request whose cost is unknown keeps its whole reservation charged. A refusal
carries the seconds until the bucket would hold enough (Retry-After); a refusal for
concurrency carries :data:`CONCURRENCY_RETRY_S`, as no one can know when a slot frees.

This class keeps the state of one process. Behind several recipe replicas (and entrypoints
taking keys on gRPC ``Generate``) the same rules run on shared state in Redis
(``libs/transport/keycaps.py``: one Lua script per step, slots that expire unless their holder
renews them); this class is then the fallback while Redis cannot be reached. Not thread-safe:
callers use it from one event loop.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

CONCURRENCY_RETRY_S = 1  # Retry-After of a concurrency refusal: a slot frees when any request ends
_KEY_ID = re.compile(r"^[0-9a-f]{8}$")


def key_id(key: str) -> str:
    """The non-secret name of an API key: the first 8 hex digits of its SHA-256. (32 bits: two
    keys of one deployment share an id, and so their limits, with odds ~n²/2³³.)"""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class KeyLimit:
    """``concurrency``: generations in flight at once, a request with ``n`` counting ``n``
    (0: no cap); ``tokens_per_min``: token rate (0: no rate limit)."""

    concurrency: int = 500
    tokens_per_min: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 0:
            raise ValueError(
                f"a key's concurrency must be >= 0 (0: no cap), got {self.concurrency}"
            )
        if self.tokens_per_min < 0:
            raise ValueError(
                f"a key's tokens per minute must be >= 0 (0: no limit), got {self.tokens_per_min}"
            )


@dataclass(frozen=True)
class KeyLimitPolicy:
    """The default limit and the per-key-id overrides."""

    default: KeyLimit = field(default_factory=KeyLimit)
    overrides: Mapping[str, KeyLimit] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kid in self.overrides:
            if not _KEY_ID.match(kid):
                raise ValueError(
                    f"--key-limits: {kid!r} is not a key id (8 lowercase hex digits: the start "
                    "of the key's SHA-256, e.g. `printf %s KEY | sha256sum | cut -c1-8`)"
                )

    def of(self, kid: str) -> KeyLimit:
        return self.overrides.get(kid, self.default)


def parse_key_limits(text: str) -> dict[str, KeyLimit]:
    """``KEYID=CONC[:TOKENS_PER_MIN]`` entries, comma-separated -> {key id: limit}; ValueError
    names the entry that is wrong."""
    out: dict[str, KeyLimit] = {}
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        kid, sep, spec = entry.partition("=")
        conc, _, tpm = spec.partition(":")
        try:
            if not sep:
                raise ValueError("no '='")
            limit = KeyLimit(int(conc), int(tpm) if tpm else 0)
        except ValueError as exc:
            raise ValueError(
                f"--key-limits entry {entry!r}: want KEYID=CONCURRENCY[:TOKENS_PER_MIN] ({exc})"
            ) from None
        out[kid.strip().lower()] = limit
    return out


@dataclass(frozen=True)
class Refusal:
    """Why a request of a key is refused now, and when to retry (whole seconds, >= 1)."""

    reason: str  # "concurrency" or "tokens"
    retry_after_s: int
    message: str


def at_cap(cap: int) -> Refusal:
    """A new request of a key that has ``cap`` generations in flight."""
    return Refusal(
        "concurrency",
        CONCURRENCY_RETRY_S,
        f"too many concurrent requests for this API key: its limit is {cap} generations in flight",
    )


def n_above_cap(cap: int, generations: int) -> Refusal:
    """A request whose ``n`` alone is above the key's cap: it can never run under that key."""
    return Refusal(
        "concurrency",
        CONCURRENCY_RETRY_S,
        f"this request runs {generations} generations at once (n={generations}) and this "
        f"API key's concurrency limit is {cap} generations in flight: lower n to at most {cap}",
    )


def no_room(cap: int, inflight: int, more: int, generations: int) -> Refusal:
    """A request whose ``more`` generations do not fit beside the ``inflight`` ones now."""
    return Refusal(
        "concurrency",
        CONCURRENCY_RETRY_S,
        f"too many concurrent requests for this API key: its limit is {cap} generations in "
        f"flight, {inflight} are and this request adds {more} more (n={generations})",
    )


def rate_reached(rate: int, tokens: int, wait_s: float) -> Refusal:
    """A request reserving ``tokens`` that the key's bucket holds in ``wait_s`` seconds."""
    return Refusal(
        "tokens",
        max(1, math.ceil(wait_s)),
        f"token rate limit of this API key reached: {rate} tokens per minute; this "
        f"request reserves {tokens} (prompt + max_tokens)",
    )


@dataclass
class Slot:
    """One admitted request: its key id, the concurrency it holds (its generations) and the
    tokens it holds reserved. ``slot_id`` names it in shared state; ``shared``: whether it is
    held there (False: in a process's own :class:`KeyLimiter`)."""

    kid: str
    reserved: int = 0
    open: bool = True
    generations: int = 1
    slot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    shared: bool = False


@dataclass
class _Bucket:
    level: float
    at: float


class KeyLimiter:
    """Admission per key: :meth:`enter` (one slot of concurrency) before the request is
    encoded, :meth:`widen` (a slot per generation) and :meth:`reserve` (tokens) once its ``n``,
    prompt and ``max_tokens`` are known, :meth:`leave` once
    it ended, however it ended (idempotent). State is kept only for keys seen, which are the
    configured keys (the caller authenticates first)."""

    def __init__(self, policy: KeyLimitPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self.clock = policy, clock
        self.inflight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def enter(self, kid: str) -> Slot | Refusal:
        cap = self.policy.of(kid).concurrency
        n = self.inflight.get(kid, 0)
        if cap and n >= cap:
            return at_cap(cap)
        self.inflight[kid] = n + 1
        return Slot(kid)

    def widen(self, slot: Slot, generations: int) -> Refusal | None:
        """``slot``'s request runs ``generations`` generations at once (its ``n``): it holds that
        many of the key's concurrency from now on. A Refusal leaves it holding what it held (the
        caller still calls :meth:`leave`)."""
        if generations <= slot.generations or not slot.open:
            return None
        cap = self.policy.of(slot.kid).concurrency
        n = self.inflight.get(slot.kid, 0)
        more = generations - slot.generations
        if cap and generations > cap:
            return n_above_cap(cap, generations)
        if cap and n + more > cap:
            return no_room(cap, n, more, generations)
        self.inflight[slot.kid] = n + more
        slot.generations = generations
        return None

    def reserve(self, slot: Slot, tokens: int) -> Refusal | None:
        """Reserve ``tokens`` (prompt + max_tokens) for ``slot``; a Refusal leaves nothing
        reserved (the caller still calls :meth:`leave`)."""
        rate = self.policy.of(slot.kid).tokens_per_min
        if not rate or not slot.open:
            return None
        bucket = self._refilled(slot.kid, rate)
        need = min(tokens, rate)
        if bucket.level < need:
            return rate_reached(rate, tokens, (need - bucket.level) / (rate / 60.0))
        bucket.level -= tokens  # may go below 0: a request larger than a minute's budget
        slot.reserved += tokens
        return None

    def leave(self, slot: Slot, used: int | None = None) -> None:
        """The request ended; ``used``: the tokens it cost (prompt + completion), None when
        unknown (its reservation stays charged)."""
        if not slot.open:
            return
        slot.open = False
        n = self.inflight.get(slot.kid, 0) - slot.generations
        if n > 0:
            self.inflight[slot.kid] = n
        else:
            self.inflight.pop(slot.kid, None)
        rate = self.policy.of(slot.kid).tokens_per_min
        if rate and slot.reserved and used is not None:
            bucket = self._refilled(slot.kid, rate)
            bucket.level = min(float(rate), bucket.level + slot.reserved - used)  # or charge more

    def _refilled(self, kid: str, rate: int) -> _Bucket:
        now = self.clock()
        bucket = self._buckets.get(kid)
        if bucket is None:
            bucket = self._buckets[kid] = _Bucket(float(rate), now)
        bucket.level = min(float(rate), bucket.level + (now - bucket.at) * rate / 60.0)
        bucket.at = now
        return bucket
