"""The recipe's Starlette app: its routes over one :class:`~.handlers.Frontend` (request handling
lives in ``handlers.py``; the protocols in ``api.py``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from libs.transport.keycaps import KeyCaps

from .api import CHAT, COMPLETIONS, MESSAGES, RESPONSES, APIError, Protocol
from .backend import GenerateBackend
from .encoding import Encoder
from .events import error_response
from .handlers import AppConfig, Frontend, Metrics
from .pool import EncodePool
from .usage import UsageSink
from .utility import utility_routes

log = logging.getLogger("recipe")


def build_app(
    cfg: AppConfig,
    encoder: Encoder,
    backend: GenerateBackend,
    metrics: Metrics | None = None,
    pool: EncodePool | None = None,
    usage: UsageSink | None = None,
    clock: Callable[[], float] = time.monotonic,
    limiter: KeyCaps | None = None,
) -> Starlette:
    """The public API. ``pool``: the encode pool (default: one of ``cfg``'s size, which the
    caller then does not close -- fine for tests); ``usage``: where usage records go (None:
    nowhere); ``limiter``: the keys' limits (default: this process's own, on ``clock``, which
    tests fake; the service passes one shared through Redis)."""
    metrics = metrics or Metrics(CollectorRegistry())
    pool = pool or EncodePool(cfg.encode_threads, cfg.encode_queue_bytes, cfg.retry_after_s * 1000)
    limiter = limiter or KeyCaps(cfg.key_limits, clock=clock)
    front = Frontend(cfg, encoder, backend, metrics, pool, usage, limiter)
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        # OpenAI's Model and Anthropic's ModelInfo at once (both SDKs list models here); the
        # anthropic SDK's strict validation requires ModelInfo's lifecycle.
        return {
            "id": cfg.model_name,
            "object": "model",
            "created": created,
            "owned_by": "deepserve",
            "type": "model",
            "display_name": cfg.model_name,
            "created_at": "1970-01-01T00:00:00Z",
            "lifecycle": "active",
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

    async def completions(request: Request) -> Response:
        return await front.handle(request, COMPLETIONS)

    async def responses(request: Request) -> Response:
        return await front.handle(request, RESPONSES)

    async def messages(request: Request) -> Response:
        return await front.handle(request, MESSAGES)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", front.count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        *utility_routes(front),  # vLLM's /health, /tokenize, /detokenize, /version
    ]
    return Starlette(
        routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error}
    )
