"""uvicorn for the recipe: no signal handling of its own, and no connection held open forever.

uvicorn (0.54, h11) closes a connection idle for ``timeout_keep_alive`` only *after* a response;
one that connects and sends nothing, or half a request head, is kept open for ever. The
:class:`TimedH11Protocol` closes a connection whose request head has not fully arrived within
``--header-timeout`` seconds of the connection opening or of the previous response ending. A
body that trickles in is bounded by the app (``--body-timeout``: 408, then the connection
closes) -- uvicorn has no body timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request head is late."""

    class TimedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle  # a new request replaces it: the head arrived
            self._head_timer = self.loop.call_later(header_timeout, self._head_timeout)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return TimedH11Protocol


class Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service's stop event decides."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_server(
    app: Any,
    host: str,
    port: int,
    *,
    log_level: str,
    drain_seconds: float,
    keep_alive_timeout: float,
    header_timeout: float,
) -> Server:
    return Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            http=timed_h11(header_timeout),
            lifespan="off",
            log_level=log_level.lower(),
            # No logging config of uvicorn's own: its lines reach the service's handlers in
            # --log-format (text or JSON). Its access log stays off: access_log.py writes ours.
            log_config=None,
            access_log=False,
            # typed int, used as a float (loop.call_later)
            timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]
            timeout_graceful_shutdown=max(1, int(drain_seconds)),
        )
    )


async def run_server(server: Server) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn's way to report a port it cannot bind; server.started says so
        pass


async def stop_server(
    server: Server, task: asyncio.Task[None], drain_seconds: float, log: logging.Logger
) -> None:
    if not task.done():
        log.info("stopping: finishing open requests for up to %.0fs", drain_seconds)
    server.should_exit = True
    await task
