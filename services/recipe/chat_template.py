"""Prompt encoding with a checkpoint's own tokenizer and chat template, for a model whose
vocabulary is not the DeepSeek one that deepseek-recipe renders (``libs/engine/tokenizer.py``
decides which model gets which).

deepseek-recipe still converts the three protocols into one ``Conversation`` and still builds
the protocol output in its ``StreamProcessor``; two things change:

* rendering: the template as transformers' ``apply_chat_template`` renders it -- a sandboxed
  jinja2 environment with ``trim_blocks``, ``lstrip_blocks`` and loop controls, a ``tojson``
  that does not escape HTML, ``raise_exception`` and ``strftime_now``; the variables
  ``messages``, ``add_generation_prompt=True``, ``bos_token`` and ``eos_token`` -- then
  tokenized with the checkpoint's tokenizer, adding no BOS or EOS of its own (the template
  writes them);
* output: read as plain text, no thinking or tool-call markup parsed (that markup is V4's);
  stop sequences and JSON output work as for V4.

Refused with a 400 that names the field (never a 500): what only deepseek-recipe's encoding
renders or parses -- thinking mode, tool definitions, an assistant prefix to continue, the
latest-reminder role -- and a conversation the template itself refuses (``raise_exception``,
a role it does not know). A message whose text spells one of the tokenizer's special tokens is
refused too: rendered text is tokenized as a whole, so that spelling would become the control
token itself, which user text never does in this server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import deepseek_recipe as dr
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from libs.engine.tokenizer import CHAT_TEMPLATE, ServedTokenizer

from .api import APIError, invalid
from .limits import chars_per_token_bound, check_fits


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it for
    training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_template(source: str) -> jinja2.Template:
    """The template in transformers' environment; ValueError for one that does not parse."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {exc} (line {exc.lineno})") from None


def _unsupported(what: str, param: str) -> APIError:
    return invalid(
        f"{what} is not available for this model: it is served with its checkpoint's own "
        "tokenizer and chat template, and only deepseek-recipe's DeepSeek encoding renders "
        f"and parses {what}; send the request without it",
        param,
        "unsupported_value",
    )


class ChatTemplateEncoder:
    """Conversations -> prompt ids through the checkpoint's chat template. Thread-safe."""

    def __init__(self, served: ServedTokenizer, served_names: Sequence[str]) -> None:
        if served.encoding != CHAT_TEMPLATE or not served.chat_template:
            raise ValueError(f"{served.model} is not served with a chat template")
        self.full = Tokenizer.from_file(str(served.path))
        self.vocab_size = self.full.get_vocab_size(with_added_tokens=True)
        bos = self.full.token_to_id(served.bos_token) if served.bos_token else None
        self.bos: int | None = None if bos is None else int(bos)
        self.chars_per_token = chars_per_token_bound(self.full)
        self.tokenizer = dr.Tokenizer.from_file(str(served.path))  # the StreamProcessor's
        # Thinking is off by default: the template renders no thinking mode (see encode).
        self.options = dr.ConversionOptions(
            default_thinking_mode=False
        ).with_model_versions_by_name(
            {name: dr.ModelVersion.DeepseekV4Pro for name in served_names}
        )
        self.template = compile_template(served.chat_template)
        self.variables = {
            k: v for k, v in (("bos_token", served.bos_token), ("eos_token", served.eos_token)) if v
        }
        self.eos = served.eos_token_ids[0]
        # The template's end-of-turn token ends an answer too, whether or not config.json says.
        eos_token = self.full.token_to_id(served.eos_token) if served.eos_token else None
        self.eos_ids = frozenset(served.eos_token_ids) | (
            {eos_token} if eos_token is not None else set()
        )
        specials = sorted(
            {t.content for t in self.full.get_added_tokens_decoder().values() if t.special},
            key=len,
            reverse=True,
        )
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None

    def parsing_options(self, request: dr.ConversationRequest) -> dr.ParsingOptions:
        """Plain text: no tool-call or thinking markup (V4's) is looked for in the output."""
        given = request.parsing_options
        return dr.ParsingOptions(
            parse_tool_calls=False,
            parse_json_output=given.parse_json_output,
            stop_sequences=given.stop_sequences,
        )

    def messages(self, conversation: dr.Conversation) -> list[dict[str, Any]]:
        """The conversation as transformers' chat messages; APIError for what it cannot hold."""
        if conversation.thinking_mode:
            raise _unsupported("thinking mode", "thinking")
        if conversation.tools:
            raise _unsupported("tools", "tools")
        out: list[dict[str, Any]] = []
        for m in conversation.messages:
            if m.role == "latest_reminder":
                raise _unsupported("the latest_reminder role", "messages")
            if m.prefix:
                raise _unsupported("an assistant prefix to continue", "messages")
            msg: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.reasoning_content:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            self._refuse_special_tokens(m)
            out.append(msg)
        return out

    def _refuse_special_tokens(self, m: dr.Message) -> None:
        if self._special is None:
            return
        texts = [m.content, m.reasoning_content or "", m.tool_call_id or ""]
        texts += [s for c in m.tool_calls or () for s in (c.id, c.name, c.arguments)]
        for text in texts:
            found = self._special.search(text)
            if found:
                raise invalid(
                    f"a {m.role} message contains {found.group()!r}, a special token of this "
                    "model's tokenizer; the chat template would turn it into the control token "
                    "itself. Remove it or spell it differently",
                    "messages",
                )

    def render(self, conversation: dr.Conversation) -> str:
        messages = self.messages(conversation)
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, **self.variables
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            raise invalid(
                f"the model's chat template refused this conversation: {exc}", "messages"
            ) from None

    def encode(
        self,
        conversation: dr.Conversation,
        parallel: bool | None = None,
        *,
        max_prompt_tokens: int | None = None,
    ) -> list[int]:
        """Prompt ids (``parallel`` is accepted for PromptEncoder's signature and unused); a
        prompt surely longer than ``max_prompt_tokens`` is refused before tokenizing."""
        prompt = self.render(conversation)
        check_fits(len(prompt), self.chars_per_token, max_prompt_tokens)
        return list(self.full.encode(prompt, add_special_tokens=False).ids)

    def encode_text(self, text: str, *, max_prompt_tokens: int | None = None) -> list[int]:
        """A raw Completions prompt: the checkpoint's BOS token (if it names one), then the
        text. Text that spells a special token is refused, as in messages (see the module
        doc): token-id prompts are the way to send one."""
        check_fits(len(text), self.chars_per_token, max_prompt_tokens, param="prompt")
        found = self._special.search(text) if self._special else None
        if found:
            raise invalid(
                f"the prompt contains {found.group()!r}, a special token of this model's "
                "tokenizer; send the prompt as token ids to use it, or spell it differently",
                "prompt",
            )
        head = [] if self.bos is None else [self.bos]
        return head + list(self.full.encode(text, add_special_tokens=False).ids)
