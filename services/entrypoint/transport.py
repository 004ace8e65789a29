"""The entrypoint's transports: the NATS control bus and the kvstore lookup client.

Each has an in-process twin in the tests (a fake bus / lookup), so the handler runs without
servers; these are the real ones that ``main.py`` wires in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
import nats.errors
from google.protobuf.message import DecodeError
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSub

from libs.common import subjects
from libs.common.grpc_auth import call_metadata
from libs.common.ready_queue import ReadyQueue
from libs.proto.deepserve.v1 import (
    control_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
)

from .contracts import BusUnavailable, LookupFailed, ResendFailed
from .delivery import Delivery

log = logging.getLogger("entrypoint")
LINK_POLL_S = 0.05  # how often a call waiting for NATS looks again (only during an outage)
RETRY_PAUSE_S = 0.1  # between two asks that nobody answered just after an outage


class NatsSubscription:
    """One request's token events. A callback queues the payloads, so taking one that is
    already here costs no task and no timer (nats-py's ``next_msg`` makes two tasks and a
    uuid per message: the entrypoint's largest per-token cost at thousands of tokens a
    second), and :meth:`ready` can tell that more are waiting."""

    def __init__(self) -> None:
        self._sub: NatsSub | None = None
        self._queue: ReadyQueue[bytes] = ReadyQueue()

    @classmethod
    async def open(cls, nc: Client, subject: str) -> NatsSubscription:
        me = cls()
        me._sub = await nc.subscribe(subject, cb=me._on_msg)
        return me

    async def _on_msg(self, msg: Msg) -> None:
        self._queue.put(msg.data)

    async def next(self, timeout: float) -> bytes:
        """The next message's payload; TimeoutError after ``timeout`` seconds of silence."""
        try:
            return await self._queue.get(timeout)
        except TimeoutError:
            raise TimeoutError(f"no message for {timeout:.1f}s") from None

    def ready(self) -> bool:
        return bool(self._queue)

    async def close(self) -> None:
        if self._sub is None:
            return
        try:
            await self._sub.unsubscribe()
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionDrainingError,
            nats.errors.BadSubscriptionError,
        ):
            pass  # shutting down: the server drops the subscription with the connection


