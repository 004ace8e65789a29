"""The kvstore's stop path without Redis or clients: a cancel always ends the Redis monitor's
loop (``handlers.RedisMonitor``; the service's exit waits for it), its readiness follows the
ping, and a gRPC stop that never ends does not hold the exit (``main._stop_grpc``).

CI once saw the kvstore never exit after SIGTERM: the loop's ``asyncio.wait_for`` around the
ping returned the answer when the cancel landed just as Redis answered (Python 3.11), and it
pinged on. redis-py loses a cancel the same way inside a command (it awaits ``wait_for``
there too), so a ping run in the monitor's own task is no cure either."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from grpc_health.v1 import health_pb2

from libs.common.grpc_server import NOT_SERVING, new_health
from services.kvstore import handlers
from services.kvstore.handlers import GRPC_SERVICE_NAME, RedisMonitor
from services.kvstore.main import _stop_grpc
from services.kvstore.store import StoreUnavailable


class _Store:
    """A ping that answers when the test says so; ``lossy``: it swallows a cancel, as a
    redis-py command does when the cancel lands as the command finishes."""

    def __init__(self, lossy: bool = False) -> None:
        self.lossy = lossy
        self.answer: asyncio.Future[None] | None = None
        self.asked = asyncio.Event()

    async def ping(self) -> None:
        self.answer = asyncio.get_running_loop().create_future()
        self.asked.set()
        try:
            await self.answer
        except asyncio.CancelledError:
            if not self.lossy:
                raise


async def _monitor(store: _Store) -> RedisMonitor:
    health = await new_health([GRPC_SERVICE_NAME], NOT_SERVING)
    return RedisMonitor(store, health, "redis://:hunter2@127.0.0.1:6379/0")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "how", ["Redis answers as the cancel lands", "the ping swallows the cancel"]
)
async def test_a_cancel_always_ends_the_monitor(how: str) -> None:
    store = _Store(lossy=how == "the ping swallows the cancel")
    monitor = await _monitor(store)
    task = asyncio.create_task(monitor.run())
    await store.asked.wait()
    assert store.answer is not None
    if how == "Redis answers as the cancel lands":
        store.answer.set_result(None)  # in the same step as the cancel: both are pending
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=3)  # the loop pings every second
    if not done:  # leave nothing running whatever happened
        task.cancel()
        await asyncio.wait({task}, timeout=3)
    assert done and task.cancelled(), "the monitor lost its cancel and pinged on"


async def test_readiness_follows_the_ping(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store()
    monitor = await _monitor(store)
    check = asyncio.create_task(monitor.check())
    await store.asked.wait()
    assert store.answer is not None
    store.answer.set_result(None)
    await check
    assert monitor.status() == (True, "Redis at redis://:***@127.0.0.1:6379/0 answers")
    watch = health_pb2.HealthCheckRequest(service=GRPC_SERVICE_NAME)
    reply = await monitor.health.Check(watch, None)  # type: ignore[arg-type]
    assert reply.status == health_pb2.HealthCheckResponse.SERVING

    store.asked.clear()
    check = asyncio.create_task(monitor.check())
    await store.asked.wait()
    assert store.answer is not None
    store.answer.set_exception(StoreUnavailable("Redis does not answer (ConnectionError)"))
    await check
    ok, detail = monitor.status()
    assert not ok and detail.startswith("Redis DOWN at redis://:***@127.0.0.1:6379/0: ")
    reply = await monitor.health.Check(watch, None)  # type: ignore[arg-type]
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

    monkeypatch.setattr(handlers, "PING_INTERVAL_S", 0.05)  # a ping gets 0.1 s
    store.asked.clear()
    await monitor.check()  # nothing answers
    assert monitor.status() == (
        False,
        "Redis DOWN at redis://:***@127.0.0.1:6379/0: ping timed out",
    )
    assert store.answer is not None and store.answer.cancelled()  # the ping given up on ended


class _StuckServer:
    """A gRPC server whose stop never returns (a handler that ignores its cancellation)."""

    async def stop(self, grace: float) -> None:
        await asyncio.sleep(3600)


async def test_a_grpc_stop_that_never_ends_is_logged_and_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = await new_health([GRPC_SERVICE_NAME])
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO):
        await _stop_grpc(_StuckServer(), health, 0.2, logging.getLogger("kvstore"))  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 3
    assert "stopping: draining for up to 0.2s" in caplog.text
    assert "gRPC server not stopped 1.2s after draining began" in caplog.text
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""), None)  # type: ignore[arg-type]
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # draining: not ready
