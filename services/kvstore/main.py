"""kvstore process: ``python -m services.kvstore --grpc-port N --redis-url redis://... --data-dir DIR``.

Serves ``deepserve.v1.KVStore`` and gRPC health on ``--grpc-port``; ``/healthz`` and ``/metrics``
on ``--http-port``. Ready (``/healthz`` 200, gRPC health SERVING) only while Redis answers.

Storage targets: ``--target DIR_OR_S3`` (repeated) or ``--targets a,b,...``; at least 12
(10 data + 2 parity shards per block, each on a distinct target). Without any, 12 directories
``<data-dir>/targets/t00..t11`` are used. ``s3://bucket`` targets go through boto3 to
``--s3-endpoint`` (credentials from the usual AWS variables). The process keeps no state of
its own: several may serve the same targets and Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from libs.common.config import common_flags, flag
from libs.common.lifecycle import install_stop_handlers, new_instance_id, setup_logging
from libs.common.telemetry import OpsServer
from libs.kvstore.policy import DAY_S, Retention
from libs.proto.deepserve.v1 import kvstore_pb2_grpc

from .ec import Codec, tune_allocator
from .handlers import KVStoreHandlers, Metrics
from .store import BlockStore, StoreUnavailable
from .targets import open_targets

SERVICE = "kvstore"
GRPC_SERVICE_NAME = "deepserve.v1.KVStore"
PING_INTERVAL_S = 1.0


@dataclass(frozen=True)
class KVStoreConfig:
    grpc_port: int
    redis_url: str
    data_dir: Path
    host: str = "127.0.0.1"
    http_port: int = 0
    instance_id: str = ""
    drain_seconds: float = 10.0
    log_level: str = "INFO"
    max_message_bytes: int = 64 << 20
    targets: tuple[str, ...] = ()
    s3_endpoint: str = ""
    capacity_bytes: int = 0
    chat_ttl: float = 7 * DAY_S
    agent_ttl: float = 3 * DAY_S
    sweep_interval: float = 60.0
    ec_backend: str = ""

    def __post_init__(self) -> None:
        if self.targets and len(set(self.targets)) < 12:
            raise ValueError(
                f"10+2 erasure coding needs at least 12 distinct targets, got "
                f"{len(set(self.targets))}: {', '.join(self.targets)}"
            )
        if self.sweep_interval <= 0:
            raise ValueError(f"--sweep-interval must be > 0 seconds, got {self.sweep_interval}")
        self.retention()  # validates TTLs and capacity
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"--grpc-port must lie in [0, 65535], got {self.grpc_port}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must lie in [0, 65535], got {self.http_port}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"--redis-url must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}"
            )
        if self.drain_seconds < 0:
            raise ValueError(f"--drain-seconds must be >= 0, got {self.drain_seconds}")
        if self.max_message_bytes < (1 << 20):
            raise ValueError(
                f"--max-message-bytes must be at least 1 MiB, got {self.max_message_bytes}"
            )

    def retention(self) -> Retention:
        return Retention({"chat": self.chat_ttl, "agent": self.agent_ttl}, self.capacity_bytes)

    def target_specs(self) -> list[str]:
        return list(self.targets) or [
            str(self.data_dir / "targets" / f"t{i:02d}") for i in range(12)
        ]


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    flag(
        p, "--grpc-port", type=int, default=0, help="gRPC port of KVStore and health (0: any free)"
    )
    flag(
        p,
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis holding block metadata",
        env="REDIS_URL",
    )
    flag(p, "--data-dir", default=".run/kvstore", help="base of the default 12 target directories")
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="a storage target: a directory (one per SSD/server) or s3://bucket; repeat",
    )
    flag(p, "--targets", default="", help="comma-separated storage targets (adds to --target)")
    flag(p, "--s3-endpoint", default="", help="S3 endpoint URL of s3:// targets (empty: AWS)")
    flag(
        p,
        "--capacity-bytes",
        type=int,
        default=0,
        help="evict least recently used chain tails past this many block bytes (0: no limit)",
    )
    flag(
        p,
        "--chat-ttl",
        type=float,
        default=7 * DAY_S,
        help="seconds a chat block lives after last use",
    )
    flag(
        p,
        "--agent-ttl",
        type=float,
        default=3 * DAY_S,
        help="seconds an agent block lives after last use",
    )
    flag(p, "--sweep-interval", type=float, default=60.0, help="seconds between retention sweeps")
    flag(
        p,
        "--ec-backend",
        default="",
        help="pyeclib backend (default: isa_l_rs_vand, then fallbacks)",
    )
    # A DeepSeek-V3 block is 61 layers x 576 x 2 bytes x 128 tokens = 9 MB: past gRPC's 4 MiB default.
    flag(
        p,
        "--max-message-bytes",
        type=int,
        default=64 << 20,
        help="largest gRPC message (one block)",
    )
    common_flags(p, SERVICE)
    return p


def parse_config(argv: list[str] | None = None) -> KVStoreConfig:
    return config_from_args(build_parser().parse_args(argv))


def config_from_args(a: argparse.Namespace) -> KVStoreConfig:
    """The config of parsed kvstore flags (also used by ``deepserve kvstore fsck``)."""
    try:
        return KVStoreConfig(
            grpc_port=a.grpc_port,
            redis_url=a.redis_url,
            data_dir=Path(a.data_dir),
            host=a.host,
            http_port=a.http_port,
            instance_id=a.instance_id,
            drain_seconds=a.drain_seconds,
            log_level=a.log_level,
            max_message_bytes=a.max_message_bytes,
            targets=tuple(a.target + [t for t in a.targets.split(",") if t]),
            s3_endpoint=a.s3_endpoint,
            capacity_bytes=a.capacity_bytes,
            chat_ttl=a.chat_ttl,
            agent_ttl=a.agent_ttl,
            sweep_interval=a.sweep_interval,
            ec_backend=a.ec_backend,
        )
    except ValueError as exc:
        raise SystemExit(f"kvstore: {exc}") from None


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
        try:
            await asyncio.wait_for(self.store.ping(), PING_INTERVAL_S * 2)
            ok, detail = True, f"Redis at {_redacted(self.redis_url)} answers"
        except (TimeoutError, StoreUnavailable) as exc:
            ok, detail = (
                False,
                f"Redis DOWN at {_redacted(self.redis_url)}: {exc or 'ping timed out'}",
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


async def _sweep_forever(store: BlockStore, interval: float) -> None:
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


def _redacted(url: str) -> str:
    """The URL without a password, for logs and /healthz."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


