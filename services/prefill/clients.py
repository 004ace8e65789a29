"""gRPC clients of prefill: the decode instances' KVTransfer and the kvstore."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import grpc

from libs.proto.deepserve.v1 import (
    common_pb2,
    control_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
)

from .handlers import Block, PushFailed

CHUNK_BYTES = 1 << 20  # KV travels in chunks of <= 1 MiB, well under gRPC's 4 MiB message limit
PUSH_TIMEOUT_S = 30.0
GET_TIMEOUT_S = 10.0
PUT_TIMEOUT_S = 30.0


class GrpcKVPusher:
    """``KVTransfer.Push`` to decode instances; one channel per address, kept open."""

    def __init__(self, timeout_s: float = PUSH_TIMEOUT_S, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._stubs: dict[str, tuple[grpc.aio.Channel, kv_transfer_pb2_grpc.KVTransferStub]] = {}

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        if address not in self._stubs:
            channel = grpc.aio.insecure_channel(address)
            self._stubs[address] = (channel, kv_transfer_pb2_grpc.KVTransferStub(channel))  # type: ignore[no-untyped-call]
        return self._stubs[address][1]

    async def push(self, address: str, task: control_pb2.DecodeTask, frame: bytes) -> None:
        async def parts() -> AsyncIterator[kv_transfer_pb2.KVPush]:
            yield kv_transfer_pb2.KVPush(task=task)
            view = memoryview(frame)
            for i in range(0, len(view), self.chunk_bytes):
                yield kv_transfer_pb2.KVPush(chunk=bytes(view[i : i + self.chunk_bytes]))

        metadata = (("traceparent", task.traceparent),) if task.traceparent else None
        try:
            reply = await self._stub(address).Push(
                parts(), timeout=self.timeout_s, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise PushFailed(
                f"KV push to decode {address} failed: {exc.code().name}: {exc.details()}"
            ) from None
        if not reply.accepted:
            raise PushFailed(f"decode {address} refused the KV: {reply.error}")

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


class GrpcKVStore:
    """The kvstore's ``Get`` and ``Put`` for prefix blocks."""

    def __init__(self, address: str) -> None:
        self.address = address
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
            kvstore_pb2.GetRequest(hashes=hashes), timeout=GET_TIMEOUT_S
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

        await self._stub.Put(parts(), timeout=PUT_TIMEOUT_S)

    async def close(self) -> None:
        await self._channel.close()
