"""What each instance can take now: its heartbeats plus what this entrypoint sent it since.

Pure policy: no I/O and no clock of its own (``clock`` is injected), so it is unit-tested with
a fake one. :class:`~libs.gateway.admission.Admission` asks it whether a request fits, holds
the request back (bounded) when it does not, and reports the request's progress to it.

Two resources gate a request:

* **prefill queue**: the heartbeat's ``queued_tokens`` (the tokens the engine will compute
  for its waiting requests: blocks resident in its prefix cache are not counted) plus the
  uncached tokens this entrypoint sent there that heartbeats may not show yet. A request fits
  an instance when that load plus its own uncached tokens is at most ``prefill_queue_seconds``
  (default 2 s) of work at the instance's own measured rate (the heartbeat's
  ``compute_tokens_per_s``), or when the queue is empty, so any prompt runs on an idle
  instance. Until an instance has measured a rate (its first steps), the limit is
  ``prefill_queue_tokens`` instead (default 65,536 = two full 32K-token prefill steps). A
  limit in time, so a fast engine is not held back by a figure sized for a slow one and a
  request waits only while the instance has that much work ahead of it.
* **decode KV**: the heartbeat's ``free_kv_blocks`` (cached-but-unused blocks count as free)
  less its ``promised_kv_blocks`` (what the requests the engine holds will still take as they
  grow to prompt + ``max_tokens``), less what this entrypoint's requests the heartbeat does
  not count yet will take: blocks for prompt + ``max_tokens``. A decode instance never has to
  preempt an admitted request. An instance that reports no ``total_kv_blocks`` is not
  KV-gated.

Reservations between heartbeats. Each heartbeat lists the keys of the requests its engine held
when it took its figures (``held``, :func:`~libs.common.request_key.request_key` of the
attempt id), so a request is counted by this entrypoint until the first heartbeat that lists
it and by the engine from then on: never twice, never zero times. A request that left the
engine (its prefill done, or finished) is counted here until its first token (prefill) or its
end arrives. An older engine lists nothing (``held`` None); then a reservation is held until
the instance's :data:`SETTLE_BEATS`-th heartbeat after the event (task sent to the prefill,
first decode token seen), or until the prefill is done, and after it has landed only the
blocks its completion may still grow into are counted: a request counted twice for up to
~2 s rather than zero times. With several entrypoints each counts only what it sent; the
heartbeats fold in everyone's.

Drain rates, for the retry hint: uncached prompt tokens whose prefill finished per second,
and decode KV blocks given back by finished requests per second, both over the last
``rate_window`` seconds of this entrypoint's own requests (with several entrypoints each sees
its share, so its hint errs long).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from libs.common.errors import InvalidArgument

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)
SETTLE_BEATS = 2  # heartbeats after which an instance's own figures surely include a request
# The window a heartbeat's busy fraction covers (the engine side's own constant,
# libs/serving/engine_stats.py, which imports torch: a test keeps the two equal).
BUSY_WINDOW_S = 1.0
FORGET_AFTER_DEAD = 10  # an instance silent this many dead_after periods is dropped


def blocks(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


@dataclass(frozen=True)
class CapacityConfig:
    block_size: int = 128
    prefill_queue_tokens: int = 65_536  # before a rate is measured; 0: not limited
    prefill_queue_seconds: float = 2.0  # of work at the measured rate; 0: tokens only
    dead_after: float = 3.0  # an instance silent this long is not counted (nor waited for)
    rate_window: float = 10.0  # seconds of history behind the drain rates

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.prefill_queue_tokens < 0:
            raise ValueError(
                f"prefill_queue_tokens must be >= 0 (0: no limit), got {self.prefill_queue_tokens}"
            )
        if not self.prefill_queue_seconds >= 0:
            raise ValueError(
                f"prefill_queue_seconds must be >= 0 (0: the token limit only), got "
                f"{self.prefill_queue_seconds}"
            )
        if not self.dead_after > 0 or not self.rate_window > 0:
            raise ValueError("dead_after and rate_window must be > 0 seconds")


@dataclass(frozen=True)
class Need:
    """What one attempt at a request asks of the instances."""

    prompt_tokens: int
    uncached_tokens: int  # prompt tokens the prefill must compute (not in the kvstore)
    max_tokens: int

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.uncached_tokens, self.max_tokens) < 0:
            raise ValueError(f"token counts must be >= 0: {self}")
        if self.uncached_tokens > self.prompt_tokens:
            raise ValueError(f"uncached_tokens exceeds prompt_tokens: {self}")

    def prefill_blocks(self, block_size: int) -> int:
        return blocks(self.prompt_tokens + 1, block_size)  # the prompt and its first token

    def decode_blocks(self, block_size: int) -> int:
        return blocks(self.prompt_tokens + self.max_tokens, block_size)


@dataclass(frozen=True)
class Load:
    """One heartbeat's figures (the fields admission uses)."""

    instance_id: str
    role: str  # PREFILL or DECODE
    model: str = ""
    address: str = ""  # decode: where prefill pushes the KV (none: not routable)
    queued_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0  # 0: not reported, not KV-gated
    draining: bool = False
    tokens_per_s: float = 0.0  # the engine's measured compute rate (0: not measured yet)
    busy_fraction: float = 0.0  # share of the last BUSY_WINDOW_S the engine spent stepping
    promised_kv_blocks: int = 0  # of free_kv_blocks, what the engine's requests will still take
    # request_key() of each request the engine held when it took these figures (None: not
    # reported, an older engine: its requests are counted for SETTLE_BEATS heartbeats instead)
    held: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")


