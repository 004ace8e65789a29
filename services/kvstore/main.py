"""``python -m services.kvstore``: the erasure-coded KV block store (``deepserve.v1.KVStore``).

Wiring only: Redis and the storage targets, the Redis readiness monitor, the ops port, the
retention sweeper, the orphan collector and the gRPC server with grpc_health; flags in
``config.py`` (``--help`` lists them), the RPCs in ``handlers.py``. Everything is opened on
the shared lifecycle's exit stack (``libs/common/service.py``) and closed in reverse.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as aioredis
from grpc_health.v1.health import aio as health_aio
from prometheus_client import REGISTRY

from libs.common.grpc_auth import server_interceptors
from libs.common.grpc_server import NOT_SERVING, add_health_and_reflection, new_health
from libs.common.redact import redact
from libs.common.service import STOP_MARGIN_S, ServiceContext, run_service
from libs.proto.deepserve.v1 import kvstore_pb2_grpc

from .config import SERVICE, KVStoreConfig, build_parser, config_from
from .ec import Codec, tune_allocator
from .handlers import (
    GRPC_SERVICE_NAME,
    KVStoreHandlers,
    Metrics,
    RedisMonitor,
    collect_orphans_forever,
    sweep_forever,
)
from .metrics import RedisStats, StoreCollector, StoreMetrics, TargetHealth
from .store import BlockStore
from .targets import open_targets


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build_parser, config_from, serve)


async def open_store(
    cfg: KVStoreConfig, metrics: StoreMetrics | None = None
) -> tuple[aioredis.Redis, BlockStore]:
    """Redis client and store of a config, targets created where missing (also used by
    ``deepserve kvstore fsck``); the caller closes both. ``metrics``: where the store counts
    (None: a private registry)."""
    tune_allocator()
    redis = aioredis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
    store = BlockStore(
        redis,
        open_targets(cfg.target_specs(), cfg.s3_endpoint),
        Codec(backend=cfg.ec_backend or None),
        cfg.retention(),
        metrics=metrics,
    )
    await asyncio.to_thread(store.prepare)
    return redis, store


async def _close_store(redis: aioredis.Redis, store: BlockStore) -> None:
    await redis.aclose()
    store.close()


async def serve(cfg: KVStoreConfig, ctx: ServiceContext) -> int:
    svc, log = cfg.service, ctx.log
    redis, store = await open_store(cfg, StoreMetrics(REGISTRY))
    ctx.stack.push_async_callback(_close_store, redis, store)
    health = await new_health([GRPC_SERVICE_NAME], NOT_SERVING)  # until Redis answers
    monitor = RedisMonitor(store, health, cfg.redis_url)
    await monitor.check()
    await _register_state_metrics(cfg, ctx, store, monitor)
    http_port = await ctx.start_ops(monitor.status)
    # Loops with nothing to clean up when cancelled: their stop is bounded (a Redis command
    # can lose the cancel, see cancel_task).
    ctx.background(monitor.run(), "redis-ping", STOP_MARGIN_S)
    ctx.background(sweep_forever(store, cfg.sweep_interval), "retention-sweep", STOP_MARGIN_S)
    if cfg.orphan_interval:
        ctx.background(
            collect_orphans_forever(store, cfg.orphan_interval, cfg.orphan_grace),
            "orphans",
            STOP_MARGIN_S,
        )
    opts = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
    ]
    server = grpc.aio.server(
        options=opts, interceptors=server_interceptors(cfg.service_token, log, "KVStore")
    )
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(  # type: ignore[no-untyped-call]
        KVStoreHandlers(store, Metrics()), server
    )
    await add_health_and_reflection(server, [GRPC_SERVICE_NAME], health)
    grpc_port = server.add_insecure_port(f"{svc.host}:{cfg.grpc_port}")
    await server.start()
    ctx.stack.push_async_callback(_stop_grpc, server, health, svc.drain_seconds, log)
    log.info(
        "%s serving KVStore on %s:%d (ops http %d), %d targets (%s), redis %s",
        svc.instance_id,
        svc.host,
        grpc_port,
        http_port,
        len(store.targets),
        store.codec.backend,
        redact(cfg.redis_url),
    )
    await ctx.stop.wait()
    return 0


async def _register_state_metrics(
    cfg: KVStoreConfig, ctx: ServiceContext, store: BlockStore, monitor: RedisMonitor
) -> None:
    """The scrape-time gauges (``metrics.py``): store size from Redis (skipped while the
    monitor sees Redis down, so a scrape never waits on it), target health from a probe."""
    targets = TargetHealth(store.targets)
    await targets.check()
    ctx.background(targets.run(), "target-probe", STOP_MARGIN_S)
    stats = RedisStats(cfg.redis_url)
    ctx.stack.callback(stats.close)
    collector = StoreCollector(
        lambda: stats() if monitor.ok else None, targets, store.retention.capacity_bytes
    )
    REGISTRY.register(collector)
    ctx.stack.callback(REGISTRY.unregister, collector)


async def _stop_grpc(
    server: grpc.aio.Server, health: health_aio.HealthServicer, grace: float, log: logging.Logger
) -> None:
    log.info("stopping: draining for up to %.1fs", grace)
    await health.enter_graceful_shutdown()
    # stop() cancels the RPCs still running after the grace, then waits for their handlers to
    # return: bounded here, so a handler that ignores its cancellation cannot hold the exit.
    stopping = asyncio.ensure_future(server.stop(grace=grace))
    done, _ = await asyncio.wait({stopping}, timeout=grace + STOP_MARGIN_S)
    if not done:
        log.error(
            "gRPC server not stopped %.1fs after draining began: an RPC handler ignores its "
            "cancellation; not waiting for it",
            grace + STOP_MARGIN_S,
        )
