"""Every API response a test reads, checked by the official clients' own types, strictly.

The openai and anthropic SDKs check a response only when asked (``_strict_response_validation``)
and then leniently: pydantic's lax mode turns ``"1"`` into ``1``, and their models keep any field
they do not know (``extra="allow"``), so a body missing nothing the SDK requires passes. What a
test reads from this project's HTTP API is held to more, by :func:`check`:

- the body is validated by its route's SDK type in pydantic's *strict* mode, from the JSON text:
  a string where a number belongs, a float where an int belongs, a required field missing, a
  value outside a ``Literal``: refused;
- no field the SDK type does not name, except the extensions in :data:`EXTENSIONS`, each with
  where it is documented (DeepSeek's ``reasoning_content``, vLLM's ``prompt_token_ids``...);
- the keys OpenAI's OpenAPI spec requires where the SDK leaves them optional (:data:`REQUIRED`:
  a choice's ``logprobs`` and a message's ``refusal`` may be null, never absent);
- an error body in its protocol's error shape (OpenAI's for the OpenAI routes and vLLM's,
  Anthropic's for ``/v1/messages``), and a stream event by event: each SSE event's data is the
  route's chunk type (or the protocol's error event), its event name agrees with its data, and a
  finished OpenAI stream ends with ``[DONE]``.

:func:`strict_http` attaches the check to an httpx client (starlette's ``TestClient`` is one) as a
response hook: every response of a route in :data:`ROUTES` is checked while the test reads it, a
stream event by event as its bytes arrive (a stream test's timing is unchanged). A mismatch fails
the test through ``pytest.fail`` (a ``BaseException``: an SDK's ``except Exception`` retry loop
cannot turn it into a connection error). :func:`openai_client`, :func:`async_openai_client` and
:func:`anthropic_client` build SDK clients with the SDK's own strict validation and this check.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import anthropic
import httpx
import httpx2
import openai
import pydantic
import pytest
from anthropic.types import MessageDeltaUsage, MessageTokensCount, ModelInfo, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse as AnthropicErrorResponse
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types import Model as OpenAIModel
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
)
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs as ChatChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkChoiceLogprobs
from openai.types.responses import Response as ResponsesResponse
from openai.types.responses import ResponseStreamEvent
from openai.types.shared import ErrorObject

C = TypeVar("C", httpx.Client, httpx.AsyncClient, httpx2.Client, httpx2.AsyncClient)


class _Closed(pydantic.BaseModel):
    """A local envelope: no field beyond those named (the SDKs have no type for these)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class OpenAIError(_Closed):
    """OpenAI's error body (OpenAPI ``ErrorResponse``: ``{"error": Error}``); also vLLM's."""

    error: ErrorObject


class RequestTooLargeError(_Closed):
    """Anthropic's 413 error object: listed on https://docs.anthropic.com/en/api/errors
    (``request_too_large``) but absent from the SDK's ``ErrorObject`` union (anthropic 2.17)."""

    type: Literal["request_too_large"]
    message: str


class AnthropicTooLarge(_Closed):
    type: Literal["error"]
    error: RequestTooLargeError
    request_id: str | None = None


class ModelList(_Closed):
    """``GET /v1/models``: OpenAI's ``ListModelsResponse`` (object, data) and Anthropic's page
    (data, has_more, first_id, last_id) at once, as the recipe serves both SDKs one list."""

    object: Literal["list"]
    data: list[Any]  # each a MODEL_CARD (Route.items)
    has_more: bool
    first_id: str | None
    last_id: str | None


class CompletionChunkChoice(CompletionChoice):
    """A streamed Completions choice: ``finish_reason`` is null until the choice's last chunk,
    as OpenAI streams it; the SDK parses stream chunks with ``Completion``, whose choice has no
    null (its lax parse lets it pass; a strict one would refuse OpenAI's own stream)."""

    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class CompletionChunk(Completion):
    choices: list[CompletionChunkChoice]  # type: ignore[assignment]


