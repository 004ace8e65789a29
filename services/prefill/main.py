"""prefill service:
``python -m services.prefill --nats-url nats://... [--kvstore-address host:port]``.

Takes PrefillTasks on ``ds.prefill.<id>.task`` (confirming each on receipt, ignoring copies),
publishes each request's first token, pushes its KV to the chosen decode instance over gRPC,
writes new prefix blocks to the kvstore, heartbeats every second on
``ds.heartbeat.prefill.<id>``, drops requests named on ``ds.abort``. SIGTERM: heartbeat
``draining``, refuse new tasks (retryable error events), finish the ones in
flight for up to ``--drain-seconds``, exit 0.

Wiring only: flags in ``config.py``, the work in ``handlers.py``; everything is opened on the
shared lifecycle's exit stack (``libs/common/service.py``) and closed in reverse.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

from libs.common import subjects
from libs.common.service import ServiceContext, run_service
from libs.common.telemetry import tracer
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.ep_supervisor import supervise
from libs.serving.instance import InstanceRuntime
from libs.serving.known_decoders import CheckedPusher, KnownDecoders
from libs.transport.kvstore_client import KVStore, open_kvstore

from .clients import GrpcKVPusher
from .config import SERVICE, PrefillConfig, build_parser, config_from
from .handlers import LocalDecode, PrefillHandler


async def open_prefill(
    ctx: ServiceContext,
    rt: InstanceRuntime,
    push_timeout_s: float,
    service_token: str,
    kvstore: KVStore | None,
    service: str,
    local: LocalDecode | None = None,
) -> tuple[PrefillHandler, Any]:
    """The prefill role over ``rt``'s engine: its handler, pushing KV (with the service token)
    only to decode instances heard on NATS, and that subscription (the caller ends it with
    its others). Prefill's own wiring, and an aggregated instance's prefill half (``local``:
    its decode half)."""
    assert rt.loop is not None and rt.nc is not None
    pusher = GrpcKVPusher(push_timeout_s, token=service_token)
    ctx.stack.push_async_callback(pusher.close)
    decoders = KnownDecoders()
    decoders_sub = await decoders.subscribe(rt.nc)
    handler = PrefillHandler(
        rt.loop,
        rt.nc.publish,
        CheckedPusher(pusher, decoders),  # only to decode instances heard on NATS
        instance_id=ctx.config.instance_id,
        model_name=rt.model.model_name,
        block_size=rt.model.block_size,
        max_model_len=rt.loop.engine.scheduler_config.max_model_len,
        kvstore=kvstore,
        tracer=tracer(service),
        local=local,
    )
    return handler, decoders_sub


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    return run_service(SERVICE, args, build_parser, config_from, partial(serve, argv=args))


async def serve(cfg: PrefillConfig, ctx: ServiceContext, argv: Sequence[str] = ()) -> int:
    if cfg.ep.supervises:  # --ep N: this process starts and watches the N rank processes
        return await supervise(
            ctx, SERVICE, argv, cfg.ep, own_grpc_port=False, device=cfg.model.device
        )
    log, instance_id = ctx.log, cfg.service.instance_id
    rt = InstanceRuntime(ctx, cfg.model, cfg.heartbeat_interval, cfg.ep, cfg.stats_interval)
    rc = await rt.start()
    if rc is not None:
        return rc
    assert rt.loop is not None and rt.nc is not None
    nc = rt.nc
    kvstore = open_kvstore(ctx.stack, cfg.kvstore_address, cfg.service_token)
    handler, decoders_sub = await open_prefill(
        ctx, rt, cfg.push_timeout_s, cfg.service_token, kvstore, SERVICE
    )

    async def on_abort(msg: object) -> None:
        await handler.on_abort(control_pb2.Abort.FromString(msg.data))  # type: ignore[attr-defined]

    subs = [
        # confirms each task on receipt (the entrypoint sends it again until it is)
        await nc.subscribe(subjects.prefill_task(instance_id), cb=handler.on_message),
        await nc.subscribe(subjects.ABORT, cb=on_abort),
        decoders_sub,
    ]
    await rt.ready(handler.status)
    log.info(
        "taking tasks on %s (kvstore: %s)",
        subjects.prefill_task(instance_id),
        cfg.kvstore_address or "none",
    )
    await ctx.stop.wait()
    await rt.leave(handler, subs)
    return rt.exit_code
