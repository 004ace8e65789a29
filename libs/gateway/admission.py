"""Admission: a request starts only when it fits; otherwise it waits, bounded, or is refused.

A request is admitted when fewer than ``max_inflight`` run (0: no cap) and, with a
:class:`~libs.gateway.capacity.Capacity`, some prefill instance can queue its uncached prompt
tokens and some decode instance has KV room for prompt + ``max_tokens``. Otherwise it joins a
FIFO queue of at most ``max_waiting`` requests and waits up to ``admit_wait`` seconds, woken
(:meth:`Admission.wake`) by every heartbeat and every finished request; past that, or with the
queue full, it is refused at once: :class:`~libs.common.errors.Overloaded` (gRPC
RESOURCE_EXHAUSTED, HTTP 429) with a retry hint from the measured drain rates, so no request
sits in an engine queue until the 60 s token timeout. First come, first served: a request that
does not fit holds back those behind it (for at most ``admit_wait``), so large prompts are not
starved by a stream of small ones. A request no instance could ever hold is
:class:`~libs.common.errors.InvalidArgument`; with no live instance of a role after the wait
(at startup the wait lasts until every live instance has heartbeated once) it is
:class:`~libs.common.errors.Unavailable`.

No I/O: asyncio futures are the only machinery; the clock is injected.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from libs.common.errors import DeepserveError, Overloaded, Unavailable

from .capacity import Capacity, Need, Rate, Ticket

MIN_RETRY_MS = 50
MAX_RETRY_MS = 60_000


class AdmissionObserver(Protocol):
    def on_admission(self, result: str, waited: float | None, waiting: int) -> None:
        """``result``: admitted, queued, refused, unfit or unavailable; ``waited``: seconds in
        the queue (None: decided without queueing); ``waiting``: queue length now."""


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
    future: asyncio.Future[Grant]


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
    ) -> None:
        self.max_inflight, self.max_waiting = max_inflight, max_waiting  # max_inflight 0: no cap
        self.admit_wait = admit_wait
        self.retry_after_ms = retry_after_ms  # the hint until a drain rate has been measured
        self.capacity, self.observer, self.clock = capacity, observer, clock
        self.running = 0
        self._queue: deque[_Waiter] = deque()
        self._finished = Rate(capacity.config.rate_window if capacity else 10.0)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def refuse_if_full(self, need: Need, model: str = "") -> None:
        """Raise the refusal a request would get at once because the queue is full and cannot
        be joined (checked before the kvstore lookup, so such a request costs nothing
        upstream; ``need`` may overstate the uncached tokens)."""
        at_cap = bool(self.max_inflight and self.running >= self.max_inflight)
        if (self._queue or at_cap) and len(self._queue) >= self.max_waiting:
            raise self._refusal(need, model, list(self._queue), None, "its queue is full")

    async def acquire(self, need: Need, model: str = "") -> Grant:
        """A grant for ``need`` (release it with :meth:`release`); raises Overloaded,
        InvalidArgument or Unavailable."""
        started = self.clock()
        if self.capacity is not None:
            unfit = self.capacity.never_fits(need, model)
            if unfit is not None:
                self._note("unfit", None)
                raise unfit
        if not self._queue:
            grant = self._try(need, model)
            if grant is not None:
                self._note("admitted", None)
                return grant
        if len(self._queue) >= self.max_waiting:
            raise self._refusal(need, model, list(self._queue), None, "its queue is full")
        waiter = _Waiter(need, model, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._note("queued", None)
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
        except BaseException:  # cancelled (the client went away), or found never to fit
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

    def bind(self, grant: Grant, prefill: str, decode: str) -> None:
        if self.capacity is not None and grant.ticket is not None:
            self.capacity.bind(grant.ticket, prefill, decode)

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
        """Admit waiting requests, in order, while the one at the head fits (call on every
        heartbeat; :meth:`release` calls it itself)."""
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # its wait ended (timeout or cancel) before it got here
                self._queue.popleft()
                continue
            unfit = self.capacity.never_fits(head.need, head.model) if self.capacity else None
            if unfit is not None:  # it queued before the instances were known
                self._queue.popleft()
                head.future.set_exception(unfit)
                self._note("unfit", None)
                continue
            grant = self._try(head.need, head.model)
            if grant is None:
                return
            self._queue.popleft()
            head.future.set_result(grant)

    # -- internals ----------------------------------------------------------------------------
    def _try(self, need: Need, model: str) -> Grant | None:
        if self.max_inflight and self.running >= self.max_inflight:
            return None
        grant = Grant()
        if self.capacity is not None:
            fit = self.capacity.fit(need, model)
            if not fit.ok:
                return None
            grant = Grant(self.capacity.reserve(need, fit), fit.full)
        self.running += 1
        return grant

    def _wait_limit(self, model: str) -> float:
        cap = self.capacity
        if cap is None or (cap.candidates("prefill", model) and cap.candidates("decode", model)):
            return self.admit_wait
        # None heard yet: at startup, wait until every live instance has heartbeated once.
        return max(self.admit_wait, cap.startup_left())

    def _leave(self, waiter: _Waiter) -> list[_Waiter]:
        """Take ``waiter`` out of the queue; returns those that were ahead of it."""
        ahead: list[_Waiter] = []
        for w in self._queue:
            if w is waiter:
                break
            ahead.append(w)
        if waiter in self._queue:
            self._queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
        self.wake()  # it may have been the head holding the others back
        return ahead

    def _note(self, result: str, waited: float | None) -> None:
        if self.observer is not None:
            self.observer.on_admission(result, waited, len(self._queue))

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
