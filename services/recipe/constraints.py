r"""Structured outputs: the constraint the engine enforces for a converted request (no I/O).

deepseek-recipe reads ``response_format`` / ``text.format`` / ``tool_choice`` into
``InferenceOptions.output_constraint`` (kind ``json``, ``regex``, ``tool_call`` or
``tool_call_required``); :func:`output_constraint` turns that into the engine's
:class:`~libs.common.sampling.Constraint` where the engine can enforce it:

* ``json`` with an empty schema (``{"type": "json_object"}``) -> ``Constraint("json")``, any JSON
  object;
* ``json`` with a schema (``{"type": "json_schema", ...}``; the library has already closed a
  ``strict`` schema: ``additionalProperties: false``, every property required) ->
  ``Constraint("json_schema", schema)``;
* ``regex`` -> ``Constraint("regex", pattern)``;
* ``tool_call_required`` (OpenAI ``tool_choice`` "required" or a named function, Responses
  likewise, Anthropic ``{"type": "tool"}``) -> ``Constraint("ebnf", grammar)`` from
  :func:`tool_call_grammar`: the DSML tool calls the DeepSeek V4 encoding writes, after the
  ``<｜DSML｜tool_calls>\n`` the prompt already opened (the library prefills it and its parser
  starts inside the block). For ``get_weather(city: string, required; days: integer)``::

      root ::= call ("\n" call)* "\n</" Token(128825) "tool_calls>"
      call ::= t0
      t0 ::= "<" Token(128825) "invoke name=\"get_weather\">\n" t0p0 t0p1?
             "</" Token(128825) "invoke>"
      t0p0 ::= "<" Token(128825) "parameter name=\"city\" string=\""
               ("true\">" text) "</" Token(128825) "parameter>\n"
      t0p1 ::= "<" Token(128825) "parameter name=\"days\" string=\""
               ("false\">" json_int) "</" Token(128825) "parameter>\n"

  (one line per rule in the real grammar) plus the shared ``text``, ``json_*`` and
  ``any_param`` rules. ``Token(128825)`` is xgrammar's syntax for that one token id, the
  ``｜DSML｜`` added token: the library's parser reads markup only where the special token
  stands (the same characters in plain pieces are argument text), and a text literal would let
  the model spell it in plain pieces -- a random-weight model does. The engine allows EOS only
  once the grammar is complete, so ``</｜DSML｜tool_calls>`` then EOS ends the output.

What the tool-call grammar enforces, and what it decides (the library's parser accepts more):

* one or more calls, each to a listed tool (a named tool: the library lists only that one, so
  every call is to it; it cannot tell "required" with one tool from a named one, so a named
  tool may be called more than once too), separated and closed as the encoding renders them;
* a tool's parameters in the order of its schema's ``properties``; those in ``required``
  must be there, the others may (no ``required``: all optional, as in JSON Schema; the
  library makes every property of a ``strict`` tool required); no undeclared names. A schema
  without ``properties``: any number of parameters with any name, either form of value;
* ``type: string`` -> ``string="true"`` and free text without ``<`` (except ``<`` before a
  space, ``=`` or a digit, as in ``a < b``) or ``｜``: every added token (chat markup,
  ``｜DSML｜``, EOS) begins with ``<`` followed by another character or contains ``｜``, so the
  text cannot spell markup nor run into the closing ``</｜DSML｜parameter>``;
  ``minLength``/``maxLength`` bound it (then without any ``<``, one character a repetition),
  ``pattern`` is an xgrammar ``Regex`` over it (with a length, or ``format``: a 400);
  ``enum`` / ``const`` -> those values (strings as ``string="true"`` text, others as JSON, as
  the library renders them); ``integer``, ``number``, ``boolean``, ``null`` by JSON pattern;
  a non-string schema that says more than its type (ranges, ``items``, nested
  ``properties``, ``minItems`` ...) -> xgrammar's own grammar of it (``schemas.embed``), so
  its keywords hold at every depth; ``$ref`` into the tool's ``$defs`` is followed, a
  top-level ``anyOf``/``oneOf`` is each alternative; no type and no keyword -> either text
  or any JSON value. The schemas are the caller's (``schemas.tool_parameters``: the library
  drops their keywords), and a keyword the grammar cannot enforce is a 400 naming it. The
  parser splices a ``string="false"`` value verbatim into the arguments, so only JSON may
  stand there. JSON is written compactly, a space allowed after ``,`` and ``:`` (the
  library's rendering); JSON strings exclude ``<`` and ``｜`` as text does (``\u003c``
  spells ``<``);
* ``parallel_tool_calls: false`` -> exactly one call;
* :data:`TEXT_LIMIT`: at most that many characters per text or JSON string (None: no limit;
  the tests set one so that a random-weight model finishes its strings).

Not enforced (the engine samples freely and the library's parser reads the output, as before):

* anything in thinking mode: the output is the reasoning, ``</think>``, then the answer, and a
  constraint covers the whole output, so it would forbid the reasoning (a required or named
  tool choice in thinking mode the library refuses anyway: a 400);
* ``tool_call`` (``tool_choice`` auto, Anthropic ``any``, which the library treats as auto:
  the model may answer in text) -- unless the request also asks for a JSON answer
  (``response_format`` / ``text.format``; the OpenAI Agents SDK's ``output_type``): then the
  output is that JSON or a tool-call block (:func:`answer_schema`);
* a tool-call grammar over :data:`~libs.common.sampling.MAX_CONSTRAINT_BYTES` (hundreds of
  tools): the request goes on unconstrained with the library's prefill, rather than failing.
"""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as dr

