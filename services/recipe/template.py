"""The DeepSeek chat template over the bundled tokenizer, with user text kept as plain text.

Rendering (the DeepSeek-V3 chat template, text only)::

    <｜begin▁of▁sentence｜> system text ("\\n\\n" between several system messages)
    <｜User｜> text                                  per user turn
    <｜Assistant｜> text <｜end▁of▁sentence｜>        per assistant turn
    <｜tool▁outputs▁begin｜> (<｜tool▁output▁begin｜> text <｜tool▁output▁end｜>)+ <｜tool▁outputs▁end｜>
                                                     per run of tool results
    <｜Assistant｜>                                  the generation prompt

Control tokens are inserted by id. Every piece of message text is encoded by a copy of the
tokenizer with *no added tokens at all*: ``tokenizers`` matches added tokens inside
``encode`` -- including the non-special ones such as ``<｜User｜>`` (id 128803), which
``encode_special_tokens`` does not cover -- so a user typing ``<｜User｜>`` would otherwise
inject a turn. Without added tokens the BPE model can only produce ids of its own vocabulary
(0..127999), and the three of those that are control tokens (0, 1, 2) are spelled with
characters (U+FF5C, U+2581) that byte-level BPE never emits as one piece. Text without control
strings encodes exactly as with the full tokenizer (added tokens only split the input).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from libs.engine.tokenizer import load_tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES ("developer" is folded into "system" by the protocol layer)
    content: str


def plain_text_tokenizer(full: Tokenizer) -> Tokenizer:
    """A copy of ``full`` that knows no added tokens, so it never emits a control id."""
    spec = json.loads(full.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


class ChatTemplate:
    """Messages -> prompt token ids; completion ids -> text. Thread-safe (tokenizers is)."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer or load_tokenizer()
        self.plain = plain_text_tokenizer(self.tokenizer)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        added = self.tokenizer.get_added_tokens_decoder()
        self.added_ids = frozenset(added)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.bos, self.eos = self._id(BOS), self._id(EOS)
        self.user, self.assistant = self._id(USER), self._id(ASSISTANT)
        self.tool_outputs = (self._id(TOOL_OUTPUTS_BEGIN), self._id(TOOL_OUTPUTS_END))
        self.tool_output = (self._id(TOOL_OUTPUT_BEGIN), self._id(TOOL_OUTPUT_END))

    def _id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer has no {token!r}: not a DeepSeek tokenizer")
        return int(i)

    def encode_text(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain-text ids of each string (never a control id); the pieces encode in parallel."""
        return [e.ids for e in self.plain.encode_batch(list(texts), add_special_tokens=False)]

    def render(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The prompt ids of a conversation, ending with the generation prompt ``<｜Assistant｜>``."""
        system = "\n\n".join(m.content for m in messages if m.role == "system")
        turns = [m for m in messages if m.role != "system"]
        for m in turns:
            if m.role not in ROLES:
                raise ValueError(f"unknown role {m.role!r}")
        pieces = self.encode_text([system] + [m.content for m in turns])
        ids = [self.bos, *pieces[0]]
        in_tools = False
        for m, text in zip(turns, pieces[1:]):
            if in_tools and m.role != "tool":
                ids.append(self.tool_outputs[1])
                in_tools = False
            if m.role == "user":
                ids += [self.user, *text]
            elif m.role == "assistant":
                ids += [self.assistant, *text, self.eos]
            else:  # tool
                if not in_tools:
                    ids.append(self.tool_outputs[0])
                    in_tools = True
                ids += [self.tool_output[0], *text, self.tool_output[1]]
        if in_tools:
            ids.append(self.tool_outputs[1])
        ids.append(self.assistant)
        return ids

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tokenizer, self.special_ids)

    def decode(self, ids: Sequence[int]) -> str:
        d = self.detokenizer()
        return d.push(ids) + d.flush()


class Detokenizer:
    """Incremental decoding for streaming: text deltas whose concatenation is the full decode.

    Special ids (BOS, EOS, pad, placeholders) are dropped. A delta is held back while the text
    ends in an incomplete UTF-8 sequence (byte-level BPE splits multi-byte characters across
    tokens); :meth:`flush` releases whatever is left at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_ids: frozenset[int]) -> None:
        self.tokenizer, self.skip_ids = tokenizer, skip_ids
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already, kept as context
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, ids: Sequence[int]) -> str:
        self.ids += [int(i) for i in ids if int(i) not in self.skip_ids]
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]
