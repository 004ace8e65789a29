"""gRPC ``deepserve.v1.KVStore`` over a :class:`BlockStore`: errors mapped to status codes here, once.

* :class:`InvalidBlock` -> ``INVALID_ARGUMENT`` (the message names the field; nothing stored);
* :class:`StoreUnavailable` (Redis down, or a block with more than 2 of its shards on targets
  that are down) and :class:`TargetDown` (a put cannot reach a target) -> ``UNAVAILABLE``;
* disk errors -> ``INTERNAL`` with the OS error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import grpc
from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from libs.common.telemetry import extract_context, tracer
from libs.proto.deepserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

from .store import BlockPut, BlockStore, InvalidBlock, StoreUnavailable
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

    @contextlib.contextmanager
    def _rpc(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[trace.Span]:
        """A span and metrics around one RPC; the store's typed errors become status codes."""
        parent = dict(context.invocation_metadata() or ()).get("traceparent", "")
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            with self.tracer.start_as_current_span(
                f"kvstore.{method}", context=extract_context(str(parent))
            ) as span:
                yield span
        except InvalidBlock as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT
            raise _Abort(code, str(exc)) from None
        except (StoreUnavailable, TargetDown) as exc:
            code = grpc.StatusCode.UNAVAILABLE
            raise _Abort(code, str(exc)) from None
        except OSError as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s: disk error", method)
            raise _Abort(code, f"kvstore disk error: {exc}") from None
        except BaseException:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.metrics.requests.labels(method, code.name).inc()
            self.metrics.latency.labels(method).observe(time.perf_counter() - t0)

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupReply:
        try:
            with self._rpc("Lookup", context) as span:
                n = await self.store.lookup(list(request.hashes))
                span.set_attribute("kv.asked", len(request.hashes))
                span.set_attribute("kv.present", n)
                if request.hashes:
                    self.metrics.lookup_hits.observe(n / len(request.hashes))
                return kvstore_pb2.LookupReply(num_present=n)
        except _Abort as a:
            await context.abort(a.code, a.message)
            raise  # unreachable: abort raises

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

        try:
            with self._rpc("Put", context) as span:
                result = await self.store.put(blocks())
                span.set_attribute("kv.stored", result.stored)
                span.set_attribute("kv.skipped", result.skipped)
                self.metrics.blocks.labels("put_stored").inc(result.stored)
                self.metrics.blocks.labels("put_skipped").inc(result.skipped)
                return kvstore_pb2.PutReply(stored=result.stored, skipped=result.skipped)
        except _Abort as a:
            await context.abort(a.code, a.message)
            raise

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.Block]:
        try:
            with self._rpc("Get", context) as span:
                n = 0
                async for h, data in self.store.get(list(request.hashes)):
                    n += 1
                    self.metrics.blocks.labels("get").inc()
                    self.metrics.bytes.labels("get").inc(len(data))
                    yield kvstore_pb2.Block(hash=h, data=data)
                span.set_attribute("kv.served", n)
        except _Abort as a:
            await context.abort(a.code, a.message)

    async def Delete(
        self, request: kvstore_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.DeleteReply:
        try:
            with self._rpc("Delete", context):
                n = await self.store.delete(list(request.hashes))
                self.metrics.blocks.labels("deleted").inc(n)
                return kvstore_pb2.DeleteReply(deleted=n)
        except _Abort as a:
            await context.abort(a.code, a.message)
            raise

    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatsReply:
        try:
            with self._rpc("Stats", context):
                blocks, size = await self.store.stats()
                return kvstore_pb2.StatsReply(blocks=blocks, bytes=size)
        except _Abort as a:
            await context.abort(a.code, a.message)
            raise


class _Abort(Exception):
    """Carries a status code out of :meth:`KVStoreHandlers._rpc` to ``context.abort``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message
