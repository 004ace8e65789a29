"""Decode: take a request's KV and task from prefill, continue generating, stream the tokens.

:class:`DecodeHandler` holds the logic and no transport: ``accept`` is what ``KVTransfer.Push``
(``transfer.py``) calls once the whole frame has arrived, ``publish`` is how TokenEvents leave
(NATS in the service, a list in tests).

Indices: prefill published output position 0 (the first token); the engine here starts from
prompt + [first token], so its k-th event is output position k (k >= 1).

Outputs already in the task: ``DecodeTask.token_ids`` past ``num_prompt_tokens`` -- the first
token, and before it a retry's prior outputs (what an earlier attempt sent the client). The
engine takes them all as output (``prior_outputs``: penalties, grammar), and max_tokens and
min_tokens, which count the whole completion, are reduced by them.

What was published per request is kept (``libs/serving/replay.py``) while it decodes and for a
short grace after, so ``KVTransfer.Resend`` can send the entrypoint again what a NATS outage
lost.

With a kvstore, a finished request's full blocks past the prompt's (the prompt's tail plus the
generated tokens) are written there in the background, so a conversation's next turn finds
them; the engine keeps the request's KV (``hold_kv``) just long enough to copy them out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from libs.common import subjects
from libs.common.errors import (
    DeepserveError,
    InstanceFailed,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from libs.common.sampling import SamplingParams, TokenLogprob
from libs.common.telemetry import extract_context
from libs.engine.engine import (
    InvalidRequest,
    KVFormatError,
    MissingPrefix,
    NoFreeBlocks,
    PreparedKV,
)
from libs.engine.kv.peer import PeerUnavailable, host_id
from libs.engine.kv.transfer import PeerKV
from libs.proto.deepserve.v1 import common_pb2, control_pb2, kv_transfer_pb2
from libs.serving.aborts import RecentAborts
from libs.serving.convert import error_event
from libs.serving.engine_loop import EngineLoop
from libs.serving.handoff import Holding
from libs.serving.instance import drain_tasks, instance_status
from libs.serving.peer_seal import PeerKVRefused, PeerSeals
from libs.serving.replay import EventLog
from libs.serving.request_stream import EngineFailed, EngineLoopClosed, RequestStream
from libs.serving.write_behind import WriteBehind
from libs.transport.kvstore_client import Block, KVStore, write_back

from .metrics import (
    ERRORS,
    KV_BLOCKS,
    KV_BYTES,
    LATENCY,
    PEER_REFUSED,
    REQUESTS,
    RESENDS,
    STORE_DROPPED,
    STORE_ERRORS,
    STORED_BLOCKS,
    TOKENS,
)

log = logging.getLogger("decode")

Publish = Callable[[str, bytes], Awaitable[None]]


class DecodeHandler:
    def __init__(
        self,
        loop: EngineLoop,
        publish: Publish,
        *,
        instance_id: str,
        model_name: str,
        address: str,
        block_size: int,
        tracer: trace.Tracer | None = None,
        kvstore: KVStore | None = None,
    ) -> None:
        self.loop = loop
        self.kvstore = kvstore
        self.publish = publish
        self.instance_id = instance_id
        self.model_name = model_name
        self.address = address
        self.block_size = block_size
        self.tracer = tracer or trace.get_tracer("decode")
        self.draining = False
        self.aborted = RecentAborts()
        self._relays: dict[str, asyncio.Task[None]] = {}
        self._stop_reason: dict[str, str] = {}  # request id -> why we cut it short ("abort", ...)
        self.writes = WriteBehind()
        self.bytes_per_block = loop.engine.spec.bytes_per_block
        # Pool references are opened only signed by a prefill peer, for their request, once.
        self.seals = PeerSeals(loop.engine.config.kv_mac_key)
        # What was published per request, for KVTransfer.Resend (events lost in a NATS outage)
        self.sent = EventLog()

    # -- KV push ------------------------------------------------------------------------------
    async def match(self, block_hashes: list[bytes]) -> Holding:
        """How many leading blocks of this chain the engine holds now (no promise to keep
        them: a push that builds on evicted ones is refused with ``missing_prefix``)."""
        hashes = list(block_hashes)
        blocks = await self.loop.call(lambda e: e.resident_blocks(hashes)) if hashes else 0
        return Holding(blocks, host_id())

    async def accept(
        self, task: control_pb2.DecodeTask, kv: bytes | PeerKV, traceparent: str = ""
    ) -> kv_transfer_pb2.KVPushReply:
        """Queue the request with its KV; the reply says whether this instance took it.

        A refusal is the one place this maps an error: its message goes into the reply (prefill
        then fails the request with a retryable error event, or resends as the reply says).
        The reply comes once the KV is copied: a pool reference's owner may then reuse it.
        """
        rid = task.request_id
        try:
            self._precheck(task)
            stream = await self._add(task, kv)
        except MissingPrefix as exc:
            REQUESTS.labels("missing_prefix").inc()
            return kv_transfer_pb2.KVPushReply(
                accepted=False, error=str(exc), missing_prefix=True, have_blocks=exc.have
            )
        except PeerUnavailable as exc:
            REQUESTS.labels("send_bytes").inc()
            return kv_transfer_pb2.KVPushReply(accepted=False, error=str(exc), send_bytes=True)
        except DeepserveError as exc:
            REQUESTS.labels("rejected").inc()
            log.warning("%s", exc)
            return kv_transfer_pb2.KVPushReply(accepted=False, error=str(exc))
        self._relays[rid] = asyncio.create_task(
            self._relay(task, stream, traceparent or task.traceparent), name=f"decode-relay-{rid}"
        )
        REQUESTS.labels("accepted").inc()
        return kv_transfer_pb2.KVPushReply(accepted=True)

    async def continue_here(
        self, task: control_pb2.DecodeTask, stream: RequestStream, store_from_block: int
    ) -> None:
        """An aggregated instance's own request: the engine that computed the prompt goes on
        generating it (``stream`` has yielded the first token, published by prefill as event
        0), so nothing is handed over. Relays the rest like a pushed request, in the calling
        task (an abort or drain of either role reaches it); at the end the blocks from
        ``store_from_block`` on -- the prompt's the kvstore lacks and the generated ones --
        go to the kvstore."""
        rid = task.request_id
        self._precheck(task)
        me = asyncio.current_task()
        assert me is not None
        self._relays[rid] = me
        REQUESTS.labels("local").inc()
        KV_BLOCKS.labels("local").inc(-(-kv_tokens(task) // self.block_size))
        await self._relay(task, stream, task.traceparent, store_from_block)

    def _precheck(self, task: control_pb2.DecodeTask) -> None:
        rid = task.request_id
        if not rid:
            raise InvalidArgument("DecodeTask.request_id must not be empty")
        if self.draining:
            raise Unavailable(
                f"decode instance {self.instance_id} is draining; retry on another instance"
            )
        if rid in self.aborted:
            raise NotFound(f"request {rid} was aborted")  # the request is gone
        if rid in self._relays:
            raise InvalidArgument(f"request {rid} is already decoding here")
        if not 0 < task.num_prompt_tokens < len(task.token_ids):
            raise InvalidArgument(
                "DecodeTask.token_ids must hold the prompt and the first generated token"
            )
        done = len(task.token_ids) - task.num_prompt_tokens
        if task.sampling.max_tokens <= done:
            raise InvalidArgument(
                f"DecodeTask.sampling.max_tokens must be > {done}: the task holds {done} "
                "outputs already (prefill's first token and any a retry resumes from)"
            )

    async def _add(self, task: control_pb2.DecodeTask, kv: bytes | PeerKV) -> RequestStream:
        """Queue the request with its KV in the engine (frames are parsed and uploaded off
        the engine thread first); returns once the KV is in this engine's pages."""
        rid = task.request_id
        arrived = time.monotonic()  # the engine metrics' end-to-end latency counts the upload
        if isinstance(kv, PeerKV):
            try:
                kv = self.seals.open(kv, rid)  # before the pool is opened or anything imported
            except PeerKVRefused:
                PEER_REFUSED.inc()
                raise
        try:
            # Prefill produced the first token (after a retry's prior outputs, if any): that
            # many fewer to generate, and to hold stops back for.
            done = len(task.token_ids) - task.num_prompt_tokens
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(task.sampling)
            sampling.min_tokens = max(0, sampling.min_tokens - done)
            params = SamplingParams.from_proto(sampling, max_tokens=sampling.max_tokens - done)
            source: PeerKV | PreparedKV
            if isinstance(kv, PeerKV):
                source = kv
            else:
                KV_BYTES.inc(len(kv))
                source = await self.loop.prepare_kv([kv])
            stream = await self.loop.add(
                rid,
                list(task.token_ids),
                params,
                kv=source,
                cache_salt=task.cache_salt,
                hold_kv=self.kvstore is not None,
                prior_outputs=done,
                arrival=arrived,
                drafts=(list(task.draft_token_ids), list(task.draft_confidences))
                if task.draft_token_ids
                else None,
            )
            if stream.imported is not None:  # a pool copy: done before the owner reuses it
                await asyncio.to_thread(stream.imported.synchronize)
        except (MissingPrefix, PeerUnavailable):
            raise
        except NoFreeBlocks as exc:
            raise Unavailable(
                f"decode instance {self.instance_id} has no room for the KV now "
                f"({exc}); retry on another instance"
            ) from None
        except (InvalidRequest, KVFormatError, ValueError) as exc:
            raise InvalidArgument(f"decode task refused: {exc}") from None
        except EngineLoopClosed:
            raise Unavailable(
                f"decode instance {self.instance_id} is shutting down; retry elsewhere"
            ) from None
        KV_BLOCKS.labels("resident").inc(source.first_block)
        sent = len(source.block_hashes)
        KV_BLOCKS.labels("peer" if isinstance(kv, PeerKV) else "bytes").inc(sent)
        if rid in self.aborted:  # the abort overtook us while the KV was imported
            await self._abort_engine(rid)
            raise NotFound(f"request {rid} was aborted")
        return stream

    # -- events -------------------------------------------------------------------------------
    async def _relay(
        self,
        task: control_pb2.DecodeTask,
        stream: RequestStream,
        traceparent: str,
        store_from_block: int | None = None,
    ) -> None:
        rid = task.request_id
        subject = task.events_subject or subjects.token_events(rid)
        t0 = time.perf_counter()
        index = 1
        self.sent.start(
            rid,
            task.token_ids[-1],
            task.num_prompt_tokens,
            task.cached_tokens,
            TokenLogprob.from_proto(task.first_logprobs)
            if task.HasField("first_logprobs")
            else None,
            task.sampling.HasField("logprobs"),
        )
        with self.tracer.start_as_current_span(
            "decode", context=extract_context(traceparent)
        ) as span:
            span.set_attribute("deepserve.request_id", rid)
            try:
                async for first in stream:
                    if first.token_id is None:  # aborted in the engine
                        await self._on_cut(rid, subject, index)
                        return
                    # the engine's tokens that are already here (this loop fell behind): one
                    # message for all of them
                    evs = [first, *stream.ready_tokens()] if not first.finished else [first]
                    last = evs[-1]
                    msg = control_pb2.TokenEvent(
                        request_id=rid,
                        index=index,
                        finished=last.finished,
                        finish_reason=last.finish_reason or "",
                        prompt_tokens=task.num_prompt_tokens,
                        cached_tokens=task.cached_tokens,
                    )
                    for ev in evs:
                        assert ev.token_id is not None  # ready_tokens stops before an abort
                        msg.token_ids.append(ev.token_id)
                        if ev.logprobs is not None:
                            msg.logprobs.append(ev.logprobs.to_proto())
                        reason = ev.finish_reason or ""
                        self.sent.token(rid, ev.token_id, ev.finished, reason, ev.logprobs)
                    if last.speculative is not None:
                        d, v, a = last.speculative
                        msg.speculative.CopyFrom(
                            control_pb2.SpecCounts(drafted=d, verified=v, accepted=a)
                        )
                    await self._send(subject, msg)
                    TOKENS.inc(len(evs))
                    index += len(evs)
                span.set_attribute("deepserve.completion_tokens", index)
                LATENCY.observe(time.perf_counter() - t0)
                if self.kvstore is not None:
                    await self._write_back(task, index, store_from_block)
            except EngineFailed as exc:
                ERRORS.inc()
                await self._send_error(
                    subject,
                    error_event(rid, InstanceFailed(f"decode engine failed: {exc}"), index=index),
                )
            except asyncio.CancelledError:
                await self._abort_engine(rid)
                await self._on_cut(rid, subject, index)
            finally:
                self._relays.pop(rid, None)
                if self._stop_reason.pop(rid, None) == "abort":
                    self.sent.drop(rid)  # the client is gone: nobody asks for a resend
                else:
                    self.sent.end(rid)

    async def _write_back(
        self, task: control_pb2.DecodeTask, outputs: int, start_block: int | None = None
    ) -> None:
        """Copy the finished request's new full blocks out of the engine, free its KV, and
        write the blocks to the kvstore in the background (if the write-behind has room)."""
        rid = task.request_id
        # A pushed request: prefill stored the full blocks of what it computed (the prompt and
        # any prior outputs); a local one says where.
        start = kv_tokens(task) // self.block_size if start_block is None else start_block
        computed = kv_tokens(task) + outputs - 1  # the last token was never computed
        nbytes = max(0, computed // self.block_size - start) * self.bytes_per_block
        try:
            if nbytes and not await self.writes.submit(
                nbytes,
                lambda: self.loop.export_blocks(rid, start),
                lambda finish: self._put(task, finish),
            ):
                STORE_DROPPED.inc()
            await self.loop.call(lambda e: e.release(rid))
        except EngineLoopClosed:
            pass  # closing frees every request

    async def _put(self, task: control_pb2.DecodeTask, finish: Callable[[], list[Block]]) -> None:
        assert self.kvstore is not None
        n = await write_back(
            self.kvstore, finish, task.cache_salt, task.traffic_class, log, task.request_id
        )
        if n < 0:
            STORE_ERRORS.inc()
        else:
            STORED_BLOCKS.inc(n)

    async def _on_cut(self, rid: str, subject: str, index: int) -> None:
        """The request ended early. Client aborts need no answer; anything else is an error."""
        reason = self._stop_reason.get(rid, "shutdown")
        if reason == "abort":
            return
        ERRORS.inc()
        await self._send_error(
            subject,
            error_event(
                rid,
                InstanceFailed(
                    f"decode instance {self.instance_id} stopped ({reason}) "
                    "before the request finished"
                ),
                index=index,
            ),
        )

    async def _send_error(self, subject: str, msg: control_pb2.TokenEvent) -> None:
        self.sent.error(msg.request_id, msg)
        await self._send(subject, msg)

    def resend(self, request: kv_transfer_pb2.ResendRequest) -> kv_transfer_pb2.ResendReply:
        """The request's events from ``from_index`` on, from :attr:`sent` (``known`` false:
        not decoding here, nor ended within the grace)."""
        events = self.sent.since(request.request_id, request.from_index)
        if events is None:
            return kv_transfer_pb2.ResendReply(known=False)
        RESENDS.inc()
        return kv_transfer_pb2.ResendReply(known=True, events=events)

    async def _send(self, subject: str, msg: control_pb2.TokenEvent) -> None:
        try:
            await self.publish(subject, msg.SerializeToString())
        except Exception as exc:  # noqa: BLE001 - the entrypoint's timeout covers a lost event
            log.warning("publishing %s for %s failed: %s", subject, msg.request_id, exc)

    # -- control ------------------------------------------------------------------------------
    async def on_abort(self, abort: control_pb2.Abort) -> None:
        rid = abort.request_id
        self.aborted.add(rid)
        if rid in self._relays:
            self._stop_reason[rid] = "abort"
            await self._abort_engine(rid)  # the relay sees the abort event and ends quietly

    async def _abort_engine(self, rid: str) -> None:
        try:
            await self.loop.abort(rid)
        except EngineLoopClosed:
            pass  # closing the loop aborts everything anyway

    @property
    def num_active(self) -> int:
        return len(self._relays)

    def status(self) -> control_pb2.InstanceStatus:
        return instance_status(
            self.loop.stats,
            instance_id=self.instance_id,
            role=control_pb2.ROLE_DECODE,
            model=self.model_name,
            address=self.address,
            draining=self.draining,
            block_size=self.block_size,
        )

    async def drain(self, timeout_s: float) -> None:
        """Take nothing new; let running requests finish for up to ``timeout_s``; cut the rest."""
        self.draining = True
        await drain_tasks(list(self._relays.values()), timeout_s, "decoding requests", log)
        await self.writes.drain(5.0)


def kv_tokens(task: control_pb2.DecodeTask) -> int:
    """The tokens whose KV comes with the task: all but the last (the first token prefill
    generated, computed by decode's first step)."""
    return max(0, len(task.token_ids) - 1)
