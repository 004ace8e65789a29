"""Compiling a :class:`~libs.common.sampling.Constraint` with xgrammar, shared by the engine's
:class:`~libs.engine.grammar.GrammarBackend` and the probe process that times a compile before
the engine runs it (``grammar_probe.py``): the vocabulary views and the one mapping from a
constraint's kind to xgrammar's compile call. Nothing here imports torch itself (xgrammar does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class GrammarError(ValueError):
    """The constraint does not compile (a bad schema, regex or grammar), or not within the
    limits of this deployment (:class:`~libs.engine.grammar_probe.GrammarLimitError`)."""


def build_views(
    tokenizer: str | Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
) -> tuple[Any, Any]:
    """xgrammar's two views of the vocabulary (``TokenizerInfo``: plain, markup)."""
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
            stop_token_ids=[int(t) for t in stop_token_ids],
            add_prefix_space=meta["add_prefix_space"],
        )

    return info(plain), info(markup)


class Compilers:
    """xgrammar's compilers over the two views. Their own caches are off: the backend keeps
    its compiled grammars in one bounded cache (an unbounded compiler cache would keep every
    distinct schema a client ever sent)."""

    def __init__(self, views: tuple[Any, Any], threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        plain, markup = views
        self.plain = xgr.GrammarCompiler(plain, max_threads=threads, cache_enabled=False)
        self.markup = xgr.GrammarCompiler(markup, max_threads=threads, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar; raises what xgrammar raises (RuntimeError, ValueError...)."""
        xgr = self.xgr
        comp = self.markup if kind in ("ebnf", "tool_call") else self.plain
        if kind == "json_schema":
            return comp.compile_json_schema(spec, any_whitespace=False)
        if kind == "json":
            return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return comp.compile_regex(spec)
        if kind == "ebnf":
            return comp.compile_grammar(spec)
        # tool_call: one tool's begin text, its JSON arguments, its end text.
        tools = json.loads(spec)["tools"]
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


def reason_of(exc: BaseException) -> str:
    """The last line of xgrammar's message (its first lines are a C++ trace)."""
    return str(exc).splitlines()[-1] if str(exc) else type(exc).__name__


def _literal(xgr: Any, text: str) -> Any:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}" if text else 'root ::= ""')
