"""Log probabilities of the generated tokens, from the backend's ``Tokens.logprobs`` to the
protocol output (no I/O).

The engine sends one ``TokenLogprobs`` per generated id (``common.proto``): the id's log
probability under the distribution it was drawn from and the N most likely tokens', most likely
first. A token the top-k / top-p cut removed has ``-inf``; JSON has no infinity, so every value
is clamped into [:data:`FLOOR`, 0] (OpenAI's own floor is -9999.0; float32 rounding can leave a
certain token at +1e-7, clamped to 0).

* Chat Completions and Responses: deepseek-recipe builds ``logprobs.content`` itself from the
  pairs :func:`chunk_logprobs` gives it (token strings and ``bytes`` from its tokenizer); it
  reports the tokens of the visible content in ``content``, the thinking tokens in
  ``reasoning_content`` (DeepSeek's extension) and none of the tool-call markup.
* Completions: :class:`CompletionLogprobs` builds OpenAI's legacy shape
  ``{tokens, token_logprobs, top_logprobs, text_offset}``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from libs.common.errors import Internal
from libs.common.sampling import MAX_LOGPROBS
from libs.proto.deepserve.v1 import generate_pb2

from .api import invalid

FLOOR = -9999.0  # what an impossible token's -inf becomes (OpenAI reports -9999.0 too)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy Completions ``logprobs``

Pair = tuple[float, list[tuple[int, float]]]  # (logprob, [(top id, top logprob), ...])


def clamp(x: float) -> float:
    """A log probability JSON can carry: NaN and -inf become FLOOR, anything above 0 is 0."""
    return min(0.0, x) if x >= FLOOR else FLOOR  # NaN fails the comparison too


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_chat_logprobs(body: dict[str, Any]) -> None:
    """Chat Completions' ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs logprobs):
    a 400 naming the field (the library's own refusals name none)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise invalid(f"logprobs must be true or false, got {lp!r:.40}", "logprobs")
    if top is None:
        return
    if not (_is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise invalid(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r:.40}",
            "top_logprobs",
        )
    if lp is not True:
        raise invalid(
            "top_logprobs needs logprobs: set logprobs to true, or leave top_logprobs out",
            "top_logprobs",
        )


def read_completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions' ``logprobs``: None (off) or how many alternatives, 0..5."""
    v = body.get("logprobs")
    if v is None:
        return None
    if not (_is_int(v) and 0 <= v <= MAX_COMPLETION_LOGPROBS):
        raise invalid(
            f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {v!r:.40}",
            "logprobs",
        )
    if body.get("echo") is True:
        raise invalid(
            "echo with logprobs is not supported: this server does not compute the prompt "
            "tokens' log probabilities; send echo or logprobs, not both",
            "echo",
            "unsupported_value",
        )
    return int(v)


def chunk_logprobs(tokens: generate_pb2.Tokens, eos: Collection[int]) -> list[Pair] | None:
    """The (logprob, top pairs) of every non-EOS id of a Tokens event, aligned with the ids the
    recipe keeps; None when the backend sent none. Internal when their counts differ."""
    if not tokens.logprobs:
        return None
    if len(tokens.logprobs) != len(tokens.token_ids):
        raise Internal(
            f"the backend sent {len(tokens.logprobs)} logprobs for {len(tokens.token_ids)} tokens"
        )
    return [
        (clamp(lp.logprob), [(int(t), clamp(v)) for t, v in zip(lp.top_ids, lp.top_logprobs)])
        for t, lp in zip(tokens.token_ids, tokens.logprobs)
        if t not in eos
    ]


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (the bytes that
    are printable stand for themselves; the others are shifted to U+0100 and up, in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in kept}
    shifted = (b for b in range(256) if b not in set(kept))
    for i, b in enumerate(shifted):
        table[chr(256 + i)] = b
    return table


_BYTES = _byte_decoder()


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as OpenAI's legacy logprobs write it: its text, or ``bytes:\\xNN...`` for a
    piece of a UTF-8 character (byte-level BPE splits characters across tokens)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    piece = tokenizer.id_to_token(token_id) or ""
    if piece and all(c in _BYTES for c in piece):
        raw = bytes(_BYTES[c] for c in piece)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


@dataclass
class _Entry:
    token: str
    logprob: float
    top: dict[str, float]
    start: int  # characters of the completion's text before this token
    end: int | None = None  # after it; None while its text waits for the rest of a character


class CompletionLogprobs:
    """A Completions choice's ``logprobs`` object, built token by token and released with the
    text it belongs to: a token is released once all of its text was released (a stop sequence
    drops the tokens after it). ``offset``: characters before the completion (none today)."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0) -> None:
        self.tokenizer, self.offset = tokenizer, offset
        self._pending: list[_Entry] = []
        self.released: list[_Entry] = []

    def add(self, token_id: int, pair: Pair, start: int, end: int) -> None:
        """A token whose text took the decoded text from ``start`` to ``end`` characters."""
        top: dict[str, float] = {}
        for t, v in pair[1]:
            top.setdefault(token_text(self.tokenizer, t), v)  # two ids, one text: the likelier
        self._pending.append(_Entry(token_text(self.tokenizer, token_id), pair[0], top, start))
        if end > start:  # this token completed text: the tokens waiting on it end here too
            for e in self._pending:
                if e.end is None:
                    e.end = end

    def release(self, sent: int, final: bool, stopped: bool) -> dict[str, Any] | None:
        """The logprobs object of the tokens newly released now that ``sent`` characters of
        text are; None when there are none. ``final``: the text is over."""
        out: list[_Entry] = []
        keep: list[_Entry] = []
        for e in self._pending:
            done = e.end is not None and e.end <= sent
            if done or (final and e.start < sent) or (final and not stopped and e.end is None):
                out.append(e)
            elif not final:
                keep.append(e)
        self._pending = keep
        self.released += out
        return self.body(out) if out else None

    def body(self, entries: Sequence[_Entry] | None = None) -> dict[str, Any]:
        es = self.released if entries is None else entries
        return {
            "tokens": [e.token for e in es],
            "token_logprobs": [e.logprob for e in es],
            "top_logprobs": [e.top for e in es],
            "text_offset": [self.offset + e.start for e in es],
        }
