"""What the prefill and decode services share around their engine: readiness, the model in
its engine thread, NATS, heartbeats and the SIGTERM drain.

    async with AsyncExitStack() as stack:
        rt = InstanceRuntime(...)
        rc = await rt.start(stack)          # ops port, model, engine thread, NATS
        if rc is not None: return rc
        ...subscribe..., rt.ready(status)   # heartbeats begin; /healthz says 200
        await rt.stop.wait()
        await rt.leave(handler, subs)       # draining heartbeat, drain, last heartbeat
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client

from libs.common import subjects
from libs.common.lifecycle import install_stop_handlers, setup_logging
from libs.common.natsutil import connect_nats
from libs.common.telemetry import OpsServer
from libs.proto.deepserve.v1 import control_pb2

from .engine_loop import EngineLoop, EngineStats
from .model_flags import ModelFlags
from .runtime import heartbeat_loop, publish_status

C = TypeVar("C")


class Drainable(Protocol):
    draining: bool

    def status(self) -> control_pb2.InstanceStatus: ...

    def drain(self, seconds: float) -> Awaitable[Any]: ...


def run_instance(
    service: str,
    argv: list[str] | None,
    build_parser: Callable[[], argparse.ArgumentParser],
    config_from: Callable[[argparse.Namespace], C],
    serve: Callable[[C, logging.Logger], Awaitable[int]],
) -> int:
    """The ``main`` of an engine-wrapping service: parse, log, build config (exit 2 if bad), serve."""
    args = build_parser().parse_args(argv)
    log = setup_logging(args.log_level, service)
    try:
        cfg = config_from(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(serve(cfg, log))  # type: ignore[arg-type]


class InstanceRuntime:
    def __init__(
        self,
        service: str,
        instance_id: str,
        model: ModelFlags,
        *,
        host: str,
        http_port: int,
        nats_url: str,
        drain_seconds: float,
        heartbeat_interval: float,
        log: logging.Logger,
    ) -> None:
        self.service, self.instance_id, self.model = service, instance_id, model
        self.host, self.http_port, self.nats_url = host, http_port, nats_url
        self.drain_seconds, self.heartbeat_interval, self.log = (
            drain_seconds,
            heartbeat_interval,
            log,
        )
        self.stop = asyncio.Event()
        self.loop: EngineLoop | None = None
        self.nc: Client | None = None
        self._ready = False
        self._hb_subject = subjects.heartbeat(service, instance_id)
        self._hb_stop = asyncio.Event()
        self._hb: asyncio.Task[None] | None = None

    def healthy(self) -> tuple[bool, str]:
        if self.loop is None:
            return False, "loading the model"
        if not self._ready or self.nc is None or not self.nc.is_connected:
            return False, "NATS is not connected"
        return True, f"{self.instance_id} serving {self.model.model_name}"

    async def start(self, stack: AsyncExitStack) -> int | None:
        """Ops port, model, engine thread, NATS. Returns an exit code if the service must end."""
        install_stop_handlers(self.stop)
        ops = OpsServer(self.host, self.http_port, self.healthy)
        self.log.info("ops on %s:%d", self.host, await ops.start())
        stack.push_async_callback(ops.stop)

        from libs.engine.engine import Engine  # torch: after the ops port answers

        from .fake_engine import FAKE_MODEL, FakeEngine

        make: Callable[[Any], Engine] = Engine
        if self.model.model == FAKE_MODEL:
            make = functools.partial(
                FakeEngine,
                step_seconds=self.model.fake_step_ms / 1e3,
                token_seconds=self.model.fake_token_us / 1e6,
            )
        try:
            engine = await asyncio.to_thread(make, self.model.engine_config())
        except (ValueError, OSError) as exc:
            self.log.error("cannot load model %r: %s", self.model.model, exc)
            return 1
        loop = EngineLoop(engine, name=self.service)
        loop.start()
        stack.push_async_callback(loop.close)
        self.loop = loop
        self.log.info(
            "model %s loaded (%s), %d KV blocks of %d tokens",
            self.model.model,
            engine.model_id,
            engine.blocks.num_blocks,
            self.model.block_size,
        )
        self.nc = await connect_nats(
            self.nats_url, self.instance_id, self.stop, self.log, self.drain_seconds
        )
        if self.nc is None:
            return 0
        stack.push_async_callback(self.nc.close)
        return None

    async def ready(self, status: Callable[[], control_pb2.InstanceStatus]) -> None:
        """Subscriptions are in place: confirm them with the server, start heartbeats, go ready."""
        assert self.nc is not None
        await self.nc.flush()
        self._ready = True
        self._hb = asyncio.create_task(
            heartbeat_loop(
                self.nc, self._hb_subject, status, self._hb_stop, self.log, self.heartbeat_interval
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
        await publish_status(self.nc, self._hb_subject, handler.status(), self.log)
        await handler.drain(self.drain_seconds)
        for sub in subscriptions:
            await sub.unsubscribe()
        self._hb_stop.set()
        if self._hb is not None:
            await self._hb
        await publish_status(self.nc, self._hb_subject, handler.status(), self.log)
        try:
            await self.nc.flush(timeout=2)
        except Exception as exc:  # noqa: BLE001 - leaving anyway; the balancer times the instance out
            self.log.warning("NATS flush on exit failed: %s", exc)


def instance_status(
    stats: EngineStats,
    *,
    instance_id: str,
    role: int,
    model: str,
    address: str,
    draining: bool,
    block_size: int,
) -> control_pb2.InstanceStatus:
    """The heartbeat payload from the engine thread's latest load snapshot.

    Prefill heartbeats carry the resident-prefix summary (for the balancer's cache-locality
    routing); decode ones do not, nobody routes on it.
    """
    resident = list(stats.resident_prefixes) if role == control_pb2.ROLE_PREFILL else []
    return control_pb2.InstanceStatus(
        instance_id=instance_id,
        role=role,
        model=model,
        address=address,
        running=stats.running,  # type: ignore[arg-type]
        waiting=stats.waiting,
        queued_tokens=stats.queued_tokens,
        free_kv_blocks=stats.free_kv_blocks,
        total_kv_blocks=stats.total_kv_blocks,
        draining=draining,
        block_size=block_size,
        resident_prefixes=resident,
    )


async def drain_tasks(
    tasks: Sequence[asyncio.Task[Any]], timeout_s: float, what: str, log: logging.Logger
) -> None:
    """Let ``tasks`` finish for up to ``timeout_s``; cancel the rest (they report their own errors)."""
    if not tasks:
        return
    log.info("draining: %d %s in flight (up to %.1f s)", len(tasks), what, timeout_s)
    _, late = await asyncio.wait(tasks, timeout=timeout_s)
    for t in late:
        t.cancel()
    if late:
        log.warning("drain deadline: cut %d %s short", len(late), what)
        await asyncio.wait(late, timeout=5.0)
