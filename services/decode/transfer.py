"""Decode's gRPC face: ``deepserve.v1.KVTransfer`` (Push, Match, Resend) over a
:class:`~services.decode.handlers.DecodeHandler`.

A push is checked before any of its KV is read: the DecodeTask first (a prompt length that
does not fit its tokens or this engine's context is refused at once), then the frame's size
against the most a frame for that prompt can be (:func:`max_frame_bytes`), chunk by chunk.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from libs.engine.kv.peer import host_id
from libs.engine.kv.transfer import MAX_HEADER_BYTES, PeerKV
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from libs.serving.handoff import Holding, peer_from_proto
from libs.serving.request_stream import EngineLoopClosed

from .handlers import DecodeHandler, kv_tokens
from .metrics import REQUESTS

log = logging.getLogger("decode")


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """``Push``: the DecodeTask first, then the KV frame in chunks or one PeerBlocks
    reference; ``Match``: what this instance holds of a chain. The handler does the rest.

    A push is refused as soon as it is implausible: a task whose prompt length does not fit
    its tokens before any chunk is read, and a frame at the first chunk that takes it past
    the most a frame for that prompt can be (:func:`max_frame_bytes`), so a garbage stream
    costs at most one frame's worth of memory and is never read to its end.
    """

    def __init__(self, handler: DecodeHandler) -> None:
        self.handler = handler
        # A prompt this engine could never hold is refused before its KV is read.
        self.max_model_len = handler.loop.engine.scheduler_config.max_model_len

    async def Push(
        self,
        request_iterator: AsyncIterator[kv_transfer_pb2.KVPush],
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.KVPushReply:
        task: control_pb2.DecodeTask | None = None
        frame = bytearray()
        limit = 0
        ref: PeerKV | None = None
        async for part in request_iterator:
            which = part.WhichOneof("part")
            if task is None:
                if which != "task":
                    return _refuse("the first KVPush message must carry the DecodeTask")
                task = part.task
                why = _implausible(task, self.max_model_len)
                if why:
                    return _refuse(why)
                limit = max_frame_bytes(
                    kv_tokens(task), self.handler.block_size, self.handler.bytes_per_block
                )
            elif which == "chunk" and ref is None:
                if len(frame) + len(part.chunk) > limit:
                    return _refuse(
                        f"KV frame for request {task.request_id!r} passed {limit} bytes, the "
                        f"most {kv_tokens(task)} prompt tokens can need here "
                        f"(block size {self.handler.block_size}, "
                        f"{self.handler.bytes_per_block} bytes per block): was it made for "
                        f"another model or prompt?"
                    )
                frame += part.chunk
            elif which == "peer" and ref is None and not frame:
                ref = peer_from_proto(part.peer)
            else:
                return _refuse(f"KVPush.{which} out of order: a task, then chunks or one peer")
        if task is None:
            return _refuse("empty KVPush stream")
        meta = dict(context.invocation_metadata() or ())
        traceparent = str(meta.get("traceparent", ""))
        return await self.handler.accept(task, ref or bytes(frame), traceparent)

    async def Match(
        self, request: kv_transfer_pb2.MatchRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.MatchReply:
        try:
            held = await self.handler.match(list(request.block_hashes))
        except EngineLoopClosed:
            held = Holding(0, host_id())
        return kv_transfer_pb2.MatchReply(blocks=held.blocks, host=held.host)

    async def Resend(
        self, request: kv_transfer_pb2.ResendRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ResendReply:
        return self.handler.resend(request)


# A frame's bytes beyond its digests and blocks: the 10-byte prefix (magic, version, header
# length) and the header's other JSON -- model id, layout hash, dtype, numbers and the mac
# (~300 bytes today); 64 KiB leaves room for long model ids without letting much through.
_HEADER_FIXED_BYTES = 64 << 10
# One hex digest in the header's JSON list: 64 hex digits (SHA-256), quotes and a comma;
# counted at twice that so a longer digest would still fit.
_HEADER_BYTES_PER_BLOCK = 2 * (64 + 3)


def max_frame_bytes(num_prompt_tokens: int, block_size: int, bytes_per_block: int) -> int:
    """The most bytes a KV frame for a prompt of ``num_prompt_tokens`` can have: prefix and
    header (the header at most ``MAX_HEADER_BYTES``) plus one block per ``block_size`` prompt
    tokens (the tail block included), each ``bytes_per_block``."""
    blocks = -(-num_prompt_tokens // block_size)
    header = min(MAX_HEADER_BYTES, blocks * _HEADER_BYTES_PER_BLOCK)
    return _HEADER_FIXED_BYTES + header + blocks * bytes_per_block


def _implausible(task: control_pb2.DecodeTask, max_model_len: int) -> str:
    """Why this task cannot be real, before any of its KV is read ("" if it can)."""
    if not 0 < task.num_prompt_tokens < max_model_len:
        return (
            f"DecodeTask.num_prompt_tokens must lie in [1, {max_model_len - 1}] (this "
            f"engine's context), got {task.num_prompt_tokens} (request {task.request_id!r})"
        )
    if len(task.token_ids) <= task.num_prompt_tokens:
        return (
            f"DecodeTask.token_ids must hold the {task.num_prompt_tokens} prompt tokens and the "
            f"first generated token, got {len(task.token_ids)} (request {task.request_id!r})"
        )
    if len(task.token_ids) >= max_model_len:
        return (
            f"DecodeTask.token_ids holds {len(task.token_ids)} tokens; this engine's context "
            f"is {max_model_len} (request {task.request_id!r})"
        )
    return ""


def _refuse(why: str) -> kv_transfer_pb2.KVPushReply:
    """A push refused before it reached the engine: counted, logged, said in the reply."""
    REQUESTS.labels("rejected").inc()
    log.warning("KV push refused: %s", why)
    return kv_transfer_pb2.KVPushReply(accepted=False, error=why)
