"""OpenAI's legacy Completions (``POST /v1/completions``) as data: the request checked into a
:class:`CompletionRequest`, output ids turned into text (stop sequences cut it), and the
``text_completion`` objects and stream chunks (no I/O).

deepseek-recipe has no Completions protocol, and none is needed: the prompt is raw text (or
token ids), tokenized with the served model's tokenizer and no chat template
(:meth:`~.encoding.PromptEncoder.encode_text`), and the output is plain text -- no thinking,
tool-call or JSON markup is parsed.

Refused with a 400 naming the field: ``suffix`` (insertion needs a fill-in-the-middle prompt
format the served model does not document), ``echo`` with ``logprobs`` (the prompt tokens' log
probabilities are not computed), a list of more than one prompt (send one request per prompt;
``n`` gives several completions of one), ``best_of`` other than ``n``, a non-empty
``logit_bias``; and every malformed field. ``logprobs`` (0..5): ``logprobs.py``; vLLM's
``guided_*`` / ``structured_outputs`` constraint: ``guided.py``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from libs.common.errors import Internal, Unavailable
from libs.common.sampling import MAX_SEED, Constraint
from libs.proto.deepserve.v1 import generate_pb2

from .api import invalid
from .choices import read_n
from .guided import guided_constraint
from .logprobs import CompletionLogprobs, chunk_logprobs, read_completion_logprobs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_STOP = 16  # stop sequences per request
MAX_STOP_CHARS = 512  # each


@dataclass(frozen=True)
class CompletionRequest:
    """A checked Completions request. Exactly one of ``prompt_text`` and ``prompt_ids`` is set."""

    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    max_tokens: int
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    echo: bool
    stream: bool
    include_usage: bool
    n: int
    extra: dict[str, Any] = field(default_factory=dict)  # sampling.extra_sampling's fields
    logprobs: int | None = None  # alternatives per token (0..5); None: no logprobs
    constraint: Constraint | None = None  # a vLLM guided field's (guided.py)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise invalid(f"{name} must be a number, got {v!r}", name)
    return float(v)


def _flag(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"{name} must be true or false, got {v!r}", name)
    return v


def _token_ids(v: list[Any]) -> tuple[int, ...] | None:
    if v and all(_is_int(t) for t in v):
        return tuple(v)
    return None


def read_prompt(body: dict[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids) of ``prompt``: a string, a list of token ids, or a list holding one
    of those; a 400 naming ``prompt`` for anything else."""
    p = body.get("prompt")
    if p is None:
        raise invalid(
            "prompt is required: a string or a list of token ids",
            "prompt",
            "missing_required_parameter",
        )
    if isinstance(p, str):
        return p, None
    if not isinstance(p, list) or not p:
        raise invalid(
            f"prompt must be a string or a non-empty list of token ids, got {p!r:.80}", "prompt"
        )
    ids = _token_ids(p)
    if ids is not None:
        return None, ids
    if len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise invalid(
            f"prompt holds {len(p)} prompts; this server completes one prompt per request: "
            "send one request per prompt (n gives several completions of one prompt)",
            "prompt",
            "unsupported_value",
        )
    if len(p) > 1:  # e.g. ["a", 5]: neither token ids nor prompts (it once meant "a")
        raise invalid(
            f"prompt must be a string, a list of token ids (integers) or a list of one of "
            f"those; got a list mixing {', '.join(sorted({type(x).__name__ for x in p}))}",
            "prompt",
        )
    only = p[0]
    if isinstance(only, str):
        return only, None
    if isinstance(only, list):
        ids = _token_ids(only)
        if ids is not None:
            return None, ids
    raise invalid("prompt must be a string or a non-empty list of token ids (integers)", "prompt")