from libs.common.errors import InvalidArgument
from libs.common.sampling import MAX_CONSTRAINT_BYTES, Constraint

from .api import invalid
from .fields import parallel_calls
from .schemas import ANNOTATIONS, embed, response_schema, tool_parameters

DSML = "｜DSML｜"
# The DSML token's id in the DeepSeek V4 vocabulary (the only one this encoding serves: a
# checkpoint with another tokenizer gets its own chat template, which refuses tools). The
# grammar names it as ``Token(id)``: the library's parser reads markup only where the special
# token stands, and a text literal would also let the model spell "｜DSML｜" in plain pieces.
DSML_TOKEN_ID = 128825
_CALLS_END = f"\n</{DSML}tool_calls>"  # after the last call; then the model's EOS
_PARAM_END = f"</{DSML}parameter>\n"
_CALLS_BEGIN = f"\n\n<{DSML}tool_calls>\n"  # how an answer opens its tool calls
TEXT_LIMIT: int | None = None  # characters per free string; None: unbounded


def output_constraint(
    conv: dr.ConversationRequest,
    thinking: bool,
    body: dict[str, Any] | None = None,
    protocol: str = "",
) -> Constraint | None:
    """The constraint to send with ``conv``; None where the engine cannot enforce the
    request's (see the module docstring). ``thinking``: the output begins with reasoning.
    ``body``: the decoded request, whose schemas are used as sent (``schemas.py``: the library
    drops their keywords); ``protocol``: its protocol's name."""
    oc = conv.inference_options.output_constraint
    if oc is None or thinking:
        return None
    body = body or {}
    if oc.kind == "json":
        raw = response_schema(body, protocol) if oc.schema else None
        kind, spec = ("json_schema", raw or oc.schema) if oc.schema else ("json", "")
    elif oc.kind == "regex":
        kind, spec = "regex", oc.schema
    elif oc.kind in ("tool_call_required", "tool_call"):
        answer = answer_schema(body, protocol) if oc.kind == "tool_call" else None
        if oc.kind == "tool_call" and answer is None:
            return None  # tool_choice auto: the model may answer in text
        tools = json.loads(oc.schema)
        params = tool_parameters(body)
        for tool in tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and fn.get("name") in params:
                fn["parameters"] = params[fn["name"]]
        grammar = tool_call_grammar(tools, TEXT_LIMIT, parallel_calls(body))
        if grammar and answer is not None:
            grammar = _answer_or_calls(grammar, answer)
        if not grammar or len(grammar.encode()) > MAX_CONSTRAINT_BYTES:
            return None  # no tool, or too many to enforce: the library's prefill stands
        return Constraint("ebnf", grammar)
    else:
        return None
    if len(spec.encode()) > MAX_CONSTRAINT_BYTES:
        raise invalid(
            f"the output schema is {len(spec.encode())} bytes; at most "
            f"{MAX_CONSTRAINT_BYTES} can be enforced",
            "response_format",
        )
    try:
        return Constraint(kind, spec)
    except InvalidArgument as exc:  # e.g. an empty pattern
        raise invalid(
            f"the output constraint {str(exc).removeprefix('sampling.')}", "response_format"
        ) from None


def answer_schema(body: dict[str, Any], protocol: str) -> Any:
    """The JSON Schema a text answer must follow (``response_format`` / ``text.format``:
    ``json_schema``, or ``json_object`` as any object); None for a free answer."""
    if protocol == "chat_completions":
        fmt = body.get("response_format")
    else:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    schema = response_schema(body, protocol) if kind == "json_schema" else None
    return None if schema is None else json.loads(schema)


