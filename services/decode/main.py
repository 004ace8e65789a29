"""decode service: ``python -m services.decode --grpc-port 50061 --nats-url nats://...``.

Serves ``deepserve.v1.KVTransfer`` (and grpc.health.v1) on ``--grpc-port``, publishes the
tokens it generates on each request's events subject, heartbeats every second on
``ds.heartbeat.decode.<id>``, drops requests named on ``ds.abort``. SIGTERM: heartbeat
``draining``, refuse new pushes, finish running requests for up to ``--drain-seconds``, exit 0.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from libs.common import subjects
from libs.common.config import common_flags, flag
from libs.common.lifecycle import new_instance_id
from libs.common.telemetry import tracer
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from libs.serving.instance import InstanceRuntime, run_instance
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from
from libs.serving.runtime import advertise_host

from .handlers import DecodeHandler

SERVICE = "decode"
MAX_MESSAGE_BYTES = 8 << 20  # KV arrives in chunks of <= 1 MiB; leave room


@dataclass(frozen=True)
class DecodeConfig:
    model: ModelFlags
    nats_url: str
    host: str
    grpc_port: int
    http_port: int
    instance_id: str
    drain_seconds: float
    heartbeat_interval: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"--grpc-port must lie in [0, 65535], got {self.grpc_port}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must lie in [0, 65535], got {self.http_port}")
        if self.drain_seconds < 0:
            raise ValueError(f"--drain-seconds must be >= 0, got {self.drain_seconds}")
        if self.heartbeat_interval <= 0:
            raise ValueError(
                f"--heartbeat-interval must be positive, got {self.heartbeat_interval}"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.decode", description=__doc__.splitlines()[0]
    )
    common_flags(parser, SERVICE)
    add_model_flags(parser)
    flag(parser, "--grpc-port", type=int, default=0, help="KVTransfer gRPC port (0: any free)")
    flag(parser, "--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    return parser


def config_from(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        model=model_flags_from(args),
        nats_url=args.nats_url,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        instance_id=new_instance_id(SERVICE, args.instance_id),
        drain_seconds=args.drain_seconds,
        heartbeat_interval=args.heartbeat_interval,
    )


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """``Push``: the DecodeTask first, then the KV frame in chunks; the handler does the rest."""

    def __init__(self, handler: DecodeHandler) -> None:
        self.handler = handler

    async def Push(
        self,
        request_iterator: AsyncIterator[kv_transfer_pb2.KVPush],
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.KVPushReply:
        task: control_pb2.DecodeTask | None = None
        frame = bytearray()
        async for part in request_iterator:
            which = part.WhichOneof("part")
            if task is None:
                if which != "task":
                    return kv_transfer_pb2.KVPushReply(
                        accepted=False, error="the first KVPush message must carry the DecodeTask"
                    )
                task = part.task
            elif which == "chunk":
                frame += part.chunk
            else:
                return kv_transfer_pb2.KVPushReply(accepted=False, error="KVPush.task sent twice")
        if task is None:
            return kv_transfer_pb2.KVPushReply(accepted=False, error="empty KVPush stream")
        meta = dict(context.invocation_metadata() or ())
        return await self.handler.accept(task, bytes(frame), str(meta.get("traceparent", "")))


def main(argv: list[str] | None = None) -> int:
    return run_instance(SERVICE, argv, build_parser, config_from, serve)


async def serve(cfg: DecodeConfig, log: logging.Logger) -> int:
    rt = InstanceRuntime(
        SERVICE,
        cfg.instance_id,
        cfg.model,
        host=cfg.host,
        http_port=cfg.http_port,
        nats_url=cfg.nats_url,
        drain_seconds=cfg.drain_seconds,
        heartbeat_interval=cfg.heartbeat_interval,
        log=log,
    )
    async with AsyncExitStack() as stack:
        rc = await rt.start(stack)
        if rc is not None:
            return rc
        assert rt.loop is not None and rt.nc is not None
        nc = rt.nc
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
        address = f"{advertise_host(cfg.host)}:{port}"
        handler = DecodeHandler(
            rt.loop,
            nc.publish,
            instance_id=cfg.instance_id,
            model_name=cfg.model.model_name,
            address=address,
            block_size=cfg.model.block_size,
            tracer=tracer(SERVICE),
        )
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(  # type: ignore[no-untyped-call]
            KVTransferServicer(handler), server
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        await server.start()
        stack.push_async_callback(server.stop, 5.0)
        for name in ("", "deepserve.v1.KVTransfer"):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("KVTransfer on %s (instance %s)", address, cfg.instance_id)

        async def on_abort(msg: object) -> None:
            await handler.on_abort(control_pb2.Abort.FromString(msg.data))  # type: ignore[attr-defined]

        subs = [await nc.subscribe(subjects.ABORT, cb=on_abort)]
        await rt.ready(handler.status)  # subscribed and serving gRPC: /healthz may say 200
        await rt.stop.wait()
        await rt.leave(handler, subs, before_drain=health_servicer.enter_graceful_shutdown)
    log.info("stopped")
    return 0
