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
import io
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client
from prometheus_client import disable_created_metrics

from .config import ServiceConfig
from .logs import setup_logging
from .loop_lag import watch_loop_lag
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

    def background(
        self, coro: Coroutine[Any, Any, None], name: str, stop_within: float | None = None
    ) -> asyncio.Task[None]:
        """Run ``coro`` as a task until the stack closes, then cancel it and wait for it to end:
        for at most ``stop_within`` seconds if given (a task with nothing to clean up when
        cancelled, e.g. a polling loop; see :func:`cancel_task`)."""
        task = asyncio.create_task(coro, name=name)
        self.stack.push_async_callback(cancel_task, task, self.log, stop_within)
        return task


# What closing one thing at exit may take past its own bound (a drain: its drain time plus
# this); past it, what is still running is logged with its stack and left behind, so a stuck
# step is named in the log and the service still exits.
STOP_MARGIN_S = 1.0


async def cancel_task(
    task: asyncio.Task[Any], log: logging.Logger | None = None, within: float | None = None
) -> None:
    """Cancel ``task`` and wait for it to end; what it raised (other than its cancellation)
    is raised here.

    ``within`` bounds the wait, for a task with nothing to clean up when cancelled. A cancel
    can be lost: on Python 3.11 ``asyncio.wait_for`` returns the result when the cancel lands
    as the awaited work finishes (redis-py awaits it inside every command), and a ``while
    True`` loop then runs on. Such a task still running halfway is logged where it is and
    cancelled once more; one still running after that is logged and left running. Without
    ``within`` the task's cancellation takes what it takes: a second cancel would cut short
    a task that is still cancelling work of its own (``natsutil._cancel``)."""
    task.cancel()
    if within is None:
        try:
            await task
        except asyncio.CancelledError:
            pass
        return
    log = log or logging.getLogger(__name__)
    done, _ = await asyncio.wait({task}, timeout=within / 2)
    if not done:  # the cancel was lost, or the task ignores it
        log.warning(
            "task %r still running %.1fs after its cancellation (lost, or ignored); "
            "cancelling it again. It is at:\n%s",
            task.get_name(),
            within / 2,
            _stack(task),
        )
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=within / 2)
    if not done:
        log.error(
            "task %r still running %.1fs after two cancellations; not waiting for it:\n%s",
            task.get_name(),
            within,
            _stack(task),
        )
        return
    if not task.cancelled():
        task.result()  # what it raised


def _stack(task: asyncio.Task[Any]) -> str:
    """Where a task is suspended (what it awaits), as ``Task.print_stack`` writes it."""
    out = io.StringIO()
    task.print_stack(file=out)
    return out.getvalue().rstrip()


def run_service(
    name: str,
    argv: list[str] | None,
    build_parser: Callable[[], argparse.ArgumentParser],
    config_from: Callable[[argparse.Namespace], C],
    serve: Callable[[C, ServiceContext], Awaitable[int]],
) -> int:
    """The ``main`` of every service: parse flags, build the config (a bad one: one line on
    stderr, exit code 2), set up logging, then serve until stopped; the exit code. Metrics
    come without ``*_created`` series."""
    # No *_created series on any service's /metrics (one per counter and histogram child, read
    # by nothing we run): process-wide, so here at the process's edge.
    disable_created_metrics()  # type: ignore[no-untyped-call]
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
    lag = asyncio.create_task(watch_loop_lag(), name="loop-lag")
    try:
        async with AsyncExitStack() as stack:
            stack.callback(faulthandler.cancel_dump_traceback_later)  # runs last
            stack.callback(lag.cancel)
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


__all__ = [
    "STOP_MARGIN_S",
    "ServiceContext",
    "cancel_task",
    "run_service",
    "setup_logging",
]
