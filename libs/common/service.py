"""One lifecycle for every service: parse flags, build a frozen config, serve inside one
``AsyncExitStack``; SIGTERM/SIGINT set a stop event, the service drains, then exits.

    def main(argv: list[str] | None = None) -> int:
        return run_service("balancer", argv, build_parser, config_from, serve)

    async def serve(cfg: BalancerConfig, ctx: ServiceContext) -> int:
        await ctx.start_ops(health)            # closed last
        nc = await ctx.connect_nats()          # drained before the ops port closes
        ...
        await ctx.stop.wait()                  # SIGTERM or Ctrl-C
        return 0                               # the stack closes everything, newest first

Whatever ``serve`` opens goes on ``ctx.stack``, so it is closed in reverse order of opening on
a stop signal and equally when ``serve`` raises half-way through starting.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client

from .config import ServiceConfig
from .logs import setup_logging
from .natsutil import close_nats, connect_nats
from .redact import redact_text
from .telemetry import HealthFn, OpsRoute, OpsServer


class HasService(Protocol):
    """A service's own frozen config: it embeds the common part."""

    @property
    def service(self) -> ServiceConfig: ...


C = TypeVar("C", bound=HasService)


@dataclass
class ServiceContext:
    """What ``serve`` gets: the exit stack that closes what it opens, the stop event that
    SIGTERM/SIGINT set, its logger and the common config."""

    name: str
    config: ServiceConfig
    stack: AsyncExitStack
    stop: asyncio.Event
    log: logging.Logger

    async def start_ops(
        self, health: HealthFn, routes: Mapping[str, OpsRoute] | None = None
    ) -> int:
        """Serve /livez, /readyz (= /healthz), /metrics and ``routes`` on the ops port until
        the stack closes; the bound port.
        The /healthz detail is redacted: a URL in it shows no password or token."""

        def redacted_health() -> tuple[bool, str]:
            ok, why = health()
            return ok, redact_text(why)

        ops = OpsServer(self.config.host, self.config.http_port, redacted_health, routes)
        port = await ops.start()
        self.stack.push_async_callback(ops.stop)
        return port

    async def connect_nats(self, drain_timeout: float | None = None) -> Client | None:
        """NATS, retried until connected or stopped (then None). At exit the connection is
        drained for up to ``drain_timeout`` seconds (None: closed at once)."""
        c = self.config
        nc = await connect_nats(c.nats_url, c.instance_id, self.stop, self.log, c.drain_seconds)
        if nc is not None:
            self.stack.push_async_callback(close_nats, nc, self.log, drain_timeout)
        return nc

    def background(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``coro`` as a task until the stack closes, then cancel it."""
        task = asyncio.create_task(coro, name=name)
        self.stack.push_async_callback(cancel_task, task)
        return task


async def cancel_task(task: asyncio.Task[Any]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def run_service(
    name: str,
    argv: list[str] | None,
    build_parser: Callable[[], argparse.ArgumentParser],
    config_from: Callable[[argparse.Namespace], C],
    serve: Callable[[C, ServiceContext], Awaitable[int]],
) -> int:
    """The ``main`` of every service: parse flags, build the config (a bad one: one line on
    stderr, exit code 2), set up logging, then serve until stopped; the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from(args)
    except ValueError as exc:
        print(f"{parser.prog}: error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    log = setup_logging(cfg.service.log_level, name, cfg.service.log_format)
    return asyncio.run(_serve(name, cfg, serve, log))


async def _serve(
    name: str,
    cfg: C,
    serve: Callable[[C, ServiceContext], Awaitable[int]],
    log: logging.Logger,
) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    try:
        async with AsyncExitStack() as stack:
            stack.callback(faulthandler.cancel_dump_traceback_later)  # runs last
            rc = await serve(cfg, ServiceContext(name, cfg.service, stack, stop, log))
            # Closing what it opened takes the drain and little more; a service still at
            # it 3 s past its drain writes every thread's stack to its log (stderr), so a
            # hang at exit says where it hangs.
            _dump_stacks_later(cfg.service.drain_seconds + 3.0)
    except Exception:
        log.exception("%s failed; everything it had opened is closed", name)
        return 1
    log.info("stopped")
    return rc


def _dump_stacks_later(seconds: float) -> None:
    try:
        faulthandler.dump_traceback_later(seconds, exit=False)
    except (AttributeError, ValueError, OSError):  # stderr with no file descriptor (tests)
        pass


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


__all__ = ["ServiceContext", "cancel_task", "run_service", "setup_logging"]
