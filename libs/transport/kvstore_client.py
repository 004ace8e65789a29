"""The kvstore's ``Get`` and ``Put`` of prefix blocks, as prefill and decode use them.

:class:`KVStore` is the interface the handlers take (tests pass a dict-backed one);
:class:`GrpcKVStore` implements it over ``deepserve.v1.KVStore``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol, cast

import grpc

from libs.common.grpc_auth import call_metadata
from libs.proto.deepserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

Block = tuple[bytes, bytes, bytes]  # (chain digest, parent digest or b"", single-block frame)
GET_TIMEOUT_S = 10.0
PUT_TIMEOUT_S = 30.0


class KVStore(Protocol):
    async def get(self, hashes: list[bytes]) -> list[bytes]:
        """Frames of the leading ``hashes`` that are stored, in chain order (may be fewer)."""

    async def put(self, blocks: list[Block], tenant: str, traffic_class: int) -> None:
        """Store the blocks; raises on failure (the caller logs it)."""


def open_kvstore(
    stack: contextlib.AsyncExitStack, address: str, token: str = ""
) -> GrpcKVStore | None:
    """A client of the kvstore at ``address`` closed with ``stack`` (None: no address, no
    kvstore: nothing cached is loaded, nothing written)."""
    if not address:
        return None
    kvstore = GrpcKVStore(address, token)
    stack.push_async_callback(kvstore.close)
    return kvstore


class GrpcKVStore:
    """The kvstore's ``Get`` and ``Put`` for prefix blocks."""

    def __init__(self, address: str, token: str = "") -> None:
        self.address = address
        self._md = call_metadata(token)  # the service credential, on every call
        # One DeepSeek-V3 block is ~9 MB (61 layers x 128 tokens x 576 bf16): above gRPC's 4 MiB
        # default.
        limit = 64 << 20
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ],
        )
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)  # type: ignore[no-untyped-call]

    async def get(self, hashes: list[bytes]) -> list[bytes]:
        found: dict[bytes, bytes] = {}
        async for block in self._stub.Get(
            kvstore_pb2.GetRequest(hashes=hashes), timeout=GET_TIMEOUT_S, metadata=self._md
        ):
            found[block.hash] = block.data
        frames = []
        for h in hashes:  # only a leading run imports: the engine needs a contiguous prefix
            if h not in found:
                break
            frames.append(found[h])
        return frames

    async def put(self, blocks: list[Block], tenant: str, traffic_class: int) -> None:
        async def parts() -> AsyncIterator[kvstore_pb2.PutBlock]:
            for digest, parent, data in blocks:
                yield kvstore_pb2.PutBlock(
                    hash=digest,
                    parent_hash=parent,
                    data=data,
                    tenant=tenant,
                    traffic_class=cast(common_pb2.TrafficClass, traffic_class),
                )

        await self._stub.Put(parts(), timeout=PUT_TIMEOUT_S, metadata=self._md)

    async def close(self) -> None:
        await self._channel.close()


async def write_back(
    store: KVStore,
    finish: Callable[[], list[Block]],
    salt: bytes,
    traffic_class: int,
    log: logging.Logger,
    request_id: str,
) -> int:
    """Build the blocks an engine started copying out (``finish``, in a worker thread) and put
    them; returns how many were written. A failure is logged and returns -1: a lost cache write
    only costs a future recompute."""
    blocks: list[Block] = []
    try:
        blocks = await asyncio.to_thread(finish)
        if blocks:
            await store.put(blocks, salt.hex(), traffic_class)
        return len(blocks)
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("request %s: kvstore Put of %d blocks failed: %s", request_id, len(blocks), exc)
        return -1
