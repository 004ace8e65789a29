"""Prefill's hand-over of a request's KV to its decode instance (the contract:
:mod:`libs.serving.handoff`).

Ask decode which leading blocks of the prompt it holds (a session's previous turn usually left
them there) and send only the rest: as references into this engine's KV pool when decode runs
on this host (it copies them device to device; the blocks stay held until it answers; the
reference is signed for the request, :mod:`libs.serving.peer_seal`), else as a frame of bytes
built off the engine thread. Decode may answer "send bytes" (it cannot
open the pool) or "missing prefix" (it evicted blocks it said it held): the hand-over is sent
again that way, at most ``MAX_SENDS`` times in all.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import trace

from libs.common.errors import InstanceFailed
from libs.common.hashchain import chain_hashes
from libs.engine.kv.peer import host_id
from libs.engine.kv.transfer import PeerKV
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engine_loop import EngineLoop
from libs.serving.handoff import KVPusher, KVResend
from libs.serving.peer_seal import seal

from .metrics import HANDOFF_BLOCKS, RESENDS

log = logging.getLogger("prefill")

MAX_SENDS = 3  # a hand-over tries at most: peer refs, bytes, bytes from block 0


class PushFailed(InstanceFailed):
    """The decode instance did not take the KV (unreachable, refused, timed out)."""


class HandOff:
    """Sends a prefilled request's KV from ``loop``'s engine through ``pusher``.

    ``same_host``: False sends bytes even to a decode instance on this host (tests,
    debugging). The caller releases the engine's copy afterwards, whatever happened.
    """

    def __init__(
        self,
        loop: EngineLoop,
        pusher: KVPusher,
        block_size: int,
        tracer: trace.Tracer,
        same_host: bool = True,
    ) -> None:
        self.loop, self.pusher, self.block_size = loop, pusher, block_size
        self.tracer, self.same_host = tracer, same_host

    async def send(
        self, task: control_pb2.PrefillTask, decode_task: control_pb2.DecodeTask, prompt: list[int]
    ) -> None:
        """Send decode the blocks it lacks, by reference on this host, else as bytes;
        PushFailed when it refused them ``MAX_SENDS`` times."""
        rid, address, bs = task.request_id, task.decode_address, self.block_size
        full = chain_hashes(prompt[: (len(prompt) // bs) * bs], bs, task.cache_salt)
        have, same_host = 0, False
        if full:
            try:
                held = await self.pusher.match(address, full)
                have = max(0, min(held.blocks, len(full)))
                same_host = self.same_host and held.host == host_id()
            except InstanceFailed as exc:  # the push says what is wrong, or works
                log.info("request %s: Match on %s failed (%s); sending every block", rid, exc)
        total = -(-len(prompt) // bs)
        for _ in range(MAX_SENDS):
            kv = await self._kv_from(rid, have, same_host)
            try:
                await self.pusher.push(address, decode_task, kv)
            except KVResend as exc:
                if exc.send_bytes:
                    same_host = False
                    RESENDS.labels("send_bytes").inc()
                if exc.have_blocks is not None:
                    have = max(0, min(have, exc.have_blocks))
                    RESENDS.labels("missing_prefix").inc()
                continue
            HANDOFF_BLOCKS.labels("held").inc(have)
            HANDOFF_BLOCKS.labels("peer" if isinstance(kv, PeerKV) else "bytes").inc(total - have)
            return
        raise PushFailed(f"decode {address} refused the KV {MAX_SENDS} times; see its log")

    async def _kv_from(self, rid: str, start: int, same_host: bool) -> bytes | PeerKV:
        if same_host:
            ref = await self.loop.call(lambda e: e.peer_kv(rid, start))
            if ref is not None:  # signed for this request: decode opens nothing else
                return seal(ref, rid, self.loop.engine.config.kv_mac_key)
        finish = await self.loop.call(
            lambda e: e.export_kv_async(rid, include_partial=True, start_block=start)
        )
        with self.tracer.start_as_current_span("prefill.export_kv"):
            return await asyncio.to_thread(finish)