def read_stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise invalid(f"stop holds {len(stop)} sequences; at most {MAX_STOP} are allowed", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise invalid(f"each stop sequence must be at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(s for s in stop if s)


def parse_completion(body: dict[str, Any], extra: dict[str, Any]) -> CompletionRequest:
    """``body`` (a decoded JSON object whose model was checked) as a request; a 400 naming
    the field for what this server cannot do or the caller got wrong."""
    if body.get("suffix") not in (None, ""):
        raise invalid(
            "suffix is not supported: this server does not do insertion (fill-in-the-middle); "
            "send the request without suffix",
            "suffix",
            "unsupported_value",
        )
    logprobs = read_completion_logprobs(body)
    if body.get("logit_bias"):
        raise invalid("logit_bias is not supported", "logit_bias", "unsupported_value")
    n = read_n(body)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise invalid(
            f"best_of is not supported (it must be absent or equal n, {n}), got {best_of!r}",
            "best_of",
            "unsupported_value",
        )
    text, ids = read_prompt(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise invalid(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < MAX_SEED):
        raise invalid(f"seed must be an integer in [0, 2**63), got {seed!r}", "seed")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if options and not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options.include_usage must be true or false", "stream_options")
    guided = guided_constraint(body)
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    if temperature is not None and not 0.0 <= temperature <= 2.0:  # OpenAI's range
        raise invalid(f"temperature must lie in [0, 2], got {temperature}", "temperature")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise invalid(f"top_p must lie in [0, 1], got {top_p}", "top_p")
    return CompletionRequest(
        prompt_text=text,
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=read_stop(body),
        echo=_flag(body, "echo"),
        stream=stream,
        include_usage=include_usage,
        n=n,
        extra=extra,
        logprobs=logprobs,
        constraint=None if guided is None else guided[1],
    )


class TextDecoder:
    """Output ids -> text, released as soon as it is final: an incomplete UTF-8 sequence waits
    for its next token, and text that may begin a stop sequence waits until it cannot. A stop
    sequence ends the text before it (the sequence itself is not returned)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.sent = 0  # characters of text released
        self.stopped = False  # a stop sequence was found

    def push(self, ids: Sequence[int]) -> str:
        """Text newly final after ``ids``; RuntimeError for an id the tokenizer cannot decode."""
        for t in ids:
            try:
                piece = self._stream.step(self._tokenizer, t)
            except Exception as exc:  # the tokenizers binding raises plain Exception
                raise RuntimeError(f"token id {t} does not decode: {exc}") from None
            if piece:
                self.text += piece
        return self._release(final=False)

    def flush(self) -> str:
        """The rest of the text, the output being over."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:
            start = max(0, self.sent - self._longest)
            hits = [p for p in (self.text.find(s, start) for s in self.stop) if p >= 0]
            if hits:
                self.stopped = True
                end = max(self.sent, min(hits))
            elif not final:
                end -= self._held()
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _held(self) -> int:
        """How many trailing characters could begin a stop sequence."""
        for k in range(min(self._longest - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    usage_field: bool,
    logprobs: dict[str, Any] | None = None,
) -> str:
    """One ``text_completion`` stream chunk (``usage: null`` when the stream reports usage)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if usage_field:
        body["usage"] = None
    return json.dumps(body, ensure_ascii=False)


class CompletionJob:
    """One choice of a Completions request on its way through the backend; the same surface as
    :class:`~.events.Job` (``push``, ``finished``, the token counts)."""

    def __init__(
        self,
        index: int,
        rid: str,
        model: str,
        created: int,
        decoder: TextDecoder,
        echo: str | None,
        include_usage: bool,
        logprobs: CompletionLogprobs | None = None,
    ) -> None:
        self.index, self.rid, self.model, self.created = index, rid, model, created
        self.decoder, self.echo, self.include_usage = decoder, echo, include_usage
        self.logprobs = logprobs  # None: the request asked for none
        self.accepted = False  # the backend's Ready came
        self.prompt_tokens = self.cached_tokens = 0
        self.completion_tokens = 0  # every id the backend sent, EOS included
        self.eos_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.parts: list[str] = []

    @property
    def answered_tokens(self) -> int:
        return self.completion_tokens - self.eos_tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def _chunk(
        self, text: str, finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> tuple[str | None, str]:
        self.parts.append(text)
        return None, completion_chunk(
            self.rid,
            self.created,
            self.model,
            self.index,
            text,
            finish_reason,
            self.include_usage,
            logprobs,
        )

    def _decode(self, tokens: generate_pb2.Tokens, eos: Collection[int]) -> str:
        """The text newly final after ``tokens``; each token's logprobs noted with its place."""
        kept = [t for t in tokens.token_ids if t not in eos]
        pairs = None if self.logprobs is None else chunk_logprobs(tokens, eos)
        if self.logprobs is None or pairs is None:
            return self.decoder.push(kept)
        text = ""
        for t, pair in zip(kept, pairs):
            start = len(self.decoder.text)
            text += self.decoder.push([t])
            self.logprobs.add(t, pair, start, len(self.decoder.text))
        return text

    def _released(self, final: bool) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return self.logprobs.release(self.decoder.sent, final, self.decoder.stopped)

    def push(
        self, ev: generate_pb2.GenerateEvent, eos: Collection[int]
    ) -> list[tuple[str | None, str]]:
        """Feed one event; the stream chunks it produced, as (SSE event name, JSON)."""
        kind = ev.WhichOneof("event")
        out: list[tuple[str | None, str]] = []
        if kind == "ready":
            self.accepted = True
            self.prompt_tokens, self.cached_tokens = ev.ready.prompt_tokens, ev.ready.cached_tokens
            if self.echo:
                out.append(self._chunk(self.echo))
            return out
        if kind not in ("tokens", "finish") or self.finished:
            return out
        if not self.accepted:
            raise Internal("tokens arrived before Ready")
        if kind == "tokens":
            ids = list(ev.tokens.token_ids)
            self.completion_tokens += len(ids)
            self.eos_tokens += sum(1 for t in ids if t in eos)
            text = self._decode(ev.tokens, eos)
            logprobs = self._released(final=self.decoder.stopped)
            if text or logprobs:
                out.append(self._chunk(text, logprobs=logprobs))
            if self.decoder.stopped:
                out.append(self._finish("stop"))
            return out
        if ev.finish.reason == "abort":
            raise Unavailable("the backend aborted the request")
        text = self.decoder.flush()
        logprobs = self._released(final=True)
        if text or logprobs:
            out.append(self._chunk(text, logprobs=logprobs))
        stopped = self.decoder.stopped or ev.finish.reason != "length"
        out.append(self._finish("stop" if stopped else "length"))
        return out

    def _finish(self, reason: str) -> tuple[str | None, str]:
        self.finished, self.finish_reason = True, reason
        return self._chunk("", reason)

    def close(self) -> None:
        """Nothing to release (the same surface as Job)."""

    def choice(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "index": self.index,
            "logprobs": None if self.logprobs is None else self.logprobs.body(),
            "finish_reason": self.finish_reason,
        }


def completion_body(
    rid: str, created: int, model: str, jobs: Sequence[CompletionJob], usage: dict[str, Any]
) -> dict[str, Any]:
    """The non-streamed ``text_completion`` object."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [j.choice() for j in jobs],
        "usage": usage,
    }


def completion_usage_chunk(rid: str, created: int, model: str, usage: dict[str, Any]) -> str:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return json.dumps(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [],
            "usage": usage,
        },
        ensure_ascii=False,
    )
