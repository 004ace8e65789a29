"""Prompt encoding with a checkpoint's own tokenizer and chat template: every checkpoint that is not
of the DeepSeek-V4 family -- DeepSeek-V2, V3, R1, V3.1 among them -- is rendered the way its
model was trained, with the template its release ships (``libs/engine/tokenizer.py`` decides
which model gets which).

deepseek-recipe still converts the three protocols into one ``Conversation`` and still builds
the protocol output in its ``StreamProcessor``; what changes:

* rendering: the template as transformers' ``apply_chat_template`` renders it
  (``template_traits.py``: the same sandboxed environment), with ``messages``,
  ``add_generation_prompt=True``, ``bos_token``, ``eos_token``, and ``tools`` (transformers'
  shape: ``{"type": "function", "function": {...}}``) and ``thinking`` / ``enable_thinking``
  where the template reads them; then tokenized with the checkpoint's tokenizer, adding no BOS
  or EOS of its own (the template writes them). An assistant message that only calls tools has
  ``content`` None, as OpenAI clients send it (DeepSeek-V3's template tells the two cases apart
  by it);
* thinking, as the template has it (``template_traits.py``): ``none`` (V3) -- thinking mode is
  a 400; ``always`` (R1: its prompt opens ``<think>``) -- thinking is the default and turning it
  off a 400, the output is parsed as reasoning up to ``</think>``, then the answer;
  ``switch`` (V3.1) -- the request's thinking mode is handed to the template;
* tool calls: where the template renders tool definitions and the tokenizer has the V3 family's
  tool-call tokens, tools are rendered and the calls the model writes are parsed
  (``tool_markup.py``); elsewhere ``tools`` is a 400 that says why -- DeepSeek-V3's and R1's
  released templates render tool calls and results in the history, never the definitions, so
  they take a template that does (``chat_template.jinja`` in the checkpoint directory). A
  required or named ``tool_choice`` and tools beside a structured answer are 400s: the engine's
  tool-call grammar is V4's markup;
* stop sequences and JSON output work as for V4.

Refused with a 400 that names the field (never a 500): the above, what only deepseek-recipe's
encoding renders -- an assistant prefix to continue, the latest-reminder role, a
``reasoning_effort`` other than the one level a template has -- and a conversation the
template itself refuses (``raise_exception``, a role it does not know). A message whose text
spells one of the tokenizer's control tokens -- a special token, or an added token spelled as
markup (``<...>`` or with ``｜``: ``<｜User｜>``, ``</think>``, the tool-call tokens, which
DeepSeek's tokenizers do not mark special) -- is refused too: rendered text is tokenized as a
whole, so that spelling would become the control token itself, which user text never does in
this server.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import deepseek_recipe as dr
from tokenizers import Tokenizer

from libs.engine.tokenizer import CHAT_TEMPLATE, ServedTokenizer

from .api import APIError, invalid
from .limits import chars_per_token_bound, check_fits
from .template_traits import RENDER_ERRORS, compile_template, template_traits
from .tool_markup import CALLS_BEGIN, CALLS_END, OutputProcessor, V3ToolCalls

__all__ = ["ChatTemplateEncoder", "compile_template"]


def _unsupported(what: str, param: str) -> APIError:
    return invalid(
        f"{what} is not available for this model: it is served with its checkpoint's own "
        f"chat template, which renders no {what}; send the request without it",
        param,
        "unsupported_value",
    )


def _control_tokens(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """Spellings user text may not hold: special added tokens, and added tokens spelled as
    markup (``<...>`` or containing ``｜``), longest first."""
    spelled = {
        t.content
        for t in tokenizer.get_added_tokens_decoder().values()
        if t.special or "｜" in t.content or (t.content.startswith("<") and t.content.endswith(">"))
    }
    ordered = sorted(spelled, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def _tool(t: dr.ToolDefinition) -> dict[str, Any]:
    """A tool in transformers' shape, as a template reads ``tools``."""
    fn: dict[str, Any] = {"name": t.name}
    if t.description is not None:
        fn["description"] = t.description
    fn["parameters"] = t.parameters
    return {"type": "function", "function": fn}


