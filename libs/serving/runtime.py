"""NATS connection and heartbeats for the engine-wrapping services."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS

from libs.proto.deepserve.v1 import control_pb2


def now_ms() -> int:
    return int(time.time() * 1000)


def advertise_host(bind_host: str) -> str:
    """The host others should dial: the bind address unless it is a wildcard."""
    return socket.gethostname() if bind_host in ("", "0.0.0.0", "::") else bind_host


async def heartbeat_loop(
    nc: NATS,
    subject: str,
    status: Callable[[], control_pb2.InstanceStatus],
    stop: asyncio.Event,
    log: logging.Logger,
    interval: float = 1.0,
) -> None:
    """Publish ``status()`` on ``subject`` every ``interval`` seconds until ``stop`` is set."""
    while not stop.is_set():
        await publish_status(nc, subject, status(), log)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


async def publish_status(
    nc: NATS, subject: str, msg: control_pb2.InstanceStatus, log: logging.Logger
) -> None:
    try:
        msg.sent_unix_ms = now_ms()
        await nc.publish(subject, msg.SerializeToString())
    except Exception as exc:  # noqa: BLE001 - a missed heartbeat is not fatal; the next one may get through
        log.warning("heartbeat on %s failed: %s", subject, exc)