@dataclass(frozen=True)
class AllOf:
    """A body that must be each of ``types`` at once; its fields: those any of them names."""

    types: tuple[Any, ...]


# GET /v1/models/{id}: one model card that both SDKs read (``models.retrieve``).
MODEL_CARD = AllOf((OpenAIModel, ModelInfo))


class Tokenized(_Closed):
    """vLLM's ``TokenizeResponse`` (``/tokenize``)."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class Detokenized(_Closed):
    """vLLM's ``DetokenizeResponse`` (``/detokenize``)."""

    prompt: str


class Version(_Closed):
    version: str


class Health(_Closed):
    """``GET /health``: vLLM answers only its status code; the recipe adds why."""

    status: Literal["ok", "unavailable"]
    detail: str


class Ping(_Closed):
    type: Literal["ping"]


# Fields a body may carry beyond its SDK type: an extension documented by the API it imitates.
EXTENSIONS: dict[type[pydantic.BaseModel], frozenset[str]] = {
    # DeepSeek API (api-docs.deepseek.com, "Reasoning Model"): the thinking text beside content.
    ChatCompletionMessage: frozenset({"reasoning_content"}),
    # DeepSeek API: the thinking tokens' log probabilities beside the content's (logprobs.py).
    ChatChoiceLogprobs: frozenset({"reasoning_content"}),
    ChunkChoiceLogprobs: frozenset({"reasoning_content"}),
    # DeepSeek API ("Function Calling"): a non-streamed tool call keeps its stream index.
    ChatCompletionMessageFunctionToolCall: frozenset({"index"}),
    ChoiceDelta: frozenset({"reasoning_content"}),
    # DeepSeek API ("Context Caching"): prompt tokens found in / missing from the cache.
    CompletionUsage: frozenset({"prompt_cache_hit_tokens", "prompt_cache_miss_tokens"}),
    # Written by deepseek-recipe 0.2.0, the converter DESIGN.md has the recipe use so its output
    # matches the official APIs', and absent from the SDK types: a Response echoes its request's
    # settings (OpenAI's own example response carries "store"); a message_delta's usage repeats
    # the service_tier of Message's usage.
    ResponsesResponse: frozenset(
        {"store", "frequency_penalty", "presence_penalty", "content_filters"}
    ),
    MessageDeltaUsage: frozenset({"service_tier"}),
}

# Keys OpenAI's OpenAPI spec (github.com/openai/openai-openapi, openapi.yaml at f85dbe2)
# requires where the SDK's type has a default: nullable, but present.
REQUIRED: dict[type[pydantic.BaseModel], tuple[str, ...]] = {
    ChatChoice: ("finish_reason", "index", "message", "logprobs"),
    ChatCompletionMessage: ("role", "content", "refusal"),
    ChunkChoice: ("delta", "finish_reason", "index"),
    CompletionChoice: ("finish_reason", "index", "logprobs", "text"),
    CompletionUsage: ("prompt_tokens", "completion_tokens", "total_tokens"),
    ErrorObject: ("type", "message", "param", "code"),  # the spec's Error
}

OPENAI_ERROR: Any = OpenAIError
ANTHROPIC_ERROR: Any = AnthropicErrorResponse | AnthropicTooLarge


@dataclass(frozen=True)
class Route:
    """What one route answers: its JSON body, its SSE events, its error body."""

    body: Any
    error: Any = OPENAI_ERROR
    chunk: Any = None  # the type of an SSE event's data; None: the route does not stream
    done: str | None = None  # the data of the event that ends a finished stream
    named: bool = False  # each SSE event is named after its data's "type"
    extra: dict[str, Any] = field(default_factory=dict)  # event name -> its own type
    items: Any = None  # the type of each element of the body's "data" (a list route)


