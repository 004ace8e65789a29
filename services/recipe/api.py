"""The three HTTP protocols the recipe speaks, as data: request/response classes of
``deepseek-recipe``, the SSE framing and each protocol's error shape (no I/O).

Every refusal is an :class:`APIError` (HTTP status, message, OpenAI type/code,
``retry_after``); :meth:`Protocol.error_body` renders it in the caller's protocol once:
OpenAI ``{"error": {"message", "type", "param", "code"}}``, Anthropic
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr


class APIError(Exception):
    """An error reply. ``retry_after`` (seconds) sets the Retry-After header."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.retry_after = param, code, retry_after


def invalid(
    message: str, param: str | None = None, code: str = "invalid_request_error"
) -> APIError:
    return APIError(400, message, param=param, code=code)


def conversion_error(exc: Exception) -> APIError:
    """The library's refusal, with the library's message, as a 400."""
    if isinstance(exc, dr.ConversionError):
        try:
            err = json.loads(exc.body)["error"]
            return APIError(
                exc.status_code if 400 <= exc.status_code < 500 else 400,
                str(err["message"]),
                str(err.get("type") or "invalid_request_error"),
                err.get("param"),
                err.get("code"),
            )
        except (ValueError, KeyError, TypeError):
            return invalid(str(exc))
    return invalid(str(exc))


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


@dataclass(frozen=True)
class Protocol:
    """One HTTP protocol over the library's request, generator and response classes."""

    name: str  # route label: chat_completions, completions, responses, messages
    # dr.ChatCompletionRequest | dr.ResponsesRequest | dr.MessagesRequest; None for Completions,
    # which deepseek-recipe does not have (completions.py)
    request_cls: Any
    response_cls: Any  # dr.ChatCompletionResponse | dr.ResponsesResponse | ...; likewise
    id_prefix: str
    anthropic: bool = False

    def error_body(self, err: APIError) -> dict[str, Any]:
        if self.anthropic:
            kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": err.message}}
        return {
            "error": {
                "message": err.message,
                "type": err.type,
                "param": err.param,
                "code": err.code,
            }
        }

    def sse(self, name: str | None, data: str) -> bytes:
        head = f"event: {name}\n" if name else ""
        return (head + "data: " + data + "\n\n").encode()

    def sse_error(self, err: APIError, sequence_number: int = 0) -> bytes:
        """The error event that ends a stream that already started; ``sequence_number``: the
        number of events sent before it (a Responses event's own number, which OpenAI's
        ``ResponseErrorEvent`` requires)."""
        if self.name in ("chat_completions", "completions"):
            return self.sse(None, json.dumps(self.error_body(err), ensure_ascii=False))
        if self.anthropic:
            return self.sse("error", json.dumps(self.error_body(err), ensure_ascii=False))
        body = {
            "type": "error",
            "code": err.code or err.type,
            "message": err.message,
            "param": err.param,
            "sequence_number": sequence_number,
        }
        return self.sse("error", json.dumps(body, ensure_ascii=False))

    def sse_done(self) -> bytes:
        if self.response_cls is None:  # Completions ends as Chat Completions does
            return self.sse(None, "[DONE]")
        done = self.response_cls.sse_done_data()
        return self.sse(None, done) if done is not None else b""


CHAT = Protocol(
    "chat_completions", dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-"
)
COMPLETIONS = Protocol("completions", None, None, "cmpl-")
RESPONSES = Protocol("responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_")
MESSAGES = Protocol("messages", dr.MessagesRequest, dr.MessagesResponse, "msg_", anthropic=True)
