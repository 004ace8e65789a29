"""Decode: take a request's KV and task from prefill, continue generating, stream the tokens.

:class:`DecodeHandler` holds the logic and no transport: ``accept`` is what ``KVTransfer.Push``
calls once the whole frame has arrived, ``publish`` is how TokenEvents leave (NATS in the
service, a list in tests).

Indices: prefill published output position 0 (the first token); the engine here starts from
prompt + [first token], so its k-th event is output position k (k >= 1).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from opentelemetry import trace
from prometheus_client import Counter, Histogram

from libs.common import subjects
from libs.common.errors import (
    DeepserveError,
    InstanceFailed,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from libs.common.sampling import SamplingParams
from libs.common.telemetry import extract_context
from libs.engine.engine import InvalidRequest, KVFormatError, NoFreeBlocks
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from libs.serving.aborts import RecentAborts
from libs.serving.convert import error_event
from libs.serving.engine_loop import EngineFailed, EngineLoop, EngineLoopClosed, RequestStream
from libs.serving.instance import drain_tasks, instance_status

log = logging.getLogger("decode")

Publish = Callable[[str, bytes], Awaitable[None]]

REQUESTS = Counter("deepserve_decode_requests_total", "KV pushes by outcome", ["outcome"])
TOKENS = Counter("deepserve_decode_tokens_total", "tokens generated and published")
ERRORS = Counter("deepserve_decode_errors_total", "requests that ended in an error event")
KV_BYTES = Counter("deepserve_decode_kv_bytes_total", "KV frame bytes received")
LATENCY = Histogram(
    "deepserve_decode_request_seconds",
    "KV accepted -> last token published",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)


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
    ) -> None:
        self.loop = loop
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

    # -- KV push ------------------------------------------------------------------------------
    async def accept(
        self, task: control_pb2.DecodeTask, frame: bytes, traceparent: str = ""
    ) -> kv_transfer_pb2.KVPushReply:
        """Queue the request with its KV; the reply says whether this instance took it.

        A refusal is the one place this maps an error: its message goes into the reply (prefill
        then fails the request with a retryable error event).
        """
        rid = task.request_id
        try:
            self._precheck(task)
            KV_BYTES.inc(len(frame))
            stream = await self._add(task, frame)
        except DeepserveError as exc:
            REQUESTS.labels("rejected").inc()
            log.warning("%s", exc)
            return kv_transfer_pb2.KVPushReply(accepted=False, error=str(exc))
        self._relays[rid] = asyncio.create_task(
            self._relay(task, stream, traceparent or task.traceparent), name=f"decode-relay-{rid}"
        )
        REQUESTS.labels("accepted").inc()
        return kv_transfer_pb2.KVPushReply(accepted=True)

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
        if task.sampling.max_tokens <= 1:
            raise InvalidArgument(
                "DecodeTask.sampling.max_tokens must be > 1: "
                "prefill already produced the first token"
            )
        if not 0 < task.num_prompt_tokens < len(task.token_ids):
            raise InvalidArgument(
                "DecodeTask.token_ids must hold the prompt and the first generated token"
            )

    async def _add(self, task: control_pb2.DecodeTask, frame: bytes) -> RequestStream:
        """Queue the request with its KV in the engine."""
        rid = task.request_id
        try:
            params = SamplingParams.from_proto(
                task.sampling, max_tokens=task.sampling.max_tokens - 1
            )
            stream = await self.loop.add(
                rid, list(task.token_ids), params, kv=frame, cache_salt=task.cache_salt
            )
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
        if rid in self.aborted:  # the abort overtook us while the KV was imported
            await self._abort_engine(rid)
            raise NotFound(f"request {rid} was aborted")
        return stream

    # -- events -------------------------------------------------------------------------------
    async def _relay(
        self, task: control_pb2.DecodeTask, stream: RequestStream, traceparent: str
    ) -> None:
        rid = task.request_id
        subject = task.events_subject or subjects.token_events(rid)
        t0 = time.perf_counter()
        index = 1
        with self.tracer.start_as_current_span(
            "decode", context=extract_context(traceparent)
        ) as span:
            span.set_attribute("deepserve.request_id", rid)
            try:
                async for ev in stream:
                    if ev.token_id is None:  # aborted in the engine
                        await self._on_cut(rid, subject, index)
                        return
                    msg = control_pb2.TokenEvent(
                        request_id=rid,
                        index=index,
                        token_ids=[ev.token_id],
                        finished=ev.finished,
                        finish_reason=ev.finish_reason or "",
                        prompt_tokens=task.num_prompt_tokens,
                        cached_tokens=task.cached_tokens,
                    )
                    await self._send(subject, msg)
                    TOKENS.inc()
                    index += 1
                span.set_attribute("deepserve.completion_tokens", index)
                LATENCY.observe(time.perf_counter() - t0)
            except EngineFailed as exc:
                ERRORS.inc()
                await self._send(
                    subject,
                    error_event(rid, InstanceFailed(f"decode engine failed: {exc}"), index=index),
                )
            except asyncio.CancelledError:
                await self._abort_engine(rid)
                await self._on_cut(rid, subject, index)
            finally:
                self._relays.pop(rid, None)
                self._stop_reason.pop(rid, None)

    async def _on_cut(self, rid: str, subject: str, index: int) -> None:
        """The request ended early. Client aborts need no answer; anything else is an error."""
        reason = self._stop_reason.get(rid, "shutdown")
        if reason == "abort":
            return
        ERRORS.inc()
        await self._send(
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


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """``Push``: the DecodeTask first, then the KV frame in chunks; the handler does the rest."""

    def __init__(self, handler: DecodeHandler) -> None:
        self.handler = handler

    async def Push(
        self,
        request_iterator: AsyncIterator[kv_transfer_pb2.KVPush],
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.KVPushReply:
        task: control_pb2.DecodeTask | None = None
        frame = bytearray()
        async for part in request_iterator:
            which = part.WhichOneof("part")
            if task is None:
                if which != "task":
                    return kv_transfer_pb2.KVPushReply(
                        accepted=False, error="the first KVPush message must carry the DecodeTask"
                    )
                task = part.task
            elif which == "chunk":
                frame += part.chunk
            else:
                return kv_transfer_pb2.KVPushReply(accepted=False, error="KVPush.task sent twice")
        if task is None:
            return kv_transfer_pb2.KVPushReply(accepted=False, error="empty KVPush stream")
        meta = dict(context.invocation_metadata() or ())
        return await self.handler.accept(task, bytes(frame), str(meta.get("traceparent", "")))
