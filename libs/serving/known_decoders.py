"""Push KV (and the service token with it) only to decode instances heard on NATS.

A ``PrefillTask`` names the decode instance to hand the request to (``decode_address``), and
the push carries the stack's service token. An address taken from the bus unchecked would
send that token wherever a task says, so prefill (and the aggregated service) listen to
``ds.heartbeat.decode.*`` -- which only decode and aggregated instances may publish (NATS
permissions, libs/common/nats_auth.py) -- and :class:`CheckedPusher` refuses any other
address with a retryable :class:`InstanceFailed` (the entrypoint tries another instance).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from libs.common.errors import InstanceFailed
from libs.engine.kv.transfer import PeerKV
from libs.proto.deepserve.v1 import control_pb2

from .handoff import Holding, KVPusher

DECODE_HEARTBEATS = "ds.heartbeat.decode.*"


class KnownDecoders:
    """Addresses of the decode instances heard heartbeat within the last ``ttl`` seconds.

    :meth:`check` of an address not heard yet waits up to ``wait`` seconds for it (a
    freshly started prefill may get a task before the decode's next beat), then refuses.
    """

    def __init__(
        self, ttl: float = 30.0, wait: float = 3.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl, self.wait, self.clock = ttl, wait, clock
        self._seen: dict[str, float] = {}  # address -> clock() of its latest heartbeat
        self._heard = asyncio.Event()  # set (and cleared) on every heartbeat

    def heard(self, status: control_pb2.InstanceStatus) -> None:
        if status.address:
            self._seen[status.address] = self.clock()
            self._heard.set()
            self._heard.clear()

    async def on_message(self, msg: Any) -> None:
        try:
            status = control_pb2.InstanceStatus.FromString(msg.data)
        except Exception:  # noqa: BLE001 - not a heartbeat: nothing heard
            return
        self.heard(status)

    async def subscribe(self, nc: Any) -> Any:
        """Listen on ``ds.heartbeat.decode.*`` through ``nc``; the subscription."""
        return await nc.subscribe(DECODE_HEARTBEATS, cb=self.on_message)

    def known(self, address: str) -> bool:
        seen = self._seen.get(address)
        return seen is not None and self.clock() - seen <= self.ttl

    async def check(self, address: str) -> None:
        """Return once ``address`` is a decode instance heard lately; else raise
        :class:`InstanceFailed` (retryable) after waiting ``wait`` seconds for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while not self.known(address):
            left = deadline - loop.time()
            if left <= 0:
                raise InstanceFailed(
                    f"decode address {address!r} is not a decode instance this prefill has "
                    f"heard on {DECODE_HEARTBEATS}; refusing to send it KV (and the service "
                    f"token); retry on another instance"
                )
            try:
                await asyncio.wait_for(self._heard.wait(), min(left, 0.5))
            except TimeoutError:
                pass


class CheckedPusher:
    """A :class:`KVPusher` that sends only to addresses :class:`KnownDecoders` knows."""

    def __init__(self, inner: KVPusher, known: KnownDecoders) -> None:
        self.inner, self.known = inner, known

    async def match(self, address: str, block_hashes: list[bytes]) -> Holding:
        await self.known.check(address)
        return await self.inner.match(address, block_hashes)

    async def push(self, address: str, task: control_pb2.DecodeTask, kv: bytes | PeerKV) -> None:
        await self.known.check(address)
        await self.inner.push(address, task, kv)

    def __getattr__(self, name: str) -> Any:  # close() and the like: the inner pusher's
        return getattr(self.inner, name)
