"""``python -m services.balancer``: routes requests to prefill/decode instances it hears about.

Subscribes ``ds.heartbeat.>`` (InstanceStatus) and answers ``ds.balancer.route`` in queue
group ``balancer`` (so several replicas share the requests). Each replica keeps its own table
from the heartbeats every instance broadcasts; they need no state in common.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.common import subjects
from libs.common.config import common_flags, flag
from libs.common.lifecycle import install_stop_handlers, new_instance_id, setup_logging
from libs.common.natsutil import connect_nats
from libs.common.telemetry import OpsServer
from libs.routing.buckets import DEFAULT_BOUNDS, check_bounds, parse_bounds
from libs.routing.policy import RoutingPolicy

from .handlers import BalancerHandlers

PRUNE_INTERVAL_S = 1.0  # one heartbeat interval: the table is never more than 1 s stale


@dataclass(frozen=True)
class BalancerConfig:
    nats_url: str
    host: str
    http_port: int
    instance_id: str
    heartbeat_timeout: float
    warmup_seconds: float
    drain_seconds: float
    prefill_buckets: tuple[int, ...] = DEFAULT_BOUNDS
    rebalance_interval: float = 10.0

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout > 0:
            raise ValueError(
                f"--heartbeat-timeout must be > 0 seconds, got {self.heartbeat_timeout}"
            )
        if self.warmup_seconds < 0:
            raise ValueError(f"--warmup-seconds must be >= 0, got {self.warmup_seconds}")
        if self.drain_seconds < 0:
            raise ValueError(f"--drain-seconds must be >= 0, got {self.drain_seconds}")
        if not self.rebalance_interval > 0:
            raise ValueError(
                f"--rebalance-interval must be > 0 seconds, got {self.rebalance_interval}"
            )
        check_bounds(self.prefill_buckets)
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must lie in [0, 65536), got {self.http_port}")


def parse_args(argv: list[str] | None = None) -> tuple[BalancerConfig, str]:
    parser = argparse.ArgumentParser(prog="python -m services.balancer", description=__doc__)
    common_flags(parser, "balancer")
    flag(
        parser,
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds without a heartbeat after which an instance is dead",
    )
    flag(
        parser,
        "--warmup-seconds",
        type=float,
        default=1.0,
        help="listen to heartbeats this long before answering routes (one heartbeat interval)",
    )
    flag(
        parser,
        "--prefill-buckets",
        default=",".join(map(str, DEFAULT_BOUNDS)),
        help="prompt-token bounds between prefill length buckets (comma-separated, increasing)",
    )
    flag(
        parser,
        "--rebalance-interval",
        type=float,
        default=10.0,
        help="seconds between re-assignments of prefill instances to buckets by demand",
    )
    args = parser.parse_args(argv)
    try:
        config = BalancerConfig(
            nats_url=args.nats_url,
            host=args.host,
            http_port=args.http_port,
            instance_id=new_instance_id("balancer", args.instance_id),
            heartbeat_timeout=args.heartbeat_timeout,
            warmup_seconds=args.warmup_seconds,
            drain_seconds=args.drain_seconds,
            prefill_buckets=parse_bounds(args.prefill_buckets),
            rebalance_interval=args.rebalance_interval,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.log_level


async def _prune_loop(handlers: BalancerHandlers, stop: asyncio.Event) -> None:
    while not stop.is_set():
        handlers.prune()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), PRUNE_INTERVAL_S)


async def run(config: BalancerConfig, log: logging.Logger) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    handlers = BalancerHandlers(
        RoutingPolicy(
            heartbeat_timeout=config.heartbeat_timeout,
            bucket_bounds=config.prefill_buckets,
            rebalance_interval=config.rebalance_interval,
        )
    )
    state: dict[str, object] = {"nc": None, "routing": False}

    def health() -> tuple[bool, str]:
        nc = state["nc"]
        if not isinstance(nc, Client) or not nc.is_connected:
            return False, f"not connected to NATS at {config.nats_url}"
        if not state["routing"]:
            return False, "warming up: collecting heartbeats"
        return True, f"{len(handlers.policy.live())} live instances"

    ops = OpsServer(config.host, config.http_port, health)
    port = await ops.start()
    log.info(
        "balancer %s: ops on http://%s:%d, NATS %s",
        config.instance_id,
        config.host,
        port,
        config.nats_url,
    )
    nc = await connect_nats(config.nats_url, config.instance_id, stop, log, config.drain_seconds)
    if nc is None:
        await ops.stop()
        return 0
    state["nc"] = nc

    async def on_heartbeat(msg: Msg) -> None:
        handlers.on_heartbeat(msg.data)

    async def on_route(msg: Msg) -> None:
        if msg.reply:
            await msg.respond(handlers.on_route(msg.data))

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat)
    pruner = asyncio.create_task(_prune_loop(handlers, stop))
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
    pruner.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pruner
    try:
        await asyncio.wait_for(nc.drain(), config.drain_seconds + 1)
    except Exception as exc:  # noqa: BLE001 - shutting down; a failed drain must not hang exit
        log.warning("NATS drain: %s", exc)
        await nc.close()
    await ops.stop()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    config, level = parse_args(argv)
    log = setup_logging(level, "balancer")
    return asyncio.run(run(config, log))
