"""Entrypoint policy: request validation and the ordered token stream. No I/O.

:func:`validate_request` turns a ``GenerateRequest`` into a :class:`ValidRequest` (its sampling
settings a :class:`~libs.common.sampling.SamplingParams`, checked once on creation) or raises
:class:`~libs.common.errors.InvalidArgument` naming the offending field, or
:class:`~libs.common.errors.NotFound` for a model not served here (mapped to a gRPC status at
the service edge). :class:`TokenReorderBuffer` puts token events back in output order: the first
token comes from the prefill instance and the rest from a decode instance, over different
NATS connections, so index 1 can overtake index 0. :class:`RequestStream` turns the ordered
events into what the client sees: Ready once, Tokens, Finish once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from libs.common.errors import InvalidArgument, NotFound
from libs.common.sampling import SamplingParams, TokenLogprob
from libs.proto.deepserve.v1 import common_pb2, generate_pb2

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # becomes part of a NATS subject
MAX_TENANT_BYTES = 256


@dataclass(frozen=True)
class Limits:
    model_name: str = "deepseek-tiny"
    vocab_size: int = 129280
    max_context: int = 163840  # prompt + completion tokens
    block_size: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_context", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")


@dataclass(frozen=True)
class ValidRequest:
    request_id: str  # "" = the entrypoint assigns one
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    model: str
    tenant: str
    traffic_class: int


def _check_ids(name: str, ids: Sequence[int], vocab: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InvalidArgument(
                f"token id {t} is outside the vocabulary [0, {vocab})", field=f"{name}[{i}]"
            )


def _sampling(msg: common_pb2.SamplingParams, prompt_len: int, limits: Limits) -> SamplingParams:
    """The request's SamplingParams (whose own checks run on creation), then the checks that
    need this deployment's limits."""
    sampling = SamplingParams.from_proto(msg)
    room = limits.max_context - prompt_len
    if sampling.max_tokens > room:
        raise InvalidArgument(
            f"prompt ({prompt_len} tokens) + max_tokens "
            f"({sampling.max_tokens}) exceeds the context limit of {limits.max_context}; "
            f"at most {room} here",
            field="sampling.max_tokens",
        )
    _check_ids("sampling.stop_token_ids", sampling.stop_token_ids, limits.vocab_size)
    return sampling


def validate_request(req: generate_pb2.GenerateRequest, limits: Limits) -> ValidRequest:
    """A checked copy of ``req``; InvalidArgument (naming the field) or NotFound otherwise."""
    if req.request_id and not REQUEST_ID_RE.match(req.request_id):
        raise InvalidArgument(
            "must be 1-128 characters of A-Z a-z 0-9 _ - "
            f"(or empty to get one assigned), got {req.request_id[:64]!r}",
            field="request_id",
        )
    model = req.model or limits.model_name
    if model != limits.model_name:
        raise NotFound(f"model {req.model!r} is not served here; available: {limits.model_name!r}")
    if len(req.tenant.encode()) > MAX_TENANT_BYTES:
        raise InvalidArgument(f"must be at most {MAX_TENANT_BYTES} bytes", field="tenant")
    known = common_pb2.TrafficClass.values()
    if int(req.traffic_class) not in known:
        # proto3 keeps an unknown enum number as it came; it would reach the kvstore's TTL
        names = ", ".join(f"{n} ({common_pb2.TrafficClass.Name(n)})" for n in sorted(known))
        raise InvalidArgument(
            f"unknown traffic class {int(req.traffic_class)}; one of {names}",
            field="traffic_class",
        )
    prompt = tuple(req.prompt_token_ids)
    if not prompt:
        raise InvalidArgument("must not be empty", field="prompt_token_ids")
    _check_ids("prompt_token_ids", prompt, limits.vocab_size)
    if len(prompt) >= limits.max_context:
        raise InvalidArgument(
            f"has {len(prompt)} tokens; the context limit "
            f"is {limits.max_context} (prompt + completion)",
            field="prompt_token_ids",
        )
    return ValidRequest(
        request_id=req.request_id,
        prompt_token_ids=prompt,
        sampling=_sampling(req.sampling, len(prompt), limits),
        model=model,
        tenant=req.tenant,
        traffic_class=int(req.traffic_class),
    )


