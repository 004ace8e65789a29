"""One request's answer: its choices (one per backend call; several for ``n > 1``) and the
protocol output they make together (no I/O).

A choice is a :class:`~.events.Job` (Chat Completions, Responses, Messages: deepseek-recipe's
``StreamProcessor``) or a :class:`~.completions.CompletionJob`. :class:`Answer` feeds each
choice its backend events, renders the SSE the client gets (a Chat Completions chunk of choice
``i`` carries ``index: i``; the merged usage comes once, last) and the non-streamed body, and
is what the request's account and metrics read (prompt counted once, completions summed).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from libs.proto.deepserve.v1 import generate_pb2

from .api import Protocol as HttpProtocol
from .choices import merged_chat, merged_usage, reindex_chunk, usage_body, usage_chunk
from .completions import CompletionJob, completion_body, completion_usage_chunk

# Events of a Responses stream that carry the whole response, usage included.
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def spec_complete(proto: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with what OpenAI's OpenAPI spec requires and deepseek-recipe 0.2.0 leaves out
    (in place): a Chat Completions message's ``refusal`` (nullable, never absent), and a
    Responses usage's ``input_tokens_details.cache_write_tokens``, without which the openai
    SDK's strict validation refuses the response (0: no cache write is billed, as the Messages
    usage's ``cache_creation_input_tokens`` says)."""
    if proto == "chat_completions":
        for choice in body.get("choices") or ():
            if isinstance(choice.get("message"), dict):
                choice["message"].setdefault("refusal", None)
    elif proto == "responses":
        response = body.get("response", body)  # a stream event carries it whole
        details = (response.get("usage") or {}).get("input_tokens_details")
        if isinstance(details, dict):
            details.setdefault("cache_write_tokens", 0)
    return body


class Choice(Protocol):
    """What :class:`Answer` uses of a job."""

    @property
    def accepted(self) -> bool: ...
    @property
    def finished(self) -> bool: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def answered_tokens(self) -> int: ...

    def push(
        self, ev: generate_pb2.GenerateEvent, eos: Collection[int]
    ) -> list[tuple[str | None, str]]: ...

    def close(self) -> None: ...


class Answer:
    """The choices of one request. ``created``: UNIX seconds, for Completions output."""

    def __init__(
        self,
        proto: HttpProtocol,
        rid: str,
        model: str,
        tenant: str,
        choices: Sequence[Choice],
        created: int,
        include_usage: bool = False,
    ) -> None:
        assert choices, "an answer has at least one choice"
        self.proto, self.rid, self.model, self.tenant = proto, rid, model, tenant
        self.choices = list(choices)
        self.created, self.include_usage = created, include_usage
        self._template: dict[str, Any] = {}  # the first chunk (id, created...) of a merged stream
        self._usages: dict[int, dict[str, Any]] = {}  # by choice, from its final chunk
        self.sent = 0  # SSE events push produced (a Responses stream numbers its events so)

    @property
    def completions(self) -> bool:
        return self.proto.name == "completions"

    @property
    def merging(self) -> bool:
        """Chat chunks are rewritten (index, usage) when there are several choices."""
        return len(self.choices) > 1 and not self.completions

    # -- what accounting and metrics read --------------------------------------------------------
    @property
    def accepted(self) -> bool:
        """The backend accepted the request (a choice's Ready came): the prompt was paid for."""
        return any(c.accepted for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def _first(self) -> Choice:
        return next((c for c in self.choices if c.accepted), self.choices[0])

    @property
    def prompt_tokens(self) -> int:
        return self._first().prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """The first choice's: the later ones find the prompt it just prefilled in the cache."""
        return self._first().cached_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def answered_tokens(self) -> int:
        return sum(c.answered_tokens for c in self.choices)

    def close(self) -> None:
        for c in self.choices:
            c.close()

    # -- output ----------------------------------------------------------------------------------
    def push(self, index: int, ev: generate_pb2.GenerateEvent, eos: Collection[int]) -> list[bytes]:
        """Feed choice ``index`` one event; the SSE messages it produced."""
        out = []
        for name, data in self.choices[index].push(ev, eos):
            if name in _RESPONSE_ENDS:
                data = json.dumps(
                    spec_complete(self.proto.name, json.loads(data)), ensure_ascii=False
                )
            if self.merging:
                data, parsed = reindex_chunk(data, index)
                if not self._template:
                    self._template = parsed
                if isinstance(parsed.get("usage"), dict):
                    self._usages[index] = parsed["usage"]
            out.append(self.proto.sse(name, data))
        self.sent += len(out)
        return out

    def usage(self) -> dict[str, Any]:
        return usage_body(self.prompt_tokens, self.cached_tokens, self.answered_tokens)

    def tail(self) -> list[bytes]:
        """The SSE after every choice finished: the merged usage (Chat Completions with several
        choices; Completions with ``stream_options.include_usage``), then the end marker."""
        out = []
        if self.merging and self._usages:
            usage = merged_usage([self._usages[i] for i in sorted(self._usages)])
            out.append(self.proto.sse(None, usage_chunk(self._template, usage)))
        elif self.completions and self.include_usage:
            chunk = completion_usage_chunk(self.rid, self.created, self.model, self.usage())
            out.append(self.proto.sse(None, chunk))
        return [*out, self.proto.sse_done()]

    def body(self) -> str:
        """The non-streamed response."""
        if self.completions:
            jobs = [c for c in self.choices if isinstance(c, CompletionJob)]
            assert len(jobs) == len(self.choices)
            body = completion_body(self.rid, self.created, self.model, jobs, self.usage())
            return json.dumps(body, ensure_ascii=False)
        bodies = [str(c.response.to_json()) for c in self.choices]  # type: ignore[attr-defined]
        text = bodies[0] if len(bodies) == 1 else merged_chat(bodies)
        if self.proto.name not in ("chat_completions", "responses"):
            return text
        return json.dumps(spec_complete(self.proto.name, json.loads(text)), ensure_ascii=False)
