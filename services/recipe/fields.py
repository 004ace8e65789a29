"""Every top-level field of the OpenAI requests the recipe serves, and what it does with each
(no I/O).

deepseek-recipe reads the fields it converts and silently ignores the rest (with version 0.2.0
``max_completion_tokens`` ran every LangChain request to the 4,096-token default). So the
recipe checks each OpenAI body against this table before conversion: a field is either
*read* (by the library or by the recipe), *accepted* with the values whose meaning this server
keeps (``service_tier: "auto"``, ``store: false``), or refused with a 400 naming it; a field in
no table is refused as unknown. ``tests/unit/test_recipe_fields.py`` derives the field lists
from the openai SDK's request types, so a field a new SDK adds fails that test until it is
entered here, and checks the table in ``docs/api.md`` against :func:`markdown`.

A field sent as ``null`` is unset and always accepted (the SDKs send ``null`` for omitted
fields in places). ``max_completion_tokens`` (Chat Completions) is the same limit as
``max_tokens``, which the library reads, and ``max_tokens`` sent to Responses the same as its
``max_output_tokens``: :func:`check` folds each into the one the library reads (:data:`ALIASES`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .api import invalid
from .sampling import FIELDS as EXTRA_SAMPLING


@dataclass(frozen=True)
class Field:
    """One request field. ``allowed``: the values served (None: any value is read and
    checked where it is used); a non-null value outside it is refused with ``refusal``."""

    name: str
    use: str  # what the server does with it, for the table in docs/api.md
    allowed: Callable[[Any], bool] | None = None
    refusal: str = ""


def _never(_: Any) -> bool:
    return False


def _empty(v: Any) -> bool:
    return v in ([], {}, "")


def _false(v: Any) -> bool:
    return v is False


def _true(v: Any) -> bool:
    return v is True


def _string(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 512


def _metadata(v: Any) -> bool:  # OpenAI's bounds: 16 pairs, keys 64 and values 512 characters
    return (
        isinstance(v, dict)
        and len(v) <= 16
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(x, str) and len(x) <= 512
            for k, x in v.items()
        )
    )


def _include(v: Any) -> bool:
    return isinstance(v, list) and all(x == LOGPROBS for x in v)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in values


def _text_only(v: Any) -> bool:
    return bool(v == ["text"])


def _stream_options(v: Any) -> bool:
    return isinstance(v, dict) and all(
        k in ("include_usage", "include_obfuscation") and isinstance(x, (bool, type(None)))
        for k, x in v.items()
    )


LIB = "read (deepseek-recipe)"
LOGPROBS = "message.output_text.logprobs"
READ = "read (recipe)"
NO_STORE = "this server stores no requests or responses; send store: false or leave it out"
_COMMON = [
    Field("model", LIB + ": must name the served model"),
    Field("stream", LIB),
    Field("temperature", LIB),
    Field("top_p", LIB),
    Field("top_logprobs", LIB),
    Field(
        "stream_options",
        "include_usage read; include_obfuscation accepted (no obfuscation padding is sent)",
        _stream_options,
        "stream_options may hold include_usage and include_obfuscation (true or false)",
    ),
    Field("user", "accepted: an end-user id (a string); kept nowhere", _string, "a string"),
    Field(
        "safety_identifier",
        "accepted: an end-user id (a string); kept nowhere",
        _string,
        "a string",
    ),
    Field(
        "metadata",
        "accepted (up to 16 string pairs); stored nowhere",
        _metadata,
        "an object of up to 16 string keys (64 characters) and values (512)",
    ),
    Field("store", "false accepted; true refused", _false, NO_STORE),
    Field(
        "service_tier",
        '"auto" and "default" accepted (one tier); others refused',
        _one_of("auto", "default"),
        'this server has one service tier: send "auto" or "default"',
    ),
    Field(
        "prompt_cache_key",
        "accepted: the prefix cache is automatic (by prompt prefix and API key)",
        _string,
        "a string",
    ),
    Field(
        "prompt_cache_retention",
        "accepted: cached prefixes live 3 days (agent) or 7 days (chat) since last use, "
        'longer than "24h"',
        _one_of("in_memory", "24h"),
        'one of "in_memory" and "24h"',
    ),
    Field(
        "prompt_cache_options",
        "refused unless empty: the prefix cache places no explicit breakpoints",
        _empty,
        "this server's prefix cache is automatic and takes no options",
    ),
    Field(
        "moderation",
        "refused: this server runs no moderation",
        _never,
        "this server runs no moderation",
    ),
    Field(
        "parallel_tool_calls",
        "true accepted; false holds a required or named tool_choice to one call (refused "
        "with tool_choice auto, which the model answers unconstrained)",
    ),
    Field("tools", LIB + "; parameter schemas reach the tool-call grammar (constraints.py)"),
    Field("tool_choice", LIB),
]

CHAT_FIELDS = [
    *_COMMON,
    Field("messages", LIB),
    Field("max_tokens", LIB),
    Field("max_completion_tokens", READ + ": the same limit as max_tokens"),
    Field("n", READ + ": one backend call per choice"),
    Field("seed", LIB),
    Field("stop", LIB),
    Field("logprobs", LIB),
    Field("presence_penalty", READ),
    Field("frequency_penalty", READ),
    Field(
        "response_format",
        LIB + "; the schema's keywords reach the grammar (constraints.py); beside tools under "
        "tool_choice auto the answer is that JSON or tool calls",
    ),
    Field("reasoning_effort", LIB + ": turns thinking on"),
    Field(
        "verbosity",
        '"medium" accepted (the model has one verbosity); others refused',
        _one_of("medium"),
        'the served model has one verbosity: send "medium" or leave it out',
    ),
    Field(
        "logit_bias",
        "refused unless empty",
        _empty,
        "logit_bias is not supported",
    ),
    Field("modalities", '["text"] accepted; audio refused', _text_only, "this model writes text"),
    Field("audio", "refused: this model writes no audio", _never, "this model writes no audio"),
    Field(
        "prediction",
        "refused: predicted outputs are not supported",
        _never,
        "predicted outputs are not supported",
    ),
    Field(
        "functions",
        "refused (deprecated): send tools",
        _empty,
        "functions is deprecated: send tools",
    ),
    Field(
        "function_call",
        "refused (deprecated): send tool_choice",
        _never,
        "function_call is deprecated: send tool_choice",
    ),
    Field(
        "web_search_options",
        "refused: this server has no web search",
        _never,
        "this server has no web search",
    ),
    # vendor fields (openai SDK: extra_body)
    Field("thinking", LIB + ' (DeepSeek: {"type": "enabled"} or {"type": "disabled"})'),
]

COMPLETIONS_FIELDS = [
    Field("model", READ + ": must name the served model"),
    Field("prompt", READ + ": a string, token ids, or a list of one of those"),
    Field("stream", READ),
    Field("temperature", READ),
    Field("top_p", READ),
    Field("max_tokens", READ + " (default 16)"),
    Field("n", READ),
    Field("seed", READ),
    Field("stop", READ),
    Field("echo", READ),
    Field("logprobs", READ + " (0..5)"),
    Field("presence_penalty", READ),
    Field("frequency_penalty", READ),
    Field("best_of", "accepted when equal to n; refused otherwise"),
    Field("suffix", "refused: no fill-in-the-middle"),
    Field("logit_bias", "refused unless empty"),
    Field("stream_options", READ + ": include_usage"),
    Field("user", "accepted: an end-user id (a string); kept nowhere", _string, "a string"),
]

RESPONSES_FIELDS = [
    *_COMMON,
    Field("input", LIB),
    Field("instructions", LIB),
    Field("max_output_tokens", LIB + ": the output's token limit"),
    Field("max_tokens", READ + ": the same limit as max_output_tokens (not in OpenAI's API)"),
    Field(
        "text",
        LIB + ": format; the schema's keywords reach the grammar (constraints.py); beside "
        "tools under tool_choice auto the answer is that JSON or tool calls",
    ),
    Field("reasoning", LIB + ": effort turns thinking on"),
    Field(
        "truncation",
        '"disabled" accepted; "auto" refused (a prompt over the context is a 400)',
        _one_of("disabled"),
        'this server does not drop input items: send "disabled" or leave it out',
    ),
    Field(
        "include",
        '"message.output_text.logprobs" read (logprobs, top_logprobs alternatives); others refused',
        _include,
        'this server adds only "message.output_text.logprobs"',
    ),
    Field(
        "max_tool_calls",
        "refused: no built-in tools run here",
        _never,
        "this server runs no built-in tools",
    ),
    Field("background", "false accepted; true refused", _false, NO_STORE),
    Field(
        "background_options",
        "refused: no background mode",
        _never,
        "this server has no background mode",
    ),
    Field(
        "previous_response_id",
        "refused: responses are not stored (send the conversation in input)",
        _never,
        NO_STORE,
    ),
    Field("conversation", "refused: conversations are not stored", _never, NO_STORE),
    Field("prompt", "refused: no stored prompt templates", _never, NO_STORE),
    Field(
        "context_management",
        "refused: no compaction",
        _never,
        "this server does not compact the context",
    ),
    Field("image", "refused: no image generation", _never, "this server generates no images"),
    Field(
        "access_programs",
        "refused: no access programs",
        _never,
        "this server has no access programs",
    ),
]


def _sampling_extras(protocol: str) -> list[Field]:
    return [
        Field(name, READ + _VLLM)
        for name in EXTRA_SAMPLING.get(protocol, ())
        if name not in ("presence_penalty", "frequency_penalty")
    ]


_VLLM = " (vLLM-style extra; openai SDK: extra_body)"
# vLLM's structured outputs (guided.py); one constraint per request, none in thinking mode
GUIDED_FIELDS = [
    Field("guided_json", READ + ": a JSON Schema or its JSON text -> the output grammar" + _VLLM),
    Field("guided_regex", READ + ": the output matches the regular expression" + _VLLM),
    Field("guided_choice", READ + ": the output is one of the strings" + _VLLM),
    Field(
        "guided_grammar",
        READ + ": an EBNF grammar in xgrammar's syntax (root ::= ...); Lark is refused" + _VLLM,
    ),
    Field(
        "structured_outputs",
        READ
        + ": one of json, regex, choice, grammar (as the guided_ fields) or json_object"
        + _VLLM,
    ),
]

TABLES: dict[str, dict[str, Field]] = {
    protocol: {
        f.name: f
        for f in [
            *fields,
            *_sampling_extras(protocol),
            *(GUIDED_FIELDS if protocol != "responses" else []),
        ]
    }
    for protocol, fields in (
        ("chat_completions", CHAT_FIELDS),
        ("completions", COMPLETIONS_FIELDS),
        ("responses", RESPONSES_FIELDS),
    )
}


def check(body: dict[str, Any], protocol: str) -> dict[str, Any]:
    """``body`` with every field checked against ``protocol``'s table (a 400 naming the first
    refused or unknown one) and its :data:`ALIASES` folded in. A
    protocol with no table (Anthropic Messages) passes unchanged."""
    table = TABLES.get(protocol)
    if table is None:
        return body
    for name, value in body.items():
        field = table.get(name)
        if field is None:
            raise invalid(
                f"unknown field {name!r}: this server reads the fields listed in docs/api.md "
                "(Every OpenAI field, read or refused) and refuses the others rather than "
                "ignore them",
                name,
                "unknown_parameter",
            )
        if value is not None and field.allowed is not None and not field.allowed(value):
            raise invalid(
                f"{name} {value!r:.80} is not supported: {field.refusal}",
                name,
                "unsupported_value",
            )
    _check_parallel_tool_calls(body)
    if protocol == "responses" and LOGPROBS in (body.get("include") or ()):
        # the library turns logprobs on by top_logprobs alone
        body = body if body.get("top_logprobs") is not None else {**body, "top_logprobs": 0}
    alias = ALIASES.get(protocol)
    return body if alias is None else _fold(body, *alias)


# (the field the library ignores, the one it reads for the same limit)
ALIASES = {
    "chat_completions": ("max_completion_tokens", "max_tokens"),
    "responses": ("max_tokens", "max_output_tokens"),
}


def _fold(body: dict[str, Any], alias: str, read: str) -> dict[str, Any]:
    limit = body.get(alias)
    if limit is None:
        return body
    other = body.get(read)
    if other is not None and other != limit:
        raise invalid(
            f"{read} ({other!r:.20}) and {alias} ({limit!r:.20}) differ: send one of them",
            alias,
        )
    out = {k: v for k, v in body.items() if k != alias}
    out[read] = limit
    return out


def _check_parallel_tool_calls(body: dict[str, Any]) -> None:
    value = body.get("parallel_tool_calls")
    if value is None or value is True:
        return
    if value is not False:
        raise invalid(
            f"parallel_tool_calls must be true or false, got {value!r:.40}", "parallel_tool_calls"
        )
    choice = body.get("tool_choice")
    forced = choice == "required" or isinstance(choice, dict)
    if body.get("tools") and not forced and choice != "none":
        raise invalid(
            'parallel_tool_calls false is enforced only with tool_choice "required" or a '
            'named tool (with "auto" the model answers unconstrained and may call several)',
            "parallel_tool_calls",
            "unsupported_value",
        )


def parallel_calls(body: dict[str, Any]) -> bool:
    """Whether the request allows several tool calls in one answer (the default)."""
    return body.get("parallel_tool_calls") is not False


def markdown() -> str:
    """The table of fields in ``docs/api.md``, one row per field and protocol."""
    names = {
        "chat_completions": "Chat Completions",
        "completions": "Completions",
        "responses": "Responses",
    }
    rows = ["| endpoint | field | what the server does |", "|---|---|---|"]
    for protocol, table in TABLES.items():
        for name in sorted(table):
            rows.append(f"| {names[protocol]} | `{name}` | {table[name].use} |")
    return "\n".join(rows) + "\n"
