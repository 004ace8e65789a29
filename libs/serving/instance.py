"""What the prefill and decode services share around their engine: readiness, the model in
its engine thread, NATS, heartbeats and the SIGTERM drain. Runs inside the shared service
lifecycle (:func:`libs.common.service.run_service`): what it opens goes on ``ctx.stack``.

    async def serve(cfg: PrefillConfig, ctx: ServiceContext) -> int:
        rt = InstanceRuntime(ctx, cfg.model, cfg.heartbeat_interval)
        rc = await rt.start()               # ops port, model, engine thread, NATS
        if rc is not None: return rc
        ...subscribe..., rt.ready(status)   # heartbeats begin; /healthz says 200
        await ctx.stop.wait()
        await rt.leave(handler, subs)       # draining heartbeat, drain, last heartbeat
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from libs.common import subjects
from libs.common.redact import redact_text
from libs.common.service import ServiceContext
from libs.proto.deepserve.v1 import control_pb2

from .engine_loop import EngineLoop
from .engine_metrics import EngineMetrics, log_stats
from .engine_stats import EngineStats
from .ep import EXIT_GROUP_FAILED, EPFlags, tag_rank_logs
from .load_report import LoadReport, publish_load
from .model_flags import ModelFlags
from .runtime import heartbeat_loop, publish_status

if TYPE_CHECKING:
    from libs.engine.engine import Engine
    from libs.engine.load_progress import ProgressSink


class Drainable(Protocol):
    draining: bool

    def status(self) -> control_pb2.InstanceStatus: ...

    def drain(self, seconds: float) -> Awaitable[Any]: ...


class InstanceRuntime:
    """``ep``: this instance is one rank of an EP group (``--ep-rank``): its engine joins the
    group and steps in lockstep; when the group fails the service stops with
    :data:`~.ep.EXIT_GROUP_FAILED` (:attr:`exit_code`), and when its supervisor is gone it
    stops too.

    The engine's metrics (:mod:`.engine_metrics`) go on the service's ops port; every
    ``stats_interval`` seconds (0: never) one stats line is logged."""

    def __init__(
        self,
        ctx: ServiceContext,
        model: ModelFlags,
        heartbeat_interval: float,
        ep: EPFlags | None = None,
        stats_interval: float = 10.0,
        heartbeat_role: str = "",
    ) -> None:
        self.ctx, self.model, self.heartbeat_interval = ctx, model, heartbeat_interval
        self.stats_interval = stats_interval
        self.ep = ep if ep is not None and ep.is_rank else None
        if self.ep is not None and self.ep.rank is not None:
            tag_rank_logs(ctx.name, self.ep.rank)
        self.exit_code = 0  # what serve() returns after leave()
        self.service, self.instance_id = ctx.name, ctx.config.instance_id
        self.drain_seconds, self.log = ctx.config.drain_seconds, ctx.log
        self.loop: EngineLoop | None = None
        self.nc: Client | None = None
        self._ready = False
        # The heartbeat's subject names the role it reports (default: the service's name).
        self._hb_subject = subjects.heartbeat(heartbeat_role or self.service, self.instance_id)
        self._hb_stop = asyncio.Event()
        self._hb: list[asyncio.Task[None]] = []
        # An aggregated instance heartbeats once per role: (subject, status) of the others.
        self._more_beats: list[tuple[str, Callable[[], control_pb2.InstanceStatus]]] = []
        self._report = LoadReport(self.instance_id, self.service, model.model_name)

    def healthy(self) -> tuple[bool, str]:
        if self.loop is None:
            return False, self._report.line()
        if not self._ready or self.nc is None or not self.nc.is_connected:
            return False, "NATS is not connected"
        return True, f"{self.instance_id} serving {self.model.model_name}"

    async def start(self) -> int | None:
        """Ops port, model, engine thread, NATS, each closed by the service's exit stack.
        Returns an exit code if the service must end (a model that cannot load, or a stop
        signal before NATS answered)."""
        self.log.info("ops on %s:%d", self.ctx.config.host, await self.ctx.start_ops(self.healthy))

        from .engines import build_engine  # torch: after the ops port answers

        build: Callable[[ModelFlags, ProgressSink], Engine] = build_engine
        if self.ep is not None:
            from .ep import build_rank_engine

            ep = self.ep
            build = lambda flags, progress: build_rank_engine(flags, ep, progress)  # noqa: E731
            self.ctx.background(self._watch_supervisor(os.getppid()), "ep-supervisor-watch")
        # NATS comes up while the weights load, so their progress is published meanwhile.
        nats = asyncio.ensure_future(self.ctx.connect_nats())
        announce = self._announce_load(nats)
        engine = None
        try:
            engine = await self._load(build)
        except (ValueError, OSError) as exc:
            self.log.error("cannot load model %r: %s", self.model.model, exc)
            self._report.finish(redact_text(f"cannot load model: {exc}"))
            await asyncio.wait((announce,), timeout=2.0)  # the error, if NATS is up
        finally:
            if engine is None:  # failed or stopped: no NATS wanted any more
                announce.cancel()
                nats.cancel()
        if engine is None:
            if self._report.error:
                return 1
            self.log.info("stopped while the model was loading")
            return 0
        self._report.finish()
        try:
            metrics = EngineMetrics(self.model.model_name, self.service)  # the ops port's
        except ValueError as exc:  # another engine of this process exports them already
            self.log.warning("engine metrics not exported on /metrics: %s", exc)
            metrics = EngineMetrics(self.model.model_name, self.service, CollectorRegistry())
        self.ctx.stack.callback(metrics.unregister)
        loop = EngineLoop(
            engine, name=self.service, on_group_failed=self._group_failed, metrics=metrics
        )
        loop.start()
        self.ctx.stack.push_async_callback(loop.close)
        self.loop = loop
        if self.stats_interval > 0:
            self.ctx.background(
                log_stats(metrics, self.stats_interval, self.log, self.ctx.stop), "engine-stats"
            )
        if engine.eplb is not None:  # an EP rank running EPLB: export its balance
            self._export_balance(loop)
        self.log.info(
            "model %s loaded (%s), %d KV blocks of %d tokens",
            self.model.model,
            engine.model_id,
            engine.blocks.num_blocks,
            self.model.block_size,
        )
        self.nc = await nats  # closed at once: leave() already drained
        if self.nc is None:
            return 0
        return None

    def _announce_load(self, nats: asyncio.Future[Client | None]) -> asyncio.Task[None]:
        """Publish the load's progress (``ds.load.<service>.<id>``) until it is over, and
        export it on ``/metrics`` for the service's life."""
        from prometheus_client import REGISTRY

        collector = self._report.collector()
        try:
            REGISTRY.register(collector)
        except ValueError as exc:  # another instance of this process exports them already
            self.log.debug("model load gauges not exported: %s", exc)
        else:
            self.ctx.stack.callback(REGISTRY.unregister, collector)
        subject = subjects.load_status(self.service, self.instance_id)
        return self.ctx.background(
            publish_load(nats, subject, self._report, self.log, self.heartbeat_interval),
            "load-progress",
        )

    def _export_balance(self, loop: EngineLoop) -> None:
        from prometheus_client import REGISTRY

        from .ep_metrics import EPBalanceCollector

        collector = EPBalanceCollector(lambda: loop.stats)
        REGISTRY.register(collector)
        self.ctx.stack.callback(REGISTRY.unregister, collector)

    def _group_failed(self, exc: BaseException) -> None:
        """The EP group broke under this rank (its requests already failed, retryable): stop
        heartbeating and exit, so the supervisor restarts the group with the ranks left."""
        self.log.error("EP group failed (%s); stopping this rank", exc)
        self._ready = False
        self.exit_code = EXIT_GROUP_FAILED
        self.ctx.stop.set()

    async def _watch_supervisor(self, parent: int) -> None:
        """A rank outlives no supervisor (kill -9 of it): its parent changes, it stops."""
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        self.log.error("the EP supervisor (pid %d) is gone; stopping this rank", parent)
        self.exit_code = EXIT_GROUP_FAILED
        self.ctx.stop.set()

    async def _load(self, build: Callable[[ModelFlags, ProgressSink], Engine]) -> Engine | None:
        """The engine, built in a daemon thread (minutes for a large model); None if a stop
        signal came first -- the service then exits at once instead of after the load (a
        daemon thread does not hold the interpreter's exit)."""
        aio = asyncio.get_running_loop()
        built: asyncio.Future[Engine] = aio.create_future()

        def settle(fn: Callable[[], None]) -> None:
            if not built.done():
                fn()

        def work() -> None:
            try:
                engine = build(self.model, self._report)
                self._warm_grammar(engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
                err = exc
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    aio.call_soon_threadsafe(settle, lambda: built.set_exception(err))
            else:
                with contextlib.suppress(RuntimeError):
                    aio.call_soon_threadsafe(settle, lambda: built.set_result(engine))

        threading.Thread(target=work, name=f"{self.service}-load", daemon=True).start()
        stop: asyncio.Future[Any] = asyncio.ensure_future(self.ctx.stop.wait())
        try:
            await asyncio.wait((built, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not built.done():
            built.cancel()
            return None
        return built.result()

    def _warm_grammar(self, engine: Engine) -> None:
        """Structured outputs' vocabulary-wide setup, here in the load thread before the
        service reports ready: built by the first constrained request instead (on the event
        loop: ``EngineLoop.add`` reads ``engine.grammar`` there) it stopped the heartbeats for
        seconds and peers counted the instance dead. A failure is logged, not fatal:
        unconstrained requests are served; a constrained one gets the error."""
        from .engines import warm_grammar

        try:
            seconds = warm_grammar(engine, self.model.grammar_budget())
        except Exception as exc:  # noqa: BLE001 - reported again by each constrained request
            self.log.warning("structured outputs not prepared at start-up: %r", exc)
        else:
            self.log.info("structured outputs prepared in %.1f s", seconds)

    async def ready(
        self,
        status: Callable[[], control_pb2.InstanceStatus],
        more_roles: Sequence[tuple[str, Callable[[], control_pb2.InstanceStatus]]] = (),
    ) -> None:
        """Subscriptions are in place: confirm them with the server, start heartbeats, go ready.

        ``more_roles``: (role, status) of further roles this instance serves with the same
        engine (an aggregated instance is a prefill and a decode target): each heartbeats on
        its own role's subject under the same instance id."""
        assert self.nc is not None
        await self.nc.flush()
        self._ready = True
        self._more_beats = [
            (subjects.heartbeat(role, self.instance_id), fn) for role, fn in more_roles
        ]
        for subject, fn in [(self._hb_subject, status), *self._more_beats]:
            self._hb.append(
                asyncio.create_task(
                    heartbeat_loop(
                        self.nc, subject, fn, self._hb_stop, self.log, self.heartbeat_interval
                    )
                )
            )

    async def leave(
        self,
        handler: Drainable,
        subscriptions: Sequence[Any],
        before_drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """SIGTERM path: heartbeat ``draining``, finish work, unsubscribe, last heartbeat."""
        assert self.nc is not None
        self.log.info("stopping: draining for up to %.1f s", self.drain_seconds)
        handler.draining = True
        if before_drain is not None:
            await before_drain()
        await self._publish_all(handler)
        await handler.drain(self.drain_seconds)
        for sub in subscriptions:
            await sub.unsubscribe()
        self._hb_stop.set()
        for t in self._hb:
            await t
        await self._publish_all(handler)
        try:
            await self.nc.flush(timeout=2)
        except Exception as exc:  # noqa: BLE001 - leaving anyway; the balancer times the instance out
            self.log.warning("NATS flush on exit failed: %s", exc)

    async def _publish_all(self, handler: Drainable) -> None:
        assert self.nc is not None
        await publish_status(self.nc, self._hb_subject, handler.status(), self.log)
        for subject, fn in self._more_beats:
            await publish_status(self.nc, subject, fn(), self.log)


def instance_status(
    stats: EngineStats,
    *,
    instance_id: str,
    role: control_pb2.Role,
    model: str,
    address: str,
    draining: bool,
    block_size: int,
) -> control_pb2.InstanceStatus:
    """The heartbeat payload from the engine thread's latest load snapshot.

    Prefill heartbeats carry the resident-prefix summary (for the balancer's cache-locality
    routing); decode ones do not, nobody routes on it. Both list the requests the engine holds
    (admission counts a request it sent once: by the engine's figures once listed here).
    """
    resident = list(stats.resident_prefixes) if role == control_pb2.ROLE_PREFILL else []
    return control_pb2.InstanceStatus(
        instance_id=instance_id,
        role=role,
        model=model,
        address=address,
        running=stats.running,
        waiting=stats.waiting,
        queued_tokens=stats.queued_tokens,
        free_kv_blocks=stats.free_kv_blocks,
        total_kv_blocks=stats.total_kv_blocks,
        draining=draining,
        block_size=block_size,
        resident_prefixes=resident,
        compute_tokens_per_s=stats.tokens_per_s,
        busy_fraction=stats.busy_fraction,
        promised_kv_blocks=stats.promised_kv_blocks,
        held_requests=stats.held_requests,
        reports_held=True,
    )


async def drain_tasks(
    tasks: Sequence[asyncio.Task[Any]], timeout_s: float, what: str, log: logging.Logger
) -> None:
    """Let ``tasks`` finish for up to ``timeout_s``; cancel the rest (they report their own
    errors)."""
    if not tasks:
        return
    log.info("draining: %d %s in flight (up to %.1f s)", len(tasks), what, timeout_s)
    _, late = await asyncio.wait(tasks, timeout=timeout_s)
    for t in late:
        t.cancel()
    if late:
        log.warning("drain deadline: cut %d %s short", len(late), what)
        await asyncio.wait(late, timeout=5.0)
