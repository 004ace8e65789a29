"""gRPC client of prefill: the decode instances' KVTransfer (the kvstore's client is shared
with decode: :mod:`libs.transport.kvstore_client`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from libs.common.grpc_auth import call_metadata
from libs.engine.kv.transfer import PeerKV
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from libs.serving.handoff import Holding, check_reply, peer_to_proto
from libs.serving.instance_flags import PUSH_TIMEOUT_S

from .handoff import PushFailed

CHUNK_BYTES = 1 << 20  # KV travels in chunks of <= 1 MiB, well under gRPC's 4 MiB message limit
MATCH_TIMEOUT_S = 5.0


class GrpcKVPusher:
    """``KVTransfer.Match`` and ``Push`` to decode instances; one channel per address, kept
    open (:class:`libs.serving.handoff.KVPusher` over gRPC)."""

    def __init__(
        self, timeout_s: float = PUSH_TIMEOUT_S, chunk_bytes: int = CHUNK_BYTES, token: str = ""
    ) -> None:
        self.timeout_s = timeout_s
        self._md = call_metadata(token)  # the service credential, on every call
        self.chunk_bytes = chunk_bytes
        self._stubs: dict[str, tuple[grpc.aio.Channel, kv_transfer_pb2_grpc.KVTransferStub]] = {}

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        if address not in self._stubs:
            channel = grpc.aio.insecure_channel(address)
            self._stubs[address] = (channel, kv_transfer_pb2_grpc.KVTransferStub(channel))  # type: ignore[no-untyped-call]
        return self._stubs[address][1]

    async def match(self, address: str, block_hashes: list[bytes]) -> Holding:
        try:
            reply = await self._stub(address).Match(
                kv_transfer_pb2.MatchRequest(block_hashes=block_hashes),
                timeout=MATCH_TIMEOUT_S,
                metadata=self._md,
            )
        except grpc.aio.AioRpcError as exc:
            raise PushFailed(
                f"KV Match on decode {address} failed: {exc.code().name}: {exc.details()}"
            ) from None
        return Holding(reply.blocks, reply.host)

    async def push(self, address: str, task: control_pb2.DecodeTask, kv: bytes | PeerKV) -> None:
        async def parts() -> AsyncIterator[kv_transfer_pb2.KVPush]:
            yield kv_transfer_pb2.KVPush(task=task)
            if isinstance(kv, PeerKV):
                yield kv_transfer_pb2.KVPush(peer=peer_to_proto(kv))
                return
            view = memoryview(kv)
            for i in range(0, len(view), self.chunk_bytes):
                yield kv_transfer_pb2.KVPush(chunk=bytes(view[i : i + self.chunk_bytes]))

        metadata = self._md + ((("traceparent", task.traceparent),) if task.traceparent else ())
        try:
            reply = await self._stub(address).Push(
                parts(), timeout=self.timeout_s, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise PushFailed(
                f"KV push to decode {address} failed: {exc.code().name}: {exc.details()}"
            ) from None
        check_reply(reply, address)

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
