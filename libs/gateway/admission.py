"""Admission: a request starts only when it fits; otherwise it waits, bounded, or is refused.

A request is admitted when fewer than ``max_inflight`` run (0: no cap) and, with a
:class:`~libs.gateway.capacity.Capacity`, some prefill instance can queue its uncached prompt
tokens and some decode instance has KV room for prompt + ``max_tokens``. Otherwise it waits in
its **tenant's** queue (the tenant the caller authenticated as, never a request field) and is
woken (:meth:`Admission.wake`) by every heartbeat and every finished request; past
``admit_wait`` seconds it is refused: :class:`~libs.common.errors.Overloaded` (gRPC
RESOURCE_EXHAUSTED, HTTP 429) with a retry hint from the measured drain rates, so no request
sits in an engine queue until the 60 s token timeout.

Waiting requests are served by weighted fair queuing over tenants (self-clocked fair queuing
by virtual finish tags), the work being a request's uncached prompt tokens (at least 1): a
tenant's request gets the tag ``V + work / weight`` when it comes to the head of its tenant's
queue (or arrives with none of its tenant waiting), ``V`` being the largest tag admitted so far
(so an idle tenant banks no credit, and head tags never lie below ``V``); the head
with the smallest tag goes next (ties: the earlier arrival), and a new request is admitted at
once only if it fits and its tag is smaller than every waiting head's. Within a tenant, first
come, first served. The head that is next and does not fit holds back the others (for at most
``admit_wait``), so large prompts are not starved by a stream of small ones; but a tenant's
burst of long prompts is tagged one after another, so another tenant's short request passes
them (its tag is smaller) instead of waiting behind all of them. Weights (default 1 each)
split admitted work in proportion.

At most ``max_waiting`` requests wait in all. When the queue is full, a request of a tenant
holding less of it (waiting requests / weight) than another takes the place of that other
tenant's newest waiter, which is refused; otherwise the newcomer is refused at once. A request
no instance could ever hold is :class:`~libs.common.errors.InvalidArgument`; with no live
instance of a role after the wait (at startup the wait lasts until every live instance has
heartbeated once) it is :class:`~libs.common.errors.Unavailable`.

No I/O: asyncio futures are the only machinery; the clock is injected.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from libs.common.errors import DeepserveError, Overloaded, Unavailable

from .capacity import Capacity, Need, Rate, Ticket

MIN_RETRY_MS = 50
MAX_RETRY_MS = 60_000


class AdmissionObserver(Protocol):
    def on_admission(self, result: str, waited: float | None, waiting: int, why: str = "") -> None:
        """``result``: admitted, queued, refused, unfit or unavailable; ``waited``: seconds in
        the queue (None: decided without queueing); ``waiting``: queue length now; ``why`` (a
        queued request): what held it -- ``behind`` (others wait ahead of it), ``inflight``
        (the ``max_inflight`` cap), ``prefill_queue``, ``decode_kv`` or ``no_instance``."""


def parse_tenant_weights(text: str) -> dict[str, float]:
    """``TENANT=WEIGHT`` entries, comma-separated -> {tenant: weight > 0}; ValueError names the
    entry that is wrong."""
    out: dict[str, float] = {}
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        tenant, sep, value = entry.partition("=")
        try:
            if not sep or not tenant.strip():
                raise ValueError("want TENANT=WEIGHT")
            weight = float(value)
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError("the weight must be a number > 0")
        except ValueError as exc:
            raise ValueError(f"--tenant-weights entry {entry!r}: {exc}") from None
        out[tenant.strip()] = weight
    return out


@dataclass(eq=False)
class Grant:
    """An admitted request's slot (and its capacity reservation, if capacity is known)."""

    ticket: Ticket | None = None
    avoid: tuple[str, ...] = ()  # live instances that cannot take it now: routes avoid them
    waited: float = 0.0
    released: bool = False


@dataclass(eq=False)
class _Waiter:
    need: Need
    model: str
    tenant: str
    seq: int  # arrival order: breaks ties between equal tags
    since: float
    future: asyncio.Future[Grant]


@dataclass(eq=False)
class _Tenant:
    queue: deque[_Waiter] = field(default_factory=deque)
    head_tag: float = 0.0  # its head's tag, fixed when it came to the head


