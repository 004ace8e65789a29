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
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from libs.common.sampling import Constraint

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

_CACHE = 128  # compiled grammars kept (least recently used go first)


class GrammarError(ValueError):
    """The constraint does not compile (a bad schema, regex or grammar)."""


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
        import xgrammar as xgr  # the engine's processes only; imported when a request needs it

        plain, markup = vocabulary_views(tokenizer, vocab_size, stop_token_ids)
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(plain, max_threads=threads)
        self.markup_compiler = xgr.GrammarCompiler(markup, max_threads=threads)
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()  # compile() may run off the engine thread (validation)
        self._matchers: dict[str, Any] = {}

    # -- compile --------------------------------------------------------------------------------
    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of ``c`` (cached); raises :class:`GrammarError` with the
        library's reason when it does not compile."""
        with self._lock:
            hit = self._compiled.get(c)
            if hit is not None:
                self._compiled.move_to_end(c)
                return hit
        try:
            compiled = self._compile(c)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).splitlines()[-1] if str(exc) else type(exc).__name__
            raise GrammarError(
                f"constraint of kind {c.kind!r} does not compile: {reason}"
            ) from None
        with self._lock:
            self._compiled[c] = compiled
            while len(self._compiled) > _CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint) -> Any:
        xgr = self._xgr
        comp = self.markup_compiler if c.kind in ("ebnf", "tool_call") else self.compiler
        if c.kind == "json_schema":
            return comp.compile_json_schema(c.spec, any_whitespace=False)
        if c.kind == "json":
            return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        if c.kind == "ebnf":
            return comp.compile_grammar(c.spec)
        # tool_call: one tool's begin text, its JSON arguments, its end text.
        tools = json.loads(c.spec)["tools"]
        options = [
            xgr.Grammar.concat(
                _literal(xgr, t.get("begin", "")),
                xgr.Grammar.from_json_schema(json.dumps(t.get("schema", {})), any_whitespace=False),
                _literal(xgr, t.get("end", "")),
            )
            for t in tools
        ]
        grammar = options[0] if len(options) == 1 else xgr.Grammar.union(*options)
        return comp.compile_grammar(grammar)

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
        views = _build_views(tokenizer, vocab_size, key[2])
        _VIEWS[key] = (tokenizer, views)
        while len(_VIEWS) > _VIEWS_KEPT:
            _VIEWS.popitem(last=False)
        return views


def _build_views(
    tokenizer: str | Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> tuple[Any, Any]:
    import xgrammar as xgr
    from tokenizers import Tokenizer

    if isinstance(tokenizer, str):
        tokenizer_json, tok = tokenizer, Tokenizer.from_str(tokenizer)
    else:
        tokenizer_json, tok = tokenizer.to_str(), tokenizer
    plain = [""] * vocab_size
    markup = [""] * vocab_size
    # Two views of the vocabulary. JSON, JSON-schema and regex constraints see added tokens
    # (control and chat markup: BOS, placeholders, thinking and tool tags) as empty, which
    # xgrammar never matches: such an output holds plain text only (a JSON string could
    # otherwise contain a control token). EBNF and tool-call constraints see them by their
    # text, so a grammar can require chat markup (a DSML tool call) as the single tokens
    # the model emits; their literals decide where. The stop tokens end either.
    added = tok.get_added_tokens_decoder()
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            markup[i] = added[i].content if i in added else text
            plain[i] = "" if i in added else text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)

    def info(encoded: list[str]) -> Any:
        return xgr.TokenizerInfo(
            encoded,
            vocab_type=meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=meta["add_prefix_space"],
        )

    return info(plain), info(markup)


def _literal(xgr: Any, text: str) -> Any:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}" if text else 'root ::= ""')


def apply_masks(logits: torch.Tensor, masks: tuple[list[int], torch.Tensor]) -> None:
    """Forbidden tokens of the constrained rows to -inf, in place (``logits`` fp32 [rows, V])."""
    import xgrammar as xgr

    rows, bitmask = masks
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=rows
    )