class NatsBus:
    """The entrypoint's :class:`~.handlers.Bus` and :class:`~.delivery.TaskSender` on NATS.

    A NATS outage is waited out, within bounds: a call made while the client is cut off
    waits for the reconnection up to ``outage_wait`` seconds (then :class:`BusUnavailable`,
    retryable) instead of leaving its message in the client's buffer, which a restarted
    server would get before anyone subscribed there again. For ``settle`` seconds after the
    link came back (or was seen down), a request that nobody answers is asked again every
    0.1 s within the same bound: the balancer replicas subscribe again as they reconnect
    (every 0.5 s, ``libs/common/natsutil.py``).
    """

    def __init__(
        self,
        nc: Client,
        outage_wait: float = 10.0,
        settle: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc, self.outage_wait, self.settle, self._clock = nc, outage_wait, settle, clock
        self._seen_reconnects = self.reconnects()
        self._changed_at = float("-inf")  # when the link was last seen down, or newly back

    def reconnects(self) -> int:
        return int(self.nc.stats["reconnects"])

    def _up(self) -> bool:
        """Whether the link is up now; notes when it was last seen down or newly back."""
        n, up = self.reconnects(), self.nc.is_connected
        if not up or n != self._seen_reconnects:
            self._seen_reconnects, self._changed_at = n, self._clock()
        return bool(up)

    def settling(self) -> bool:
        self._up()
        return self._clock() - self._changed_at < self.settle

    async def _link(self, give_up: float) -> None:
        """Return once connected; :class:`BusUnavailable` if not by ``give_up``."""
        if self._up():
            return
        log.info("NATS is unreachable: waiting up to %gs for it", self.outage_wait)
        while not self._up():
            if self._clock() >= give_up:
                raise BusUnavailable(f"NATS unreachable for {self.outage_wait:g}s")
            await asyncio.sleep(LINK_POLL_S)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        give_up = self._clock() + self.outage_wait
        while True:
            await self._link(give_up)
            try:
                msg = await self.nc.request(subject, data, timeout=timeout)
                return msg.data
            except nats.errors.NoRespondersError:
                why = f"nothing listens on {subject}"
            except nats.errors.TimeoutError:
                why = f"no answer on {subject} within {timeout:.1f}s"
            except nats.errors.Error as exc:  # closed, reconnecting, buffer full
                why = f"NATS: {exc!r}"
            if not self.settling() or self._clock() >= give_up:
                raise BusUnavailable(why)
            log.info("%s just after NATS was cut off; asking again", why)
            await asyncio.sleep(RETRY_PAUSE_S)

    async def send(self, subject: str, data: bytes, timeout: float) -> Delivery:
        await self._link(self._clock() + self.outage_wait)
        before = self.reconnects()
        try:
            await self.nc.request(subject, data, timeout=timeout)
            return Delivery.ACKED
        except nats.errors.NoRespondersError:
            return Delivery.NOBODY
        except nats.errors.TimeoutError:
            pass
        except nats.errors.Error as exc:  # closed, reconnecting, buffer full
            log.info("sending on %s: %r", subject, exc)
            await asyncio.sleep(RETRY_PAUSE_S)
            return Delivery.CUT_OFF
        # Only a subscriber could have kept the server from saying "no responders" at once.
        if self._up() and self.reconnects() == before:
            return Delivery.UNANSWERED
        return Delivery.CUT_OFF

    async def publish(self, subject: str, data: bytes) -> None:
        await self.nc.publish(subject, data)

    async def subscribe(self, subject: str) -> NatsSubscription:
        await self._link(self._clock() + self.outage_wait)
        sub = await NatsSubscription.open(self.nc, subject)
        # The subscription must be live at the server before anyone publishes to it (the
        # prefill task goes out next, and its first token may come back within milliseconds).
        try:
            await self.nc.flush(timeout=max(1, round(self.outage_wait)))
        except (nats.errors.Error, TimeoutError) as exc:
            await sub.close()
            raise BusUnavailable(f"NATS did not confirm a subscription: {exc!r}") from None
        return sub


class HeartbeatWatch:
    """When each instance last heartbeated (``ds.heartbeat.<role>.<instance>``), for
    :class:`~libs.gateway.retry.Watch` (the subject names the instance), and each heartbeat's
    figures for ``on_status`` (admission), if given.

    A NATS outage is not an instance's death: while this entrypoint is cut off from NATS no
    instance counts as silent, and after it is back an instance's silence is counted from
    the reconnection (heartbeats could not arrive in between), so in-flight requests wait for
    NATS instead of being failed over to other instances.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._seen: dict[str, float] = {}
        self._sub: NatsSub | None = None
        self._nc: Any = None
        self._clock = clock
        self._cut_off = False
        self._back_at = 0.0  # when NATS answered again after an outage

    async def start(
        self, nc: Client, on_status: Callable[[control_pb2.InstanceStatus], None] | None = None
    ) -> None:
        self._nc = nc

        async def on_beat(msg: Any) -> None:
            self._seen[msg.subject.rsplit(".", 1)[-1]] = self._clock()
            if on_status is None:
                return
            try:
                status = control_pb2.InstanceStatus.FromString(msg.data)
            except DecodeError:
                log.warning("unreadable heartbeat on %s ignored", msg.subject)
                return
            on_status(status)

        self._sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)

    def silent_for(self, instance_id: str) -> float | None:
        seen = self._seen.get(instance_id)
        if seen is None:
            return None
        now = self._clock()
        if self._nc is not None and not self._nc.is_connected:
            if not self._cut_off:
                log.warning("NATS is unreachable: no instance is declared dead until it is back")
            self._cut_off = True
            return 0.0
        if self._cut_off:  # back: silence counts from now on
            self._cut_off, self._back_at = False, now
        return now - max(seen, self._back_at)


class GrpcResender:
    """Lost token events back from the decode instance (``KVTransfer.Resend``), over gRPC so
    the answer does not depend on the NATS that lost them; and how often NATS reconnected.

    One channel per decode address, at most ``max_channels`` (the oldest is closed first).
    """

    def __init__(
        self, nc: Client, token: str = "", timeout: float = 2.0, max_channels: int = 256
    ) -> None:
        self.nc, self.timeout, self.max_channels = nc, timeout, max_channels
        self._md = call_metadata(token)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._flushed = 0

    def reconnects(self) -> int:
        """Reconnections so far that are complete (subscriptions replayed); 0 while cut off."""
        if not self.nc.is_connected:
            return self._flushed
        return int(self.nc.stats["reconnects"])

    async def settle(self) -> None:
        """Make sure the server has our replayed subscriptions (a round trip) before asking
        for what was missed, so no event falls between the answer and the subscription."""
        n = self.reconnects()
        if n == self._flushed:
            return
        try:
            await self.nc.flush(timeout=max(1, round(self.timeout)))
        except (nats.errors.Error, TimeoutError) as exc:
            raise ResendFailed(f"NATS is not back yet: {exc!r}") from None
        self._flushed = n

    async def resend(
        self, address: str, request_id: str, from_index: int
    ) -> list[control_pb2.TokenEvent] | None:
        stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel(address))  # type: ignore[no-untyped-call]
        try:
            reply = await stub.Resend(
                kv_transfer_pb2.ResendRequest(request_id=request_id, from_index=from_index),
                timeout=self.timeout,
                metadata=self._md,
            )
        except grpc.aio.AioRpcError as exc:
            raise ResendFailed(f"{address}: {exc.code().name}: {exc.details()}") from None
        return list(reply.events) if reply.known else None

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.pop(address, None)
        if channel is None:
            channel = grpc.aio.insecure_channel(address)
            while len(self._channels) >= self.max_channels:
                oldest = next(iter(self._channels))
                closing = self._channels.pop(oldest)
                asyncio.get_running_loop().create_task(closing.close(grace=1.0))
        self._channels[address] = channel  # most recently used last
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


class NoLookup:
    """No kvstore configured: nothing is ever cached."""

    async def lookup(self, hashes: list[bytes]) -> int:
        return 0

    async def close(self) -> None:
        pass


class GrpcLookup:
    """``KVStore.Lookup`` over gRPC; a failure is logged and raised as :class:`LookupFailed`."""

    def __init__(self, address: str, timeout: float, token: str = "") -> None:
        self.address, self.timeout = address, timeout
        self._md = call_metadata(token)  # the service credential, on every call
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)  # type: ignore[no-untyped-call]

    async def lookup(self, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        try:
            reply = await self._stub.Lookup(
                kvstore_pb2.LookupRequest(hashes=hashes), timeout=self.timeout, metadata=self._md
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "kvstore %s lookup failed (%s: %s); computing the prompt from scratch",
                self.address,
                exc.code().name,
                exc.details(),
            )
            raise LookupFailed(str(exc)) from None
        return max(0, min(int(reply.num_present), len(hashes)))

    async def close(self) -> None:
        await self._channel.close()
