"""A request's way into an :class:`~libs.engine.engine.Engine`, and what it says of itself once
inside.

:func:`check_request` refuses a request as given -- its id, tokens, context length, stop ids,
the outputs it says it already has -- with :class:`InvalidRequest`, the one recoverable error a
caller fixes by changing the request (the services map it to a 400 / INVALID_ARGUMENT).
:class:`Intake` admits a checked request: its offered drafts checked, its constraint started,
its KV imported through the engine's :class:`~.kv_port.KVPort`, queued in the scheduler; and it
counts the prefix cache's lookups. :func:`request_info` is the view of a request the services
report.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from libs.common.errors import InvalidArgument
from libs.common.sampling import SamplingParams

from .grammar import GrammarBackend, GrammarError
from .kv.transfer import PeerKV
from .kv_port import KVInput, KVPort, PreparedKV
from .scheduler import Request, Scheduler, Status, StepPlan

if TYPE_CHECKING:
    from .speculative import SpecDecoder


class InvalidRequest(InvalidArgument):
    """A request the engine refuses as given (recoverable by fixing the request)."""


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    finished: bool
    finish_reason: str | None
    num_preemptions: int


def check_request(
    request_id: str,
    tokens: Sequence[int],
    params: SamplingParams,
    prior_outputs: int,
    *,
    in_use: Container[str],
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raise :class:`InvalidRequest` unless the request can be queued: a fresh non-empty id
    (not in ``in_use``), a non-empty prompt of ids in the vocabulary and shorter than the
    context limit, stop ids in the vocabulary, and ``prior_outputs`` (the prompt's last tokens
    generated already) in ``[0, len(tokens))``."""
    if not request_id:
        raise InvalidRequest("request_id must be a non-empty string")
    if request_id in in_use:
        raise InvalidRequest(f"request_id {request_id!r} is already in use")
    if not tokens:
        raise InvalidRequest("prompt_token_ids must not be empty")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt_token_ids holds {bad}, outside the vocabulary [0, {vocab_size})"
        )
    if len(tokens) >= max_model_len:
        raise InvalidRequest(
            f"prompt has {len(tokens)} tokens; the context limit is {max_model_len}"
        )
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must lie in [0, {vocab_size})")
    if not 0 <= prior_outputs < len(tokens):
        raise InvalidRequest(f"prior_outputs must lie in [0, {len(tokens)}), got {prior_outputs}")


def warmup_prompts(lengths: Sequence[int], max_model_len: int, vocab_size: int) -> list[list[int]]:
    """Throwaway prompts of these lengths (cut to fit the context), of ids past the first three
    (a preset's special tokens), for :meth:`Engine.warm_up`."""
    limit = max_model_len - 2
    return [[(i * 7919 + n) % (vocab_size - 3) + 3 for i in range(min(n, limit))] for n in lengths]


