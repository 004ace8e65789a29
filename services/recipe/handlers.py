"""The recipe's HTTP app: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages over
the entrypoint's ``Generate`` stream, with ``deepseek-recipe`` doing conversion, rendering and
output parsing.

Routes: ``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST /v1/messages`` (JSON or
SSE), ``POST /v1/messages/count_tokens``, ``GET /v1/models``, ``GET /healthz``. ``/metrics`` is
not on this public port: the metrics are in the process's registry, which the ops port
(``--http-port``) serves; their tenant label is a hash (:func:`tenant_label`), never the name.
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
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import deepseek_recipe as dr
from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from libs.common.auth import KeyTable
from libs.common.errors import DeepserveError, Internal
from libs.common.telemetry import extract_context, inject_traceparent, tracer
from libs.gateway.keylimits import KeyLimitPolicy
from libs.proto.deepserve.v1 import common_pb2, generate_pb2

from .accounting import Accounting, RequestAccount
from .api import CHAT, MESSAGES, RESPONSES, APIError, Protocol, conversion_error, invalid
from .backend import GenerateBackend, GenerateCall
from .encoding import Encoder
from .events import Job, api_error
from .pool import EncodePool
from .sampling import checked, extra_sampling
from .usage import UsageSink

log = logging.getLogger("recipe")
T = TypeVar("T")
# A client marks its traffic as agent traffic (kvstore retention 3 days instead of 7) with this
# header set to "agent"; requests that declare tools are agent traffic anyway.
TRAFFIC_CLASS_HEADER = "x-deepserve-traffic-class"


@dataclass(frozen=True)
class AppConfig:
    model_name: str = "deepseek-tiny"
    default_max_tokens: int = 4096  # caps the library's default when a request names none
    max_context: int = 163840  # prompt + completion tokens (the entrypoint's default)
    max_body_bytes: int = 32 << 20
    # The whole body must arrive within this many seconds (32 MiB at 1 MB/s is 32 s); a client
    # that trickles it (slowloris) gets a 408 and the connection closes.
    body_timeout: float = 60.0
    encode_threads: int = 4  # the EncodePool's threads (long prompts also use Rayon's pool)
    encode_queue: int = 64  # jobs waiting for an encode thread before a 429
    retry_after_s: int = 1
    keys: KeyTable = field(default_factory=KeyTable)
    # Per API key: concurrency cap and token rate (--key-max-concurrency, --key-tokens-per-min,
    # --key-limits); no effect on an open API (no keys configured).
    key_limits: KeyLimitPolicy = field(default_factory=KeyLimitPolicy)

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
        if self.encode_threads <= 0:
            raise ValueError(f"--encode-threads must be positive, got {self.encode_threads}")
        if self.encode_queue < 0:
            raise ValueError(f"--encode-queue must be >= 0, got {self.encode_queue}")


def tenant_label(tenant: str) -> str:
    """A tenant as a metrics label: the first 8 hex digits of its SHA-256 ("-" for none), so
    scraped metrics never carry tenant names (STYLE 15); ``deepserve``'s operators can hash a
    name to find its series."""
    if tenant == "-":
        return tenant
    return hashlib.sha256(tenant.encode()).hexdigest()[:8]


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.requests = Counter(
            "deepserve_recipe_requests_total",
            "HTTP requests by route, status and tenant (hashed: tenant_label)",
            ["route", "status", "tenant"],
            registry=registry,
        )
        self.latency = Histogram(
            "deepserve_recipe_request_seconds",
            "generation time, to the last byte",
            ["stream"],
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.ttft = Histogram(
            "deepserve_recipe_time_to_first_token_seconds",
            "request to first token",
            registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tokens = Counter(
            "deepserve_recipe_tokens_total",
            "tokens by kind (prompt, cached, completion) and tenant (hashed: tenant_label)",
            ["kind", "tenant"],
            registry=registry,
        )
        self.disconnects = Counter(
            "deepserve_recipe_client_disconnects_total",
            "requests whose client went away before the answer ended",
            registry=registry,
        )
        self.key_limited = Counter(
            "deepserve_recipe_key_limited_total",
            "requests refused with 429 by their API key's limit (reason: concurrency, tokens)",
            ["reason", "tenant"],
            registry=registry,
        )
        self.usage_records = Counter(
            "deepserve_recipe_usage_records_total",
            "usage records by outcome (published, dropped_queue_full, failed)",
            ["outcome"],
            registry=registry,
        )


class ClientGone(Exception):
    """The HTTP client disconnected; the generation was cancelled."""


def error_response(proto: Protocol, err: APIError, request_id: str = "") -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else {}
    if request_id:
        headers["X-Request-Id"] = request_id
    if err.status == 408:  # the rest of the body may still trickle in: end the connection
        headers["Connection"] = "close"
    return JSONResponse(proto.error_body(err), status_code=err.status, headers=headers)


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
        call: GenerateCall,
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.encoder, self.backend, self.metrics = cfg, encoder, backend, metrics
        self.pool = pool
        self.tracer = tracer("recipe")
        self.accounting = Accounting(cfg.key_limits, cfg.keys, usage, metrics.key_limited, clock)

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

    async def _prepare(
        self, proto: Protocol, body: bytes, rid: str
    ) -> tuple[str, dr.ConversationRequest, Any, dict[str, Any], list[int]]:
        """(model, conversation request, chunk generator, extra sampling fields, prompt ids),
        computed in the encode pool: parsing, conversion, rendering and tokenizing a large
        body takes seconds."""

        def work() -> tuple[str, dr.ConversationRequest, Any, dict[str, Any], list[int]]:
            model, conv, gen, extra = self._convert(proto, body, rid)
            prompt = self.encoder.encode(conv.conversation, max_prompt_tokens=self.cfg.max_context)
            return model, conv, gen, extra, prompt

        return await self.pool.run(work)

    def _convert(
        self, proto: Protocol, body: bytes, rid: str
    ) -> tuple[str, dr.ConversationRequest, Any, dict[str, Any]]:
        """(model, conversation request, chunk generator, extra sampling fields); APIError for
        what the caller got wrong."""
        try:
            decoded = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise invalid(
                f"could not parse the JSON body of your request: {exc}", code="invalid_json"
            ) from None
        except RecursionError:  # json's C scanner counts its depth and gives up (~1000 deep)
            raise invalid(
                "could not parse the JSON body of your request: it is nested too deeply",
                code="invalid_json",
            ) from None
        if not isinstance(decoded, dict):
            raise invalid("the request body must be a JSON object")
        model = decoded.get("model")
        if not isinstance(model, str) or not model:
            raise invalid(
                "model is required (a string naming the served model)",
                "model",
                "missing_required_parameter",
            )
        if model != self.cfg.model_name:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                param="model",
                code="model_not_found",
            )
        try:
            req = proto.request_cls(body)
            extra = (
                (req.namespace_tool_map(self.encoder.options), req.echo())
                if proto is RESPONSES
                else None
            )
            conv = req.convert(self.encoder.options)
            gen = proto.request_cls.chunk_generator(conv, proto.id_prefix + rid, model)
        except (dr.ConversionError, ValueError, TypeError, OverflowError) as exc:
            raise conversion_error(exc) from None
        except RecursionError:  # only a body that nests deeper than any request needs
            raise invalid("the request is nested too deeply", code="invalid_json") from None
        # Images: the V4 conversion itself replaces them with "[Unsupported Image]" text.
        if conv.inference_options.logprobs:
            raise invalid("logprobs are not supported yet", "logprobs", "unsupported_value")
        # conv.inference_options.output_constraint (JSON schema, regex, tool calls) is not
        # enforced by constrained decoding: the engine samples freely and the parser reads it.
        if extra is not None:
            gen = gen.with_namespace_tool_map(extra[0]).with_echo(extra[1])
        return model, conv, gen, extra_sampling(decoded, proto.name)

    def _sampling(
        self, conv: dr.ConversationRequest, prompt_len: int, extra: dict[str, Any]
    ) -> common_pb2.SamplingParams:
        io = conv.inference_options
        try:
            max_tokens = conv.resolve_max_tokens(prompt_len, self.cfg.max_context)
        except dr.ConversionError as exc:
            raise conversion_error(exc) from None
        if io.max_tokens is None:  # the library's default (8K..128K) is too much for a tiny model
            max_tokens = min(max_tokens, self.cfg.default_max_tokens)
        temperature = 1.0 if io.temperature is None else io.temperature
        top_p = 1.0 if io.top_p is None else io.top_p
        if top_p == 0.0:  # a nucleus of zero mass keeps only the most likely token: greedy
            temperature, top_p = 0.0, 1.0
        sp = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        if io.seed is not None:
            sp.seed = io.seed
        return checked(sp, extra)

    # -- the request ------------------------------------------------------------------------------
    async def handle(self, request: Request, proto: Protocol) -> Response:
        rid, tenant = uuid.uuid4().hex, "-"
        t0 = time.perf_counter()
        acct: RequestAccount | None = None
        response: Response | None = None
        status = "client_gone"  # unless set below: also when this task is cancelled
        try:
            tenant = self._tenant(request) or "-"
            acct = self.accounting.admit(
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
            proto.name, str(response.status_code), tenant_label(tenant)
        ).inc()
        return response

    async def count_tokens(self, request: Request) -> Response:
        rid, tenant = uuid.uuid4().hex, "-"
        try:
            tenant = self._tenant(request) or "-"
            *_, ids = await self._prepare(MESSAGES, await self._body(request), rid)
            response: Response = JSONResponse({"input_tokens": len(ids)})
        except APIError as err:
            response = error_response(MESSAGES, err, rid)
        except DeepserveError as exc:  # the encode pool is full
            response = error_response(MESSAGES, api_error(exc, self.cfg.retry_after_s), rid)
        self.metrics.requests.labels(
            "count_tokens", str(response.status_code), tenant_label(tenant)
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
        model, conv, gen, extra, prompt = await self._prepare(proto, await self._body(request), rid)
        agent = (
            bool(conv.conversation.tools)
            or request.headers.get(TRAFFIC_CLASS_HEADER, "").strip().lower() == "agent"
        )
        sampling = self._sampling(conv, len(prompt), extra)
        acct.reserve(len(prompt) + sampling.max_tokens)
        gen_req = generate_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=sampling,
            model=self.cfg.model_name,
            tenant="" if tenant == "-" else tenant,
            traffic_class=common_pb2.TRAFFIC_CLASS_AGENT
            if agent
            else common_pb2.TRAFFIC_CLASS_CHAT,
        )
        job = Job(
            proto,
            proto.id_prefix + rid,
            model,
            tenant,
            conv,
            dr.StreamProcessor(gen, self.encoder.parsing_options(conv), self.encoder.tokenizer),
        )
        acct.job = job
        span = self.tracer.start_span(
            f"recipe.{proto.name}", context=extract_context(request.headers.get("traceparent", ""))
        )
        span.set_attribute("request.id", rid)
        span.set_attribute("prompt.tokens", len(prompt))
        with trace.use_span(span, end_on_exit=False):
            call = self.backend.generate(gen_req, inject_traceparent())
        events = aiter(call)
        handed_over = False
        try:
            first = await self._unless_gone(request, self._next(events), call)
            self.metrics.ttft.observe(time.perf_counter() - t0)
            pending = self._push(job, first)
            if conv.stream:
                handed_over = True
                return _CancellingStream(
                    self._stream(job, events, pending, call, span, t0, acct),
                    call,
                    {"X-Request-Id": rid, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    lambda: acct.end("client_gone"),
                )
            await self._unless_gone(request, self._collect(job, events), call)
            self._count(job)
            self.metrics.latency.labels("false").observe(time.perf_counter() - t0)
            return Response(
                job.response.to_json(), media_type="application/json", headers={"X-Request-Id": rid}
            )
        finally:
            if not handed_over:
                job.processor.close()
                call.cancel()
                span.end()

    def _push(self, job: Job, ev: generate_pb2.GenerateEvent) -> list[tuple[str | None, str]]:
        try:
            return job.push(ev, self.encoder.eos_ids)
        except RuntimeError as exc:  # the processor could not decode the backend's ids
            raise APIError(
                502,
                f"could not parse the model output: {exc}",
                "server_error",
                code="upstream_error",
            ) from None

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

    async def _collect(self, job: Job, events: AsyncIterator[generate_pb2.GenerateEvent]) -> None:
        async for ev in events:
            self._push(job, ev)
            if job.finished:
                break
        if not job.finished:
            raise APIError(
                502,
                "the model backend ended the stream before finishing",
                "server_error",
                code="upstream_error",
            )

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

    async def _stream(
        self,
        job: Job,
        events: AsyncIterator[generate_pb2.GenerateEvent],
        pending: list[tuple[str | None, str]],
        call: GenerateCall,
        span: trace.Span,
        t0: float,
        acct: RequestAccount,
    ) -> AsyncIterator[bytes]:
        proto, ended, status = job.proto, False, "client_gone"
        try:
            for name, data in pending:
                yield proto.sse(name, data)
            if not job.finished:
                async for ev in events:
                    for name, data in self._push(job, ev):
                        yield proto.sse(name, data)
                    if job.finished:
                        break
            if not job.finished:
                raise Internal("the stream ended before finishing")
            call.cancel()  # done (a stop sequence may have ended it early)
            self._count(job)
            status = "ok"
            yield proto.sse_done()
            ended = True
        except (DeepserveError, APIError) as exc:
            err = exc if isinstance(exc, APIError) else api_error(exc, self.cfg.retry_after_s)
            log.warning("request %s failed mid-stream: %s", job.rid, exc)
            status = "error"
            yield proto.sse_error(err)
            ended = True
        finally:
            if not ended:
                self.metrics.disconnects.inc()
            acct.end(status)
            job.processor.close()
            self.metrics.latency.labels("true").observe(time.perf_counter() - t0)
            span.end()

    def _count(self, job: Job) -> None:
        label = tenant_label(job.tenant)
        self.metrics.tokens.labels("prompt", label).inc(job.prompt_tokens)
        self.metrics.tokens.labels("cached", label).inc(job.cached_tokens)
        self.metrics.tokens.labels("completion", label).inc(job.completion_tokens)


def build_app(
    cfg: AppConfig,
    encoder: Encoder,
    backend: GenerateBackend,
    metrics: Metrics | None = None,
    pool: EncodePool | None = None,
    usage: UsageSink | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """The public API. ``pool``: the encode pool (default: one of ``cfg``'s size, which the
    caller then does not close -- fine for tests); ``usage``: where usage records go (None:
    nowhere); ``clock``: the key limits' clock (tests pass a fake)."""
    metrics = metrics or Metrics(CollectorRegistry())
    pool = pool or EncodePool(cfg.encode_threads, cfg.encode_queue, cfg.retry_after_s * 1000)
    front = Frontend(cfg, encoder, backend, metrics, pool, usage, clock)
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        return {
            "id": cfg.model_name,
            "object": "model",
            "created": created,
            "owned_by": "deepserve",
            "type": "model",
            "display_name": cfg.model_name,
            "created_at": "1970-01-01T00:00:00Z",
        }

    def guarded(request: Request) -> Response | None:
        try:
            front._tenant(request)
        except APIError as err:
            return error_response(CHAT, err)
        return None

    async def models(request: Request) -> Response:
        refused = guarded(request)
        metrics.requests.labels("models", "401" if refused else "200", "-").inc()
        return refused or JSONResponse(
            {
                "object": "list",
                "data": [model_card()],
                "has_more": False,
                "first_id": cfg.model_name,
                "last_id": cfg.model_name,
            }
        )

    async def model(request: Request) -> Response:
        refused = guarded(request)
        if refused:
            return refused
        if request.path_params["model"] != cfg.model_name:
            name = request.path_params["model"]
            return error_response(
                CHAT,
                APIError(
                    404, f"The model {name!r} does not exist", param="model", code="model_not_found"
                ),
            )
        return JSONResponse(model_card())

    async def healthz(request: Request) -> Response:
        ok, detail = await backend.check()
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "detail": detail},
            status_code=200 if ok else 503,
        )

    def proto_of(request: Request) -> Protocol:
        return MESSAGES if request.url.path.startswith("/v1/messages") else CHAT

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(proto_of(request), APIError(exc.status_code, message, code=code))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(
            proto_of(request),
            APIError(
                500,
                "internal server error; the server log has the details",
                "server_error",
                code="internal_error",
            ),
        )

    async def chat(request: Request) -> Response:
        return await front.handle(request, CHAT)

    async def responses(request: Request) -> Response:
        return await front.handle(request, RESPONSES)

    async def messages(request: Request) -> Response:
        return await front.handle(request, MESSAGES)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", front.count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error}
    )