def lookup_prefix(prompt_len: int, block_size: int) -> int:
    """Tokens whose blocks may come from the cache: full blocks inside ``prompt[:-1]``.

    The last prompt token is always computed (its logits give the first output token), so a
    prompt of exactly 2 blocks looks up only 1.
    """
    return ((prompt_len - 1) // block_size) * block_size


# -- token stream -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One token event: ``token_ids`` start at output position ``index``."""

    index: int
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # One per token when the request asked for logprobs (else empty); sliced with token_ids.
    logprobs: tuple[TokenLogprob, ...] = ()
    # A finishing event's speculative decoding counts (drafted, verified, accepted); () none.
    speculative: tuple[int, ...] = ()


class ReorderOverflow(RuntimeError):
    """Too many events wait for a gap that never fills (a lost event)."""


@dataclass
class TokenReorderBuffer:
    """Releases chunks in output order, each exactly once.

    A chunk whose ``index`` is the next position is released, along with any held chunks it
    unblocks; a later one is held; tokens already released (a duplicate or an overlap) are
    cut off. An empty chunk (say, a bare finish) is released once its position is reached.
    Nothing is released after a finished chunk.
    """

    max_pending: int = 4096
    next_index: int = 0
    finished: bool = False
    _held: dict[int, list[Chunk]] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return sum(len(v) for v in self._held.values())

    def missing(self, end: int) -> int:
        """Positions in ``[next_index, end)`` neither released nor held (lost, or late)."""
        held = {
            c.index + i for cs in self._held.values() for c in cs for i in range(len(c.token_ids))
        }
        return sum(1 for i in range(self.next_index, end) if i not in held)

    def push(self, chunk: Chunk) -> list[Chunk]:
        if self.finished:
            return []
        if chunk.index > self.next_index:
            if self.pending >= self.max_pending:
                raise ReorderOverflow(
                    f"{self.pending} token events wait for position "
                    f"{self.next_index}, which never arrived"
                )
            self._held.setdefault(chunk.index, []).append(chunk)
            return []
        out: list[Chunk] = []
        self._release(chunk, out)
        while not self.finished:  # release what the new position unblocks, lowest first
            reached = [i for i in self._held if i <= self.next_index]
            if not reached:
                break
            for held in self._held.pop(min(reached)):
                self._release(held, out)
        return out

    def _release(self, chunk: Chunk, out: list[Chunk]) -> None:
        if self.finished:
            return
        skip = self.next_index - chunk.index  # >= 0: already released tokens
        if skip >= len(chunk.token_ids) and chunk.token_ids and not chunk.finished:
            return  # a pure duplicate
        skip = min(skip, len(chunk.token_ids))
        fresh = chunk.token_ids[skip:]
        trimmed = Chunk(
            self.next_index,
            fresh,
            chunk.finished,
            chunk.finish_reason,
            chunk.prompt_tokens,
            chunk.cached_tokens,
            chunk.logprobs[skip:],
            chunk.speculative,
        )
        self.next_index += len(fresh)
        self.finished = chunk.finished
        out.append(trimmed)


@dataclass(frozen=True)
class Ready:
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked


@dataclass(frozen=True)
class Finish:
    reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    speculative: tuple[int, ...] = ()  # (drafted, verified, accepted) where decode speculated


Output = Ready | Tokens | Finish


def joined(outputs: list[Output]) -> list[Output]:
    """``outputs`` with each run of adjacent :class:`Tokens` made one (tokens and logprobs in
    order): what was released together is sent together."""
    out: list[Output] = []
    for o in outputs:
        last = out[-1] if out else None
        if isinstance(o, Tokens) and isinstance(last, Tokens):
            out[-1] = Tokens(last.token_ids + o.token_ids, last.logprobs + o.logprobs)
        else:
            out.append(o)
    return out


@dataclass
class RequestStream:
    """What the client sees, from token events in any order: Ready, Tokens..., Finish.

    Ready carries the prompt/cached counts of the first event in order (the prefill
    instance's). At most ``max_tokens`` tokens go out: a stray extra token from an instance
    ends the stream with "length" and sets ``truncated`` (the caller then aborts upstream).
    """

    prompt_tokens: int
    max_tokens: int
    buffer: TokenReorderBuffer = field(default_factory=TokenReorderBuffer)
    cached_tokens: int = 0
    completion_tokens: int = 0
    ready_sent: bool = False
    done: bool = False
    truncated: bool = False

    def push(self, chunk: Chunk) -> list[Output]:
        out: list[Output] = []
        for c in self.buffer.push(chunk):
            if self.done:
                break
            if not self.ready_sent:
                self.prompt_tokens = c.prompt_tokens or self.prompt_tokens
                self.cached_tokens = c.cached_tokens
                self.ready_sent = True
                out.append(Ready(self.prompt_tokens, self.cached_tokens))
            room = self.max_tokens - self.completion_tokens
            ids = c.token_ids[:room]
            if ids:
                self.completion_tokens += len(ids)
                out.append(Tokens(ids, c.logprobs[:room]))
            reason = c.finish_reason or "stop"
            if len(c.token_ids) > room or (
                self.completion_tokens >= self.max_tokens and not c.finished
            ):
                self.truncated, reason = True, "length"
            if c.finished or self.truncated:
                self.done = True
                out.append(
                    Finish(
                        reason,
                        self.prompt_tokens,
                        self.cached_tokens,
                        self.completion_tokens,
                        c.speculative,
                    )
                )
        return out
