"""Closing a NATS connection at shutdown never fails the exit (``close_nats``)."""

from __future__ import annotations

import logging

from libs.common.natsutil import close_nats


class CutOff:
    """A client whose socket is gone (SIGTERM during a NATS outage): close() raises."""

    is_closed = False

    async def drain(self) -> None:
        raise ConnectionResetError("Connection lost")

    async def close(self) -> None:
        raise ConnectionResetError("Connection lost")


async def test_close_during_an_outage_is_logged_not_raised() -> None:
    await close_nats(CutOff(), logging.getLogger("t"), drain_timeout=1.0)  # type: ignore[arg-type]


async def test_a_connect_that_swallows_a_cancel_is_cancelled_again() -> None:
    """asyncio.wait_for in Python 3.11 can swallow a cancellation (nats.connect uses it): the
    connect loop then must not wait forever for the attempt to end (SIGTERM hung in CI)."""
    import asyncio

    from libs.common.natsutil import _cancel

    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 1:
                    continue  # the first cancellation is lost, as in the race
                raise

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await _cancel(task, logging.getLogger("t"))  # type: ignore[arg-type]
    assert task.cancelled() and swallowed == 2
    assert loop.time() - t0 < 2.0
