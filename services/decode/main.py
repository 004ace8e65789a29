"""decode service: ``python -m services.decode --grpc-port 50061 --nats-url nats://...``.

Serves ``deepserve.v1.KVTransfer`` (and grpc.health.v1) on ``--grpc-port``, publishes the
tokens it generates on each request's events subject, heartbeats every second on
``ds.heartbeat.decode.<id>``, drops requests named on ``ds.abort``. SIGTERM: heartbeat
``draining``, refuse new pushes, finish running requests for up to ``--drain-seconds``, exit 0.

Wiring only: flags in ``config.py``, the work in ``handlers.py``; everything is opened on the
shared lifecycle's exit stack (``libs/common/service.py``) and closed in reverse.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial

import grpc
from grpc_health.v1.health import aio as health_aio

from libs.common import subjects
from libs.common.grpc_auth import server_interceptors
from libs.common.grpc_server import add_health_and_reflection
from libs.common.service import ServiceContext, run_service
from libs.common.telemetry import tracer
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2_grpc
from libs.serving.ep_supervisor import supervise
from libs.serving.instance import InstanceRuntime
from libs.serving.runtime import advertise_host
from libs.transport.kvstore_client import KVStore, open_kvstore

from .config import SERVICE, DecodeConfig, build_parser, config_from
from .handlers import DecodeHandler
from .transfer import KVTransferServicer

MAX_MESSAGE_BYTES = 8 << 20  # KV arrives in chunks of <= 1 MiB; leave room


async def open_decode(
    ctx: ServiceContext,
    rt: InstanceRuntime,
    grpc_port: int,
    service_token: str,
    kvstore: KVStore | None,
    service: str,
) -> tuple[DecodeHandler, health_aio.HealthServicer]:
    """The decode role over ``rt``'s engine: its handler, and the ``KVTransfer`` server (with
    gRPC health) started on ``grpc_port`` and stopped by the service's exit stack. Decode's
    own wiring, and an aggregated instance's decode half."""
    assert rt.loop is not None and rt.nc is not None
    host, instance_id = ctx.config.host, ctx.config.instance_id
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        interceptors=server_interceptors(service_token, ctx.log, "KVTransfer"),
    )
    port = server.add_insecure_port(f"{host}:{grpc_port}")
    address = f"{advertise_host(host)}:{port}"
    handler = DecodeHandler(
        rt.loop,
        rt.nc.publish,
        instance_id=instance_id,
        model_name=rt.model.model_name,
        address=address,
        block_size=rt.model.block_size,
        tracer=tracer(service),
        kvstore=kvstore,
    )
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(  # type: ignore[no-untyped-call]
        KVTransferServicer(handler), server
    )
    health_servicer = await add_health_and_reflection(server, ["deepserve.v1.KVTransfer"])
    await server.start()
    ctx.stack.push_async_callback(server.stop, 5.0)
    ctx.log.info("KVTransfer on %s (instance %s)", address, instance_id)
    return handler, health_servicer


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    return run_service(SERVICE, args, build_parser, config_from, partial(serve, argv=args))


async def serve(cfg: DecodeConfig, ctx: ServiceContext, argv: Sequence[str] = ()) -> int:
    if cfg.ep.supervises:  # --ep N: this process starts and watches the N rank processes
        return await supervise(
            ctx, SERVICE, argv, cfg.ep, own_grpc_port=True, device=cfg.model.device
        )
    rt = InstanceRuntime(ctx, cfg.model, cfg.heartbeat_interval, cfg.ep, cfg.stats_interval)
    rc = await rt.start()
    if rc is not None:
        return rc
    assert rt.loop is not None and rt.nc is not None
    nc = rt.nc
    kvstore = open_kvstore(ctx.stack, cfg.kvstore_address, cfg.service_token)
    handler, health_servicer = await open_decode(
        ctx, rt, cfg.grpc_port, cfg.service_token, kvstore, SERVICE
    )

    async def on_abort(msg: object) -> None:
        await handler.on_abort(control_pb2.Abort.FromString(msg.data))  # type: ignore[attr-defined]

    subs = [await nc.subscribe(subjects.ABORT, cb=on_abort)]
    await rt.ready(handler.status)  # subscribed and serving gRPC: /healthz may say 200
    await ctx.stop.wait()
    await rt.leave(handler, subs, before_drain=health_servicer.enter_graceful_shutdown)
    return rt.exit_code
