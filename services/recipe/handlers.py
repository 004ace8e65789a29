"""The recipe's HTTP app: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages over
the entrypoint's ``Generate`` stream, with ``deepseek-recipe`` doing conversion, rendering and
output parsing; OpenAI's legacy Completions with a raw prompt (``completions.py``).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
``POST /v1/messages`` (JSON or SSE), ``POST /v1/messages/count_tokens``, ``GET /v1/models``,
``GET /healthz``; vLLM's ``GET /health``, ``POST /tokenize``, ``POST /detokenize`` and
``GET /version`` (``utility.py``). A request body becomes a :class:`~.plan.Plan`
(``plan.py``); ``n > 1`` (Chat Completions, Completions) is one backend call per choice
(``backend.py: Calls``), their output merged by :class:`~.answer.Answer` (``choices.py``).
``/metrics`` is not on this public port: the metrics are in the process's registry, which the
ops port (``--http-port``) serves; their tenant label is a salted hash
(``libs/common/tenant_label.py``, ``AppConfig.labels``), never the name.
Errors are mapped once, in the caller's protocol: bad input 400 (the library's message; also
JSON nested too deep and a prompt surely longer than the context), bad key 401, unknown model
404, body not sent within ``--body-timeout`` 408 (then the connection closes), body too large
413, an API key past its concurrency cap or token rate (``accounting.py``), the encoding pool
or the backend at capacity 429 / unavailable 503 (+ Retry-After), entrypoint silent past its
deadline 504; never a 500 for bad input. Every request the backend accepted leaves one usage
record (``usage.py``). Everything CPU-heavy of a request
(JSON, conversion, rendering, tokenization) runs in the :class:`~.pool.EncodePool`, never on the
event loop. The backend's failures arrive as the kinds of
:mod:`libs.common.errors` and become an :class:`APIError` in :meth:`Frontend.handle` (before
the first byte) or :meth:`Frontend._stream` (an error event mid-stream), both through
:func:`events.api_error`. A client that goes away cancels the gRPC call
(before the first token, while collecting a non-streamed answer, or mid-stream).

Backend events become library chunks and protocol output in ``events.py`` (where the
library's sharp edges are handled). Prompts are rendered and outputs parsed by the
:class:`~.encoding.Encoder` the served model calls for: deepseek-recipe's V4 encoding, or a
checkpoint's own chat template (``chat_template.py``), which refuses with a 400 what it cannot
render.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from libs.common.auth import KeyTable
from libs.common.errors import DeepserveError, Internal
from libs.common.grpc_auth import OnBehalf
from libs.common.telemetry import extract_context, inject_traceparent, tracer
from libs.common.tenant_label import TenantLabels
from libs.gateway.keylimits import KeyLimitPolicy
from libs.proto.deepserve.v1 import generate_pb2
from libs.transport.keycaps import KeyCaps

from .accounting import Accounting, RequestAccount
from .answer import Answer
from .api import COMPLETIONS, MESSAGES, APIError, Protocol
from .backend import Calls, GenerateBackend, GenerateCall, merged
from .encoding import Encoder
from .events import api_error, error_response
from .events import tenant_label as tenant_label
from .metrics import Metrics as Metrics
from .plan import Plan, Planner
from .pool import DEFAULT_QUEUE_BYTES, EncodePool
from .usage import UsageSink

log = logging.getLogger("recipe")
T = TypeVar("T")
# A client marks its traffic as agent traffic (kvstore retention 3 days instead of 7) with this
# header set to "agent"; requests that declare tools are agent traffic anyway.
TRAFFIC_CLASS_HEADER = "x-deepserve-traffic-class"


# The largest request body by default: parsing it, and taking its rendered prompt into Python,
# hold the GIL about 4-6 ms a MB (docs/security.md), so 8 MiB keeps every other request's wait
# for the GIL within ~50 ms; a 163,840-token prompt of text is under 2 MB of JSON.
MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class AppConfig:
    model_name: str = "deepseek-tiny"
    default_max_tokens: int = 4096  # caps the library's default when a request names none
    max_context: int = 163840  # prompt + completion tokens (the entrypoint's default)
    max_body_bytes: int = MAX_BODY_BYTES
    # The whole body must arrive within this many seconds (8 MiB at 1 MB/s is 8 s); a client
    # that trickles it (slowloris) gets a 408 and the connection closes.
    body_timeout: float = 60.0
    # the EncodePool's threads (long prompts also use Rayon's pool); 0: one per usable core
    encode_threads: int = 0
    encode_queue_bytes: int = DEFAULT_QUEUE_BYTES  # bodies in the pool before a 429
    retry_after_s: int = 1
    keys: KeyTable = field(default_factory=KeyTable)
    # Per API key: concurrency cap and token rate (--key-max-concurrency, --key-tokens-per-min,
    # --key-limits); no effect on an open API (no keys configured).
    key_limits: KeyLimitPolicy = field(default_factory=KeyLimitPolicy)
    # What logs and metrics call a tenant (--tenant-label-secret): a salted hash, never a name.
    labels: TenantLabels = field(default_factory=TenantLabels)

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("--model-name must not be empty")
        if self.default_max_tokens <= 0:
            raise ValueError(
                f"--default-max-tokens must be positive, got {self.default_max_tokens}"
            )
        if self.max_context <= 0:
            raise ValueError(f"--max-context must be positive, got {self.max_context}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        if not self.body_timeout > 0:
            raise ValueError(f"--body-timeout must be > 0 seconds, got {self.body_timeout}")
        if self.encode_threads < 0:
            raise ValueError(
                f"--encode-threads must be >= 0 (0: every core), got {self.encode_threads}"
            )
        if self.encode_queue_bytes <= 0:
            raise ValueError(
                f"--encode-queue-bytes must be positive, got {self.encode_queue_bytes}"
            )


class ClientGone(Exception):
    """The HTTP client disconnected; the generation was cancelled."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _CancellingStream(StreamingResponse):
    """A StreamingResponse that always stops its generation when it ends, however it ends,
    and then ends the request's account (a no-op when the stream itself already did; needed
    when the stream was never started, so its own ``finally`` never ran)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        call: Calls,
        headers: dict[str, str],
        on_end: Callable[[], None],
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._content, self._call, self._on_end = content, call, on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._call.cancel()
            await self._content.aclose()  # type: ignore[attr-defined]
            self._on_end()


class Frontend:
    def __init__(
        self,
        cfg: AppConfig,
        encoder: Encoder,
        backend: GenerateBackend,
        metrics: Metrics,
        pool: EncodePool,
        usage: UsageSink | None = None,
        limiter: KeyCaps | None = None,
    ) -> None:
        self.cfg, self.encoder, self.backend, self.metrics = cfg, encoder, backend, metrics
        self.pool = pool
        self.planner = Planner(encoder, cfg.model_name, cfg.default_max_tokens, cfg.max_context)
        self.tracer = tracer("recipe")
        limiter = limiter or KeyCaps(cfg.key_limits)
        self.accounting = Accounting(limiter, cfg.keys, usage, metrics.key_limited, cfg.labels)

    # -- shared front half: auth, body, model, conversion ---------------------------------------
    def _tenant(self, request: Request) -> str:
        tenant = self.cfg.keys.tenant(request.headers)
        if tenant is None:
            given = KeyTable.presented(request.headers) is not None
            raise APIError(
                401,
                "Incorrect API key provided"
                if given
                else "No API key provided: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                "authentication_error",
                code="invalid_api_key",
            )
        return tenant

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.cfg.max_body_bytes:
            raise APIError(
                413,
                f"request body is {declared} bytes; the limit is {self.cfg.max_body_bytes}",
                code="request_too_large",
            )
        chunks, size = [], 0
        try:
            # uvicorn has no timeout for a body that trickles in (only for idle keep-alive)
            async with asyncio.timeout(self.cfg.body_timeout):
                async for part in request.stream():
                    size += len(part)
                    if size > self.cfg.max_body_bytes:
                        raise APIError(
                            413,
                            f"request body exceeds {self.cfg.max_body_bytes} bytes",
                            code="request_too_large",
                        )
                    chunks.append(part)
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {self.cfg.body_timeout:g} s "
                f"({size} bytes came)",
                code="request_timeout",
            ) from None
        return b"".join(chunks)

    async def _plan(self, proto: Protocol, body: bytes, rid: str, tenant: str) -> Plan:
        """The request's :class:`~.plan.Plan`, computed in the encode pool: parsing,
        conversion, rendering and tokenizing a large body takes seconds."""
        if proto is COMPLETIONS:
            return await self.pool.run(lambda: self.planner.completion(proto, body, rid), len(body))
        return await self.pool.run(lambda: self.planner.chat(proto, body, rid, tenant), len(body))

    # -- the request ------------------------------------------------------------------------------
    async def handle(self, request: Request, proto: Protocol) -> Response:
        rid, tenant = uuid.uuid4().hex, "-"
        t0 = time.perf_counter()
        acct: RequestAccount | None = None
        response: Response | None = None
        status = "client_gone"  # unless set below: also when this task is cancelled
        try:
            tenant = self._tenant(request) or "-"
            acct = await self.accounting.admit(
                request.headers, proto.name, rid, "" if tenant == "-" else tenant
            )
            response = await self._serve(request, proto, rid, tenant, t0, acct)
            status = "ok"
        except APIError as err:
            status, response = "error", error_response(proto, err, rid)
        except DeepserveError as exc:  # the backend's failure, before the first byte went out
            status = "error"
            response = error_response(proto, api_error(exc, self.cfg.retry_after_s), rid)
        except ClientGone:
            self.metrics.disconnects.inc()
            response = Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        finally:
            if acct is not None and not isinstance(response, _CancellingStream):
                acct.end(status)  # a stream ends its account when it ends
        assert response is not None
        self.metrics.requests.labels(
            proto.name, str(response.status_code), self.cfg.labels(tenant)
        ).inc()
        return response

    async def count_tokens(self, request: Request) -> Response:
        rid, tenant = uuid.uuid4().hex, "-"
        try:
            tenant = self._tenant(request) or "-"
            body = await self._body(request)

            def work() -> int:
                _, conv, _, _ = self.planner.convert(MESSAGES, body, rid)
                return len(self.planner.prompt_ids(conv))

            count = await self.pool.run(work, len(body))
            response: Response = JSONResponse({"input_tokens": count})
        except APIError as err:
            response = error_response(MESSAGES, err, rid)
        except DeepserveError as exc:  # the encode pool is full
            response = error_response(MESSAGES, api_error(exc, self.cfg.retry_after_s), rid)
        self.metrics.requests.labels(
            "count_tokens", str(response.status_code), self.cfg.labels(tenant)
        ).inc()
        return response

    async def _serve(
        self,
        request: Request,
        proto: Protocol,
        rid: str,
        tenant: str,
        t0: float,
        acct: RequestAccount,
    ) -> Response:
        plan = await self._plan(proto, await self._body(request), rid, tenant)
        agent = (
            plan.agent or request.headers.get(TRAFFIC_CLASS_HEADER, "").strip().lower() == "agent"
        )
        # Every choice is a generation of the key's concurrency and may run to max_tokens; the
        # prompt is paid for once (the later choices find it in the prefix cache).
        await acct.reserve(len(plan.prompt) + plan.n * plan.sampling.max_tokens, plan.n)
        answer = Answer(
            proto,
            proto.id_prefix + rid,
            plan.model,
            tenant,
            plan.choices(),
            int(time.time()),
            plan.include_usage,
        )
        acct.job = answer
        span = self.tracer.start_span(
            f"recipe.{proto.name}", context=extract_context(request.headers.get("traceparent", ""))
        )
        span.set_attribute("request.id", rid)
        span.set_attribute("prompt.tokens", len(plan.prompt))
        span.set_attribute("choices", plan.n)
        owner = "" if tenant == "-" else tenant
        with trace.use_span(span, end_on_exit=False):
            traceparent = inject_traceparent()
        on_behalf = OnBehalf(acct.kid, proto.name)  # for the entrypoint's usage record
        call = Calls(
            lambda i: self.backend.generate(
                plan.request(rid, i, owner, agent), traceparent, on_behalf
            )
        )
        calls, events = call.calls, call.events
        handed_over = False
        try:
            firsts = await self._unless_gone(request, self._firsts(call, plan.n), call)
            self.metrics.ttft.observe(time.perf_counter() - t0)
            pending = [sse for i, ev in enumerate(firsts) for sse in self._push(answer, i, ev)]
            self._end_finished(answer, calls)
            if plan.stream:
                handed_over = True
                return _CancellingStream(
                    self._stream(answer, events, pending, calls, span, t0, acct),
                    call,
                    {"X-Request-Id": rid, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    lambda: acct.end("client_gone"),
                )
            await self._unless_gone(request, self._collect(answer, events, calls), call)
            self._count(answer)
            self.metrics.latency.labels("false").observe(time.perf_counter() - t0)
            return Response(
                answer.body(), media_type="application/json", headers={"X-Request-Id": rid}
            )
        finally:
            if not handed_over:
                answer.close()
                call.cancel()
                span.end()

    def _push(self, answer: Answer, index: int, ev: generate_pb2.GenerateEvent) -> list[bytes]:
        try:
            return answer.push(index, ev, self.encoder.eos_ids)
        except RuntimeError as exc:  # the processor could not decode the backend's ids
            raise APIError(
                502,
                f"could not parse the model output: {exc}",
                "server_error",
                code="upstream_error",
            ) from None

    @staticmethod
    def _end_finished(answer: Answer, calls: list[GenerateCall]) -> None:
        """Cancel the calls of finished choices (a stop sequence may end one early)."""
        for choice, call in zip(answer.choices, calls, strict=True):
            if choice.finished:
                call.cancel()

    async def _next(
        self, events: AsyncIterator[generate_pb2.GenerateEvent]
    ) -> generate_pb2.GenerateEvent:
        try:
            return await anext(events)
        except StopAsyncIteration:
            raise APIError(
                502,
                "the model backend ended the request without an answer",
                "server_error",
                code="upstream_error",
            ) from None

    async def _firsts(self, call: Calls, n: int) -> list[generate_pb2.GenerateEvent]:
        """Start every choice's call; the first event of each (the first failure raises).

        Choice 0 goes first and the others once its first event came -- its prefill done, so
        they find the prompt's KV in the prefix cache instead of each computing it again (the
        later choices' first token waits for that prefill; their own is then short)."""
        firsts = [await self._next(call.start(0))]
        if n == 1:
            return firsts
        tasks = [asyncio.ensure_future(self._next(call.start(i))) for i in range(1, n)]
        try:
            return firsts + list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(
        self,
        answer: Answer,
        events: list[AsyncIterator[generate_pb2.GenerateEvent]],
        calls: list[GenerateCall],
    ) -> None:
        live = merged(events, lambda i: not answer.choices[i].finished)
        async with contextlib.aclosing(live):  # its reads end with it, whatever ends it
            async for i, ev in live:
                self._push(answer, i, ev)
                self._end_finished(answer, calls)
        if not answer.finished:
            raise APIError(
                502,
                "the model backend ended the stream before finishing",
                "server_error",
                code="upstream_error",
            )

    async def _unless_gone(self, request: Request, work: Awaitable[T], call: Calls) -> T:
        """Await ``work``; if the client disconnects first, cancel the call and raise ClientGone."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, gone):
                if not t.done():
                    t.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        call.cancel()
        raise ClientGone()

    async def _stream(
        self,
        answer: Answer,
        events: list[AsyncIterator[generate_pb2.GenerateEvent]],
        pending: list[bytes],
        calls: list[GenerateCall],
        span: trace.Span,
        t0: float,
        acct: RequestAccount,
    ) -> AsyncIterator[bytes]:
        proto, ended, status = answer.proto, False, "client_gone"
        try:
            for sse in pending:
                yield sse
            live = merged(events, lambda i: not answer.choices[i].finished)
            async with contextlib.aclosing(live):  # its reads end with it, whatever ends it
                async for i, ev in live:
                    for sse in self._push(answer, i, ev):
                        yield sse
                    self._end_finished(answer, calls)
            if not answer.finished:
                raise Internal("the stream ended before finishing")
            for call in calls:  # done (a stop sequence may have ended one early)
                call.cancel()
            self._count(answer)
            status = "ok"
            for sse in answer.tail():
                yield sse
            ended = True
        except (DeepserveError, APIError) as exc:
            err = exc if isinstance(exc, APIError) else api_error(exc, self.cfg.retry_after_s)
            log.warning("request %s failed mid-stream: %s", answer.rid, exc)
            status = "error"
            yield proto.sse_error(err, answer.sent)
            ended = True
        finally:
            if not ended:
                self.metrics.disconnects.inc()
            acct.end(status)
            answer.close()
            self.metrics.latency.labels("true").observe(time.perf_counter() - t0)
            span.end()

    def _count(self, answer: Answer) -> None:
        label = self.cfg.labels(answer.tenant)
        self.metrics.tokens.labels("prompt", label).inc(answer.prompt_tokens)
        self.metrics.tokens.labels("cached", label).inc(answer.cached_tokens)
        self.metrics.tokens.labels("completion", label).inc(answer.completion_tokens)
