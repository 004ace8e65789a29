"""Structured outputs: a request's :class:`~libs.common.sampling.Constraint` compiled into token
masks over the model's vocabulary (xgrammar), applied by the sampler.

One :class:`GrammarBackend` per engine: the tokenizer's vocabulary as xgrammar reads it (built
once per process and tokenizer, from ``tokenizer.json`` with the ``tokenizers`` library: no
transformers; a service builds it at start-up, before it reports ready), compiled
grammars cached by constraint (a schema is compiled once however many requests use it), and a
matcher per constrained request. The matcher consumes every output token the request already
has (a decode instance continues what prefill began; a retried request what was sent) and each
token the engine commits; before a step, :meth:`GrammarBackend.masks` fills one bitmask row per
constrained sequence, which the sampler applies after penalties and before the draw. A
finished grammar allows only the end-of-sequence tokens, so a constrained request ends by
itself once its output is complete.

Bounded compilation: with a :class:`~.grammar_probe.GrammarBudget` (:meth:`GrammarBackend.limit`;
a service sets it from ``--grammar-compile-seconds`` and ``--grammar-memory-mib``), a
constraint not compiled yet is first compiled in a probe process that is killed past the
budget (:class:`~.grammar_probe.GrammarLimitError`, naming the limit), and only then in this
process. ``EngineLoop.add`` compiles in a worker thread before the engine sees the request, so
the engine thread's :meth:`GrammarBackend.start` finds the grammar in the cache.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from libs.common.sampling import Constraint

from .grammar_compile import Compilers, GrammarError, build_views, reason_of
from .grammar_probe import GrammarBudget, GrammarLimitError, ProbePool, over_memory

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["GrammarBackend", "GrammarBudget", "GrammarError", "GrammarLimitError"]

log = logging.getLogger(__name__)

_CACHE = 128  # compiled grammars kept (least recently used go first)
_CACHE_BYTES = 1 << 30  # and at most this much of them (a 5,000-string enum is ~52 MB)
_VERDICTS = 4096  # constraints the probes judged, remembered by digest


class GrammarBackend:
    """``tokenizer``: the model's tokenizer, or its ``tokenizer.json`` text. The vocabulary
    views it needs (seconds of work, most of it holding the GIL) are built once per process
    for a tokenizer (:func:`vocabulary_views`); a backend over a tokenizer already seen is
    cheap. A service builds its engine's backend before it reports ready
    (:func:`libs.serving.engines.warm_grammar`), so no request waits for it."""

    def __init__(
        self,
        tokenizer: str | Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        threads: int = 2,
    ) -> None:
        self._compilers = Compilers(
            vocabulary_views(tokenizer, vocab_size, stop_token_ids), threads
        )
        self._xgr = self._compilers.xgr
        self.vocab_size = vocab_size
        self._source = (tokenizer, tuple(int(t) for t in stop_token_ids))  # for the probes
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._compiled_bytes = 0
        self._lock = threading.Lock()  # compile() may run off the engine thread (validation)
        self._matchers: dict[str, Any] = {}
        self.budget: GrammarBudget | None = None
        self._probes: ProbePool | None = None
        # digest of (kind, spec) -> the refusal ("" : fits), so a schema is judged once
        self._verdicts: OrderedDict[bytes, tuple[type[GrammarError], str]] = OrderedDict()

    def limit(self, budget: GrammarBudget | None, *, warm: bool = False) -> None:
        """Bound every compile from now on (None: unbounded, the library's default); ``warm``
        starts a probe process now rather than at the first new constraint. Grammars already
        compiled stay cached."""
        tokenizer, stops = self._source
        probes = None
        if budget is not None:
            text = tokenizer if isinstance(tokenizer, str) else tokenizer.to_str()
            probes = ProbePool(text, self.vocab_size, stops, budget)
            if warm:
                probes.warm()
        with self._lock:
            old, self._probes, self.budget = self._probes, probes, budget
            self._verdicts.clear()
        if old is not None:
            old.close()

    def close(self) -> None:
        """Stop the probe processes (they also end when this process does)."""
        self.limit(None)

    # -- compile --------------------------------------------------------------------------------
    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of ``c`` (cached); raises :class:`GrammarError` with the
        library's reason when it does not compile, :class:`GrammarLimitError` naming the limit
        when it does not within the budget (:meth:`limit`). Blocks for as long as compiling
        takes: call it off the engine thread for a constraint that may be new."""
        with self._lock:
            hit = self._compiled.get(c)
            if hit is not None:
                self._compiled.move_to_end(c)
                return hit
            budget, probes = self.budget, self._probes
        if probes is not None and c.kind != "json":  # "json": our own fixed schema
            self._vet(c, probes)
        try:
            compiled = self._compilers.compile(c.kind, c.spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise GrammarError(
                f"constraint of kind {c.kind!r} does not compile: {reason_of(exc)}"
            ) from None
        size = int(compiled.memory_size_bytes)
        if budget is not None and size > budget.memory_bytes:  # the probe said so already
            raise over_memory(c.kind, budget, size)
        with self._lock:
            if c not in self._compiled:
                self._compiled[c] = compiled
                self._compiled_bytes += size
            while len(self._compiled) > 1 and (
                len(self._compiled) > _CACHE or self._compiled_bytes > _CACHE_BYTES
            ):
                _, old = self._compiled.popitem(last=False)
                self._compiled_bytes -= int(old.memory_size_bytes)
        return compiled

    def _vet(self, c: Constraint, probes: ProbePool) -> None:
        """Compile ``c`` in a probe under the budget first; raise its refusal (remembered, so
        the same schema again is refused at once and one that fitted is not probed again)."""
        key = hashlib.sha256(f"{c.kind}\0{c.spec}".encode()).digest()
        with self._lock:
            verdict = self._verdicts.get(key)
        if verdict is None:
            try:
                probes.check(c.kind, c.spec)
                verdict = (GrammarError, "")
            except GrammarError as exc:  # GrammarLimitError included
                verdict = (type(exc), str(exc))
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > _VERDICTS:
                    self._verdicts.popitem(last=False)
        kind, message = verdict
        if message:
            raise kind(message)

    # -- requests -------------------------------------------------------------------------------
    def start(self, request_id: str, c: Constraint, outputs: Sequence[int]) -> None:
        """A matcher for the request, past the output tokens it already has."""
        matcher = self._xgr.GrammarMatcher(self.compile(c))
        for i, tok in enumerate(outputs):
            if not matcher.accept_token(int(tok)):
                raise GrammarError(
                    f"output token {i} ({tok}) already generated does not follow the constraint"
                )
        self._matchers[request_id] = matcher

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def accept(self, request_id: str, token: int) -> None:
        m = self._matchers.get(request_id)
        if m is not None and not m.is_terminated() and not m.accept_token(int(token)):
            # Cannot happen through the mask (a bug, or a token the sampler forced): say so
            # once; the request goes on unconstrained rather than failing.
            log.warning(
                "request %s: token %d breaks its constraint; constraint dropped", request_id, token
            )
            del self._matchers[request_id]

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def draft_masks(self, request_id: str, drafts: Sequence[int]) -> tuple[int, torch.Tensor]:
        """For verifying ``drafts`` of a constrained request (speculative decoding): how many
        of them, from the first, the constraint allows (a draft that would end it -- its stop
        token -- is not taken: the verification row after it would allow nothing), and one
        bitmask row for each verification row: row ``i`` the tokens allowed after the first
        ``i`` drafts. The matcher is left where it was."""
        m = self._matchers[request_id]
        bitmask = self._xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        taken = 0
        for i in range(len(drafts) + 1):
            if m.is_terminated():
                bitmask[i].zero_()
            else:
                m.fill_next_token_bitmask(bitmask, i)
            if i == len(drafts) or m.is_terminated() or not m.accept_token(int(drafts[i])):
                break
            taken += 1
            if m.is_terminated():  # the draft ends the output: verify up to it, not past
                taken -= 1
                m.rollback(1)
                break
        if taken:
            m.rollback(taken)
        return taken, bitmask[: taken + 1]

    def masks(self, request_ids: Sequence[str | None]) -> tuple[list[int], torch.Tensor] | None:
        """For a step's sampling rows (None: not constrained): the constrained rows and an
        int32 bitmask with one row per sampling row (xgrammar's layout); None if none is."""
        rows = [i for i, rid in enumerate(request_ids) if rid is not None and rid in self._matchers]
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        for i in rows:
            m = self._matchers[request_ids[i]]  # type: ignore[index]
            if m.is_terminated():  # complete and ended: only what ends it (no token follows)
                bitmask[i].zero_()
                continue
            m.fill_next_token_bitmask(bitmask, i)
        return rows, bitmask


# (tokenizer key, vocab size, stop ids) -> (the tokenizer object kept alive, its two views)
_VIEWS: OrderedDict[tuple[Any, int, tuple[int, ...]], tuple[Any, tuple[Any, Any]]] = OrderedDict()
_VIEWS_KEPT = 4
_VIEWS_LOCK = threading.Lock()


def vocabulary_views(
    tokenizer: str | Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
) -> tuple[Any, Any]:
    """xgrammar's two views of the vocabulary (``TokenizerInfo``: plain, markup), built once
    per process for a tokenizer -- the same :class:`Tokenizer` object (``load_tokenizer``
    caches one per source) or the same ``tokenizer.json`` text -- and shared by every backend
    over it (they are read-only). Building them reads all 129K tokens in Python and in
    xgrammar, holding the GIL for most of ~1-4 s: a service does it before it reports ready.
    """
    # A Tokenizer by identity (kept alive in the entry, so its id is not reused meanwhile);
    # the JSON text by value.
    ident: Any = tokenizer if isinstance(tokenizer, str) else id(tokenizer)
    key = (ident, vocab_size, tuple(int(t) for t in stop_token_ids))
    with _VIEWS_LOCK:  # held while building: a second engine waits for the first's views
        hit = _VIEWS.get(key)
        if hit is not None and (isinstance(tokenizer, str) or hit[0] is tokenizer):
            _VIEWS.move_to_end(key)
            return hit[1]
        views = build_views(tokenizer, vocab_size, key[2])
        _VIEWS[key] = (tokenizer, views)
        while len(_VIEWS) > _VIEWS_KEPT:
            _VIEWS.popitem(last=False)
        return views


def apply_masks(logits: torch.Tensor, masks: tuple[list[int], torch.Tensor]) -> None:
    """Forbidden tokens of the constrained rows to -inf, in place (``logits`` fp32 [rows, V])."""
    import xgrammar as xgr

    rows, bitmask = masks
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=rows
    )
