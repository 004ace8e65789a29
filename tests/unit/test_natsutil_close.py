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
