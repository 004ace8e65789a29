"""The prefill -> decode KV hand-off contract, apart from how the bytes travel.

Prefill asks the decode instance what it holds (:class:`Holding`: leading blocks of the
prompt's chain, and its host), then sends only the blocks it lacks: as references into
prefill's own KV pool when both run on one host (:class:`~libs.engine.kv.transfer.PeerKV`,
copied device to device), else as a frame of bytes. A transport (gRPC ``KVTransfer``, the
in-process pusher of tests) implements :class:`KVPusher`; a cross-host transfer library
(NIXL, Mooncake's transfer engine) would be one more implementation of the same two calls.

A decode instance that cannot take what was sent says what would work instead
(:class:`KVResend`): the blocks it was to build on are gone (resend from ``have_blocks``),
or it cannot map the pool (resend as bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from libs.common.errors import InstanceFailed
from libs.engine.kv.transfer import PeerKV
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2


@dataclass(frozen=True)
class Holding:
    """What a decode instance holds of a prompt: its leading ``blocks``, on host ``host``."""

    blocks: int
    host: str


class KVResend(Exception):
    """The decode instance took nothing; sending again as it says can work."""

    def __init__(self, message: str, have_blocks: int | None, send_bytes: bool) -> None:
        super().__init__(message)
        self.have_blocks = have_blocks  # resend from this block (the ones before are gone)
        self.send_bytes = send_bytes  # resend as a frame (the pool cannot be mapped there)


class KVPusher(Protocol):
    async def match(self, address: str, block_hashes: list[bytes]) -> Holding:
        """What the decode instance at ``address`` holds of this chain; raises
        :class:`InstanceFailed` when it cannot be asked."""

    async def push(self, address: str, task: control_pb2.DecodeTask, kv: bytes | PeerKV) -> None:
        """Deliver ``task`` with its KV (a frame or pool references).

        Raises :class:`KVResend` when a different send can work, else
        :class:`InstanceFailed` with a message a person can act on.
        """


def check_reply(reply: kv_transfer_pb2.KVPushReply, address: str) -> None:
    """Raise what a refusing :class:`~kv_transfer_pb2.KVPushReply` means (nothing if taken)."""
    if reply.accepted:
        return
    if reply.missing_prefix or reply.send_bytes:
        raise KVResend(
            f"decode {address}: {reply.error}",
            reply.have_blocks if reply.missing_prefix else None,
            reply.send_bytes,
        )
    raise InstanceFailed(f"decode {address} refused the KV: {reply.error}")


def peer_to_proto(kv: PeerKV) -> kv_transfer_pb2.PeerBlocks:
    return kv_transfer_pb2.PeerBlocks(
        pool=kv.pool,
        block_ids=list(kv.block_ids),
        first_block=kv.first_block,
        num_tokens=kv.num_tokens,
        block_hashes=list(kv.block_hashes),
    )


def peer_from_proto(msg: kv_transfer_pb2.PeerBlocks) -> PeerKV:
    return PeerKV(
        bytes(msg.pool),
        tuple(msg.block_ids),
        msg.first_block,
        msg.num_tokens,
        tuple(msg.block_hashes),
    )