def _answer_or_calls(calls_grammar: str, schema: Any) -> str:
    """tool_choice auto with a structured answer (the OpenAI Agents SDK's output_type): the
    output is either the JSON answer or, as the encoding writes one, a tool-call block
    (``\\n\\n<｜DSML｜tool_calls>\\n`` then the calls). deepseek-recipe keeps only the tools
    then, so without this the answer's schema went unenforced."""
    try:
        root, rules = embed(schema, "answer")
    except (RuntimeError, ValueError) as exc:
        raise invalid(
            f"the output schema cannot be enforced: {str(exc).splitlines()[-1]}",
            "response_format",
        ) from None
    calls = calls_grammar.replace("root ::= ", "calls ::= ", 1)
    head = f"root ::= {root} | {_lit(_CALLS_BEGIN)} calls"
    return "\n".join([head, calls.rstrip("\n"), *rules]) + "\n"


# -- the DSML tool-call grammar -------------------------------------------------------------------
def tool_call_grammar(
    tools: list[Any], text_limit: int | None = None, parallel: bool = True
) -> str:
    """An xgrammar EBNF grammar for what follows the prefilled ``<｜DSML｜tool_calls>\\n``:
    one or more calls of ``tools`` (Chat Completions function tools, as the library lists them
    in ``OutputConstraint.schema``), then the block's end; "" when no tool has a name.
    ``text_limit``: at most that many characters per free string (None: unbounded);
    ``parallel`` false: exactly one call (``parallel_tool_calls: false``)."""
    rules: list[str] = []
    calls: list[str] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        calls.append(f"t{i}")
        rules.extend(_invoke_rules(f"t{i}", name, fn.get("parameters")))
    if not calls:
        return ""
    rep = "*" if text_limit is None else f"{{0,{text_limit}}}"
    more = ' ("\\n" call)*' if parallel else ""
    head = [
        f"root ::= call{more} {_lit(_CALLS_END)}",
        f"call ::= {' | '.join(calls)}",
    ]
    return "\n".join(head + rules + _shared_rules(rep)) + "\n"


def _lit(text: str) -> str:
    """An EBNF sequence for ``text``: string literals (JSON escapes, which xgrammar reads),
    with every ``｜DSML｜`` as the single special token."""
    pieces: list[str] = []
    for i, part in enumerate(text.split(DSML)):
        pieces += [f"Token({DSML_TOKEN_ID})"] if i else []
        pieces += [json.dumps(part, ensure_ascii=False)] if part else []
    return " ".join(pieces) or '""'


def _invoke_rules(rule: str, name: str, schema: Any) -> list[str]:
    begin, end = _lit(f'<{DSML}invoke name="{name}">\n'), _lit(f"</{DSML}invoke>")
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):  # nothing declared: any parameters
        return [f"{rule} ::= {begin} any_param* {end}"]
    required = schema.get("required")
    required = set(required) if isinstance(required, list) else set()
    defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    body: list[str] = []
    rules: list[str] = []
    for j, (pname, pschema) in enumerate(props.items()):
        head = _lit(f'<{DSML}parameter name="{pname}" string="')
        tail = _lit(_PARAM_END)
        value = _Value(f"{rule}p{j}", defs, rules).of(pschema)
        rules.append(f"{rule}p{j} ::= {head} {value} {tail}")
        body.append(f"{rule}p{j}" + ("" if pname in required else "?"))
    return [f"{rule} ::= {' '.join([begin, *body, end])}", *rules]


_TEXT, _JSON = '"true\\">" text', '"false\\">" '
_ANY = f"({_TEXT} | {_JSON}json_value)"
_BY_TYPE = {
    "string": _TEXT,
    "integer": _JSON + "json_int",
    "number": _JSON + "json_number",
    "boolean": _JSON + '("true" | "false")',
    "null": _JSON + '"null"',
    "object": _JSON + "json_object",
    "array": _JSON + "json_array",
}


