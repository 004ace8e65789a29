"""Backend events -> deepseek-recipe chunks -> protocol output, and gRPC failures -> HTTP errors.

No I/O. The library's sharp edges are handled here: the EOS id is taken out of the token
stream (it would reach the ``StreamProcessor`` as text) and the backend's finish reason sent
instead; every output chunk is serialized *before* ``accumulate`` consumes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr
import grpc

from libs.proto.deepserve.v1 import generate_pb2

from .api import APIError, Protocol
from .backend import BackendError

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
    grpc.StatusCode.ABORTED: (503, "service_unavailable", "service_unavailable"),
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
    return APIError(
        status, message, type_, code=code, retry_after=retry_after if status in (429, 503) else None
    )


def inference_chunks(ev: generate_pb2.GenerateEvent, eos: int) -> list[dr.InferenceChunk]:
    """A Generate event as the library's input. The EOS id never reaches the processor as text."""
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
        ids = [int(t) for t in ev.tokens.token_ids if t != eos]
        return [dr.InferenceChunk.tokens(ids)] if ids else []
    if kind == "finish":
        if ev.finish.reason == "abort":
            raise BackendError(grpc.StatusCode.ABORTED, "the backend aborted the request")
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
    processor: dr.StreamProcessor
    response: Any = None  # the protocol's Response accumulator, built at Ready
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False

    def push(self, ev: generate_pb2.GenerateEvent, eos: int) -> list[tuple[str | None, str]]:
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
        out: list[tuple[str | None, str]] = []
        for chunk in inference_chunks(ev, eos):
            if self.response is None:
                raise BackendError(grpc.StatusCode.INTERNAL, "tokens arrived before Ready")
            produced = self.processor.push(chunk)
            if kind == "finish":
                produced += self.processor.finish()
            for c in produced:
                out.append((self.proto.response_cls.sse_event_name(c), c.to_json()))
                self.response.accumulate(c)
        # A stop sequence ends the answer inside the processor before the backend is done.
        self.finished = self.finished or kind == "finish" or self.processor.finished
        return out
