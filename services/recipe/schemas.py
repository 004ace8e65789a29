"""JSON Schemas of structured outputs and tool parameters, as the caller sent them (no I/O).

deepseek-recipe 0.2.0 closes a ``strict`` schema (``additionalProperties: false``, every
property required) and in doing so drops every other keyword: ``{"type": "string",
"maxLength": 12}`` reached the engine as ``{"type": "string"}``, so a bounded field ran to the
token limit. The recipe therefore takes each schema from the request body
(:func:`response_schema`, :func:`tool_parameters`), checks that every keyword in it is one the
grammar enforces (:func:`check_keywords`: a 400 naming the first one that is not; annotations
such as ``title`` and ``description`` constrain nothing and pass), and closes a strict schema
itself (:func:`close_strict`).

:func:`embed` turns a schema into EBNF rules that can stand inside another grammar (the DSML
tool-call grammar, ``constraints.py``): xgrammar's own JSON-schema grammar, its rules renamed
under a prefix, and every negated character class made to exclude ``<`` and ``｜``, which
begin or hold every added token (markup), so a JSON string can neither spell markup nor run
into the closing tag. A ``pattern`` becomes an xgrammar ``Regex``, which is not narrowed so:
a pattern that admits ``<`` or ``｜`` may admit markup tokens too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .api import invalid

# What xgrammar (0.2.9) enforces: measured by compiling each keyword and comparing grammars
# (uniqueItems, contains, dependentRequired, unevaluatedProperties, additionalItems change
# nothing: they are refused rather than ignored).
ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
        "definitions", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minProperties",
        "maxProperties", "patternProperties", "propertyNames",
    }
)  # fmt: skip
ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
        "deprecated", "readOnly", "writeOnly", "strict",
    }
)  # fmt: skip
# string formats xgrammar writes a grammar for
FORMATS = frozenset(
    {
        "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "uuid",
    }
)  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames")


def check_keywords(schema: Any, param: str, where: str = "schema") -> None:
    """A 400 naming ``param`` and the first keyword in ``schema`` the grammar does not
    enforce (its path in the schema too)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be a JSON Schema object", param)
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        # xgrammar enforces the pattern and drops the lengths (with a warning in its log)
        length = "minLength" if "minLength" in schema else "maxLength"
        raise invalid(
            f"JSON Schema keyword {length!r} beside 'pattern' (at {where}) is not supported: "
            "the grammar would enforce only the pattern; put the length in the pattern",
            param,
            "unsupported_value",
        )
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise invalid(
            f"JSON Schema format {fmt!r} (at {where}) is not supported; the grammar enforces "
            f"{', '.join(sorted(FORMATS))}",
            param,
            "unsupported_value",
        )
    for key, value in schema.items():
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise invalid(
                f"JSON Schema keyword {key!r} (at {where}) is not supported: the output "
                "grammar cannot enforce it; remove it from the schema",
                param,
                "unsupported_value",
            )
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_keywords(sub, param, f"{where}.{key}.{name}")
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_keywords(sub, param, f"{where}.{key}[{i}]")
        elif key in _SUBSCHEMAS and isinstance(value, (dict, bool)):
            check_keywords(value, param, f"{where}.{key}")
        elif key == "items" and isinstance(value, list):
            for i, sub in enumerate(value):
                check_keywords(sub, param, f"{where}.items[{i}]")


def close_strict(schema: Any) -> Any:
    """OpenAI's strict mode: every object with ``properties`` takes no other property and
    requires all of them, at every depth (a copy; the keywords stay)."""
    if isinstance(schema, list):
        return [close_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: close_strict(v) for k, v in value.items()}
        elif key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMAS):
            out[key] = close_strict(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict):
        out["additionalProperties"] = False
        out["required"] = list(out["properties"])
    return out


def prepared(schema: Any, strict: bool, param: str) -> Any:
    check_keywords(schema, param)
    return close_strict(schema) if strict else schema


def response_schema(body: dict[str, Any], protocol: str) -> str | None:
    """The structured-output schema of a Chat Completions or Responses body as JSON, checked
    and closed when strict; None when the body has none."""
    if protocol == "chat_completions":
        fmt, param = body.get("response_format"), "response_format"
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    else:
        text, param = body.get("text"), "text"
        spec = text.get("format") if isinstance(text, dict) else None
    if not isinstance(spec, dict) or spec.get("type", "json_schema") != "json_schema":
        return None
    schema = spec.get("schema")
    if not isinstance(schema, dict) or not schema:
        return None
    return json.dumps(prepared(schema, spec.get("strict") is True, param))


def tool_parameters(body: dict[str, Any]) -> dict[str, Any]:
    """Each function tool's parameter schema by name, as sent (checked; closed when
    strict). Chat Completions nests it under ``function``, Responses does not."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        if params is None:
            continue
        check_keywords(params, "tools", f"tools[{i}].parameters")
        out[fn["name"]] = close_strict(params) if fn.get("strict") is True else params
    return out


def for_library(body: dict[str, Any], protocol: str) -> dict[str, Any]:
    """``body`` as deepseek-recipe gets it: strict tools beside a structured answer lose
    their ``strict`` flag (the library refuses "response_format should not be used with tools"
    for that pair, which the OpenAI Agents SDK sends for every agent with tools and an
    output_type; the recipe closes those tools' schemas itself, :func:`tool_parameters`, from
    the body as sent). Anything else passes unchanged."""
    fmt = body.get("response_format") if protocol == "chat_completions" else body.get("text")
    if protocol == "responses" and isinstance(fmt, dict):
        fmt = fmt.get("format")
    tools = body.get("tools")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return body
    if not isinstance(tools, list):
        return body
    loose = [_unstrict(t) for t in tools]
    return body if loose == tools else {**body, "tools": loose}


def _unstrict(tool: Any) -> Any:
    if not isinstance(tool, dict):
        return tool
    if isinstance(tool.get("function"), dict) and "strict" in tool["function"]:
        fn = {k: v for k, v in tool["function"].items() if k != "strict"}
        return {**tool, "function": fn}
    if "strict" in tool and tool.get("type") == "function":
        return {k: v for k, v in tool.items() if k != "strict"}
    return tool


# -- a schema as EBNF rules inside another grammar ------------------------------------------------
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def embed(schema: Any, prefix: str) -> tuple[str, list[str]]:
    """(root rule name, rules) of ``schema``'s JSON grammar, every rule renamed
    ``{prefix}_...`` and every negated character class excluding ``<`` and ``｜``."""
    import xgrammar as xgr  # the recipe compiles nothing; only xgrammar writes schema grammars

    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    lines = [m.groups() for m in map(_RULE.match, text.splitlines()) if m]
    names = {name for name, _ in lines}
    rules = [f"{prefix}_{name} ::= {_rename(body, names, prefix)}" for name, body in lines]
    return f"{prefix}_root", rules


def _rename(body: str, names: set[str], prefix: str) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == '"':  # a string literal (also a Regex's pattern): copied as it is
            j = i + 1
            while body[j] != '"':
                j += 2 if body[j] == "\\" else 1
            out.append(body[i : j + 1])
            i = j + 1
        elif c == "[":  # a character class; a negated one excludes markup's characters
            j = i + 1
            while body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            cls = body[i : j + 1]
            out.append("[^<｜" + cls[2:] if cls.startswith("[^") else cls)
            i = j + 1
        elif m := _IDENT.match(body, i):
            word = m.group()
            out.append(f"{prefix}_{word}" if word in names else word)
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)
