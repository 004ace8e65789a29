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
from collections.abc import Awaitable, Callable

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from libs.common import subjects
from libs.common.telemetry import extract_context
from libs.engine.engine import InvalidRequest, KVFormatError, NoFreeBlocks
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2
from libs.serving.aborts import RecentAborts
from libs.serving.convert import error_event, sampling_from_proto
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
        """Queue the request with its KV; the reply says whether this instance took it."""
        rid = task.request_id
        refusal = self._precheck(task)
        if refusal:
            REQUESTS.labels("rejected").inc()
            return kv_transfer_pb2.KVPushReply(accepted=False, error=refusal)
        KV_BYTES.inc(len(frame))
        try:
            params = sampling_from_proto(task.sampling, max_tokens=task.sampling.max_tokens - 1)
            stream = await self.loop.add(
                rid, list(task.token_ids), params, kv=frame, cache_salt=task.cache_salt
            )
        except NoFreeBlocks as exc:
            return self._refuse(
                f"decode instance {self.instance_id} has no room for the KV now "
                f"({exc}); retry on another instance"
            )
        except (InvalidRequest, KVFormatError, ValueError) as exc:
            return self._refuse(f"decode task refused: {exc}")
        except EngineLoopClosed:
            return self._refuse(
                f"decode instance {self.instance_id} is shutting down; retry elsewhere"
            )
        if rid in self.aborted:  # the abort overtook us while the KV was imported
            await self._abort_engine(rid)
            return self._refuse(f"request {rid} was aborted")
        self._relays[rid] = asyncio.create_task(
            self._relay(task, stream, traceparent or task.traceparent), name=f"decode-relay-{rid}"
        )
        REQUESTS.labels("accepted").inc()
        return kv_transfer_pb2.KVPushReply(accepted=True)

    def _precheck(self, task: control_pb2.DecodeTask) -> str:
        rid = task.request_id
        if not rid:
            return "DecodeTask.request_id must not be empty"
        if self.draining:
            return f"decode instance {self.instance_id} is draining; retry on another instance"
        if rid in self.aborted:
            return f"request {rid} was aborted"
        if rid in self._relays:
            return f"request {rid} is already decoding here"
        if task.sampling.max_tokens <= 1:
            return "DecodeTask.sampling.max_tokens must be > 1: prefill already produced the first token"
        if not 0 < task.num_prompt_tokens < len(task.token_ids):
            return "DecodeTask.token_ids must hold the prompt and the first generated token"
        return ""

    def _refuse(self, message: str) -> kv_transfer_pb2.KVPushReply:
        REQUESTS.labels("rejected").inc()
        log.warning("%s", message)
        return kv_transfer_pb2.KVPushReply(accepted=False, error=message)

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
                    error_event(rid, f"decode engine failed: {exc}", retryable=True, index=index),
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
                f"decode instance {self.instance_id} stopped ({reason}) before the request finished",
                retryable=True,
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