def warmup_batches(
    prompts: list[list[int]], block_size: int, num_free: Callable[[], int]
) -> Iterator[list[tuple[str, list[int]]]]:
    """The warm-up's batches of (request id, prompt): all prompts together, then each alone,
    then each continued by the next one's tokens (a follow-up turn: prompt chunks over a cached
    prefix, what most served steps are), each batch cut to the prompts that fit the blocks
    free when it is taken."""
    numbered = [(f"__warmup-{i}", p) for i, p in enumerate(prompts)]
    turns = [
        (f"__warmup-{i}-turn", p + prompts[(i + 1) % len(prompts)]) for i, p in enumerate(prompts)
    ]
    for batch in (numbered, *([one] for one in numbered), turns):
        yield [(rid, p) for rid, p in batch if -(-len(p) // block_size) + 1 < num_free()]


def request_info(req: Request) -> RequestInfo:
    return RequestInfo(
        req.request_id,
        tuple(req.token_ids),
        req.num_prompt_tokens,
        req.num_cached_tokens,
        req.num_computed,
        req.status is Status.FINISHED,
        req.finish_reason,
        req.num_preemptions,
    )


class Intake:
    """Requests into an engine (module doc). ``grammar`` builds (once) and returns the engine's
    structured-output backend; ``built_grammar`` returns it only if it was built.

    The prefix cache is counted in prompt tokens, once per request, when its prompt is first
    looked up in this engine's own cache (first admission, or a KV import's local hits); what
    was imported from elsewhere is not a hit. Engine thread only."""

    def __init__(
        self,
        scheduler: Scheduler,
        port: KVPort,
        vocab_size: int,
        grammar: Callable[[], GrammarBackend],
        built_grammar: Callable[[], GrammarBackend | None],
        speculative: SpecDecoder | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.port = port
        self.vocab_size = vocab_size
        self._grammar = grammar
        self._built_grammar = built_grammar
        self.speculative = speculative
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._unqueried: set[str] = set()  # added without KV, not yet admitted

    def add(
        self,
        request_id: str,
        tokens: list[int],
        params: SamplingParams,
        cache_salt: bytes,
        kv: KVInput | None,
        hold_kv: bool,
        prior_outputs: int,
        drafts: tuple[Sequence[int], Sequence[float]] | None,
        weight: float = 1.0,
    ) -> Any:
        """Queue a request. ``kv``: frames from :meth:`Engine.export_kv` covering a prefix of
        the tokens (or blocks ``first_block ..`` of it when this engine holds the blocks before),
        the same already :meth:`KVPort.prepare`-d, or a :class:`PeerKV`.

        Returns an event (None when there is nothing to wait for) that completes once a
        :class:`PeerKV` source has been copied; its owner may reuse the blocks after it.
        Raises :class:`InvalidRequest` for bad input, :class:`KVFormatError` for KV that does
        not belong to this model or these tokens (:class:`MissingPrefix` when the blocks it
        builds on are gone), :class:`NoFreeBlocks` if imported KV does not fit now.
        ``prior_outputs``: how many of the last prompt tokens were generated already (the
        first token, for a decode after prefill): the penalties count them as output.
        ``drafts``: (token ids, confidences) another engine drafted for the request's next
        step (:meth:`take_drafts`); verified here when this engine speculates, else unused.
        """
        check_request(
            request_id,
            tokens,
            params,
            prior_outputs,
            in_use=self.scheduler.requests,
            vocab_size=self.vocab_size,
            max_model_len=self.scheduler.config.max_model_len,
        )
        offered = None
        if drafts is not None and self.speculative is not None:
            try:
                offered = self.speculative.checked(*drafts)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        if not (weight > 0 and math.isfinite(weight)):
            raise InvalidRequest(f"a tenant's weight must be a positive number, got {weight}")
        req = Request(request_id, tokens, len(tokens), params, cache_salt, hold_kv)
        req.weight = weight
        req.num_prior_outputs = prior_outputs
        if params.constraint is not None:
            try:  # compiled (cached) and advanced past the outputs the request already has
                self._grammar().start(
                    request_id, params.constraint, tokens[len(tokens) - prior_outputs :]
                )
            except GrammarError as exc:
                raise InvalidRequest(str(exc)) from None
        done, local_hits = None, 0
        if kv is not None:
            if not isinstance(kv, (PreparedKV, PeerKV)):
                kv = self.port.prepare(
                    [kv] if isinstance(kv, (bytes, bytearray, memoryview)) else list(kv)
                )
            try:
                done, local_hits = self.port.import_into(req, kv)
            except BaseException:
                self._forget_grammar(request_id)
                raise
        try:
            self.scheduler.add(req)
        except ValueError as exc:
            self.port.blocks.release(req.blocks)
            self._forget_grammar(request_id)
            raise InvalidRequest(str(exc)) from None
        if offered is not None and offered[0]:
            assert self.speculative is not None
            self.speculative.drafts[request_id] = offered  # verified by its first step
        if kv is None:
            self._unqueried.add(request_id)  # looked up when first scheduled (count_lookups)
        else:
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += min(local_hits, req.num_prompt_tokens)
        return done

    def _forget_grammar(self, request_id: str) -> None:
        g = self._built_grammar()
        if g is not None:
            g.drop(request_id)

    def count_lookups(self, plan: StepPlan) -> None:
        """Requests admitted for the first time in ``plan`` had their prompt looked up in the
        prefix cache (:meth:`Scheduler._admit_prefix` set ``num_cached_tokens``)."""
        if not self._unqueried:
            return
        for seq in plan.seqs:
            if seq.request_id in self._unqueried:
                self._unqueried.discard(seq.request_id)
                req = self.scheduler.requests[seq.request_id]
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += req.num_cached_tokens

    def forget(self, request_id: str) -> None:
        """The request is aborted: not looked up, its constraint and drafts dropped."""
        self._unqueried.discard(request_id)
        self._forget_grammar(request_id)
        if self.speculative is not None:
            self.speculative.forget(request_id)

    def take_drafts(self, request_id: str) -> tuple[list[int], list[float]] | None:
        """The drafts made for a held request's next step (speculative decoding), for the
        engine it is handed to (``add_request(drafts=...)``); None when there are none."""
        if self.speculative is None:
            return None
        return self.speculative.drafts.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """Free a finished request kept with ``hold_kv``."""
        if self.speculative is not None:
            self.speculative.drafts.pop(request_id, None)
        req = self.scheduler.requests.get(request_id)
        if req is not None and req.status is Status.FINISHED:
            self.scheduler.free(req)

    def reset_counts(self) -> None:
        self.prefix_cache_queries = self.prefix_cache_hits = 0
