"""In-process twins of the control bus (NATS) and of prefill's KV push (``KVTransfer.Push``).

:class:`InProcBus` keeps NATS's subject semantics inside one asyncio loop: tokens split on
``.``, ``*`` matches one token, ``>`` (last) matches one or more; subscribers sharing a queue
group get each message once between them (round-robin), everyone else gets every message;
request/reply goes through a private inbox. It serves both styles the services use:

* the entrypoint's ``Bus`` (``request``, ``publish``, ``subscribe(subject)`` returning a
  subscription with ``next(timeout)`` and ``close()``);
* the callback style of balancer/prefill/decode ``main.py`` (``subscribe(subject, queue=...,
  cb=...)``, the callback gets a :class:`Msg` with ``subject``, ``data``, ``reply`` and
  ``respond``; ``unsubscribe()``). A subscription's callbacks run one at a time, in order.

A subscription is live when ``subscribe`` returns (there is no server to flush to).
:class:`InProcKVPusher` hands a prefill's DecodeTask and KV (frame or pool references) to the
decode handler registered under the address the balancer chose.

Failures raise the shared retryable kinds, as the real transports do: :class:`NoResponders`
is an ``Unavailable`` (the entrypoint's bus contract), :class:`PushRefused` an
``InstanceFailed`` (prefill's pusher contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from libs.common.errors import InstanceFailed, Unavailable
from libs.engine.kv.transfer import PeerKV
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2
from libs.serving.handoff import Holding, check_reply

log = logging.getLogger(__name__)

INBOX_PREFIX = "_INBOX"


class NoResponders(Unavailable):
    """A request found no subscriber, or none answered in time (the default failure)."""


class PushRefused(InstanceFailed):
    """No decode handler at the address, or it refused the KV (the default failure)."""


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` matches ``pattern`` (NATS: ``*`` one token, ``>`` the rest)."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return i == len(want) - 1 and len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


@dataclass(frozen=True)
class Msg:
    """One delivered message, shaped like ``nats.aio.msg.Msg`` where the services read it."""

    subject: str
    data: bytes
    reply: str = ""
    _bus: InProcBus | None = field(default=None, repr=False, compare=False)

    async def respond(self, data: bytes) -> None:
        if not self.reply or self._bus is None:
            raise ValueError(f"message on {self.subject} has no reply subject")
        await self._bus.publish(self.reply, data)


Callback = Callable[[Msg], Awaitable[None]]


class InProcSubscription:
    def __init__(self, bus: InProcBus, subject: str, queue: str, cb: Callback | None) -> None:
        self.bus, self.subject, self.queue, self.cb = bus, subject, queue, cb
        self._messages: asyncio.Queue[Msg] = asyncio.Queue()
        self._pump = asyncio.get_running_loop().create_task(self._run()) if cb else None

    def _deliver(self, msg: Msg) -> None:
        self._messages.put_nowait(msg)

    async def next_msg(self, timeout: float) -> Msg:
        """The next message; TimeoutError after ``timeout`` seconds without one."""
        try:
            return await asyncio.wait_for(self._messages.get(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no message on {self.subject} for {timeout:.1f}s") from None

    def take_pending(self) -> list[Msg]:
        """The messages delivered but not read yet, without waiting (they count as read).
        Delivery happens inside ``publish``, so this is everything published so far."""
        out = []
        while not self._messages.empty():
            out.append(self._messages.get_nowait())
        return out

    def ready(self) -> bool:
        """Whether a message is already here (the entrypoint's ``Subscription``)."""
        return not self._messages.empty()

    async def next(self, timeout: float) -> bytes:
        """The next payload (the entrypoint's ``Subscription``)."""
        return (await self.next_msg(timeout)).data

    async def unsubscribe(self) -> None:
        self.bus._remove(self)
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    async def close(self) -> None:
        await self.unsubscribe()

    async def _run(self) -> None:
        assert self.cb is not None
        while True:
            msg = await self._messages.get()
            try:
                await self.cb(msg)
            except Exception:  # NATS logs a failing callback and keeps delivering
                log.exception("callback on %s failed", self.subject)


class InProcBus:
    """NATS in one process; ``request`` raises :class:`NoResponders` when nobody answers."""

    def __init__(self) -> None:
        self._subs: list[InProcSubscription] = []
        self._turn: dict[tuple[str, str], int] = {}  # (pattern, queue) -> round-robin counter
        self._inboxes = itertools.count()

    async def subscribe(
        self, subject: str, *, queue: str = "", cb: Callback | None = None
    ) -> InProcSubscription:
        sub = InProcSubscription(self, subject, queue, cb)
        self._subs.append(sub)
        return sub

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        self._publish(subject, data, reply)

    def _publish(self, subject: str, data: bytes, reply: str = "") -> int:
        """Deliver to every plain subscriber and to one member of each queue group."""
        msg = Msg(subject, bytes(data), reply, self)
        groups: dict[tuple[str, str], list[InProcSubscription]] = {}
        delivered = 0
        for sub in self._subs:
            if not subject_matches(sub.subject, subject):
                continue
            if sub.queue:
                groups.setdefault((sub.subject, sub.queue), []).append(sub)
            else:
                sub._deliver(msg)
                delivered += 1
        for key, members in groups.items():
            turn = self._turn.get(key, 0)
            self._turn[key] = turn + 1
            members[turn % len(members)]._deliver(msg)
            delivered += 1
        return delivered

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        """The first reply's payload; ``unavailable`` if nobody listens or answers in time."""
        inbox = await self.subscribe(f"{INBOX_PREFIX}.{next(self._inboxes)}")
        try:
            if not self._publish(subject, data, inbox.subject):
                raise NoResponders(f"nothing listens on {subject}")
            try:
                return await inbox.next(timeout)
            except TimeoutError:
                raise NoResponders(f"no answer on {subject} within {timeout:.1f}s") from None
        finally:
            await inbox.unsubscribe()

    async def flush(self, timeout: float | None = None) -> None:
        """Nothing to flush: every subscription is live when ``subscribe`` returns."""

    def _remove(self, sub: InProcSubscription) -> None:
        with contextlib.suppress(ValueError):
            self._subs.remove(sub)


class Decode(Protocol):
    """What a decode instance answers over ``KVTransfer`` (its handler)."""

    async def match(self, block_hashes: list[bytes]) -> Holding: ...

    async def accept(
        self, task: control_pb2.DecodeTask, kv: bytes | PeerKV, traceparent: str = ""
    ) -> kv_transfer_pb2.KVPushReply: ...


class InProcKVPusher:
    """Prefill's ``KVPusher`` over direct calls: ``register(address, decode)`` stands for a
    decode instance serving ``KVTransfer`` at ``address``; ``push`` raises
    :class:`PushRefused` when there is no such instance or it refuses the KV (or the
    :class:`KVResend` it asks for)."""

    def __init__(self) -> None:
        self._targets: dict[str, Decode] = {}
        self.pushed = 0  # hand-overs delivered (accepted or not)
        self.sent: list[bytes | PeerKV] = []  # what each push carried, in order

    def register(self, address: str, decode: Decode) -> None:
        self._targets[address] = decode

    def unregister(self, address: str) -> None:
        self._targets.pop(address, None)

    def _target(self, address: str) -> Decode:
        decode = self._targets.get(address)
        if decode is None:
            raise PushRefused(f"KV push to decode {address} failed: UNAVAILABLE: no such instance")
        return decode

    async def match(self, address: str, block_hashes: list[bytes]) -> Holding:
        return await self._target(address).match(block_hashes)

    async def push(self, address: str, task: control_pb2.DecodeTask, kv: bytes | PeerKV) -> None:
        decode = self._target(address)
        self.pushed += 1
        self.sent.append(kv)
        reply = await decode.accept(task, kv, task.traceparent)
        try:
            check_reply(reply, address)
        except InstanceFailed as exc:
            raise PushRefused(str(exc)) from None

    async def close(self) -> None:
        self._targets.clear()
