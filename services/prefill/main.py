"""prefill service: ``python -m services.prefill --nats-url nats://... [--kvstore-address host:port]``.

Takes PrefillTasks on ``ds.prefill.<id>.task``, publishes each request's first token, pushes
its KV to the chosen decode instance over gRPC, writes new prefix blocks to the kvstore,
heartbeats every second on ``ds.heartbeat.prefill.<id>``, drops requests named on
``ds.abort``. SIGTERM: heartbeat ``draining``, refuse new tasks (retryable error events),
finish the ones in flight for up to ``--drain-seconds``, exit 0.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass

from libs.common import subjects
from libs.common.config import common_flags, flag
from libs.common.lifecycle import new_instance_id
from libs.common.telemetry import tracer
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.instance import InstanceRuntime, run_instance
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from

from .clients import PUSH_TIMEOUT_S, GrpcKVPusher, GrpcKVStore
from .handlers import PrefillHandler

SERVICE = "prefill"


@dataclass(frozen=True)
class PrefillConfig:
    model: ModelFlags
    nats_url: str
    host: str
    http_port: int
    instance_id: str
    drain_seconds: float
    kvstore_address: str = ""  # empty: no kvstore (no cached prefixes, no block writes)
    push_timeout_s: float = PUSH_TIMEOUT_S
    heartbeat_interval: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must lie in [0, 65535], got {self.http_port}")
        if self.drain_seconds < 0:
            raise ValueError(f"--drain-seconds must be >= 0, got {self.drain_seconds}")
        if self.kvstore_address and ":" not in self.kvstore_address:
            raise ValueError(f"--kvstore-address must be host:port, got {self.kvstore_address!r}")
        if self.push_timeout_s <= 0:
            raise ValueError(f"--push-timeout must be positive, got {self.push_timeout_s}")
        if self.heartbeat_interval <= 0:
            raise ValueError(
                f"--heartbeat-interval must be positive, got {self.heartbeat_interval}"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.prefill", description=__doc__.splitlines()[0]
    )
    common_flags(parser, SERVICE)
    add_model_flags(parser)
    flag(parser, "--kvstore-address", default="", help="kvstore gRPC host:port (empty: no kvstore)")
    flag(
        parser,
        "--push-timeout",
        type=float,
        default=PUSH_TIMEOUT_S,
        help="seconds for one KV push to decode",
    )
    flag(parser, "--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    return parser


def config_from(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(
        model=model_flags_from(args),
        nats_url=args.nats_url,
        host=args.host,
        http_port=args.http_port,
        instance_id=new_instance_id(SERVICE, args.instance_id),
        drain_seconds=args.drain_seconds,
        kvstore_address=args.kvstore_address,
        push_timeout_s=args.push_timeout,
        heartbeat_interval=args.heartbeat_interval,
    )


def main(argv: list[str] | None = None) -> int:
    return run_instance(SERVICE, argv, build_parser, config_from, serve)


async def serve(cfg: PrefillConfig, log: logging.Logger) -> int:
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
        pusher = GrpcKVPusher(cfg.push_timeout_s)
        stack.push_async_callback(pusher.close)
        kvstore = GrpcKVStore(cfg.kvstore_address) if cfg.kvstore_address else None
        if kvstore is not None:
            stack.push_async_callback(kvstore.close)
        handler = PrefillHandler(
            rt.loop,
            nc.publish,
            pusher,
            instance_id=cfg.instance_id,
            model_name=cfg.model.model_name,
            block_size=cfg.model.block_size,
            max_model_len=rt.loop.engine.scheduler_config.max_model_len,
            kvstore=kvstore,
            tracer=tracer(SERVICE),
        )

        async def on_task(msg: object) -> None:
            try:
                task = control_pb2.PrefillTask.FromString(msg.data)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - not ours to answer: we cannot even read the request id
                log.warning("unreadable PrefillTask dropped: %s", exc)
                return
            handler.submit(task)  # its own task: the subscription keeps taking messages

        async def on_abort(msg: object) -> None:
            await handler.on_abort(control_pb2.Abort.FromString(msg.data))  # type: ignore[attr-defined]

        subs = [
            await nc.subscribe(subjects.prefill_task(cfg.instance_id), cb=on_task),
            await nc.subscribe(subjects.ABORT, cb=on_abort),
        ]
        await rt.ready(handler.status)
        log.info(
            "taking tasks on %s (kvstore: %s)",
            subjects.prefill_task(cfg.instance_id),
            cfg.kvstore_address or "none",
        )
        await rt.stop.wait()
        await rt.leave(handler, subs)
    log.info("stopped")
    return 0