@dataclass(eq=False)
class Ticket:
    """One admitted attempt's reservations; :class:`Capacity` owns and updates it."""

    need: Need
    prefill: str = ""
    decode: str = ""
    key: int | None = None  # request_key() of the attempt's id, once it is bound
    prefill_beat: int = 0  # the prefill's heartbeat count when the task was (about to be) sent
    landed_beat: int | None = None  # the decode's count when its first token was seen
    prefilled: bool = False
    generated: int = 0  # tokens of this attempt seen so far
    released: bool = False


@dataclass(frozen=True)
class Fit:
    """Which instances can take a request now."""

    prefill: tuple[str, ...]  # can take it, best first (shortest queue)
    decode: tuple[str, ...]  # can take it, best first (most room)
    full: tuple[str, ...]  # live candidates that cannot: a route should avoid them
    short: str  # what is short when it does not fit (for messages), else ""
    missing: str  # a role with no live candidate at all, else ""

    @property
    def ok(self) -> bool:
        return bool(self.prefill and self.decode)


class Rate:
    """Amount per second over the last ``window`` seconds (fewer since the first sample, but
    at least 1 s); None with no sample in the window."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()
        self._sum = 0.0
        self._first: float | None = None

    def add(self, now: float, amount: float) -> None:
        self._first = now if self._first is None else self._first
        self._samples.append((now, amount))
        self._sum += amount

    def per_second(self, now: float) -> float | None:
        while self._samples and now - self._samples[0][0] > self.window:
            self._sum -= self._samples.popleft()[1]
        if not self._samples or self._first is None:
            return None
        return max(self._sum, 0.0) / max(1.0, min(self.window, now - self._first))


@dataclass
class _Inst:
    load: Load
    seen: float
    beats: int = 1


def _serves(load: Load, model: str) -> bool:
    return not model or not load.model or load.model == model


class Capacity:
    """The table of instances from heartbeats, the reservations of admitted requests, and the
    drain rates; answers whether a request fits and how long until it would."""

    def __init__(
        self, config: CapacityConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or CapacityConfig()
        self.clock = clock
        self.started = clock()
        self._inst: dict[tuple[str, str], _Inst] = {}
        self._tickets: set[Ticket] = set()
        self._forgot_at = self.started
        self.prefill_rate = Rate(self.config.rate_window)  # uncached tokens prefilled / s
        self.decode_rate = Rate(self.config.rate_window)  # decode KV blocks given back / s

    # -- heartbeats -------------------------------------------------------------------------
    def observe(self, load: Load) -> None:
        """Record a heartbeat received now."""
        now = self.clock()
        key = (load.role, load.instance_id)
        entry = self._inst.get(key)
        if entry is None:
            self._inst[key] = _Inst(load, now)
        else:
            entry.load, entry.seen, entry.beats = load, now, entry.beats + 1
        if now - self._forgot_at > self.config.dead_after:
            self._forget(now)

    def _forget(self, now: float) -> None:
        self._forgot_at = now
        limit = FORGET_AFTER_DEAD * self.config.dead_after
        bound = {t.prefill for t in self._tickets} | {t.decode for t in self._tickets}
        for key in [k for k, e in self._inst.items() if now - e.seen > limit]:
            if key[1] not in bound:  # its beat count still settles tickets bound to it
                del self._inst[key]

    def live(self, role: str) -> list[Load]:
        """Every instance of ``role`` heard within ``dead_after`` (draining ones too)."""
        now = self.clock()
        return [
            e.load
            for (r, _), e in sorted(self._inst.items())
            if r == role and now - e.seen <= self.config.dead_after
        ]

    def candidates(self, role: str, model: str = "", exclude: Iterable[str] = ()) -> list[Load]:
        """Live, not draining, serving ``model`` (decode: with an address), not excluded."""
        now, excluded = self.clock(), frozenset(exclude)
        out = []
        for (r, iid), e in sorted(self._inst.items()):
            load = e.load
            if r != role or now - e.seen > self.config.dead_after or load.draining:
                continue
            if iid in excluded or not _serves(load, model) or (r == DECODE and not load.address):
                continue
            out.append(load)
        return out

    def startup_left(self) -> float:
        """Seconds until every live instance must have been heard once (0 afterwards)."""
        return max(0.0, self.started + self.config.dead_after - self.clock())

    def _beats(self, role: str, instance_id: str) -> int:
        entry = self._inst.get((role, instance_id))
        return 0 if entry is None else entry.beats

    # -- the view -----------------------------------------------------------------------------
    def prefill_load(self, load: Load) -> int:
        """Tokens queued on a prefill instance: its heartbeat's plus ours it does not show
        (not listed among its held requests; without that list, until SETTLE_BEATS)."""
        beats = self._beats(PREFILL, load.instance_id)
        mine = sum(
            t.need.uncached_tokens
            for t in self._tickets
            if t.prefill == load.instance_id
            and not t.prefilled
            and not _counted(load, t)
            and (load.held is not None or beats < t.prefill_beat + SETTLE_BEATS)
        )
        return load.queued_tokens + mine

    def decode_room(self, load: Load) -> int | None:
        """KV blocks free on a decode instance after what its own requests and ours will still
        take (None: not reported). A request of ours the heartbeat lists is in the engine's
        own figures and is not counted again."""
        if load.total_kv_blocks <= 0:
            return None
        beats, bs = self._beats(DECODE, load.instance_id), self.config.block_size
        mine = 0
        for t in self._tickets:
            if t.decode != load.instance_id or _counted(load, t):
                continue
            need = t.need.decode_blocks(bs)
            if t.landed_beat is None or beats < t.landed_beat + SETTLE_BEATS:
                mine += need  # not in its heartbeat yet: all of it
            else:  # the heartbeat counts what it holds; it may still grow to ``need``
                mine += max(need - blocks(t.need.prompt_tokens + t.generated, bs), 0)
        return load.free_kv_blocks - load.promised_kv_blocks - mine

    def prefill_limit(self, load: Load) -> int:
        """Tokens a prefill instance may have queued (0: no limit): ``prefill_queue_seconds``
        at its measured rate, or ``prefill_queue_tokens`` while it has measured none."""
        seconds = self.config.prefill_queue_seconds
        if seconds and load.tokens_per_s > 0:
            return max(1, int(seconds * load.tokens_per_s))
        return self.config.prefill_queue_tokens

    def _prefill_fits(self, load: Load, need: Need) -> bool:
        if load.total_kv_blocks and need.prefill_blocks(self.config.block_size) > (
            load.total_kv_blocks
        ):
            return False
        queued, limit = self.prefill_load(load), self.prefill_limit(load)
        return not limit or queued == 0 or queued + need.uncached_tokens <= limit

    def _describe_queue(self, load: Load) -> str:
        """A prefill queue and its limit, for messages."""
        queued, rate = self.prefill_load(load), load.tokens_per_s
        if self.config.prefill_queue_seconds and rate > 0:
            return (
                f"{queued} tokens = {queued / rate:.2f}s at its measured {rate:.0f} tokens/s, "
                f"limit {self.config.prefill_queue_seconds:g}s"
            )
        return f"{queued} tokens, limit {self.config.prefill_queue_tokens}"

    def fit(self, need: Need, model: str = "", exclude: Iterable[str] = ()) -> Fit:
        """Which live instances can take ``need`` now, and what is short if none can."""
        excluded = tuple(exclude)
        pre = self.candidates(PREFILL, model, excluded)
        dec = self.candidates(DECODE, model, excluded)
        p_ok = sorted((p for p in pre if self._prefill_fits(p, need)), key=self.prefill_load)
        want = need.decode_blocks(self.config.block_size)
        rooms = {d.instance_id: self.decode_room(d) for d in dec}
        d_ok = [
            d for d in dec if rooms[d.instance_id] is None or want <= _int(rooms[d.instance_id])
        ]
        d_ok.sort(key=lambda d: -_int(rooms[d.instance_id], 1 << 62))
        fitting = {p.instance_id for p in p_ok} | {d.instance_id for d in d_ok}
        full = tuple(i.instance_id for i in (*pre, *dec) if i.instance_id not in fitting)
        missing = PREFILL if not pre else DECODE if not dec else ""
        short = []
        if pre and not p_ok:
            least = min(pre, key=self.prefill_load)
            short.append(
                f"prefill queues are full (the shortest holds {self._describe_queue(least)}; "
                f"this prompt adds {need.uncached_tokens})"
            )
        if dec and not d_ok:
            most = max(_int(r) for r in rooms.values())
            short.append(f"no decode instance has {want} free KV blocks (most: {max(most, 0)})")
        return Fit(
            tuple(p.instance_id for p in p_ok),
            tuple(d.instance_id for d in d_ok),
            full,
            "; ".join(short),
            missing,
        )

    def never_fits(self, need: Need, model: str = "") -> InvalidArgument | None:
        """The error for a request no live instance could ever hold, else None (also None
        while a role has no live instance: one may come up)."""
        bs = self.config.block_size
        for role, want in ((PREFILL, need.prefill_blocks(bs)), (DECODE, need.decode_blocks(bs))):
            totals = [i.total_kv_blocks for i in self.candidates(role, model)]
            if not totals or 0 in totals or want <= max(totals):
                continue
            prompt_alone = blocks(need.prompt_tokens + 1, bs) > max(totals)
            return InvalidArgument(
                f"prompt ({need.prompt_tokens} tokens)"
                + ("" if role == PREFILL else f" + max_tokens ({need.max_tokens})")
                + f" needs {want} KV blocks of {bs} tokens, but the largest {role} instance "
                f"holds {max(totals)} ({max(totals) * bs} tokens); it can never run here",
                field="prompt_token_ids" if prompt_alone else "sampling.max_tokens",
            )
        return None

    # -- tickets ------------------------------------------------------------------------------
    def reserve(self, need: Need, fit: Fit) -> Ticket:
        """Reserve ``need`` on the best instances of ``fit`` (a retry may reserve with nothing
        fitting: it is already admitted); :meth:`bind` moves it to where it was routed."""
        ticket = Ticket(need)
        self._tickets.add(ticket)
        self.bind(
            ticket, fit.prefill[0] if fit.prefill else "", fit.decode[0] if fit.decode else ""
        )
        return ticket

    def bind(self, ticket: Ticket, prefill: str, decode: str, key: int | None = None) -> None:
        """The attempt goes to ``prefill`` and ``decode``: its reservations move there.
        ``key``: request_key() of the id the attempt carries upstream (the instances'
        heartbeats list it once its figures count it)."""
        ticket.prefill, ticket.decode, ticket.key = prefill, decode, key
        ticket.prefill_beat = self._beats(PREFILL, prefill)

    def saw(self, ticket: Ticket, index: int, generated: int) -> None:
        """A token event of the attempt arrived: ``index`` 0 is the prefill's first token,
        1 and on come from the decode instance (its KV has landed there)."""
        ticket.generated = max(ticket.generated, generated)
        if not ticket.prefilled:
            ticket.prefilled = True
            self.prefill_rate.add(self.clock(), ticket.need.uncached_tokens)
        if index >= 1 and ticket.landed_beat is None:
            ticket.landed_beat = self._beats(DECODE, ticket.decode)

    def release(self, ticket: Ticket) -> None:
        """The attempt ended: its reservations go, and a landed request gives its KV back."""
        if ticket.released:
            return
        ticket.released = True
        self._tickets.discard(ticket)
        if ticket.landed_beat is not None:
            self.decode_rate.add(self.clock(), ticket.need.decode_blocks(self.config.block_size))

    @property
    def tickets(self) -> int:
        return len(self._tickets)

    # -- the retry hint -----------------------------------------------------------------------
    def drain_seconds(
        self, need: Need, ahead: Sequence[Need] = (), model: str = ""
    ) -> float | None:
        """Seconds until ``need`` would fit after the requests ``ahead`` of it took theirs, at
        the measured drain rates; None when something is short but no rate is measured yet."""
        now, bs = self.clock(), self.config.block_size
        pre, dec = self.candidates(PREFILL, model), self.candidates(DECODE, model)
        waits: list[float | None] = [0.0]
        limits = [self.prefill_limit(p) for p in pre]
        if pre and 0 not in limits:
            loads = [self.prefill_load(p) for p in pre]
            tokens = need.uncached_tokens + sum(a.uncached_tokens for a in ahead)
            # Its own excess on the queue nearest its limit, or everyone's over all queues.
            excess = max(
                min(q - lim for q, lim in zip(loads, limits, strict=True)) + need.uncached_tokens,
                sum(loads) + tokens - sum(limits),
            )
            # The rate measured here; before one is, the instances' own compute rates.
            rate = self.prefill_rate.per_second(now) or sum(p.tokens_per_s for p in pre)
            waits.append(_at(excess, rate))
        rooms = [self.decode_room(d) for d in dec]
        if dec and None not in rooms:
            known = [_int(r) for r in rooms]
            want = need.decode_blocks(bs)
            deficit = max(
                want - max(known), want + sum(a.decode_blocks(bs) for a in ahead) - sum(known)
            )
            waits.append(_at(deficit, self.decode_rate.per_second(now)))
        return None if None in waits else max(w for w in waits if w is not None)


def _counted(load: Load, ticket: Ticket) -> bool:
    """Whether ``load``'s own figures already count ``ticket``'s request."""
    return load.held is not None and ticket.key is not None and ticket.key in load.held


def _at(amount: float, rate: float | None) -> float | None:
    if amount <= 0:
        return 0.0
    return None if not rate else amount / rate


def _int(value: int | None, default: int = 0) -> int:
    return default if value is None else value
