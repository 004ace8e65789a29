"""Long plain text -> bounded pieces whose token ids, joined, are exactly the whole text's; the
pieces encoded in bounded batches that release the GIL (no I/O).

Why: ``Tokenizer.encode`` holds the GIL for the whole call (offsets included, ~2.5 us a
character here: a 64,000-character text held it 50 ms, a 17 MB one 16 s, freezing the event
loop and ``/healthz``), and one call on a 17 MB text peaked at 2.4 GB. ``encode_batch_fast``
releases the GIL while it works; the GIL is then held only to turn each result into a Python
list, which is short for a bounded piece. Bounded pieces also bound the memory of one call, and
let a prompt that is already past the context limit stop being tokenized.

Where a text may be cut. The DeepSeek tokenizer has no normalizer; its pre-tokenizer is three
``Isolated`` regex splits applied in turn (``\\p{N}{1,3}``, then runs of
``[\\u4e00-\\u9fa5\\u3040-\\u309f\\u30a0-\\u30ff]``, then a GPT-style word regex whose only
lookaround is ``\\s+(?!\\S)``), then byte-level mapping; BPE never merges across the pieces.
Cutting at position ``p`` (characters ``L`` before, ``R`` after) gives the same pieces when:

- ``R`` is a space and ``L`` is not whitespace: no alternative of the word regex holds a
  non-space followed by a space, and the left part does not end in whitespace, the one place
  where the end of the text could change a match (the lookahead);
- ``L`` is an ASCII letter and ``R`` any other ASCII character: every alternative that holds a
  letter ends at the first character that is neither letter nor mark;
- one of ``L``, ``R`` is an ASCII digit and the other an ASCII non-digit: a digit run begins or
  ends there, so the three-digit groups of the first split are the same;
- exactly one of ``L``, ``R`` is in the second split's class: its run begins or ends there.

The character classes above are plain ranges, so no Unicode table version matters. A text with
no such position in long stretches (a run of one letter, of spaces, of CJK ideographs: one
pre-token, which BPE cannot cut) is encoded as one piece, still without the GIL.
:func:`splittable` admits only a tokenizer whose normalizer and pre-tokenizer are exactly these.
``tests/unit/test_recipe_chunking.py`` checks identical ids over adversarial texts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from tokenizers import Tokenizer

CHUNK_CHARS = 16_384  # a piece ends at the first safe position past this many characters
BATCH_CHARS = 1 << 18  # characters per encode_batch_fast call: ~40 MB of tokenizer memory
_WINDOW = 8_192  # characters one boundary search looks at (well under 1 ms with the GIL held)

_CJK = "\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff"
_ASCII_NON_LETTER = "\x00-\x40\x5b-\x60\x7b-\x7f"
_ASCII_NON_DIGIT = "\x00-\x2f\x3a-\x7f"
BOUNDARY = re.compile(
    r"(?<=\S)(?= )"
    rf"|(?<=[A-Za-z])(?=[{_ASCII_NON_LETTER}])"
    rf"|(?<=[0-9])(?=[{_ASCII_NON_DIGIT}])|(?<=[{_ASCII_NON_DIGIT}])(?=[0-9])"
    rf"|(?<=[{_CJK}])(?=[^{_CJK}])|(?<=[^{_CJK}])(?=[{_CJK}])"
)

# The pre-tokenizer the rules above were derived for (the bundled tokenizer.json's).
_DIGITS = r"\p{N}{1,3}"
_CJK_RUN = f"[{_CJK}]+"
_WORDS = (  # with real CR and LF characters, as tokenizer.json spells them
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)


_NO_NORMALIZER = {"type": "Sequence", "normalizers": []}


def _split(regex: str) -> dict[str, Any]:
    return {
        "type": "Split",
        "pattern": {"Regex": regex},
        "behavior": "Isolated",
        "invert": False,
    }


KNOWN_PRE_TOKENIZER: dict[str, Any] = {
    "type": "Sequence",
    "pretokenizers": [
        _split(_DIGITS),
        _split(_CJK_RUN),
        _split(_WORDS),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}


def splittable(tokenizer: Tokenizer) -> bool:
    """Whether :data:`BOUNDARY` is exact for ``tokenizer``: no normalizer (or an empty one),
    the pre-tokenizer above, no added tokens (they would cut the text before pre-tokenizing)."""
    if tokenizer.get_added_tokens_decoder() or tokenizer.pre_tokenizer is None:
        return False
    normalizer = tokenizer.normalizer
    if normalizer is not None and json.loads(normalizer.__getstate__()) != _NO_NORMALIZER:
        return False
    return bool(json.loads(tokenizer.pre_tokenizer.__getstate__()) == KNOWN_PRE_TOKENIZER)


def boundary_after(text: str, at: int, end: int) -> int:
    """The first safe cut of ``text`` at or after ``at`` and before ``end``; ``end`` if none.
    Searches a window at a time so that no single call holds the GIL long."""
    pos = at
    while pos < end:
        stop = min(end, pos + _WINDOW)
        # endpos stop + 1 so the lookahead sees the character at stop; a cut at end is no cut
        m = BOUNDARY.search(text, pos, min(end, stop + 1))
        if m is not None and m.start() < end:
            return m.start()
        pos = stop
    return end


def pieces_of(
    text: str, chunk: int = CHUNK_CHARS, start: int = 0, end: int | None = None
) -> Iterator[str]:
    """``text[start:end]`` cut at safe positions, each piece about ``chunk`` characters or more
    (a stretch with no safe position stays whole); only the pieces are copied."""
    n = len(text) if end is None else end
    while n - start > chunk:
        cut = boundary_after(text, start + chunk, n)
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:n]


class TooLong(Exception):
    """More than ``limit`` tokens so far: the prompt cannot fit, stop tokenizing."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.tokens = tokens


def encode_pieces(
    tokenizer: Tokenizer,
    text: str,
    parts: Sequence[int | tuple[int, int]],
    *,
    split: bool,
    batch_chars: int = BATCH_CHARS,
    chunk: int = CHUNK_CHARS,
    limit: int | None = None,
) -> list[int]:
    """Ids of ``parts`` in order: an int is a token id as is, ``(start, end)`` the plain text
    ``text[start:end]`` for ``tokenizer`` (no special tokens added). Texts are cut (when
    ``split``) and encoded ``batch_chars`` characters at a time through ``encode_batch_fast``;
    :class:`TooLong` as soon as more than ``limit`` ids are known (the rest is then never
    tokenized)."""
    ids: list[int] = []
    pending: list[str | int] = []  # in order; the strs go to the next encode_batch_fast call
    size = 0

    def flush() -> None:
        nonlocal size
        texts = [p for p in pending if isinstance(p, str)]
        encoded = iter(
            tokenizer.encode_batch_fast(texts, add_special_tokens=False) if texts else ()
        )
        for p in pending:
            if isinstance(p, int):
                ids.append(p)
            else:
                ids.extend(next(encoded).ids)
        pending.clear()
        size = 0
        if limit is not None and len(ids) > limit:
            raise TooLong(len(ids))

    for part in parts:
        if isinstance(part, int):
            pending.append(part)
            continue
        start, end = part
        cuts = pieces_of(text, chunk, start, end) if split else iter((text[start:end],))
        for piece in cuts:
            if size and size + len(piece) > batch_chars:
                flush()
            if piece:
                pending.append(piece)
                size += len(piece)
    flush()
    return ids
