"""Sending a PrefillTask so that a NATS outage cannot lose it.

Core NATS keeps nothing. A task published while the entrypoint is cut off waits in the
client's buffer and reaches the restarted server before the prefill instance has subscribed
there again, and the server drops it; so does a task published just after the restart. The
request would then wait for ``--request-timeout`` (60 s) and end DEADLINE_EXCEEDED.

So a task goes out as a NATS request, once the bus is connected, and each copy ends one of
four ways (:class:`Delivery`). The prefill instance answers on receipt, before it computes
anything (an empty reply), and ignores further copies of a task it has (in flight or seen
lately) while still answering them. The server answers "no responders" at once when nobody
subscribes to the subject: the instance has not subscribed again after a restart (send again
shortly), or it is gone (the attempt fails over after ``gone_after``). A copy nobody answers
while the connection stayed up was handed to a subscriber that does not confirm (an instance
from before confirmations, or one stalled longer than the wait): it arrived. A copy out when
the connection dropped may be lost: sent again.

The normal path costs one round trip (entrypoint -> NATS -> prefill -> NATS -> entrypoint,
well under a millisecond on one host), while prefill already works on the task: the first
token is not later for it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from libs.gateway.retry import AttemptFailed

log = logging.getLogger("entrypoint")


class Delivery(enum.Enum):
    """How one copy of a task ended."""

    ACKED = "acked"  # the instance confirmed receipt
    UNANSWERED = "unanswered"  # handed to a subscriber that did not confirm in time: arrived
    NOBODY = "nobody"  # the server has no subscriber on the subject
    CUT_OFF = "cut_off"  # the connection dropped while the copy was out: maybe lost


class TaskSender(Protocol):
    """The bus side of task delivery (NATS request/reply in production)."""

    def reconnects(self) -> int:
        """How many times the bus connection came back so far (it only grows)."""

    def settling(self) -> bool:
        """Whether the bus was cut off or came back within the last few seconds: the other
        side may not have subscribed again, nor its heartbeats been heard again."""

    async def send(self, subject: str, data: bytes, timeout: float) -> Delivery:
        """Send one copy once the bus is connected and wait up to ``timeout`` for the
        receiver's confirmation; raises :class:`~libs.common.errors.Unavailable` if the bus
        does not come back within its bound."""


async def deliver(
    sender: TaskSender,
    subject: str,
    data: bytes,
    *,
    instance: str,
    ack_timeout: float,
    gone_after: float,
    pause: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> tuple[Delivery, int]:
    """Send ``data`` to prefill ``instance`` on ``subject`` until a copy arrives; returns how
    the last copy ended (ACKED or UNANSWERED) and how many copies went out.

    "Nobody subscribed" is answered again every ``pause`` seconds; once it has lasted
    ``gone_after`` seconds (counted from the bus's latest reconnection: a restarted server
    takes subscriptions back as their clients reconnect) the instance counts as gone:
    :class:`AttemptFailed` naming it, so the attempt fails over to another instance.
    """
    sent = 0
    nobody_since: float | None = None
    nobody_reconnects = -1
    while True:
        outcome = await sender.send(subject, data, ack_timeout)
        sent += 1
        if outcome in (Delivery.ACKED, Delivery.UNANSWERED):
            if sent > 1 or outcome is Delivery.UNANSWERED:
                log.info("task %s: %s after %d copies", subject, outcome.value, sent)
            return outcome, sent
        if outcome is Delivery.CUT_OFF:
            nobody_since = None
            continue  # the sender waits for the bus before the next copy
        now, reconnects = clock(), sender.reconnects()
        if nobody_since is None or reconnects != nobody_reconnects:
            nobody_since, nobody_reconnects = now, reconnects
        elif now - nobody_since >= gone_after:
            raise AttemptFailed(
                f"prefill instance {instance} takes no tasks (nothing subscribed to "
                f"{subject} for {gone_after:g}s)",
                (instance,),
            )
        await sleep(pause)