ROUTES: dict[tuple[str, str], Route] = {
    ("POST", "/v1/chat/completions"): Route(
        ChatCompletion, chunk=ChatCompletionChunk | OpenAIError, done="[DONE]"
    ),
    ("POST", "/v1/completions"): Route(
        Completion, chunk=CompletionChunk | OpenAIError, done="[DONE]"
    ),
    ("POST", "/v1/responses"): Route(ResponsesResponse, chunk=ResponseStreamEvent, named=True),
    ("POST", "/v1/messages"): Route(
        anthropic.types.Message,
        error=ANTHROPIC_ERROR,
        chunk=RawMessageStreamEvent,
        named=True,
        extra={"ping": Ping, "error": ANTHROPIC_ERROR},
    ),
    ("POST", "/v1/messages/count_tokens"): Route(MessageTokensCount, error=ANTHROPIC_ERROR),
    ("GET", "/v1/models"): Route(ModelList, items=MODEL_CARD),
    ("GET", "/v1/models/*"): Route(MODEL_CARD),
    ("POST", "/tokenize"): Route(Tokenized),
    ("POST", "/detokenize"): Route(Detokenized),
    ("GET", "/version"): Route(Version),
    ("GET", "/health"): Route(Health),
}


def route_of(method: str, path: str) -> Route | None:
    """The route a request went to; ``path`` may carry a prefix (a base URL's ``/v1``...)."""
    for (m, p), route in ROUTES.items():
        if m != method:
            continue
        if p.endswith("/*") and p[:-1] in path and not path.endswith(p[:-1]):
            return route
        if path == p:
            return route
    return None


def _adapter(tp: Any) -> pydantic.TypeAdapter[Any]:
    if tp not in _ADAPTERS:
        _ADAPTERS[tp] = pydantic.TypeAdapter(tp)
    return _ADAPTERS[tp]


_ADAPTERS: dict[Any, pydantic.TypeAdapter[Any]] = {}


def _inherited(table: dict[type[Any], Any], kind: type[Any], also: frozenset[str]) -> set[str]:
    """The entries of ``kind`` and its bases in ``table`` (a subclass here narrows an SDK type)."""
    return set(also).union(*(table.get(k, ()) for k in kind.__mro__))


def _walk(value: Any, where: str, problems: list[str], also: frozenset[str] = frozenset()) -> None:
    """Extra fields (beyond EXTENSIONS, and ``also`` at the top) and absent REQUIRED keys, at
    every depth."""
    if isinstance(value, pydantic.BaseModel):
        kind = type(value)
        allowed = _inherited(EXTENSIONS, kind, also)
        extra = [k for k in value.model_extra or {} if k not in allowed]
        problems += [f"{where}.{k}: not a field of {kind.__name__}" for k in extra]
        problems += [
            f"{where}.{k}: required by OpenAI's OpenAPI spec (may be null, not absent)"
            for k in _inherited(REQUIRED, kind, frozenset())
            if k not in value.model_fields_set
        ]
        for name in kind.model_fields:
            _walk(getattr(value, name), f"{where}.{name}", problems)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _walk(item, f"{where}[{i}]", problems)
    elif isinstance(value, dict):
        for k, item in value.items():
            _walk(item, f"{where}.{k}", problems)


def problems_of(tp: Any, text: str | bytes, where: str = "body") -> list[str]:
    """What is wrong with ``text`` as a ``tp`` (empty: nothing): strict types, extra fields,
    the spec's required keys. ``tp`` may be a union (one member must take it whole) or an
    :class:`AllOf` (each must)."""
    if isinstance(tp, AllOf):
        named = frozenset().union(*(t.model_fields for t in tp.types))
        return [p for t in tp.types for p in _problems_as(t, text, where, named)]
    members = list(getattr(tp, "__args__", ())) if _is_union(tp) else [tp]
    found: list[str] = []
    for member in members:
        wrong = _problems_as(member, text, where)
        if not wrong:
            return []
        found += wrong
    return found


