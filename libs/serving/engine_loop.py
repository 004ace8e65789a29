"""Run a synchronous :class:`Engine` in one dedicated thread, driven from asyncio.

The engine is single-threaded by contract, so exactly one thread ever touches it: the
engine thread. It loops::

    apply queued commands (add / abort / export / anything via call) in arrival order,
    then up to BACKGROUND_PER_ITERATION background ones (their own order; all when idle)
    -> engine.step() if the engine has unfinished work, else wait for a command
    -> hand the step's TokenEvents to the asyncio loop (call_soon_threadsafe)

Commands therefore run *between* steps, never during one, and see a consistent engine.

With expert parallelism (the engine is one rank of an EP group, ``engine.ep``) the thread
never waits idle on its own: every iteration is one :meth:`Lockstep.tick
<libs.serving.ep.lockstep.Lockstep.tick>` that every rank of the group runs together (a step,
empty where this rank has nothing, or an idle poll of a few ms). A tick that raises -- a peer
died or timed out -- breaks the group for good: every request in flight fails with
:class:`EngineFailed` (retryable for the entrypoint), the loop refuses further commands and
``on_group_failed`` is called on the asyncio loop (the service then exits, and its supervisor
starts a new group).
The asyncio side gets one :class:`RequestStream` per request; events reach it in the order
the engine produced them, and a command's result is delivered after every event the engine
produced before the command ran (both go through ``call_soon_threadsafe``, which is FIFO).

Who owns what: the stream dictionary lives on the asyncio thread; the engine and everything
it holds live on the engine thread; :attr:`EngineLoop.stats` is an immutable snapshot the
engine thread replaces after every iteration, safe to read from anywhere (its
``busy_fraction`` is filled in as it is read, so an idle engine's reads fall towards 0).

What the heartbeat's load means: ``queued_tokens`` is what the engine will compute for its
waiting requests -- a request's leading blocks already resident in this engine's prefix cache
are not counted; ``promised_kv_blocks`` what its requests will still grow into and
``held_requests`` which requests those are; ``tokens_per_s`` is the measured compute rate,
``busy_fraction`` the share of the last second the engine spent stepping (the measures:
:mod:`.engine_stats`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, InvalidRequest, KVInput, PreparedKV
from libs.engine.grammar import GrammarError
from libs.engine.scheduler import TokenEvent

from .engine_stats import (
    RATE_STEPS,
    RESIDENT_REFRESH_S,
    BusyMeter,
    ComputeRate,
    EngineStats,
    HeldRequests,
    WaitingWork,
    engine_stats,
)
from .request_stream import EngineFailed, EngineLoopClosed, NotAdded, RequestStream

if TYPE_CHECKING:
    from .engine_metrics import EngineMetrics
    from .ep.lockstep import Lockstep

log = logging.getLogger(__name__)

T = TypeVar("T")

# Background commands (call(..., background=True)) run between two steps while the engine has
# work: 8 of a wave of 128 finished requests' copies, ~1-2 ms of host work each, per step.
BACKGROUND_PER_ITERATION = 8
_NOT_ADDED = object()  # add(unless=...): the check said no


# An idle EP group asks every 10 ms whether any rank has work (one all-reduce of 2 integers,
# ~0.1 ms on gloo over loopback): <= 10 ms added to a request arriving at an idle group.
LOCKSTEP_POLL_S = 0.01


_Command = tuple[Callable[[Engine], Any], "concurrent.futures.Future[Any]"]


class EngineLoop:
    """Owns an :class:`Engine` and the one thread that runs it.

    Use from one asyncio event loop::

        loop = EngineLoop(engine)
        loop.start()                                   # binds to the running asyncio loop
        stream = await loop.add("r1", prompt, params)  # raises InvalidRequest, KVFormatError, ...
        async for ev in stream: ...
        await loop.abort("r1")
        frame = await loop.call(lambda e: e.export_kv("r1"))
        await loop.close()

    After :meth:`start`, no other code may touch ``engine`` except through :meth:`call`.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "engine",
        poll_s: float = LOCKSTEP_POLL_S,
        on_group_failed: Callable[[BaseException], None] | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics  # fed from both threads (engine_metrics.py says which part)
        self.name = name
        self._lockstep: Lockstep | None = None
        if engine.ep is not None:
            from .ep.lockstep import Lockstep

            self._lockstep = Lockstep(engine, poll_s=poll_s)
        self._on_group_failed = on_group_failed
        self.group_failure: BaseException | None = None  # set once an EP group broke
        self._work = WaitingWork()
        self._held = HeldRequests()
        self.busy = BusyMeter()
        self._steps = 0
        self._rate = 0.0
        self._stats = self._measure()
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._background: deque[_Command] = deque()  # call(..., background=True)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # asyncio thread only
        self._rates = ComputeRate(RATE_STEPS)
        self._resident_at = 0.0  # monotonic time the resident summary was last built
        if metrics is not None:
            metrics.attach(lambda: self.stats)

    @property
    def stats(self) -> EngineStats:
        """The latest load snapshot, with the busy fraction as of now."""
        return dataclasses.replace(self._stats, busy_fraction=self.busy.fraction())

    @stats.setter
    def stats(self, value: EngineStats) -> None:
        self._stats = value

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._aio = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-thread", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_streams(self) -> int:
        """Requests whose stream has not delivered its finishing event yet."""
        return len(self._streams)

    async def close(self) -> None:
        """Abort what is left (each open stream gets an abort event), stop and join the thread."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None

    # -- commands -----------------------------------------------------------------------------
    async def call(self, fn: Callable[[Engine], T], *, background: bool = False) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception.

        ``background``: a command nobody waits on for a reply to a client (copying a finished
        request's blocks out for the kvstore). Background commands keep their own order but
        run after the others and at most :data:`BACKGROUND_PER_ITERATION` between two steps
        while the engine has work: a wave of finished requests' copies then neither holds
        the next turns' admissions behind it nor stops the steps of everyone running.

        Cancelling the awaiting task before the command starts skips the command; once it has
        started it runs to the end (its result is then dropped).
        """
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self._thread is None:
                raise EngineLoopClosed(f"{self.name} loop is not running")
            (self._background if background else self._commands).append((fn, fut))
            self._cond.notify()
        return await asyncio.wrap_future(fut)

    async def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: bytes = b"",
        weight: float = 1.0,
        kv: KVInput | None = None,
        hold_kv: bool = False,
        prior_outputs: int = 0,
        arrival: float | None = None,
        drafts: tuple[Sequence[int], Sequence[float]] | None = None,
        unless: Callable[[Engine], bool] | None = None,
    ) -> RequestStream:
        """Queue a request; returns its event stream once the engine accepted it.

        ``unless``: asked on the engine thread first, in the same command; when it says True
        the request is not added and :class:`NotAdded` is raised (e.g. the kvstore holds
        blocks this engine lacks: the caller fetches them and adds it with ``kv``). One
        engine round trip where asking first would take two.

        ``arrival``: ``time.monotonic()`` when the request reached this instance (default:
        now); the latency metrics (time to first token, end to end) count from it.
        ``weight``: its tenant's share of prompt tokens beside other tenants' (the
        entrypoint's ``--tenant-weights``).

        Raises what :meth:`Engine.add_request` raises (InvalidRequest, KVFormatError,
        NoFreeBlocks), unchanged.
        """
        if request_id in self._streams:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if params is not None and params.constraint is not None:
            # Compile (or find cached) here, in a worker thread: a new schema takes milliseconds
            # to seconds, which the engine thread -- every request's steps -- must not wait for.
            # The backend itself is looked up there too: an engine nobody warmed builds it on
            # first use (seconds, vocabulary-wide), which must not stall this event loop.
            constraint = params.constraint
            try:
                await asyncio.to_thread(lambda: self.engine.grammar.compile(constraint))
            except GrammarError as exc:
                raise InvalidRequest(str(exc)) from None
        stream = RequestStream(request_id)
        self._streams[request_id] = stream  # before the command: its events may follow at once
        tokens = list(prompt_token_ids)
        if self.metrics is not None:
            self.metrics.on_add(request_id, len(tokens), arrival)

        def _add(e: Engine) -> Any:
            if unless is not None and unless(e):
                return _NOT_ADDED
            return e.add_request(
                request_id,
                tokens,
                params,
                cache_salt=cache_salt,
                weight=weight,
                kv=kv,
                hold_kv=hold_kv,
                prior_outputs=prior_outputs,
                drafts=drafts,
            )

        def drop() -> None:  # the add failed or was refused: forget its stream
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                if self.metrics is not None:
                    self.metrics.on_drop(request_id)

        try:
            imported = await self.call(_add)
        except BaseException as exc:
            drop()
            if isinstance(exc, asyncio.CancelledError) and not self._stopping:
                # The command may already have run: nobody will read this request, so drop it.
                with contextlib.suppress(BaseException):
                    await asyncio.shield(self.call(lambda e: e.abort(request_id)))
            raise
        if imported is _NOT_ADDED:
            drop()
            raise NotAdded(request_id)
        stream.imported = imported
        return stream

    async def export_blocks(
        self, request_id: str, start_block: int
    ) -> Callable[[], list[tuple[bytes, bytes, bytes]]]:
        """Start copying a finished request's full blocks from ``start_block`` on out for the
        kvstore (:meth:`Engine.export_blocks_async`; call the result, off this loop, for the
        frames). A background command: a wave of finishing requests' copies must not hold the
        next turns' admissions behind it."""
        return await self.call(
            lambda e: e.export_blocks_async(request_id, start_block), background=True
        )

    async def prepare_kv(self, frames: Sequence[bytes]) -> PreparedKV:
        """Parse, check and upload KV frames in a worker thread (:meth:`Engine.prepare_kv`
        touches no engine state), so the engine keeps stepping meanwhile; pass the result to
        :meth:`add`."""
        return await asyncio.to_thread(self.engine.prepare_kv, list(frames))

    async def abort(self, request_id: str) -> bool:
        """Drop the request (and free its blocks, also if held after finishing).

        Returns True if a running or waiting request was aborted; its stream then ends with an
        abort event. Unknown or already finished requests: False.
        """

        def _abort(engine: Engine) -> bool:
            ev = engine.abort(request_id)
            if ev is not None:
                self.stats = self._snapshot()  # whoever sees the abort sees the load after it
                self._emit([ev])
            return ev is not None

        return await self.call(_abort)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        if self._lockstep is not None:
            self._run_lockstep(self._lockstep)
            return
        while True:
            with self._cond:
                while (
                    not self._commands
                    and not self._background
                    and not self._stopping
                    and not self.engine.has_unfinished()
                ):
                    self._cond.wait()
                # Background ones all at once only when idle, or in the last round.
                busy = self.engine.has_unfinished() and not self._stopping
                commands = self._take(BACKGROUND_PER_ITERATION if busy else None)
                stopping = self._stopping
            for fn, fut in commands:
                self._apply(fn, fut)
            if stopping:
                self._shutdown()
                return
            events = self._step() if self.engine.has_unfinished() else []
            # Snapshot before handing events over: whoever sees an event sees load after it.
            self.stats = self._snapshot()
            if events:
                self._emit(events)

    def _run_lockstep(self, lockstep: Lockstep) -> None:
        """The EP loop: commands, then one tick with the peers, forever (module doc)."""
        while True:
            with self._cond:
                commands = self._take()
                stopping = self._stopping
            for fn, fut in commands:
                self._apply(fn, fut)
            self.busy.begin()
            try:
                tick = lockstep.tick(stopping)
            except Exception as exc:  # noqa: BLE001 - any failure of a rank breaks the group
                self.busy.end(count=False)
                self._group_failed(exc)
                return
            self.busy.end(count=tick.stepped)
            if tick.stop:
                self._shutdown()
                return
            if tick.stepped:
                self._count_step()
            self.stats = self._snapshot()
            if tick.events:
                self._emit(tick.events)

    def _group_failed(self, exc: Exception) -> None:
        log.error("%s: the EP group failed (%r); failing every request in flight", self.name, exc)
        with self._cond:
            self._stopping = True  # call() refuses from now on
            late = self._take()
        sched = self.engine.scheduler
        for rid in [r.request_id for r in (*sched.running, *sched.waiting)]:
            self.engine.abort(rid)  # local bookkeeping only: no collective
        for _, fut in late:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineLoopClosed(f"{self.name}: the EP group failed"))
        self._call_soon(self._fail_open_streams, EngineFailed(f"EP group failed: {exc!r}"))
        self.group_failure = exc
        if self._on_group_failed is not None:
            self._call_soon(self._on_group_failed, exc)

    def _take(self, background: int | None = None) -> list[_Command]:
        """The queued commands, then up to ``background`` background ones (None: all); hold
        ``_cond``."""
        n = len(self._background) if background is None else min(background, len(self._background))
        out = [*self._commands, *(self._background.popleft() for _ in range(n))]
        self._commands.clear()
        return out

    def _snapshot(self) -> EngineStats:
        """Load after this iteration; the resident summary (O(summary) Python) only every
        RESIDENT_REFRESH_S, not every step."""
        now = time.monotonic()
        resident = None
        if now - self._resident_at < RESIDENT_REFRESH_S:
            resident = self._stats.resident_prefixes
        else:
            self._resident_at = now
        return self._measure(resident)

    def _measure(self, resident: tuple[bytes, ...] | None = None) -> EngineStats:
        """The engine's load now (``resident``: a summary to reuse; None: built now)."""
        return engine_stats(self.engine, self._steps, self._rate, resident, self._work, self._held)

    def _apply(self, fn: Callable[[Engine], Any], fut: concurrent.futures.Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it; the loop goes on
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _step(self) -> list[TokenEvent]:
        self.busy.begin()
        try:
            events = self.engine.step()
        except Exception as exc:
            self.busy.end()
            log.exception("%s: engine step failed; failing every request in flight", self.name)
            self._fail_all(exc)
            return []
        self.busy.end()
        self._count_step()
        return events

    def _count_step(self) -> None:
        self._steps += 1
        e = self.engine
        if self.metrics is not None:
            self.metrics.on_step(
                e.finished_steps, e.last_step_seconds, e.last_finished_seqs, e.last_finished_tokens
            )
        self._rates.observe(e.last_finished_tokens, e.last_step_seconds)
        self._rate = self._rates.tokens_per_s()

    def _fail_all(self, exc: Exception) -> None:
        sched = self.engine.scheduler
        failed = [r.request_id for r in (*sched.running, *sched.waiting)]
        for rid in failed:
            self.engine.abort(rid)
        self._call_soon(self._fail_streams, failed, EngineFailed(f"engine step failed: {exc!r}"))

    def _shutdown(self) -> None:
        sched = self.engine.scheduler
        events = [ev for rid in list(sched.requests) if (ev := self.engine.abort(rid)) is not None]
        self.stats = self._measure()
        if events:
            self._emit(events)
        with self._cond:  # commands that raced with close(): refuse them
            late = self._take()
        for _, fut in late:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineLoopClosed(f"{self.name} loop stopped"))

    def _emit(self, events: list[TokenEvent]) -> None:
        self._call_soon(self._deliver, events)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._aio is not None
        try:
            self._aio.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the asyncio loop is closed: nobody is listening any more
            pass

    # -- asyncio thread -----------------------------------------------------------------------
    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            stream._put(ev)
            if ev.finished:
                del self._streams[ev.request_id]
        if self.metrics is not None:
            self.metrics.on_events(events)

    def _fail_open_streams(self, err: EngineFailed) -> None:
        self._fail_streams(list(self._streams), err)

    def _fail_streams(self, request_ids: list[str], err: EngineFailed) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(err)
            if self.metrics is not None:
                self.metrics.on_drop(rid)
