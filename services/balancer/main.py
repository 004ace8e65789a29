"""``python -m services.balancer``: routes requests to prefill/decode instances it hears about.

Wiring only: the ops port, NATS (heartbeats in, routes answered in queue group ``balancer``),
the prune timer; flags in ``config.py``, message handling in ``handlers.py``. Everything is
opened on the shared lifecycle's exit stack (``libs/common/service.py``) and closed in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

from libs.common import subjects
from libs.common.service import ServiceContext, run_service
from libs.routing.policy import RoutingPolicy

from .config import SERVICE, BalancerConfig, build_parser, config_from
from .handlers import BalancerHandlers
from .metrics import BalancerMetrics

PRUNE_INTERVAL_S = 1.0  # one heartbeat interval: the table is never more than 1 s stale


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build_parser, config_from, serve)


async def _prune_loop(handlers: BalancerHandlers, stop: asyncio.Event) -> None:
    while not stop.is_set():
        handlers.prune()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), PRUNE_INTERVAL_S)


def _unregister(metrics: BalancerMetrics) -> None:
    REGISTRY.unregister(metrics.decisions)
    if metrics.collector is not None:
        REGISTRY.unregister(metrics.collector)


async def serve(config: BalancerConfig, ctx: ServiceContext) -> int:
    svc, log, stop = config.service, ctx.log, ctx.stop
    policy = RoutingPolicy(
        heartbeat_timeout=config.heartbeat_timeout,
        bucket_bounds=config.prefill_buckets,
        rebalance_interval=config.rebalance_interval,
        load_cap=config.load_cap,
        load_weight=config.load_weight,
    )
    metrics = BalancerMetrics(REGISTRY, policy)
    ctx.stack.callback(_unregister, metrics)
    handlers = BalancerHandlers(policy, metrics)
    state: dict[str, object] = {"nc": None, "routing": False}

    def health() -> tuple[bool, str]:
        nc = state["nc"]
        if not isinstance(nc, Client) or not nc.is_connected:
            return False, f"not connected to NATS at {svc.nats_url}"
        if not state["routing"]:
            return False, "warming up: collecting heartbeats"
        return True, f"{len(handlers.policy.live())} live instances"

    port = await ctx.start_ops(health)
    log.info(
        "balancer %s: ops on http://%s:%d, NATS %s", svc.instance_id, svc.host, port, svc.nats_url
    )
    nc = await ctx.connect_nats(drain_timeout=svc.drain_seconds + 1)
    if nc is None:
        return 0
    state["nc"] = nc

    async def on_heartbeat(msg: Msg) -> None:
        handlers.on_heartbeat(msg.data)

    async def on_route(msg: Msg) -> None:
        if msg.reply:
            await msg.respond(handlers.on_route(msg.data))

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat)
    ctx.background(_prune_loop(handlers, stop), "prune")
    # Answer routes only once every live instance has had a chance to heartbeat, so a fresh
    # replica joining the queue group does not turn requests away with "no instance".
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), config.warmup_seconds)
    if not stop.is_set():
        await nc.subscribe(subjects.ROUTE, queue=subjects.BALANCER_QUEUE, cb=on_route)
        await nc.flush()
        state["routing"] = True
        log.info("answering %s (queue %s)", subjects.ROUTE, subjects.BALANCER_QUEUE)
    await stop.wait()
    log.info("stopping: draining NATS subscriptions")
    state["routing"] = False
    return 0
