"""The recipe's HTTP app: OpenAI Chat Completions over the entrypoint's ``Generate`` stream.

Routes: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /healthz``,
``GET /metrics``. Errors are OpenAI-shaped and mapped once: bad input 400, unknown model 404,
entrypoint unavailable 503 + Retry-After, RESOURCE_EXHAUSTED 429 + Retry-After, never a 500
for bad input. A client that goes away cancels the gRPC call (before the first token, while
collecting a non-streamed answer, or mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import trace
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from libs.common.telemetry import extract_context, inject_traceparent, tracer
from libs.proto.deepserve.v1 import common_pb2, generate_pb2

from . import protocol
from .backend import BackendError, GenerateBackend, GenerateCall
from .protocol import APIError, ChatRequest
from .template import ChatTemplate

log = logging.getLogger("recipe")
T = TypeVar("T")
TRAFFIC_CLASS_HEADER = "x-deepserve-traffic-class"


@dataclass(frozen=True)
class AppConfig:
    model_name: str = "deepseek-tiny"
    default_max_tokens: int = 4096  # when the request names none (DeepSeek's API default)
    max_body_bytes: int = 32 << 20
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("--model-name must not be empty")
        if self.default_max_tokens <= 0:
            raise ValueError(f"--default-max-tokens must be positive, got {self.default_max_tokens}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.requests = Counter("deepserve_recipe_requests_total", "HTTP requests by route and status",
                                ["route", "status"], registry=registry)
        self.latency = Histogram("deepserve_recipe_request_seconds",
                                 "chat completion time, to the last byte", ["stream"], registry=registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft = Histogram("deepserve_recipe_time_to_first_token_seconds", "request to first token",
                              registry=registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tokens = Counter("deepserve_recipe_tokens_total",
                              "tokens by kind (prompt, cached, completion)", ["kind"], registry=registry)
        self.disconnects = Counter("deepserve_recipe_client_disconnects_total",
                                   "requests whose client went away before the answer ended",
                                   registry=registry)


class ClientGone(Exception):
    """The HTTP client disconnected; the generation was cancelled."""


_STATUS_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", None),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "timeout"),
}


def api_error(exc: BackendError, retry_after: int) -> APIError:
    """A gRPC failure of the entrypoint as the HTTP error a client can act on."""
    status, type_, code = _STATUS_OF.get(exc.code, (502, "server_error", "upstream_error"))
    message = exc.message or exc.code.name
    if status == 503:
        message = f"the model backend is unavailable ({message}); retry in {retry_after} s"
    elif status == 429:
        message = f"the server is at capacity ({message}); retry in {retry_after} s"
    elif status == 502:
        message = f"the model backend failed ({exc.code.name}: {message})"
    return APIError(status, message, type_, code=code,
                    retry_after=retry_after if status in (429, 503) else None)


def error_response(err: APIError, request_id: str = "") -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else {}
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class _Answer:
    """Folds Generate events into text deltas, counts and the finish reason."""

    def __init__(self, template: ChatTemplate) -> None:
        self.detok = template.detokenizer()
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.reason: str | None = None
        self.text: list[str] = []

    def apply(self, ev: generate_pb2.GenerateEvent) -> str:
        """The new text this event adds ("" for none)."""
        kind = ev.WhichOneof("event")
        if kind == "ready":
            self.prompt_tokens, self.cached_tokens = ev.ready.prompt_tokens, ev.ready.cached_tokens
            return ""
        if kind == "tokens":
            self.completion_tokens += len(ev.tokens.token_ids)
            delta = self.detok.push(ev.tokens.token_ids)
        elif kind == "finish":
            self.reason = protocol.finish_reason(ev.finish.reason)
            if ev.finish.HasField("usage"):
                u = ev.finish.usage
                self.prompt_tokens = u.prompt_tokens or self.prompt_tokens
                self.cached_tokens = u.cached_tokens or self.cached_tokens
                self.completion_tokens = u.completion_tokens or self.completion_tokens
            delta = self.detok.flush()
        else:
            return ""
        self.text.append(delta)
        return delta

    def usage(self) -> dict[str, Any]:
        return protocol.usage(self.prompt_tokens, self.cached_tokens, self.completion_tokens)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _CancellingStream(StreamingResponse):
    """A StreamingResponse that always stops its generation when it ends, however it ends."""

    def __init__(self, content: AsyncIterator[bytes], call: GenerateCall, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._content, self._call = content, call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._call.cancel()
            await self._content.aclose()  # type: ignore[attr-defined]


class ChatCompletions:
    def __init__(self, cfg: AppConfig, template: ChatTemplate, backend: GenerateBackend,
                 metrics: Metrics) -> None:
        self.cfg, self.template, self.backend, self.metrics = cfg, template, backend, metrics
        self.tracer = tracer("recipe")

    async def handle(self, request: Request) -> Response:
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        try:
            response = await self._serve(request, rid, t0)
        except APIError as err:
            response = error_response(err, rid)
        except ClientGone:
            self.metrics.disconnects.inc()
            response = Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        self.metrics.requests.labels("chat_completions", str(response.status_code)).inc()
        return response

    async def _serve(self, request: Request, rid: str, t0: float) -> Response:
        req = protocol.parse_chat_request(await self._json(request), self.template.vocab_size)
        if req.model != self.cfg.model_name:
            raise APIError(404, f"The model {req.model!r} does not exist; this server serves "
                           f"{self.cfg.model_name!r}", param="model", code="model_not_found")
        if req.stop:
            log.info("request %s: stop sequences %r ignored (string stops are not applied yet)",
                     rid, req.stop)
        agent = req.has_tools or request.headers.get(TRAFFIC_CLASS_HEADER, "").strip().lower() == "agent"
        prompt = await asyncio.to_thread(self.template.render, req.messages)
        gen = generate_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=self._sampling(req),
            model=self.cfg.model_name,
            traffic_class=common_pb2.TRAFFIC_CLASS_AGENT if agent else common_pb2.TRAFFIC_CLASS_CHAT)
        span = self.tracer.start_span("recipe.chat_completions",
                                      context=extract_context(request.headers.get("traceparent", "")))
        span.set_attribute("request.id", rid)
        span.set_attribute("prompt.tokens", len(prompt))
        with trace.use_span(span, end_on_exit=False):
            call = self.backend.generate(gen, inject_traceparent())
        events = aiter(call)
        answer = _Answer(self.template)
        handed_over = False
        try:
            first = await self._unless_gone(request, self._next(events), call)
            self.metrics.ttft.observe(time.perf_counter() - t0)
            answer.apply(first)
            if req.stream:
                handed_over = True
                return _CancellingStream(self._stream(req, rid, events, first, answer, span, t0), call,
                                         {"X-Request-Id": rid, "Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
            await self._unless_gone(request, self._collect(events, answer), call)
            self._count(answer)
            self.metrics.latency.labels("false").observe(time.perf_counter() - t0)
            body = protocol.completion(f"chatcmpl-{rid}", int(time.time()), req.model,
                                       "".join(answer.text), answer.reason or "stop", answer.usage())
            return JSONResponse(body, headers={"X-Request-Id": rid})
        finally:
            if not handed_over:
                call.cancel()
                span.end()

    def _sampling(self, req: ChatRequest) -> common_pb2.SamplingParams:
        temperature, top_p = req.temperature, req.top_p
        if top_p == 0.0:  # a nucleus of zero mass keeps only the most likely token: greedy
            temperature, top_p = 0.0, 1.0
        sp = common_pb2.SamplingParams(
            temperature=temperature, top_p=top_p, top_k=req.top_k,
            max_tokens=req.max_tokens or self.cfg.default_max_tokens,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        if req.seed is not None:
            sp.seed = req.seed
        return sp

    async def _json(self, request: Request) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.cfg.max_body_bytes:
            raise APIError(413, f"request body is {declared} bytes; the limit is "
                           f"{self.cfg.max_body_bytes}", code="request_too_large")
        chunks, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.cfg.max_body_bytes:
                raise APIError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(part)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise protocol.invalid(None, f"could not parse the JSON body of your request: {exc}",
                                   "invalid_json") from None

    async def _next(self, events: AsyncIterator[generate_pb2.GenerateEvent]) -> generate_pb2.GenerateEvent:
        try:
            return await anext(events)
        except BackendError as exc:
            raise api_error(exc, self.cfg.retry_after_s) from None
        except StopAsyncIteration:
            raise APIError(502, "the model backend ended the request without an answer",
                           "server_error", code="upstream_error") from None

    async def _collect(self, events: AsyncIterator[generate_pb2.GenerateEvent], answer: _Answer) -> None:
        try:
            async for ev in events:
                answer.apply(ev)
        except BackendError as exc:
            raise api_error(exc, self.cfg.retry_after_s) from None
        if answer.reason is None:
            raise APIError(502, "the model backend ended the stream before finishing",
                           "server_error", code="upstream_error")

    async def _unless_gone(self, request: Request, work: Awaitable[T], call: GenerateCall) -> T:
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

    async def _stream(self, req: ChatRequest, rid: str, events: AsyncIterator[generate_pb2.GenerateEvent],
                      first: generate_pb2.GenerateEvent, answer: _Answer, span: trace.Span,
                      t0: float) -> AsyncIterator[bytes]:
        cid, created, model = f"chatcmpl-{rid}", int(time.time()), req.model
        finished = False
        try:
            yield sse(protocol.chunk(cid, created, model, {"role": "assistant", "content": ""}))
            pending = "".join(answer.text)  # text the first event carried, if any
            if pending:
                yield sse(protocol.chunk(cid, created, model, {"content": pending}))
            async for ev in events:
                delta = answer.apply(ev)
                if delta:
                    yield sse(protocol.chunk(cid, created, model, {"content": delta}))
            if answer.reason is None:
                raise BackendError(grpc.StatusCode.UNKNOWN, "the stream ended before finishing")
            self._count(answer)
            use = answer.usage()
            yield sse(protocol.chunk(cid, created, model, {}, answer.reason,
                                     None if req.include_usage else use))
            if req.include_usage:
                yield sse(protocol.chunk(cid, created, model, None, use=use))
            yield b"data: [DONE]\n\n"
            finished = True
        except BackendError as exc:
            err = api_error(exc, self.cfg.retry_after_s)
            log.warning("request %s failed mid-stream: %s", rid, exc)
            yield sse(err.body())
            finished = True
        finally:
            if not finished:
                self.metrics.disconnects.inc()
            self.metrics.latency.labels("true").observe(time.perf_counter() - t0)
            span.end()

    def _count(self, answer: _Answer) -> None:
        self.metrics.tokens.labels("prompt").inc(answer.prompt_tokens)
        self.metrics.tokens.labels("cached").inc(answer.cached_tokens)
        self.metrics.tokens.labels("completion").inc(answer.completion_tokens)


def build_app(cfg: AppConfig, template: ChatTemplate, backend: GenerateBackend,
              metrics: Metrics | None = None) -> Starlette:
    metrics = metrics or Metrics(CollectorRegistry())
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        return {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "deepserve"}

    async def models(request: Request) -> Response:
        metrics.requests.labels("models", "200").inc()
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        if request.path_params["model"] != cfg.model_name:
            name = request.path_params["model"]
            return error_response(APIError(404, f"The model {name!r} does not exist",
                                           param="model", code="model_not_found"))
        return JSONResponse(model_card())

    async def healthz(request: Request) -> Response:
        ok, detail = await backend.check()
        return JSONResponse({"status": "ok" if ok else "unavailable", "detail": detail},
                            status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, code=code))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, "internal server error; the server log has the details",
                                       "server_error", code="internal_error"))

    routes = [
        Route("/v1/chat/completions", ChatCompletions(cfg, template, backend, metrics).handle,
              methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    return Starlette(routes=routes,
                     exception_handlers={HTTPException: http_error, Exception: server_error})
