"""``python -m services.entrypoint``: the public token-level gRPC API (``deepserve.v1.Generate``).

Wiring only: NATS (balancer routes, prefill tasks, token events, aborts), the optional kvstore
client, the gRPC server with grpc_health, the ops port, and the SIGTERM drain; flags in
``config.py``, request handling in ``handlers.py``. Everything is opened on the shared
lifecycle's exit stack (``libs/common/service.py``) and closed in reverse.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1.health import aio as health_aio
from nats.aio.client import Client

from libs.common.grpc_server import add_health_and_reflection
from libs.common.service import ServiceContext, run_service
from libs.common.tenant_label import warn_if_unsalted
from libs.proto.deepserve.v1 import generate_pb2, generate_pb2_grpc
from libs.transport.keycaps import KeyCaps, open_redis

from .callers import CredentialInterceptor
from .config import SERVICE, EntrypointConfig, build_parser, config_from
from .handlers import EntrypointHandlers
from .ledger import RedisLedger
from .transport import GrpcLookup, GrpcResender, HeartbeatWatch, NatsBus, NoLookup

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build_parser, config_from, serve)


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
            return False, f"not connected to NATS at {self.config.service.nats_url}"
        if not self.grpc_port:
            return False, "gRPC server not started"
        return True, f"serving on {self.config.service.host}:{self.grpc_port}"


async def serve(config: EntrypointConfig, ctx: ServiceContext) -> int:
    svc, log = config.service, ctx.log
    state = _State(config)
    ops_port = await ctx.start_ops(state.health)
    log.info(
        "entrypoint %s: ops on http://%s:%d, NATS %s, kvstore %s",
        svc.instance_id,
        svc.host,
        ops_port,
        svc.nats_url,
        config.kvstore_address or "(none)",
    )
    kv: GrpcLookup | NoLookup = (
        GrpcLookup(config.kvstore_address, config.kvstore_timeout, config.handler.service_token)
        if config.kvstore_address
        else NoLookup()
    )
    ctx.stack.push_async_callback(kv.close)
    if not config.handler.api_keys and not config.handler.service_token:
        log.warning(
            "Generate is OPEN: no --api-keys and no --service-token; any caller that reaches "
            "port %d may send requests as any tenant",
            config.grpc_port,
        )
    warn_if_unsalted(config.handler.labels, log)
    nc = await ctx.connect_nats(drain_timeout=5.0)
    if nc is None:
        return 0
    state.nc = nc
    liveness = HeartbeatWatch()
    # token events lost in a NATS outage come back from the decode instance over gRPC
    resender = GrpcResender(nc, config.handler.service_token)
    ctx.stack.push_async_callback(resender.close)
    # route requests and PrefillTasks wait out a NATS outage (up to --nats-wait); tasks are
    # confirmed by the prefill instance and sent again until one is (delivery.py)
    bus = NatsBus(nc, outage_wait=config.nats_wait)
    caps, ledger = _shared_state(config, ctx)
    handlers = EntrypointHandlers(
        config.handler, bus, kv, liveness, resender, tasks=bus, caps=caps, ledger=ledger
    )
    await liveness.start(nc, on_status=handlers.on_status)  # before the gRPC server opens

    # a call without a credential this entrypoint takes is refused before its body is read
    server = grpc.aio.server(interceptors=[CredentialInterceptor(handlers.callers)])
    generate_pb2_grpc.add_GenerateServicer_to_server(handlers, server)  # type: ignore[no-untyped-call]
    health_servicer = await add_health_and_reflection(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{svc.host}:{config.grpc_port}")
    await server.start()
    ctx.stack.push_async_callback(
        _drain, server, health_servicer, handlers, state, svc.drain_seconds, log
    )
    state.grpc_port = port
    log.info("serving %s on %s:%d", SERVICE_NAME, svc.host, port)
    await ctx.stop.wait()
    return 0


async def _drain(
    server: grpc.aio.Server,
    health_servicer: health_aio.HealthServicer,
    handlers: EntrypointHandlers,
    state: _State,
    grace: float,
    log: logging.Logger,
) -> None:
    """Refuse new requests, let those in flight finish for up to ``grace`` seconds."""
    log.info(
        "stopping: refusing new requests, finishing %d in flight (up to %gs)",
        handlers.inflight,
        grace,
    )
    state.draining = handlers.draining = True
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=grace)  # cancels what is still running after that
    await handlers.wait_idle(timeout=2.0)  # cleanup and aborts of cancelled requests


def _shared_state(
    config: EntrypointConfig, ctx: ServiceContext
) -> tuple[KeyCaps, RedisLedger | None]:
    """The key limits (shared with the recipe replicas) and the usage ledger, both in Redis
    when --redis-url is set; without it, this process's own limits and no usage records."""
    policy, shared = config.handler.key_limits, config.shared
    if not shared.redis_url:
        ctx.log.warning(
            "no --redis-url: no usage records are written here, and an API key's limits on "
            "Generate are this entrypoint's own"
        )
        return KeyCaps(policy), None
    client = open_redis(shared.redis_url)
    ctx.stack.push_async_callback(client.aclose)
    caps = KeyCaps(policy, client, slot_ttl_s=shared.slot_ttl_s, log=ctx.log)
    ctx.background(caps.renew_forever(ctx.stop), "key-slots")
    ledger = RedisLedger(client, config.service.instance_id)
    ctx.stack.push_async_callback(ledger.flush, 5.0)  # after the server drained
    ctx.background(ledger.maintain_forever(ctx.stop), "usage-ledger")
    return caps, ledger