async def open_store(cfg: KVStoreConfig) -> tuple[aioredis.Redis, BlockStore]:
    """Redis client and store of a config, targets created where missing."""
    tune_allocator()
    redis = aioredis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
    store = BlockStore(
        redis,
        open_targets(cfg.target_specs(), cfg.s3_endpoint),
        Codec(backend=cfg.ec_backend or None),
        cfg.retention(),
    )
    await asyncio.to_thread(store.prepare)
    return redis, store


async def serve(cfg: KVStoreConfig) -> int:
    log = setup_logging(cfg.log_level, SERVICE)
    instance = new_instance_id(SERVICE, cfg.instance_id)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    redis, store = await open_store(cfg)
    opts = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
    ]
    server = grpc.aio.server(options=opts)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreHandlers(store, Metrics()), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", GRPC_SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    grpc_port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
    monitor = RedisMonitor(store, health, cfg.redis_url)
    await monitor.check()
    await server.start()
    ops = OpsServer(cfg.host, cfg.http_port, monitor.status)
    http_port = await ops.start()
    pinger = asyncio.create_task(monitor.run())
    sweeper = asyncio.create_task(_sweep_forever(store, cfg.sweep_interval))
    log.info(
        "%s serving KVStore on %s:%d (ops http %d), %d targets (%s), redis %s",
        instance,
        cfg.host,
        grpc_port,
        http_port,
        len(store.targets),
        store.codec.backend,
        _redacted(cfg.redis_url),
    )
    try:
        await stop.wait()
        log.info("stopping: draining for up to %.1fs", cfg.drain_seconds)
        await health.enter_graceful_shutdown()
        await server.stop(grace=cfg.drain_seconds)
    finally:
        pinger.cancel()
        sweeper.cancel()
        await ops.stop()
        await redis.aclose()
        store.close()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(serve(parse_config(argv)))
