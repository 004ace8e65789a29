"""Tool calls as the DeepSeek-V3 family writes them, read through deepseek-recipe's parser (no I/O).

DeepSeek-V3, R1 and V3.1 write tool calls with their own added tokens::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3 and R1: the call's type, then the name and the arguments fenced as JSON; V3.1 and later
drop the type and the fence: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``;
several calls follow each other inside one block). deepseek-recipe's ``StreamProcessor`` parses
only V4's DSML markup, and it is what builds every protocol's tool calls (Chat Completions,
Responses, Messages), so :class:`V3ToolCalls` sits in front of it: output tokens pass through
untouched (log probabilities included) until ``<｜tool▁calls▁begin｜>``; the block is held to
``<｜tool▁calls▁end｜>`` (or the end of the output), then handed to the processor as the DSML text
V4 would have written for the same calls, with the block's token count. A block that does not
parse -- arguments that are not a JSON object, a call without a name -- reaches the client as
the text the model wrote, never as a made-up call.

A tokens event whose first ids are text and whose later ids open the block (several tokens per
event: speculative decoding) gives its text ids without their log probabilities: the library's
chunks cannot be split, and rebuilding them is not worth a field no client asks for with tools.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import deepseek_recipe as dr
from tokenizers import Tokenizer

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_CALL = re.compile(
    re.escape(CALL_BEGIN) + "(.*?)" + re.escape(SEP) + "(.*?)" + re.escape(CALL_END), re.S
)
_FENCED = re.compile(r"(?s)\A([^\n]+)\n```(?:json)?\n(.*)\n```\s*\Z")

Chunk = dr.ChatCompletionChunk | dr.ResponsesStreamEvent | dr.MessagesStreamEvent


class OutputProcessor(Protocol):
    """What a request's output goes through: deepseek-recipe's ``StreamProcessor`` or a wrapper
    of it (the same four members)."""

    @property
    def finished(self) -> bool: ...

    def push(self, chunk: dr.InferenceChunk) -> list[Chunk]: ...

    def finish(self) -> list[Chunk]: ...

    def close(self) -> None: ...


def parse_v3_calls(block: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The (name, arguments) of each call in a V3-family tool-call block; None where it does not
    parse as one."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for head, body in _CALL.findall(block):
        fenced = _FENCED.match(body)
        if fenced and head.strip() in ("function", ""):  # V3 / R1: type, then name and JSON
            name, args = fenced.group(1).strip(), fenced.group(2)
        else:  # V3.1: name, then the arguments as they are
            name, args = head.strip(), body
        try:
            value = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
        if not name or not isinstance(value, dict):
            return None
        calls.append((name, value))
    return calls or None


def dsml_calls(calls: list[tuple[str, dict[str, Any]]], dsml: str = "｜DSML｜") -> str:
    """The calls in V4's DSML markup, as deepseek-recipe's V4 encoding writes an assistant's
    calls: a string argument as text (``string="true"``), any other as JSON."""
    lines = [f"<{dsml}tool_calls>"]
    for name, args in calls:
        lines.append(f'<{dsml}invoke name="{name}">')
        for key, value in args.items():
            is_text = isinstance(value, str)
            text = value if is_text else json.dumps(value, ensure_ascii=False)
            flag = "true" if is_text else "false"
            lines.append(f'<{dsml}parameter name="{key}" string="{flag}">{text}</{dsml}parameter>')
        lines.append(f"</{dsml}invoke>")
    lines.append(f"</{dsml}tool_calls>")
    return "\n".join(lines)


class V3ToolCalls:
    """A ``StreamProcessor`` whose input's V3-family tool-call blocks are rewritten as DSML (see
    the module doc). ``tokenizer`` decodes a held block; ``begin``/``end``: the ids of
    ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``."""

    def __init__(
        self, processor: dr.StreamProcessor, tokenizer: Tokenizer, begin: int, end: int
    ) -> None:
        self.processor, self.tokenizer, self.begin, self.end = processor, tokenizer, begin, end
        self.held: list[int] | None = None  # a block's ids, from its begin token; None: outside

    @property
    def finished(self) -> bool:
        return self.processor.finished

    def push(self, chunk: dr.InferenceChunk) -> list[Chunk]:
        if chunk.kind != "tokens":
            released = self._release() if chunk.kind == "finish" else []
            return released + self.processor.push(chunk)
        ids = chunk.token_ids or []
        if self.held is None and self.begin not in ids:
            return self.processor.push(chunk)  # text: as it came, log probabilities and all
        out: list[Chunk] = []
        if self.held is None:
            at = ids.index(self.begin)
            if at:
                out += self.processor.push(dr.InferenceChunk.tokens(ids[:at]))
            self.held, ids = [], ids[at:]
        assert self.held is not None
        self.held += ids
        if self.end in self.held:
            at = self.held.index(self.end) + 1
            rest = self.held[at:]
            self.held = self.held[:at]
            out += self._release()
            if rest:
                out += self.push(dr.InferenceChunk.tokens(rest))
        return out

    def _release(self) -> list[Chunk]:
        """The held block to the processor: as DSML where it parses, else as its text."""
        held, self.held = self.held, None
        if not held:
            return []
        text = self.tokenizer.decode(held, skip_special_tokens=False)
        calls = parse_v3_calls(text)
        if calls is None:
            return self.processor.push(dr.InferenceChunk.tokens(held))
        return self.processor.push(dr.InferenceChunk.text(dsml_calls(calls), len(held)))

    def finish(self) -> list[Chunk]:
        return self._release() + self.processor.finish()

    def close(self) -> None:
        self.processor.close()