def _problems_as(
    tp: Any, text: str | bytes, where: str, also: frozenset[str] = frozenset()
) -> list[str]:
    try:
        value = _adapter(tp).validate_json(text, strict=True)
    except pydantic.ValidationError as exc:
        return [f"{where} as {_name(tp)}: {_errors(exc)}"]
    wrong: list[str] = []
    _walk(value, where, wrong, also)
    return [f"{where} as {_name(tp)}: " + "; ".join(wrong)] if wrong else []


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _errors(exc: pydantic.ValidationError) -> str:
    shown = [
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r:.60})"
        for e in exc.errors()[:6]
    ]
    return "; ".join(shown)


def check(method: str, path: str, status: int, content_type: str, text: str) -> None:
    """Fail the test if a whole response of a known route does not match (see the module doc)."""
    route = route_of(method, path)
    if route is None:
        return
    if "text/event-stream" in content_type:
        events = SseChecker(route, f"{method} {path}")
        events.feed(text)
        events.end()
        return
    if status == 200:
        found = problems_of(route.body, text)
        if not found and route.items is not None:
            for i, item in enumerate(json.loads(text)["data"]):
                found += problems_of(route.items, json.dumps(item), f"body.data[{i}]")
        _fail_on(found, f"{method} {path} {status}", text)
    elif status >= 400 and text:
        _fail_on(problems_of(route.error, text, "error"), f"{method} {path} {status}", text)


def _fail_on(problems: list[str], what: str, text: str) -> None:
    if problems:
        shown = text if len(text) < 1500 else text[:1500] + "..."
        pytest.fail(f"{what}: not the official shape\n  " + "\n  ".join(problems) + f"\n{shown}")


class SseChecker:
    """Checks an SSE stream event by event as its text arrives."""

    def __init__(self, route: Route, what: str) -> None:
        self.route, self.what = route, what
        self.buffer, self.last_data, self.events = "", "", 0
        self.failed = False  # the last event was the protocol's error event

    def feed(self, text: str) -> None:
        self.buffer += text.replace("\r\n", "\n")
        while "\n\n" in self.buffer:
            raw, self.buffer = self.buffer.split("\n\n", 1)
            self._event(raw)

    def _event(self, raw: str) -> None:
        name, data = None, []
        for line in raw.split("\n"):
            if line.startswith(":") or not line:
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
        if not data:
            return
        text = "\n".join(data)
        self.events += 1
        what = f"{self.what} event {self.events} ({name or 'unnamed'})"
        if self.route.done is not None and self.last_data == self.route.done:
            pytest.fail(f"{what}: an event after {self.route.done}: {text[:300]}")
        self.last_data = text
        if text == self.route.done:
            return
        tp = self.route.extra.get(name or "", self.route.chunk)
        _fail_on(problems_of(tp, text, "data"), what, text)
        self.failed = name == "error" or '"error"' in text[:10]
        if self.route.named and name not in self.route.extra:
            kind = json.loads(text).get("type")
            if name != kind:
                pytest.fail(f"{what}: event name {name!r} but its data's type is {kind!r}")

    def end(self) -> None:
        """The stream ended (the server closed it): the last event must have ended it."""
        if self.buffer.strip():
            self._event(self.buffer)
            self.buffer = ""
        ended = self.last_data == self.route.done or self.failed  # an error event ends it too
        if self.route.done is not None and self.events and not ended:
            pytest.fail(f"{self.what}: the stream ended without {self.route.done}")


# -- attaching the check to clients ---------------------------------------------------------------
class _Checked:
    """Wraps a response's byte stream: checks each SSE event as it passes, or the whole JSON
    body once it has all passed. A stream left unfinished (the test stopped reading) is not
    judged as a whole."""

    def __init__(self, response: Any, route: Route) -> None:
        req = response.request
        self.what = f"{req.method} {req.url.path}"
        self.status, self.route = response.status_code, route
        self.ctype = response.headers.get("content-type", "")
        self.sse = SseChecker(route, self.what) if "text/event-stream" in self.ctype else None
        self.body = bytearray()

    def chunk(self, raw: bytes) -> None:
        if self.sse is not None:
            self.sse.feed(raw.decode("utf-8", errors="replace"))
        else:
            self.body += raw

    def end(self) -> None:
        if self.sse is not None:
            self.sse.end()
        else:
            check(
                *self.what.split(" ", 1),
                self.status,
                self.ctype,
                self.body.decode("utf-8", errors="replace"),
            )


