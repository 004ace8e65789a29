"""aggregated service: ``python -m services.aggregated --grpc-port 50061 --nats-url nats://...``.

One engine, both roles: where prefill and decode would share a GPU, one instance does both
with one copy of the weights and one KV pool. It takes PrefillTasks on
``ds.prefill.<id>.task`` like a prefill instance and serves ``deepserve.v1.KVTransfer`` like a
decode instance, and heartbeats as both (``ds.heartbeat.prefill.<id>`` with its resident
prefixes, ``ds.heartbeat.decode.<id>`` with its KVTransfer address), so the balancer,
entrypoint, kvstore, failover and status page treat it as the two instances it stands for.
A task whose decode target is this instance never moves its KV: the engine that computed the
prompt goes on generating it (prompt chunks ride in the decode batch under the step's time
budget). A task for another decode instance is handed over as a prefill instance does, and a
push from another prefill instance is taken as a decode instance does. SIGTERM: both roles
heartbeat ``draining``, take nothing new, finish what runs for up to ``--drain-seconds``.

Wiring only: flags in ``config.py``; the work is the prefill and decode handlers'.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from libs.common import subjects
from libs.common.grpc_auth import server_interceptors
from libs.common.grpc_server import add_health_and_reflection
from libs.common.service import ServiceContext, run_service
from libs.common.telemetry import tracer
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2_grpc
from libs.serving.instance import InstanceRuntime
from libs.serving.known_decoders import CheckedPusher, KnownDecoders
from libs.serving.runtime import advertise_host
from libs.transport.kvstore_client import GrpcKVStore
from services.decode.handlers import DecodeHandler, KVTransferServicer
from services.decode.main import MAX_MESSAGE_BYTES
from services.prefill.clients import GrpcKVPusher
from services.prefill.handlers import PrefillHandler

from .config import SERVICE, AggregatedConfig, build_parser, config_from


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    return run_service(SERVICE, args, build_parser, config_from, serve)


class BothRoles:
    """The two handlers as one drainable instance (what :meth:`InstanceRuntime.leave` takes):
    draining one drains both; the prefill role's status is the primary heartbeat."""

    def __init__(self, prefill: PrefillHandler, decode: DecodeHandler) -> None:
        self.prefill, self.decode = prefill, decode

    @property
    def draining(self) -> bool:
        return self.prefill.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.prefill.draining = self.decode.draining = value

    def status(self) -> control_pb2.InstanceStatus:
        return self.prefill.status()

    async def drain(self, seconds: float) -> None:
        await asyncio.gather(self.prefill.drain(seconds), self.decode.drain(seconds))

    async def on_abort(self, abort: control_pb2.Abort) -> None:
        await self.decode.on_abort(abort)  # marks a local request's end as an abort first
        await self.prefill.on_abort(abort)


async def serve(cfg: AggregatedConfig, ctx: ServiceContext) -> int:
    log, host, instance_id = ctx.log, cfg.service.host, cfg.service.instance_id
    rt = InstanceRuntime(
        ctx, cfg.model, cfg.heartbeat_interval, None, cfg.stats_interval, heartbeat_role="prefill"
    )
    rc = await rt.start()
    if rc is not None:
        return rc
    assert rt.loop is not None and rt.nc is not None
    nc = rt.nc
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        interceptors=server_interceptors(cfg.service_token, log, "KVTransfer"),
    )
    port = server.add_insecure_port(f"{host}:{cfg.grpc_port}")
    address = f"{advertise_host(host)}:{port}"
    kvstore = GrpcKVStore(cfg.kvstore_address, cfg.service_token) if cfg.kvstore_address else None
    if kvstore is not None:
        ctx.stack.push_async_callback(kvstore.close)
    pusher = GrpcKVPusher(cfg.push_timeout_s, token=cfg.service_token)
    ctx.stack.push_async_callback(pusher.close)
    decoders = KnownDecoders()
    decoders_sub = await decoders.subscribe(nc)
    decode = DecodeHandler(
        rt.loop,
        nc.publish,
        instance_id=instance_id,
        model_name=cfg.model.model_name,
        address=address,
        block_size=cfg.model.block_size,
        tracer=tracer(SERVICE),
        kvstore=kvstore,
    )
    prefill = PrefillHandler(
        rt.loop,
        nc.publish,
        CheckedPusher(pusher, decoders),  # only to decode instances heard on NATS
        instance_id=instance_id,
        model_name=cfg.model.model_name,
        block_size=cfg.model.block_size,
        max_model_len=rt.loop.engine.scheduler_config.max_model_len,
        kvstore=kvstore,
        tracer=tracer(SERVICE),
        local=decode,
    )
    both = BothRoles(prefill, decode)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(  # type: ignore[no-untyped-call]
        KVTransferServicer(decode), server
    )
    health_servicer = await add_health_and_reflection(server, ["deepserve.v1.KVTransfer"])
    await server.start()
    ctx.stack.push_async_callback(server.stop, 5.0)

    async def on_abort(msg: object) -> None:
        await both.on_abort(control_pb2.Abort.FromString(msg.data))  # type: ignore[attr-defined]

    subs = [
        await nc.subscribe(subjects.prefill_task(instance_id), cb=prefill.on_message),
        await nc.subscribe(subjects.ABORT, cb=on_abort),
        decoders_sub,
    ]
    await rt.ready(prefill.status, more_roles=[("decode", decode.status)])
    log.info(
        "aggregated instance %s: tasks on %s, KVTransfer on %s (kvstore: %s)",
        instance_id,
        subjects.prefill_task(instance_id),
        address,
        cfg.kvstore_address or "none",
    )
    await ctx.stop.wait()
    await rt.leave(both, subs, before_drain=health_servicer.enter_graceful_shutdown)
    return rt.exit_code
