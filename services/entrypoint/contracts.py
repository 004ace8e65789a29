"""What the entrypoint's handler needs of the world, as small interfaces: the bus (NATS in
production), the kvstore's prefix lookup, the decode instances' resend of lost token events;
tests drive the handler with in-process fakes of each."""

from __future__ import annotations

from typing import Protocol

from libs.common.errors import Unavailable
from libs.proto.deepserve.v1 import control_pb2


class BusUnavailable(Unavailable):
    """A request on the bus found no responder, or none answered in time."""


class LookupFailed(Unavailable):
    """The kvstore could not answer (treated as a miss)."""


class ResendFailed(Unavailable):
    """The decode instance could not be asked for lost token events (asked again later)."""


class Subscription(Protocol):
    async def next(self, timeout: float) -> bytes:
        """The next payload; raises TimeoutError after ``timeout`` seconds without one."""

    def ready(self) -> bool:
        """Whether a payload is already here (``next`` would not wait)."""

    async def close(self) -> None: ...


class Bus(Protocol):
    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        """The reply's payload; raises :class:`Unavailable` (or a subclass) if none comes."""

    async def publish(self, subject: str, data: bytes) -> None: ...

    async def subscribe(self, subject: str) -> Subscription:
        """A subscription that is live at the server when this returns."""


class Resender(Protocol):
    """Token events lost on the bus, back from the decode instance (gRPC in production).

    Token events are core NATS: those published while NATS is down, or before this
    entrypoint's subscription is back on a restarted server, are gone. The decode instance
    keeps what it published (``libs/serving/replay.py``) and sends it again on request.
    """

    def reconnects(self) -> int:
        """How many times the bus connection came back so far (it only grows)."""

    async def settle(self) -> None:
        """Wait until the server has this entrypoint's subscriptions again after a
        reconnection; raises :class:`ResendFailed` if it cannot tell yet."""

    async def resend(
        self, address: str, request_id: str, from_index: int
    ) -> list[control_pb2.TokenEvent] | None:
        """The events of ``request_id`` from ``from_index`` on, from the decode instance at
        ``address``; None if it does not know the request; raises :class:`ResendFailed`."""


class PrefixLookup(Protocol):
    async def lookup(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` the kvstore holds; raises LookupFailed."""
