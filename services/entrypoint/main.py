"""``python -m services.entrypoint``: the public token-level gRPC API (``deepserve.v1.Generate``).

Wiring only: NATS (balancer routes, prefill tasks, token events, aborts), the optional kvstore
client, the gRPC server with grpc_health, the ops port, and the SIGTERM drain.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from nats.aio.client import Client

from libs.common.config import common_flags, flag
from libs.common.lifecycle import install_stop_handlers, new_instance_id, setup_logging
from libs.common.natsutil import connect_nats
from libs.common.telemetry import OpsServer
from libs.gateway.policy import Limits
from libs.proto.deepserve.v1 import generate_pb2, generate_pb2_grpc

from .handlers import EntrypointHandlers, HandlerConfig, PrefixLookup
from .transport import GrpcLookup, HeartbeatWatch, NatsBus, NoLookup

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


@dataclass(frozen=True)
class EntrypointConfig:
    handler: HandlerConfig
    nats_url: str
    host: str
    grpc_port: int
    http_port: int
    kvstore_address: str
    kvstore_timeout: float
    instance_id: str
    drain_seconds: float

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must lie in [0, 65536)")
        if self.kvstore_address and ":" not in self.kvstore_address:
            raise ValueError(f"--kvstore-address must be host:port, got {self.kvstore_address!r}")
        if not self.kvstore_timeout > 0:
            raise ValueError(f"--kvstore-timeout must be > 0 seconds, got {self.kvstore_timeout}")
        if self.drain_seconds < 0:
            raise ValueError(f"--drain-seconds must be >= 0, got {self.drain_seconds}")


def parse_args(argv: list[str] | None = None) -> tuple[EntrypointConfig, str]:
    parser = argparse.ArgumentParser(prog="python -m services.entrypoint", description=__doc__)
    common_flags(parser, "entrypoint")
    flag(parser, "--grpc-port", type=int, default=50051, help="port of the Generate gRPC API")
    flag(parser, "--kvstore-address", default="", help="kvstore gRPC host:port (empty: no cache)")
    flag(
        parser,
        "--kvstore-timeout",
        type=float,
        default=1.0,
        help="seconds to wait for a kvstore lookup before computing the prompt from scratch",
    )
    flag(parser, "--model-name", default="deepseek-tiny", help="served model name")
    flag(parser, "--vocab-size", type=int, default=129280, help="token ids must lie below this")
    flag(parser, "--max-context", type=int, default=163840, help="prompt + completion token limit")
    flag(parser, "--block-size", type=int, default=128, help="tokens per KV block (hash chain)")
    flag(
        parser, "--route-timeout", type=float, default=2.0, help="seconds to wait for the balancer"
    )
    flag(
        parser,
        "--request-timeout",
        type=float,
        default=60.0,
        help="seconds without a token event after which a request is aborted",
    )
    flag(
        parser,
        "--max-inflight",
        type=int,
        default=256,
        help="requests served at once (0: no limit); more wait, then get RESOURCE_EXHAUSTED",
    )
    flag(
        parser,
        "--max-waiting",
        type=int,
        default=256,
        help="requests that may wait for a slot; past that RESOURCE_EXHAUSTED at once",
    )
    flag(
        parser,
        "--admit-wait",
        type=float,
        default=1.0,
        help="seconds a request waits for a slot before RESOURCE_EXHAUSTED",
    )
    flag(
        parser,
        "--retry-after-ms",
        type=int,
        default=500,
        help="retry hint sent with RESOURCE_EXHAUSTED (trailing metadata retry-after-ms)",
    )
    flag(
        parser,
        "--max-attempts",
        type=int,
        default=3,
        help="attempts per request when instances fail (1: no retry)",
    )
    flag(
        parser,
        "--instance-dead-after",
        type=float,
        default=3.0,
        help="seconds without a heartbeat after which a serving instance counts as dead",
    )
    args = parser.parse_args(argv)
    try:
        limits = Limits(
            model_name=args.model_name,
            vocab_size=args.vocab_size,
            max_context=args.max_context,
            block_size=args.block_size,
        )
        config = EntrypointConfig(
            handler=HandlerConfig(
                limits=limits,
                route_timeout=args.route_timeout,
                request_timeout=args.request_timeout,
                max_inflight=args.max_inflight,
                max_waiting=args.max_waiting,
                admit_wait=args.admit_wait,
                retry_after_ms=args.retry_after_ms,
                max_attempts=args.max_attempts,
                instance_dead_after=args.instance_dead_after,
            ),
            nats_url=args.nats_url,
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            kvstore_address=args.kvstore_address,
            kvstore_timeout=args.kvstore_timeout,
            instance_id=new_instance_id("entrypoint", args.instance_id),
            drain_seconds=args.drain_seconds,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.log_level


class _State:
    def __init__(self, config: EntrypointConfig) -> None:
        self.config = config
        self.nc: Client | None = None
        self.grpc_port = 0  # bound port, once serving
        self.draining = False

    def health(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self.nc is None or not self.nc.is_connected:
            return False, f"not connected to NATS at {self.config.nats_url}"
        if not self.grpc_port:
            return False, "gRPC server not started"
        return True, f"serving on {self.config.host}:{self.grpc_port}"


async def run(config: EntrypointConfig, log: logging.Logger) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    state = _State(config)
    ops = OpsServer(config.host, config.http_port, state.health)
    ops_port = await ops.start()
    log.info(
        "entrypoint %s: ops on http://%s:%d, NATS %s, kvstore %s",
        config.instance_id,
        config.host,
        ops_port,
        config.nats_url,
        config.kvstore_address or "(none)",
    )
    nc = await connect_nats(config.nats_url, config.instance_id, stop, log, config.drain_seconds)
    if nc is None:
        await ops.stop()
        return 0
    state.nc = nc
    kv: PrefixLookup = (
        GrpcLookup(config.kvstore_address, config.kvstore_timeout)
        if config.kvstore_address
        else NoLookup()
    )
    liveness = HeartbeatWatch()
    await liveness.start(nc)
    handlers = EntrypointHandlers(config.handler, NatsBus(nc), kv, liveness)

    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServicer_to_server(handlers, server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    state.grpc_port = port
    log.info("serving %s on %s:%d", SERVICE_NAME, config.host, port)

    await stop.wait()
    log.info(
        "stopping: refusing new requests, finishing %d in flight (up to %gs)",
        handlers.inflight,
        config.drain_seconds,
    )
    state.draining = handlers.draining = True
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=config.drain_seconds)  # cancels what is still running after that
    await handlers.wait_idle(timeout=2.0)  # cleanup and aborts of cancelled requests
    try:
        await asyncio.wait_for(nc.drain(), 5)
    except Exception as exc:  # noqa: BLE001 - shutting down; a failed drain must not hang exit
        log.warning("NATS drain: %s", exc)
        await nc.close()
    if isinstance(kv, GrpcLookup):
        await kv.close()
    await ops.stop()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    config, level = parse_args(argv)
    log = setup_logging(level, "entrypoint")
    return asyncio.run(run(config, log))
