"""Connecting to NATS the same way in every service."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client

from .nats_auth import PASSWORD_ENV, USER_ENV, inbox_prefix
from .redact import redact, redact_text


def credentials(url: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``nats.connect`` options that log in: the user and password in the environment
    (DEEPSERVE_NATS_USER / DEEPSERVE_NATS_PASSWORD) unless ``url`` carries its own, and the
    user's own inbox prefix (its NATS permissions allow replies there only)."""
    env = os.environ if env is None else env
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    user = unquote(parts.username or "")
    opts: dict[str, Any] = {}
    if not user and env.get(USER_ENV):
        user = env[USER_ENV]
        opts = {"user": user, "password": env.get(PASSWORD_ENV, "")}
    if user:
        opts["inbox_prefix"] = inbox_prefix(user)
    return opts


async def connect_nats(
    url: str, name: str, stop: asyncio.Event, log: logging.Logger, drain_timeout: float = 10.0
) -> Client | None:
    """Connect, retrying every second until connected or ``stop`` is set (then None).

    Once connected the client reconnects by itself forever; each service's /healthz reports
    the gaps. ``drain_timeout`` bounds ``drain()`` at shutdown.
    """
    closing: list[Client] = []
    shown = redact(url)  # logs never show the URL's password or token

    async def on_error(exc: Exception) -> None:
        log.warning("NATS %s: %s", shown, redact_text(str(exc)))

    async def on_disconnect() -> None:
        if not (closing and closing[0].is_closed):  # our own close() is not an outage
            log.warning("NATS disconnected from %s; reconnecting", shown)

    async def on_reconnect() -> None:
        log.info("NATS reconnected to %s", shown)

    while not stop.is_set():
        # With max_reconnect_attempts=-1 nats.connect itself retries a server that is not
        # there yet, forever: race it against the stop event so SIGTERM still ends the wait.
        attempt = asyncio.ensure_future(
            nats.connect(
                servers=[url],
                name=name,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                drain_timeout=max(1, int(drain_timeout)),
                **credentials(url),
            )
        )
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({attempt, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            await _cancel(attempt, log)
        if not attempt.done() or attempt.cancelled():
            return None  # stopped while connecting
        exc = attempt.exception()
        if exc is None:
            nc = attempt.result()
            closing.append(nc)
            return nc
        log.warning("NATS at %s not reachable (%s); retrying in 1 s", shown, redact_text(str(exc)))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    return None


async def _cancel(attempt: asyncio.Future[Client], log: logging.Logger) -> None:
    """Cancel a pending ``nats.connect``: its retry loop can swallow a cancellation that lands
    inside its own error handling (seen in CI: SIGTERM then waited forever), so cancel again
    every 0.5 s and give up on it after 5 s rather than hang the shutdown."""
    for _ in range(10):
        if attempt.done():
            return
        attempt.cancel()
        await asyncio.wait({attempt}, timeout=0.5)
    if not attempt.done():
        log.warning("NATS connect did not stop when cancelled; leaving it behind")


async def close_nats(nc: Client, log: logging.Logger, drain_timeout: float | None = None) -> None:
    """Drain ``nc`` for up to ``drain_timeout`` seconds (None: no drain), then close it.

    A drain that fails or runs late must not hang the exit: the connection is closed anyway.
    """
    if nc.is_closed:
        return
    if drain_timeout is not None:
        try:
            await asyncio.wait_for(nc.drain(), drain_timeout)
        except Exception as exc:  # noqa: BLE001 - shutting down; close below regardless
            log.warning("NATS drain: %s", exc)
    if not nc.is_closed:
        try:
            await nc.close()
        except OSError as exc:  # closing while cut off (SIGTERM during an outage) is no failure
            log.warning("NATS close: %s", exc)
