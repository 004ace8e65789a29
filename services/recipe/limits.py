"""A prompt too long for the context, refused before it is tokenized (no I/O).

Tokenizing costs time and memory in proportion to the text (a 31 MiB prompt took 88 s and
4.7 GB before its 400), yet the answer is known at once for most such prompts: no token of a
vocabulary spells more than its longest entry, so a text of ``n`` characters is at least
``ceil(n / longest)`` tokens. :func:`chars_per_token_bound` reads that bound off the tokenizer
itself -- 128 for the bundled DeepSeek vocabulary (runs of 128 spaces or dots; ordinary text
averages ~4, single bytes, emoji and CJK 1 or less) -- so :func:`check_fits` never refuses a
prompt that would fit.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer

from .api import APIError

# Normalizers that never make a text shorter than 1/4 of its characters: decomposition only
# grows it; composition (NFC/NFKC) folds at most 4 code points into one (the longest canonical
# decomposition is 4, e.g. U+1F82); lowercasing and prepending do not shrink. Any other
# normalizer (Replace, Strip, BertNormalizer's control-character removal...) can drop text
# without bound, and then there is no bound: such a tokenizer's prompts are always tokenized.
_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 4, "NFKC": 4}


def _shrink_factor(normalizer: Any) -> int | None:
    if not normalizer:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", []):
            f = _shrink_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    return _SHRINK.get(str(kind))


def chars_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """The most characters of input one token of ``tokenizer`` can stand for, or None when the
    tokenizer's normalizer can shrink text without bound.

    A vocabulary entry's length is at least the characters it stands for: byte-level entries
    spell one symbol per byte (a character is 1 to 4 bytes), ``##`` and ``▁`` markers and
    ``<0xE4>`` byte fallbacks only add symbols.
    """
    spec = json.loads(tokenizer.to_str())
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None:
        return None
    longest = max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))
    return max(1, longest) * factor


def check_fits(
    chars: int, bound: int | None, max_context: int | None, param: str = "messages"
) -> None:
    """APIError 400 when a prompt of ``chars`` characters is surely more than ``max_context``
    tokens; silent when it might fit (the entrypoint and the library count exactly later)."""
    if bound is None or max_context is None:
        return
    at_least = math.ceil(chars / bound)
    if at_least > max_context:
        raise APIError(
            400,
            f"the prompt is {chars} characters, so at least {at_least} tokens (a token of this "
            f"model spells at most {bound} characters); this server's context limit "
            f"(--max-context) is {max_context} tokens",
            param=param,
            code="context_length_exceeded",
        )


def too_many_tokens(tokens: int, max_context: int | None, param: str = "messages") -> APIError:
    """The 400 for a prompt found, while tokenizing, to be more than ``max_context`` tokens
    (tokenizing stopped there: ``tokens`` is a lower bound)."""
    return APIError(
        400,
        f"the prompt is more than {tokens} tokens; this server's context limit "
        f"(--max-context) is {max_context} tokens",
        param=param,
        code="context_length_exceeded",
    )


def untokenizable(param: str = "messages") -> APIError:
    """The 400 for a prompt the tokenizer gave up on (a panic in its regex engine)."""
    return APIError(
        400,
        "the tokenizer cannot split this prompt: it holds a run of millions of repeated "
        "characters (such as whitespace) past its regex engine's backtracking limit; shorten it",
        param=param,
        code="invalid_prompt",
    )
