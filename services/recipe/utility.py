"""vLLM's utility routes, for clients and tools written against vLLM's server.

* ``GET /health``: 200 while the backend serves (as ``/healthz``), else a 503;
* ``POST /tokenize``: ``{"model", "prompt"}`` (a string: the ids a Completions request with
  that prompt sends -- the model's BOS, then the text as plain text; ``add_special_tokens:
  false`` leaves the BOS out) or ``{"model", "messages", ...}`` (a Chat Completions body:
  the ids a chat request with those fields sends, rendered by the same encoder; vLLM's
  ``add_generation_prompt`` accepted when true, as the prompt always opens the answer) ->
  ``{"tokens", "count", "max_model_len"}`` (``max_model_len``: ``--max-context``);
* ``POST /detokenize``: ``{"model", "tokens"}`` -> ``{"prompt": text}``, special tokens spelled
  out; an id outside the vocabulary is a 400 naming ``tokens``;
* ``GET /version``: ``{"version"}``, the installed deepserve distribution's.

Each needs the API key when keys are configured (401 as the ``/v1`` routes), answers errors in
OpenAI's shape, and tokenizes in the encode pool (a 429 when it is full). A field these routes
do not read is a 400 naming it, as in the ``/v1`` routes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from libs.common.errors import DeepserveError

from .api import CHAT, APIError, invalid
from .events import api_error, error_response
from .plan import decode_body

if TYPE_CHECKING:
    from .handlers import Frontend

_PROMPT_FIELDS = ("model", "prompt", "add_special_tokens")
_DETOKENIZE_FIELDS = ("model", "tokens")


def version() -> str:
    """The installed deepserve distribution's version ("unknown" from a bare source tree)."""
    try:
        return dist_version("deepserve")
    except PackageNotFoundError:
        return "unknown"


def _unknown(body: dict[str, Any], known: tuple[str, ...]) -> None:
    for name in body:
        if name not in known:
            raise invalid(
                f"unknown field {name!r}: this route reads {', '.join(known)}",
                name,
                "unknown_parameter",
            )


def utility_routes(front: Frontend) -> list[Route]:
    """The routes above over ``front``'s key table, planner, encoder and encode pool."""

    cfg, encoder, planner = front.cfg, front.encoder, front.planner

    def tokenize(raw: bytes, rid: str) -> dict[str, Any]:
        body = decode_body(raw, cfg.model_name)
        if "messages" in body and "prompt" in body:
            raise invalid("send prompt or messages, not both", "prompt")
        if "messages" in body:
            fold = body.pop("add_generation_prompt", None)
            if fold not in (None, True):
                raise invalid(
                    "add_generation_prompt false is not supported: the prompt always opens "
                    "the assistant's answer, as a chat request's does",
                    "add_generation_prompt",
                    "unsupported_value",
                )
            _, conv, _, _ = planner.convert(CHAT, json.dumps(body).encode(), rid)
            ids = planner.prompt_ids(conv)
        else:
            _unknown(body, _PROMPT_FIELDS)
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise invalid("prompt (a string) or messages (a list) is required", "prompt")
            if not isinstance(special, bool):
                raise invalid("add_special_tokens must be true or false", "add_special_tokens")
            ids = encoder.encode_text(prompt, max_prompt_tokens=cfg.max_context)
            bos = getattr(encoder, "bos", None)
            if not special and bos is not None and ids[:1] == [bos]:
                ids = ids[1:]
        return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_context}

    def detokenize(raw: bytes, rid: str) -> dict[str, Any]:
        body = decode_body(raw, cfg.model_name)
        _unknown(body, _DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise invalid("tokens must be a list of token ids (integers)", "tokens")
        bad = next((t for t in tokens if not 0 <= t < encoder.vocab_size), None)
        if bad is not None:
            raise invalid(
                f"tokens holds token id {bad}; this model's ids are 0 to {encoder.vocab_size - 1}",
                "tokens",
            )
        return {"prompt": encoder.full.decode(tokens, skip_special_tokens=False)}

    def route(
        name: str, answer: Callable[[Request, str], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """``answer`` behind the API key, its errors in OpenAI's shape, counted."""

        async def endpoint(request: Request) -> Response:
            rid, tenant = uuid.uuid4().hex, "-"
            try:
                tenant = front._tenant(request) or "-"
                response = await answer(request, rid)
            except APIError as err:
                response = error_response(CHAT, err, rid)
            except DeepserveError as exc:  # the encode pool is full
                response = error_response(CHAT, api_error(exc, cfg.retry_after_s), rid)
            front.metrics.requests.labels(
                name, str(response.status_code), front.cfg.labels(tenant)
            ).inc()
            return response

        return endpoint

    def pooled(
        work: Callable[[bytes, str], dict[str, Any]],
    ) -> Callable[[Request, str], Awaitable[Response]]:
        async def answer(request: Request, rid: str) -> Response:
            raw = await front._body(request)
            return JSONResponse(await front.pool.run(lambda: work(raw, rid), len(raw)))

        return answer

    async def health(request: Request, rid: str) -> Response:
        ok, detail = await front.backend.check()
        if not ok:
            raise APIError(
                503,
                f"the model backend is unavailable ({detail})",
                "server_error",
                code="unavailable",
                retry_after=cfg.retry_after_s,
            )
        return JSONResponse({"status": "ok", "detail": detail})

    async def show_version(request: Request, rid: str) -> Response:
        return JSONResponse({"version": version()})

    return [
        Route("/health", route("health", health), methods=["GET"]),
        Route("/tokenize", route("tokenize", pooled(tokenize)), methods=["POST"]),
        Route("/detokenize", route("detokenize", pooled(detokenize)), methods=["POST"]),
        Route("/version", route("version", show_version), methods=["GET"]),
    ]