def _stream_types(response: Any) -> tuple[type[Any], type[Any]]:
    """This response's library's (sync, async) stream wrappers: httpx, or httpx2 (which
    starlette's TestClient and the openai and anthropic SDKs use), whose stream base classes
    are their own."""
    lib = sys.modules[type(response).__module__.split(".")[0]]
    if lib not in _WRAPPERS:

        class SyncChecked(lib.SyncByteStream):  # type: ignore[name-defined,misc]
            def __init__(self, inner: Any, checked: _Checked) -> None:
                self.inner, self.checked = inner, checked

            def __iter__(self) -> Iterator[bytes]:
                for raw in self.inner:
                    self.checked.chunk(raw)
                    yield raw
                self.checked.end()

            def close(self) -> None:
                self.inner.close()

        class AsyncChecked(lib.AsyncByteStream):  # type: ignore[name-defined,misc]
            def __init__(self, inner: Any, checked: _Checked) -> None:
                self.inner, self.checked = inner, checked

            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for raw in self.inner:
                    self.checked.chunk(raw)
                    yield raw
                self.checked.end()

            async def aclose(self) -> None:
                await self.inner.aclose()

        _WRAPPERS[lib] = (SyncChecked, AsyncChecked)
    return _WRAPPERS[lib]


_WRAPPERS: dict[Any, tuple[type[Any], type[Any]]] = {}


def _wrap(response: Any, asynchronous: bool) -> None:
    route = route_of(response.request.method, urlsplit(str(response.request.url)).path)
    encoding = response.headers.get("content-encoding", "identity")
    if route is None or encoding not in ("", "identity"):
        return
    sync, async_ = _stream_types(response)
    wrapper = async_ if asynchronous else sync
    response.stream = wrapper(response.stream, _Checked(response, route))


def _sync_hook(response: Any) -> None:
    _wrap(response, asynchronous=False)


async def _async_hook(response: Any) -> None:
    _wrap(response, asynchronous=True)


def strict_http(client: C) -> C:
    """``client`` with every response of a route in :data:`ROUTES` checked as it is read."""
    hooks = client.event_hooks
    asynchronous = isinstance(client, httpx.AsyncClient | httpx2.AsyncClient)
    hook: Callable[..., Any] = _async_hook if asynchronous else _sync_hook
    if hook not in hooks["response"]:
        hooks["response"] = [*hooks["response"], hook]
        client.event_hooks = hooks
    return client


def openai_client(sdk_validation: bool = True, **kw: Any) -> openai.OpenAI:
    """An ``openai.OpenAI`` with the SDK's strict response validation and :func:`check`.

    ``sdk_validation=False`` leaves only :func:`check`, which validates the same types more
    strictly: for streamed Completions, whose chunks the SDK validates as ``Completion``, which
    allows no null ``finish_reason`` though OpenAI streams one until a choice's last chunk
    (:class:`CompletionChunk`)."""
    sdk = openai.OpenAI(**kw, _strict_response_validation=sdk_validation)
    strict_http(sdk._client)
    return sdk


def async_openai_client(**kw: Any) -> openai.AsyncOpenAI:
    sdk = openai.AsyncOpenAI(**kw, _strict_response_validation=True)
    strict_http(sdk._client)
    return sdk


def anthropic_client(**kw: Any) -> anthropic.Anthropic:
    """An ``anthropic.Anthropic`` with the SDK's strict response validation and :func:`check`."""
    sdk = anthropic.Anthropic(**kw, _strict_response_validation=True)
    strict_http(sdk._client)
    return sdk
