"""gRPC ``deepserve.v1.KVStore`` over a :class:`BlockStore`: errors mapped to status codes here,
once, in :meth:`KVStoreHandlers._rpc` (through :func:`libs.common.grpc_errors.abort`).

* :class:`InvalidBlock` (an InvalidArgument) -> ``INVALID_ARGUMENT`` (the message names the
  field; nothing stored);
* :class:`StoreUnavailable` (an Unavailable: Redis down, or a block with more than 2 of its
  shards on targets that are down) and :class:`TargetDown` (a put cannot reach a target) ->
  ``UNAVAILABLE``;
* other disk errors -> ``INTERNAL`` with the OS error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from libs.common import grpc_errors
from libs.common.errors import DeepserveError, Internal, Unavailable
from libs.common.redact import redact
from libs.common.telemetry import extract_context, tracer
from libs.proto.deepserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

from .fsck import collect_orphans
from .store import BlockPut, BlockStore, StoreUnavailable
from .targets import TargetDown

log = logging.getLogger("kvstore.handlers")

_CLASS_NAMES = {
    common_pb2.TRAFFIC_CLASS_UNSPECIFIED: "chat",  # unspecified keeps the longer (chat) retention
    common_pb2.TRAFFIC_CLASS_CHAT: "chat",
    common_pb2.TRAFFIC_CLASS_AGENT: "agent",
}


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter(
            "deepserve_kvstore_requests_total",
            "KVStore RPCs by method and status",
            ["method", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "deepserve_kvstore_request_seconds",
            "KVStore RPC latency",
            ["method"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.blocks = Counter(
            "deepserve_kvstore_blocks_total",
            "blocks by operation (put_stored, put_skipped, get, deleted)",
            ["op"],
            registry=registry,
        )
        self.bytes = Counter(
            "deepserve_kvstore_bytes_total",
            "frame bytes by operation (put, get)",
            ["op"],
            registry=registry,
        )
        self.lookup_hits = Histogram(
            "deepserve_kvstore_lookup_hit_ratio",
            "leading blocks present / blocks asked, per Lookup",
            registry=registry,
            buckets=(0, 0.25, 0.5, 0.75, 0.9, 0.99, 1),
        )


class KVStoreHandlers(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, metrics: Metrics | None = None) -> None:
        self.store = store
        self.metrics = metrics or Metrics(CollectorRegistry())
        self.tracer = tracer("kvstore")

    @contextlib.asynccontextmanager
    async def _rpc(
        self, method: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trace.Span]:
        """A span and metrics around one RPC; an error ends it with its kind's status code."""
        parent = dict(context.invocation_metadata() or ()).get("traceparent", "")
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            try:
                with self.tracer.start_as_current_span(
                    f"kvstore.{method}", context=extract_context(str(parent))
                ) as span:
                    yield span
            except TargetDown as exc:  # an OSError, but the target is down, not the disk bad
                raise Unavailable(str(exc)) from None
            except OSError as exc:
                log.exception("%s: disk error", method)
                raise Internal(f"kvstore disk error: {exc}") from None
        except DeepserveError as exc:
            code = grpc_errors.status_code(exc)
            await grpc_errors.abort(context, exc)
        except BaseException:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.metrics.requests.labels(method, code.name).inc()
            self.metrics.latency.labels(method).observe(time.perf_counter() - t0)

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupReply:
        async with self._rpc("Lookup", context) as span:
            n = await self.store.lookup(list(request.hashes))
            span.set_attribute("kv.asked", len(request.hashes))
            span.set_attribute("kv.present", n)
            if request.hashes:
                self.metrics.lookup_hits.observe(n / len(request.hashes))
            return kvstore_pb2.LookupReply(num_present=n)

    async def Put(
        self,
        request_iterator: AsyncIterator[kvstore_pb2.PutBlock],
        context: grpc.aio.ServicerContext,
    ) -> kvstore_pb2.PutReply:
        async def blocks() -> AsyncIterator[BlockPut]:
            async for msg in request_iterator:
                self.metrics.bytes.labels("put").inc(len(msg.data))
                yield BlockPut(
                    msg.hash,
                    msg.parent_hash,
                    msg.data,
                    msg.tenant,
                    _CLASS_NAMES.get(msg.traffic_class, "chat"),
                )

        async with self._rpc("Put", context) as span:
            result = await self.store.put(blocks())
            span.set_attribute("kv.stored", result.stored)
            span.set_attribute("kv.skipped", result.skipped)
            self.metrics.blocks.labels("put_stored").inc(result.stored)
            self.metrics.blocks.labels("put_skipped").inc(result.skipped)
            return kvstore_pb2.PutReply(stored=result.stored, skipped=result.skipped)

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.Block]:
        async with self._rpc("Get", context) as span:
            n = 0
            async for h, data in self.store.get(list(request.hashes)):
                n += 1
                self.metrics.blocks.labels("get").inc()
                self.metrics.bytes.labels("get").inc(len(data))
                yield kvstore_pb2.Block(hash=h, data=data)
            span.set_attribute("kv.served", n)

    async def Delete(
        self, request: kvstore_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.DeleteReply:
        async with self._rpc("Delete", context):
            n = await self.store.delete(list(request.hashes))
            self.metrics.blocks.labels("deleted").inc(n)
            return kvstore_pb2.DeleteReply(deleted=n)

    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatsReply:
        async with self._rpc("Stats", context):
            blocks, size = await self.store.stats()
            return kvstore_pb2.StatsReply(blocks=blocks, bytes=size)


# -- Readiness and retention timers (moved here from main.py) ---------------------------------

GRPC_SERVICE_NAME = "deepserve.v1.KVStore"
PING_INTERVAL_S = 1.0


class RedisMonitor:
    """Pings Redis every second; readiness (HTTP and gRPC health) follows the answer."""

    def __init__(
        self, store: BlockStore, health: health_aio.HealthServicer, redis_url: str
    ) -> None:
        self.store, self.health, self.redis_url = store, health, redis_url
        self.ok = False
        self.detail = "Redis not checked yet"
        self.log = logging.getLogger("kvstore.health")

    def status(self) -> tuple[bool, str]:
        return self.ok, self.detail

    async def check(self) -> None:
        # The ping is a task of its own, awaited with asyncio.wait, so cancelling check() always
        # ends it. Not wait_for, nor a ping in this task: on Python 3.11 both lose a cancel that
        # lands as a command finishes (redis-py awaits wait_for inside every command), and run()
        # then pings on forever, holding the service's exit.
        ping = asyncio.ensure_future(self.store.ping())
        ping.add_done_callback(_retrieve)  # a ping given up on must not warn when it fails
        try:
            done, _ = await asyncio.wait({ping}, timeout=PING_INTERVAL_S * 2)
        finally:
            ping.cancel()  # nothing once it is done
        try:
            if not done:
                raise TimeoutError
            ping.result()
            ok, detail = True, f"Redis at {redact(self.redis_url)} answers"
        except (TimeoutError, StoreUnavailable) as exc:
            ok, detail = (
                False,
                f"Redis DOWN at {redact(self.redis_url)}: {str(exc) or 'ping timed out'}",
            )
        if ok != self.ok:
            (self.log.info if ok else self.log.error)(detail)
            r = health_pb2.HealthCheckResponse
            status = r.SERVING if ok else r.NOT_SERVING
            for name in ("", GRPC_SERVICE_NAME):
                await self.health.set(name, status)
        self.ok, self.detail = ok, detail

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(PING_INTERVAL_S)


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


async def sweep_forever(store: BlockStore, interval: float) -> None:
    """Retention every ``interval`` seconds; several processes sweeping at once is harmless
    (deletes are idempotent Lua scripts)."""
    log = logging.getLogger("kvstore.retention")
    while True:
        await asyncio.sleep(interval)
        try:
            await store.sweep()
        except StoreUnavailable as exc:
            log.warning("retention sweep skipped: %s", exc)
        except Exception:
            log.exception("retention sweep failed")


async def collect_orphans_forever(store: BlockStore, interval: float, grace: float) -> None:
    """Remove orphan shards older than ``grace`` every ``interval`` seconds (first run after one
    interval). Several processes collecting at once is harmless (deletes are idempotent, and
    metadata is read after the listing)."""
    log = logging.getLogger("kvstore.orphans")
    while True:
        await asyncio.sleep(interval)
        try:
            report = await collect_orphans(store, grace)
        except StoreUnavailable as exc:
            log.warning("orphan collection skipped: %s", exc)
            continue
        except Exception:
            log.exception("orphan collection failed")
            continue
        if report.removed_orphans:
            log.warning("removed %d orphan shards", report.removed_orphans)
