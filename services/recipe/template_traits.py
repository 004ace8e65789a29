"""A checkpoint's jinja chat template: compiled as transformers compiles it, and what it can render
(no I/O).

The environment is transformers' ``apply_chat_template`` one -- a sandboxed jinja2 environment
with ``trim_blocks``, ``lstrip_blocks`` and loop controls, a ``tojson`` that does not escape
HTML, ``raise_exception`` and ``strftime_now`` -- so a template renders here exactly as there.

:func:`template_traits` reads off the template, without knowing its family by name:

* **tools**: whether it renders tool definitions (it reads the ``tools`` variable; DeepSeek-V3's
  and R1's released templates do not -- they render tool *calls* and *results* in the history
  only -- V3.1's does);
* **thinking**: ``switch`` where it reads a ``thinking`` / ``enable_thinking`` variable
  (V3.1: ``<think>`` or ``</think>`` after ``<｜Assistant｜>``); ``always`` where its generation
  prompt itself ends by opening the reasoning (R1's ends ``<｜Assistant｜><think>\\n``), so the
  output begins inside it; ``none`` otherwise (V3, V2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

THINK_START = "<think>"  # R1's, V3.1's and V4's spelling (deepseek-recipe's ThinkingStart)
THINKING_VARIABLES = ("thinking", "enable_thinking")  # V3.1's, and the name others use
Thinking = Literal["none", "always", "switch"]
# Errors a template can raise while rendering a conversation it does not expect.
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError)


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


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_template(source: str) -> jinja2.Template:
    """The template in transformers' environment; ValueError for one that does not parse."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {exc} (line {exc.lineno})") from None


@dataclass(frozen=True)
class TemplateTraits:
    """What a template renders (see the module doc)."""

    renders_tools: bool
    thinking: Thinking
    thinking_variables: tuple[str, ...] = ()  # set to the request's thinking mode (``switch``)


def template_traits(
    source: str, template: jinja2.Template, variables: dict[str, Any]
) -> TemplateTraits:
    """Read ``source`` (compiled: ``template``; ``variables``: bos_token/eos_token)."""
    used = jinja2.meta.find_undeclared_variables(_environment().parse(source))
    switch = tuple(v for v in THINKING_VARIABLES if v in used)
    thinking: Thinking = "switch" if switch else "none"
    if not switch:
        probe = [{"role": "user", "content": "x"}]
        try:
            bare = template.render(messages=probe, add_generation_prompt=False, **variables)
            asked = template.render(messages=probe, add_generation_prompt=True, **variables)
        except RENDER_ERRORS:
            bare = asked = ""
        prompt = asked[len(bare) :] if asked.startswith(bare) else asked
        if prompt.rstrip().endswith(THINK_START):
            thinking = "always"
    return TemplateTraits("tools" in used, thinking, switch)