def _granted(future: asyncio.Future[Grant]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


class Admission:
    def __init__(
        self,
        max_inflight: int,
        max_waiting: int,
        admit_wait: float,
        retry_after_ms: int,
        *,
        capacity: Capacity | None = None,
        observer: AdmissionObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.max_inflight, self.max_waiting = max_inflight, max_waiting  # max_inflight 0: no cap
        self.admit_wait = admit_wait
        self.retry_after_ms = retry_after_ms  # the hint until a drain rate has been measured
        self.capacity, self.observer, self.clock = capacity, observer, clock
        self.weights = dict(weights or {})  # tenant -> weight; others weigh 1
        for tenant, w in self.weights.items():
            if not (w > 0 and math.isfinite(w)):
                raise ValueError(f"tenant {tenant!r}: a weight must be > 0, got {w}")
        self.running = 0
        self._tenants: dict[str, _Tenant] = {}  # those with requests waiting
        self._vtime = 0.0  # V: the largest tag admitted
        self._waiting = 0
        self._seq = itertools.count()
        self._finished = Rate(capacity.config.rate_window if capacity else 10.0)

    @property
    def waiting(self) -> int:
        return self._waiting

    def weight_of(self, tenant: str) -> float:
        """``tenant``'s --tenant-weights entry (1 when unlisted)."""
        return self.weights.get(tenant, 1.0)

    def waiting_of(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return len(t.queue) if t else 0

    def refuse_if_full(self, need: Need, model: str = "", tenant: str = "") -> None:
        """Raise the refusal a request would get at once because the queue is full and cannot
        be joined (checked before the kvstore lookup, so such a request costs nothing
        upstream; ``need`` may overstate the uncached tokens)."""
        at_cap = bool(self.max_inflight and self.running >= self.max_inflight)
        full = (self._waiting or at_cap) and self._waiting >= self.max_waiting
        if full and self._displaceable(tenant) is None:
            ahead = self._ahead_of_new(tenant, need)
            raise self._refusal(need, model, ahead, None, "its queue is full")

    async def acquire(self, need: Need, model: str = "", tenant: str = "") -> Grant:
        """A grant for ``need`` of ``tenant`` (release it with :meth:`release`); raises
        Overloaded, InvalidArgument or Unavailable."""
        started = self.clock()
        if self.capacity is not None:
            unfit = self.capacity.never_fits(need, model)
            if unfit is not None:
                self._note("unfit", None)
                raise unfit
        why = "behind"
        if self._first_in_line(tenant, need):
            grant, held = self._try(need, model)
            if grant is not None:
                self._charge(self._tag_of_new(tenant, need))
                self._note("admitted", None)
                return grant
            why = held
        if self._waiting >= self.max_waiting:
            victim = self._displaceable(tenant)
            if victim is None:
                ahead = self._ahead_of_new(tenant, need)
                raise self._refusal(need, model, ahead, None, "its queue is full")
            self._displace(victim)
        waiter = _Waiter(
            need,
            model,
            tenant,
            next(self._seq),
            started,
            asyncio.get_running_loop().create_future(),
        )
        self._join(waiter)
        self._note("queued", None, why)
        self.wake()  # it may be first in the fair order, and fit
        limit = self._wait_limit(model)
        try:
            async with asyncio.timeout(limit):
                grant = await waiter.future
        except TimeoutError:
            if not _granted(waiter.future):
                ahead = self._leave(waiter)
                waited = self.clock() - started
                raise self._refusal(
                    need, model, ahead, waited, f"none came free within {limit:g}s"
                ) from None
            grant = waiter.future.result()  # admitted as the wait ran out: take it
        except BaseException:  # cancelled (the client went away), displaced, or never fits
            if _granted(waiter.future):
                self.release(waiter.future.result())
            else:
                self._leave(waiter)
            raise
        grant.waited = self.clock() - started
        self._note("admitted", grant.waited)
        return grant

    def rebook(self, grant: Grant, need: Need, model: str = "") -> None:
        """A retry of an admitted request: its reservation is replaced by one for ``need``
        at once (it already waited its turn; refusing it now would waste the tokens sent)."""
        if self.capacity is None or grant.released:
            return
        if grant.ticket is not None:
            self.capacity.release(grant.ticket)
        fit = self.capacity.fit(need, model)
        grant.ticket = self.capacity.reserve(need, fit)
        grant.avoid = fit.full if fit.ok else ()
        self.wake()

    def bind(self, grant: Grant, prefill: str, decode: str, key: int | None = None) -> None:
        """The attempt was routed (``key``: request_key() of the id it carries upstream)."""
        if self.capacity is not None and grant.ticket is not None:
            self.capacity.bind(grant.ticket, prefill, decode, key)

    def saw(self, grant: Grant, index: int, generated: int) -> None:
        if self.capacity is not None and grant.ticket is not None:
            self.capacity.saw(grant.ticket, index, generated)

    def release(self, grant: Grant) -> None:
        """The request ended: its slot and reservations free up and waiters are woken.
        Synchronous, so a cancelled task's cleanup can call it."""
        if grant.released:
            return
        grant.released = True
        self.running -= 1
        self._finished.add(self.clock(), 1)
        if self.capacity is not None and grant.ticket is not None:
            self.capacity.release(grant.ticket)
        self.wake()

    def wake(self) -> None:
        """Admit waiting requests in fair order while the next one fits (call on every
        heartbeat; :meth:`release` calls it itself)."""
        while True:
            t = self._next()
            if t is None:
                return
            head = t.queue[0]
            if head.future.done():  # its wait ended (timeout or cancel) before it got here
                self._pop(head)
                continue
            unfit = self.capacity.never_fits(head.need, head.model) if self.capacity else None
            if unfit is not None:  # it queued before the instances were known
                self._pop(head)
                head.future.set_exception(unfit)
                self._note("unfit", None)
                continue
            grant, _ = self._try(head.need, head.model)
            if grant is None:
                return
            self._charge(t.head_tag)  # first: the next head's tag starts at V
            self._pop(head)
            head.future.set_result(grant)

    # -- fair queuing -----------------------------------------------------------------------------
    def _cost(self, tenant: str, need: Need) -> float:
        """Virtual work of a request: its uncached prompt tokens (at least 1) over the weight."""
        return max(1, need.uncached_tokens) / self.weight_of(tenant)

    def _tag_of_new(self, tenant: str, need: Need) -> float:
        """The tag a new request of ``tenant`` would have at the end of its tenant's queue."""
        t = self._tenants.get(tenant)
        if t is None or not t.queue:
            return self._vtime + self._cost(tenant, need)
        return self._tags(t)[-1] + self._cost(tenant, need)

    def _tags(self, t: _Tenant) -> list[float]:
        """Projected tags of a tenant's waiters, in order (only the head's is fixed)."""
        tags, tag = [], t.head_tag
        for i, w in enumerate(t.queue):
            if i:
                tag += self._cost(w.tenant, w.need)
            tags.append(tag)
        return tags

    def _next(self) -> _Tenant | None:
        """The tenant whose head goes next: the smallest tag, then the earliest arrival."""
        heads = [t for t in self._tenants.values() if t.queue]
        return min(heads, key=lambda t: (t.head_tag, t.queue[0].seq), default=None)

    def _first_in_line(self, tenant: str, need: Need) -> bool:
        """Whether a new request would be next in the fair order (nothing of its tenant waits
        and its tag is below every waiting head's)."""
        if self.waiting_of(tenant):
            return False
        nxt = self._next()
        return nxt is None or self._tag_of_new(tenant, need) < nxt.head_tag

    def _charge(self, tag: float) -> None:
        """A request with ``tag`` was admitted: V moves up to it (the tenant's next request
        starts there, as does everyone else's: no tenant banks credit)."""
        self._vtime = max(self._vtime, tag)

    def _join(self, waiter: _Waiter) -> None:
        t = self._tenants.setdefault(waiter.tenant, _Tenant())
        t.queue.append(waiter)
        self._waiting += 1
        if len(t.queue) == 1:
            t.head_tag = self._vtime + self._cost(waiter.tenant, waiter.need)

    def _pop(self, waiter: _Waiter) -> None:
        """Take ``waiter`` out of its tenant's queue (a new head gets its tag)."""
        t = self._tenants.get(waiter.tenant)
        if t is None or waiter not in t.queue:
            return
        was_head = t.queue[0] is waiter
        t.queue.remove(waiter)
        self._waiting -= 1
        if was_head and t.queue:
            new = t.queue[0]
            t.head_tag = self._vtime + self._cost(new.tenant, new.need)
        if not t.queue:
            del self._tenants[waiter.tenant]

    def _order(self) -> Iterator[tuple[float, int, _Waiter]]:
        """Every waiter with its projected tag, in the fair order."""
        rows = [
            (tag, w.seq, w)
            for t in self._tenants.values()
            for tag, w in zip(self._tags(t), t.queue, strict=True)
        ]
        return iter(sorted(rows, key=lambda r: (r[0], r[1])))

    def _ahead_of_new(self, tenant: str, need: Need) -> list[_Waiter]:
        tag = self._tag_of_new(tenant, need)
        return [w for wtag, _, w in self._order() if wtag <= tag]

    def _share(self, tenant: str) -> float:
        return self.waiting_of(tenant) / self.weight_of(tenant)

    def _displaceable(self, tenant: str) -> _Waiter | None:
        """With the queue full: the newest waiter of the tenant holding the largest share of
        it, if that share exceeds what ``tenant``'s would be with one more request."""
        heads = [name for name, t in self._tenants.items() if t.queue and name != tenant]
        if not heads:
            return None
        top = max(heads, key=self._share)
        mine = (self.waiting_of(tenant) + 1) / self.weight_of(tenant)
        return self._tenants[top].queue[-1] if self._share(top) > mine else None

    def _displace(self, victim: _Waiter) -> None:
        ahead = [w for _, _, w in self._order() if w is not victim]
        self._pop(victim)
        victim.future.set_exception(
            self._refusal(
                victim.need,
                victim.model,
                ahead,
                self.clock() - victim.since,
                "its queue is full (another tenant's request took its place: its tenant "
                "held the largest share of the queue)",
            )
        )

    # -- internals ----------------------------------------------------------------------------
    def _try(self, need: Need, model: str) -> tuple[Grant | None, str]:
        """A grant if ``need`` fits now; else None and what it lacks (``inflight``,
        ``no_instance``, ``prefill_queue`` or ``decode_kv``: see :class:`AdmissionObserver`)."""
        if self.max_inflight and self.running >= self.max_inflight:
            return None, "inflight"
        grant = Grant()
        if self.capacity is not None:
            fit = self.capacity.fit(need, model)
            if not fit.ok:
                if fit.missing:
                    return None, "no_instance"
                return None, "prefill_queue" if not fit.prefill else "decode_kv"
            grant = Grant(self.capacity.reserve(need, fit), fit.full)
        self.running += 1
        return grant, ""

    def _wait_limit(self, model: str) -> float:
        cap = self.capacity
        if cap is None or (cap.candidates("prefill", model) and cap.candidates("decode", model)):
            return self.admit_wait
        # None heard yet: at startup, wait until every live instance has heartbeated once.
        return max(self.admit_wait, cap.startup_left())

    def _leave(self, waiter: _Waiter) -> list[_Waiter]:
        """Take ``waiter`` out of the queue; returns those that were ahead of it."""
        ahead: list[_Waiter] = []
        for _, _, w in self._order():
            if w is waiter:
                break
            ahead.append(w)
        self._pop(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
        self.wake()  # it may have been the head holding the others back
        return ahead

    def _note(self, result: str, waited: float | None, why: str = "") -> None:
        if self.observer is not None:
            self.observer.on_admission(result, waited, self._waiting, why)

    def _refusal(
        self, need: Need, model: str, ahead: list[_Waiter], waited: float | None, why: str
    ) -> DeepserveError:
        cap = self.capacity
        fit = None if cap is None else cap.fit(need, model)
        if cap is not None and fit is not None and fit.missing:
            self._note("unavailable", waited)
            return Unavailable(
                f"no live {fit.missing} instance serves {model or 'this model'} (none "
                f"heartbeated in the last {cap.config.dead_after:g}s); retry in a few seconds"
            )
        short = []
        if self.max_inflight and self.running >= self.max_inflight:
            short.append(f"{self.running} requests in flight (limit {self.max_inflight})")
        if fit is not None and fit.short:
            short.append(fit.short)
        if not short:
            short.append(f"{len(ahead)} requests ahead of it are waiting for capacity")
        ms = self.retry_after(need, model, ahead)
        self._note("refused", waited)
        return Overloaded(
            f"entrypoint overloaded: {'; '.join(short)} and {why}; retry after {ms} ms", ms
        )

    def retry_after(self, need: Need, model: str = "", ahead: list[_Waiter] | None = None) -> int:
        """Milliseconds until ``need`` would likely be admitted: what is short (in-flight
        slots, prefill queue, decode KV), plus what the requests ``ahead`` take first, over
        the rate at which it drains, measured here. ``retry_after_ms`` stands in for a rate
        not measured yet; the hint lies in [MIN_RETRY_MS, MAX_RETRY_MS]."""
        ahead = ahead or []
        now, waits, unknown = self.clock(), [0.0], False
        excess = self.running + len(ahead) + 1 - self.max_inflight
        if self.max_inflight and excess > 0:
            rate = self._finished.per_second(now)
            if rate:
                waits.append(excess / rate)
            else:
                unknown = True
        if self.capacity is not None:
            s = self.capacity.drain_seconds(need, [w.need for w in ahead], model)
            if s is None:
                unknown = True
            else:
                waits.append(s)
        ms = max(waits) * 1000
        if unknown:
            ms = max(ms, self.retry_after_ms)
        return int(min(max(ms, MIN_RETRY_MS), MAX_RETRY_MS))