class ChatTemplateEncoder:
    """Conversations -> prompt ids through the checkpoint's chat template. Thread-safe.

    ``default_thinking`` (``--default-thinking``): thinking mode for a request that does not
    say, where the template can switch it; a template without thinking refuses it (ValueError).
    """

    def __init__(
        self, served: ServedTokenizer, served_names: Sequence[str], default_thinking: bool = False
    ) -> None:
        if served.encoding != CHAT_TEMPLATE or not served.chat_template:
            raise ValueError(f"{served.model} is not served with a chat template")
        self.template = compile_template(served.chat_template)
        self.variables = {
            k: v for k, v in (("bos_token", served.bos_token), ("eos_token", served.eos_token)) if v
        }
        self.traits = template_traits(served.chat_template, self.template, self.variables)
        if default_thinking and self.traits.thinking == "none":
            raise ValueError(
                f"--default-thinking: --model {served.model!r} is served with its checkpoint's "
                "chat template, which has no thinking mode; leave --default-thinking off"
            )
        self.tokenizer_path = served.path
        self.full = Tokenizer.from_file(str(served.path))
        self.vocab_size = self.full.get_vocab_size(with_added_tokens=True)
        bos = self.full.token_to_id(served.bos_token) if served.bos_token else None
        self.bos: int | None = None if bos is None else int(bos)
        self.chars_per_token = chars_per_token_bound(self.full)
        self.tokenizer = dr.Tokenizer.from_file(str(served.path))  # the StreamProcessor's
        thinking = self.traits.thinking == "always" or default_thinking
        self.options = dr.ConversionOptions(
            default_thinking_mode=thinking
        ).with_model_versions_by_name(
            {name: dr.ModelVersion.DeepseekV4Pro for name in served_names}
        )
        self.eos = served.eos_token_ids[0]
        # The template's end-of-turn token ends an answer too, whether or not config.json says.
        eos_token = self.full.token_to_id(served.eos_token) if served.eos_token else None
        self.eos_ids = frozenset(served.eos_token_ids) | (
            {eos_token} if eos_token is not None else set()
        )
        begin, end = self.full.token_to_id(CALLS_BEGIN), self.full.token_to_id(CALLS_END)
        # (begin, end) where tools can be rendered and the calls read back
        self.call_ids = (
            (int(begin), int(end))
            if self.traits.renders_tools and begin is not None and end is not None
            else None
        )
        self._special = _control_tokens(self.full)

    def _calls_tools(self, conversation: dr.Conversation) -> bool:
        return bool(conversation.tools) and self.call_ids is not None

    def parsing_options(self, request: dr.ConversationRequest) -> dr.ParsingOptions:
        """Reasoning up to ``</think>`` in thinking mode; tool calls where tools were rendered
        (rewritten into the markup the parser reads by :meth:`stream_processor`)."""
        given = request.parsing_options
        return dr.ParsingOptions(
            parse_tool_calls=self._calls_tools(request.conversation),
            parse_json_output=given.parse_json_output,
            thinking_initial_stage=given.thinking_initial_stage,
            stop_sequences=given.stop_sequences,
        )

    def stream_processor(self, generator: Any, request: dr.ConversationRequest) -> OutputProcessor:
        """The processor of one choice's output (``generator``: its protocol's chunk
        generator)."""
        processor = dr.StreamProcessor(generator, self.parsing_options(request), self.tokenizer)
        if self.call_ids is None or not self._calls_tools(request.conversation):
            return processor
        return V3ToolCalls(processor, self.full, *self.call_ids)

    def _check_modes(self, conversation: dr.Conversation) -> None:
        """Thinking, reasoning effort and tools as this template has them (module doc)."""
        thinking = self.traits.thinking
        if conversation.thinking_mode and thinking == "none":
            raise _unsupported("thinking mode", "thinking")
        if not conversation.thinking_mode and thinking == "always":
            raise invalid(
                "this model always thinks: its chat template opens the reasoning in every "
                "answer, so thinking mode cannot be turned off; send the request without "
                "disabling it",
                "thinking",
                "unsupported_value",
            )
        if conversation.reasoning_effort not in (None, "high"):
            raise invalid(
                f"reasoning_effort {conversation.reasoning_effort!r} is not available for this "
                "model: its chat template has one level of reasoning; send high or leave it out",
                "reasoning_effort",
                "unsupported_value",
            )
        if not conversation.tools:
            return
        if not self.traits.renders_tools:
            raise invalid(
                "tools are not available for this model: its checkpoint's chat template renders "
                "no tool definitions (DeepSeek-V3's and R1's released templates render tool "
                "calls and results in the history only). Put a template that renders them in "
                "the checkpoint directory as chat_template.jinja, or send the request without "
                "tools",
                "tools",
                "unsupported_value",
            )
        if self.call_ids is None:
            raise invalid(
                "tools are not available for this model: its tokenizer has no "
                f"{CALLS_BEGIN} / {CALLS_END} tokens, the only tool-call markup read back from "
                "a chat-template model; send the request without tools",
                "tools",
                "unsupported_value",
            )
        if conversation.tool_choice == "required":
            raise _unsupported("a required or named tool_choice", "tool_choice")
        if conversation.response_format != "text":
            raise invalid(
                "tools beside a structured answer (response_format) are not available for this "
                "model; send one or the other",
                "response_format",
                "unsupported_value",
            )

    def messages(self, conversation: dr.Conversation) -> list[dict[str, Any]]:
        """The conversation as transformers' chat messages; APIError for what it cannot hold."""
        self._check_modes(conversation)
        out: list[dict[str, Any]] = []
        for m in conversation.messages:
            if m.role == "latest_reminder":
                raise _unsupported("the latest_reminder role", "messages")
            if m.prefix:
                raise _unsupported("an assistant prefix to continue", "messages")
            # A message that only calls tools has no content (OpenAI clients send null).
            content = None if m.tool_calls and not m.content else m.content
            msg: dict[str, Any] = {"role": m.role, "content": content}
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
                    f"a {m.role} message contains {found.group()!r}, a control token of this "
                    "model's tokenizer; the chat template would turn it into the control token "
                    "itself. Remove it or spell it differently",
                    "messages",
                )

    def variables_for(self, conversation: dr.Conversation) -> dict[str, Any]:
        """The template's variables beside ``messages``."""
        out: dict[str, Any] = dict(self.variables)
        if self._calls_tools(conversation):
            out["tools"] = [_tool(t) for t in conversation.tools]
        for name in self.traits.thinking_variables:
            out[name] = conversation.thinking_mode
        return out

    def render(self, conversation: dr.Conversation) -> str:
        messages = self.messages(conversation)
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, **self.variables_for(conversation)
            )
        except RENDER_ERRORS as exc:
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
        return self._ids(prompt)

    def encode_text(self, text: str, *, max_prompt_tokens: int | None = None) -> list[int]:
        """A raw Completions prompt: the checkpoint's BOS token (if it names one), then the
        text. Text that spells a control token is refused, as in messages (see the module
        doc): token-id prompts are the way to send one."""
        check_fits(len(text), self.chars_per_token, max_prompt_tokens, param="prompt")
        found = self._special.search(text) if self._special else None
        if found:
            raise invalid(
                f"the prompt contains {found.group()!r}, a control token of this model's "
                "tokenizer; send the prompt as token ids to use it, or spell it differently",
                "prompt",
            )
        head = [] if self.bos is None else [self.bos]
        return head + self._ids(text)

    def _ids(self, text: str) -> list[int]:
        """``encode_batch_fast`` releases the GIL while it tokenizes; ``encode`` holds it for
        the whole call (0.66 s for 200,000 characters), which froze the event loop."""
        return list(self.full.encode_batch_fast([text], add_special_tokens=False)[0].ids)
