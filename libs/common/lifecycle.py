"""One lifecycle for every service: SIGTERM/SIGINT set an event; the service drains, then exits."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def new_instance_id(service: str, given: str = "") -> str:
    return given or f"{service}-{uuid.uuid4().hex[:8]}"


def setup_logging(level: str, service: str) -> logging.Logger:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
    return logging.getLogger(service)
