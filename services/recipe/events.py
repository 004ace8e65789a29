"""Backend events -> deepseek-recipe chunks -> protocol output, and backend errors -> HTTP errors.

No I/O. The library's sharp edges are handled here: the EOS ids are taken out of the token
stream (it would reach the ``StreamProcessor`` as text) and the backend's finish reason sent
instead; every output chunk is serialized *before* ``accumulate`` consumes it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr
from starlette.responses import JSONResponse

from libs.common.errors import (
    DeadlineExceeded,
    DeepserveError,
    InstanceFailed,
    Internal,
    InvalidArgument,
    NotFound,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from libs.common.tenant_label import UNSALTED, TenantLabels
from libs.proto.deepserve.v1 import generate_pb2

from .api import APIError, Protocol
from .logprobs import chunk_logprobs
from .tool_markup import OutputProcessor

# (HTTP status, OpenAI error type, OpenAI error code) by kind; the nearest base class decides.
_STATUS_OF: dict[type[DeepserveError], tuple[int, str, str | None]] = {
    InvalidArgument: (400, "invalid_request_error", "invalid_value"),
    NotFound: (404, "invalid_request_error", "not_found"),
    Unauthenticated: (401, "authentication_error", None),
    Overloaded: (429, "rate_limit_error", "rate_limit_exceeded"),
    Unavailable: (503, "service_unavailable", "service_unavailable"),
    InstanceFailed: (503, "service_unavailable", "service_unavailable"),
    DeadlineExceeded: (504, "timeout", "timeout"),
}
_UPSTREAM = (502, "server_error", "upstream_error")  # Internal, and anything else


def api_error(exc: DeepserveError, retry_after: int) -> APIError:
    """A backend failure as the HTTP error a client can act on (the recipe's one mapping).

    ``retry_after`` (seconds) is the default hint; an :class:`Overloaded` that carries the
    backend's own hint (from its measured drain rate) gives that instead, rounded up.
    """
    if isinstance(exc, Overloaded) and exc.retry_after_ms > 0:
        retry_after = max(1, math.ceil(exc.retry_after_ms / 1000))
    found = (_STATUS_OF.get(k) for k in type(exc).__mro__)
    status, type_, code = next((v for v in found if v is not None), _UPSTREAM)
    message = str(exc)
    if status == 503:
        message = f"the model backend is unavailable ({message}); retry in {retry_after} s"
    elif status == 429:
        message = f"the server is at capacity ({message}); retry in {retry_after} s"
    elif status == 502:
        message = f"the model backend failed ({message})"
    return APIError(
        status, message, type_, code=code, retry_after=retry_after if status in (429, 503) else None
    )


def inference_chunks(
    ev: generate_pb2.GenerateEvent, eos: Collection[int]
) -> list[dr.InferenceChunk]:
    """A Generate event as the library's input. An EOS id never reaches the processor as text."""
    kind = ev.WhichOneof("event")
    if kind == "ready":
        return [
            dr.InferenceChunk.ready(
                prompt_usage=dr.PromptUsage(
                    prompt_tokens=ev.ready.prompt_tokens,
                    prompt_cache_hit_tokens=ev.ready.cached_tokens,
                )
            )
        ]
    if kind == "tokens":
        ids = [int(t) for t in ev.tokens.token_ids if t not in eos]
        return [dr.InferenceChunk.tokens(ids, chunk_logprobs(ev.tokens, eos))] if ids else []
    if kind == "finish":
        if ev.finish.reason == "abort":
            raise Unavailable("the backend aborted the request")
        reason = (
            dr.InferenceFinishReason.Length
            if ev.finish.reason == "length"
            else dr.InferenceFinishReason.Stop
        )
        return [dr.InferenceChunk.finish(reason)]
    return []


@dataclass
class Job:
    """One converted request on its way through the backend."""

    proto: Protocol
    rid: str
    model: str
    tenant: str
    conv: dr.ConversationRequest
    processor: OutputProcessor  # deepseek-recipe's StreamProcessor, or a wrapper of it
    response: Any = None  # the protocol's Response accumulator, built at Ready
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # every id the backend sent, EOS included
    eos_tokens: int = 0  # of which EOS ids: the response's usage leaves them out
    finished: bool = False

    @property
    def accepted(self) -> bool:
        """The backend's Ready came (the response accumulator exists)."""
        return self.response is not None

    @property
    def answered_tokens(self) -> int:
        """Completion tokens as the response's usage counts them (EOS not counted)."""
        return self.completion_tokens - self.eos_tokens

    def close(self) -> None:
        """Release the processor (also when it did not finish)."""
        self.processor.close()

    def push(
        self, ev: generate_pb2.GenerateEvent, eos: Collection[int]
    ) -> list[tuple[str | None, str]]:
        """Feed one event; the (SSE event name, JSON) of every output chunk, serialized before
        ``accumulate`` consumes it."""
        kind = ev.WhichOneof("event")
        if kind == "ready":
            self.prompt_tokens, self.cached_tokens = ev.ready.prompt_tokens, ev.ready.cached_tokens
            self.response = self.proto.response_cls(
                self.rid, self.model, int(time.time()), self.prompt_tokens, self.cached_tokens
            )
        elif kind == "tokens":
            self.completion_tokens += len(ev.tokens.token_ids)
            self.eos_tokens += sum(1 for t in ev.tokens.token_ids if t in eos)
        out: list[tuple[str | None, str]] = []
        for chunk in inference_chunks(ev, eos):
            if self.response is None:
                raise Internal("tokens arrived before Ready")
            produced = self.processor.push(chunk)
            if kind == "finish":
                produced += self.processor.finish()
            for c in produced:
                out.append((self.proto.response_cls.sse_event_name(c), c.to_json()))
                self.response.accumulate(c)
        # A stop sequence ends the answer inside the processor before the backend is done.
        self.finished = self.finished or kind == "finish" or self.processor.finished
        return out


def tenant_label(tenant: str, labels: TenantLabels = UNSALTED) -> str:
    """A tenant as a metrics label (``-`` for none): ``labels``' salted hash, so scraped metrics
    never carry tenant names (STYLE 15). The app labels with its ``AppConfig.labels``; with no
    secret configured that is :data:`UNSALTED`, this default."""
    return labels(tenant)


def error_response(proto: Protocol, err: APIError, request_id: str = "") -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else {}
    if request_id:
        headers["X-Request-Id"] = request_id
    if err.status == 408:  # the rest of the body may still trickle in: end the connection
        headers["Connection"] = "close"
    return JSONResponse(proto.error_body(err), status_code=err.status, headers=headers)