class _Value:
    """The rest of a parameter's opening tag (``true">`` or ``false">``) and its value, for
    one parameter's schema; rules it needs go to ``rules``, named under ``rule``. Strings are
    text (``minLength``/``maxLength`` bound it, ``pattern`` is a Regex over it); other types are
    JSON, through xgrammar's grammar of the schema (``schemas.embed``) when the schema says
    more than its type. ``$ref`` to the tool's ``$defs`` is followed; ``anyOf``/``oneOf`` at
    the parameter's top are alternatives of each. What cannot be enforced is a 400 naming
    the keyword (``tools``)."""

    def __init__(self, rule: str, defs: dict[str, Any], rules: list[str]) -> None:
        self.rule, self.defs, self.rules, self.n = rule, defs, rules, 0

    def _name(self) -> str:
        self.n += 1
        return f"{self.rule}_{self.n}"

    def of(self, schema: Any, depth: int = 0) -> str:
        if not isinstance(schema, dict):
            return _ANY
        ref = schema.get("$ref")
        if isinstance(ref, str) and depth < 8:
            target = self.defs.get(ref.rsplit("/", 1)[-1])
            if isinstance(target, dict):
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                return self.of({**target, **rest}, depth + 1)
        values = schema.get("enum")
        if "const" in schema:
            values = [schema["const"]]
        if isinstance(values, list) and values:
            alts = [
                f'"true\\">" {_lit(v)}'
                if isinstance(v, str)
                else _JSON + _lit(json.dumps(v, ensure_ascii=False))
                for v in values
            ]
            return f"({' | '.join(dict.fromkeys(alts))})"
        for key in ("anyOf", "oneOf"):
            subs = schema.get(key)
            if isinstance(subs, list) and subs and depth < 8:
                base = {k: v for k, v in schema.items() if k != key}
                return f"({' | '.join(self.of({**base, **s}, depth + 1) for s in subs)})"
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        keywords = set(schema) - ANNOTATIONS - {"type"}
        if schema.get("enum") == []:  # no value at all: read, as before, as no bound
            schema = {k: v for k, v in schema.items() if k != "enum"}
            keywords.discard("enum")
        if not isinstance(types, list) or not types or any(t not in _BY_TYPE for t in types):
            return self._json(schema) if keywords else _ANY
        alts = [self._string(schema) for t in types if t == "string"]
        others = [t for t in dict.fromkeys(types) if t != "string"]
        if others and keywords:
            alts.append(self._json({**schema, "type": others}))
        elif others:
            alts += [_BY_TYPE[t] for t in others]
        return f"({' | '.join(alts)})"

    def _string(self, schema: dict[str, Any]) -> str:
        if "format" in schema:
            raise _refused("format")
        lo, hi, pattern = schema.get("minLength"), schema.get("maxLength"), schema.get("pattern")
        if pattern is not None:
            if lo is not None or hi is not None:
                raise _refused("minLength" if lo is not None else "maxLength", "with pattern")
            if not isinstance(pattern, str):
                raise _refused("pattern", "that is not a string")
            return f'"true\\">" Regex({json.dumps(pattern, ensure_ascii=False)})'
        if lo is None and hi is None:
            return _TEXT
        if not all(v is None or (isinstance(v, int) and v >= 0) for v in (lo, hi)):
            raise _refused("minLength" if lo is not None else "maxLength", "not an integer >= 0")
        name = self._name()
        # one character per repetition ("<" never: see text_char), so the bound is exact
        self.rules.append(f"{name} ::= [^<｜]{{{lo or 0},{'' if hi is None else hi}}}")
        return f'"true\\">" {name}'

    def _json(self, schema: dict[str, Any]) -> str:
        try:
            root, rules = embed(
                {**schema, "$defs": self.defs} if self.defs else schema, self._name()
            )
        except (RuntimeError, ValueError) as exc:  # xgrammar's refusal of the schema
            raise invalid(
                f"a tool's parameter schema cannot be enforced: {str(exc).splitlines()[-1]}",
                "tools",
            ) from None
        self.rules.extend(rules)
        return _JSON + root


def _refused(keyword: str, why: str = "") -> Exception:
    return invalid(
        f"JSON Schema keyword {keyword!r} {why + ' ' if why else ''}in a tool's string "
        "parameter is not supported: tool-call strings are enforced as text; remove it",
        "tools",
        "unsupported_value",
    )


def _shared_rules(rep: str) -> list[str]:
    """Free text, JSON values and undeclared parameters; ``rep`` bounds a string's length."""
    return [
        f"text ::= text_char{rep}",
        # "<" only before a space, "=" or a digit, and no "｜": see the module docstring
        'text_char ::= [^<｜] | "<" [ =0-9]',
        f'any_param ::= {_lit(f"<{DSML}parameter name=")} "\\"" param_name "\\" string=\\"" '
        f"{_ANY} {_lit(_PARAM_END)}",
        'param_name ::= [^"<｜\\n]{1,64}',
        "json_value ::= json_object | json_array | json_string | json_number"
        ' | "true" | "false" | "null"',
        'json_object ::= "{" (json_member ("," " "? json_member)*)? "}"',
        'json_member ::= json_string ":" " "? json_value',
        'json_array ::= "[" (json_value ("," " "? json_value)*)? "]"',
        f'json_string ::= "\\"" json_char{rep} "\\""',
        'json_char ::= [^"\\\\<｜\\u0000-\\u001f] | "<" [ =0-9]'
        ' | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4})',
        'json_int ::= "-"? ("0" | [1-9] [0-9]*)',
        'json_number ::= json_int ("." [0-9]+)? ([eE] [+-]? [0-9]+)?',
    ]
