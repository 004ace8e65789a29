"""OpenAI Chat Completions: request validation and response shapes (no I/O).

Every refusal is an :class:`APIError` carrying the HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``; the app turns it into a response once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .template import ChatMessage

TEMPERATURE_MAX = 2.0  # OpenAI's range
SEED_LIMIT = 2**63  # the engine's seed range
MAX_STOP = 4  # OpenAI: up to 4 stop sequences


class APIError(Exception):
    """An error reply in OpenAI's shape. ``retry_after`` (seconds) sets the Retry-After header."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.retry_after = param, code, retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat completion request, in deepserve's terms."""

    model: str
    messages: tuple[ChatMessage, ...]
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None  # None: the server's default
    seed: int | None = None
    stop: tuple[str, ...] = ()  # accepted, not applied yet (string stops need detokenized matching)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    has_tools: bool = False


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"{name} must be a number, got {v!r}", "invalid_type")
    if v < lo or (lo_open and v == lo) or v > hi:
        bracket = "(" if lo_open else "["
        raise invalid(name, f"{name} must lie in {bracket}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, f"{name} must be an integer, got {v!r}", "invalid_type")
    if v < lo or (hi is not None and v >= hi):
        limit = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi})"
        raise invalid(name, f"{name} must be {limit}, got {v}")
    return v


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(name, f"{name} must be true or false, got {v!r}", "invalid_type")
    return v


def _content(value: Any, where: str, role: str) -> str:
    if value is None:
        if role == "assistant":
            return ""
        raise invalid(f"{where}.content", f"{where}.content is required for role {role!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(f"{where}.content[{j}]",
                              f"{where}.content[{j}] must be an object with a type")
            if part["type"] != "text":
                raise invalid(f"{where}.content[{j}].type",
                              f"{where}.content[{j}].type {part['type']!r} is not supported; "
                              "this model reads text parts only", "unsupported_value")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}].text", f"{where}.content[{j}].text must be a string")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts")


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list):
        raise invalid("messages", "messages must be a list of messages", "invalid_type")
    if not value:
        raise invalid("messages", "messages must hold at least one message", "empty_array")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"{where} must be an object with role and content", "invalid_type")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for system instructions
        if role not in ("system", "user", "assistant", "tool"):
            raise invalid(f"{where}.role", f"{where}.role must be one of system, developer, user, "
                          f"assistant, tool; got {role!r}")
        if role == "assistant" and m.get("tool_calls"):
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls: replaying tool calls is not "
                          "supported yet", "unsupported_value")
        out.append(ChatMessage(role, _content(m.get("content"), where, role)))
    return tuple(out)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOP:
        raise invalid("stop", f"stop holds {len(stops)} sequences; at most {MAX_STOP}")
    return tuple(stops)


def parse_chat_request(body: Any, vocab_size: int) -> ChatRequest:
    """Validate a decoded JSON body; raises :class:`APIError` (400) naming the bad field."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", "invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model is required (a string naming the served model)",
                      "missing_required_parameter")
    if "messages" not in body:
        raise invalid("messages", "messages is required", "missing_required_parameter")
    messages = parse_messages(body["messages"])
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise invalid("n", f"n must be 1 (one choice per request), got {n}", "unsupported_value")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise invalid("logprobs", "logprobs are not supported yet", "unsupported_value")
    max_tokens = _int(body, "max_tokens", 1)
    max_completion = _int(body, "max_completion_tokens", 1)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid("stream_options", "stream_options must be an object", "invalid_type")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stop_ids):
        raise invalid("stop_token_ids", f"stop_token_ids must be token ids in [0, {vocab_size})")
    top_k = _int(body, "top_k", -1)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", "tools must be a list", "invalid_type")
    return ChatRequest(
        model=model, messages=messages, stream=_bool(body, "stream"),
        include_usage=_bool(stream_options, "include_usage"),
        temperature=_number(body, "temperature", 1.0, 0.0, TEMPERATURE_MAX),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=max(top_k or 0, 0),  # vLLM's convention: -1 (or 0) is off
        max_tokens=max_completion if max_completion is not None else max_tokens,
        seed=_int(body, "seed", 0, SEED_LIMIT), stop=_stop(body), stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos"), has_tools=bool(tools),
    )


# -- responses ------------------------------------------------------------------------------------
FINISH_REASONS = {"stop": "stop", "length": "length"}


def finish_reason(reason: str) -> str:
    """deepserve's reason in OpenAI's terms; others (e.g. "abort") pass through as they are."""
    return FINISH_REASONS.get(reason, reason or "stop")


def usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """OpenAI's usage object, with DeepSeek's cache hit/miss split."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": prompt - cached,
    }


def completion(cid: str, created: int, model: str, text: str, reason: str,
               use: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": reason}],
        "usage": use,
    }


def chunk(cid: str, created: int, model: str, delta: dict[str, Any] | None,
          reason: str | None = None, use: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` gives OpenAI's usage-only chunk (no choices)."""
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": []}
    if delta is not None:
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
    if use is not None:
        out["usage"] = use
    return out
