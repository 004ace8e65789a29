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

from libs.common import subjects
from libs.common.service import ServiceContext, run_service
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.instance import InstanceRuntime
from libs.transport.kvstore_client import open_kvstore
from services.decode.handlers import DecodeHandler
from services.decode.main import open_decode
from services.prefill.handlers import PrefillHandler
from services.prefill.main import open_prefill

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
    log, instance_id = ctx.log, cfg.service.instance_id
    rt = InstanceRuntime(
        ctx, cfg.model, cfg.heartbeat_interval, None, cfg.stats_interval, heartbeat_role="prefill"
    )
    rc = await rt.start()
    if rc is not None:
        return rc
    assert rt.loop is not None and rt.nc is not None
    nc = rt.nc
    kvstore = open_kvstore(ctx.stack, cfg.kvstore_address, cfg.service_token)
    decode, health_servicer = await open_decode(
        ctx, rt, cfg.grpc_port, cfg.service_token, kvstore, SERVICE
    )
    prefill, decoders_sub = await open_prefill(
        ctx, rt, cfg.push_timeout_s, cfg.service_token, kvstore, SERVICE, local=decode
    )
    both = BothRoles(prefill, decode)

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
        decode.address,
        cfg.kvstore_address or "none",
    )
    await ctx.stop.wait()
    await rt.leave(both, subs, before_drain=health_servicer.enter_graceful_shutdown)
    return rt.exit_code
