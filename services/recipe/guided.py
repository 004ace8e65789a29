"""vLLM's structured-output request fields (no I/O), for Chat Completions and Completions.

vLLM clients send the output's constraint as extra body fields; each becomes the engine's
:class:`~libs.common.sampling.Constraint`, the kinds ``response_format`` uses (``constraints.py``):

* ``guided_json``: a JSON Schema (an object, or its JSON text) -> ``json_schema``, the schema as
  sent (its keywords checked as ``response_format``'s are: ``schemas.check_keywords``; not
  closed: vLLM has no strict mode);
* ``guided_regex``: a regular expression -> ``regex``;
* ``guided_choice``: a list of strings -> ``regex``, the alternatives escaped (exactly one of
  them is the output);
* ``guided_grammar``: an EBNF grammar in xgrammar's syntax (GBNF-like, ``root ::= ...``; the
  engine's grammar backend, ``libs/engine/grammar.py``) -> ``ebnf``; a Lark grammar, which vLLM
  also reads, does not parse here and is a 400. An EBNF constraint sees added tokens by their
  text (a DSML tool call needs that), so a grammar whose literals or classes spell chat markup
  lets the model write it;
* ``structured_outputs``: vLLM's newer object, one of ``json``, ``regex``, ``choice``,
  ``grammar`` (each as above) or ``json_object: true`` (-> ``json``, any JSON object); any
  other key is refused by name.

Each is checked here with xgrammar's own parser (no vocabulary: nothing is compiled), so what
does not parse is a 400 naming the field rather than an engine error. Refused with a 400 naming
the fields: two constraints at once (two of these, or one beside ``response_format`` or a
required or named ``tool_choice``) and, in Chat Completions, any of them in thinking mode (the
constraint would cover the reasoning too; ``response_format`` is then left unenforced, but a
field whose only meaning is the constraint is refused rather than ignored). Beside tools under
``tool_choice`` auto the constraint holds: the answer follows it, so no tool is called (as in
vLLM).
"""

from __future__ import annotations

import json
from typing import Any

from libs.common.errors import InvalidArgument
from libs.common.sampling import MAX_CONSTRAINT_BYTES, Constraint

from .api import invalid
from .schemas import check_keywords

FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
# structured_outputs' keys, and the guided field each one is
_STRUCTURED = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "json_object": "json_object",
}
_REGEX_META = frozenset("\\.^$|?*+()[]{}")


def requested(body: dict[str, Any]) -> list[str]:
    """The guided fields ``body`` sets (not null), in :data:`FIELDS` order."""
    return [name for name in FIELDS if body.get(name) is not None]


def guided_constraint(body: dict[str, Any]) -> tuple[str, Constraint] | None:
    """(the field, its constraint) for the one guided field ``body`` sets; None for none; a 400
    naming the fields when it sets more than one, naming the field when its value is bad."""
    names = requested(body)
    if not names:
        return None
    if len(names) > 1:
        raise conflict(names[0], names[1])
    name = names[0]
    value = body[name]
    if name != "structured_outputs":
        return name, _constraint(name, value, name)
    if not isinstance(value, dict):
        raise invalid(
            "structured_outputs must be an object holding one of json, regex, choice, grammar "
            f"and json_object, got {value!r:.80}",
            name,
        )
    unknown = sorted(k for k in value if k not in _STRUCTURED)
    if unknown:
        raise invalid(
            f"structured_outputs.{unknown[0]} is not supported: this server reads json, regex, "
            "choice, grammar and json_object",
            name,
            "unsupported_value",
        )
    keys = [k for k in _STRUCTURED if value.get(k) is not None]
    if keys == ["json_object"] and value["json_object"] is False:
        return None  # json_object: false asks nothing
    if len(keys) != 1:
        raise invalid(
            "structured_outputs must hold exactly one of json, regex, choice, grammar and "
            f"json_object; got {', '.join(keys) or 'none'}",
            name,
        )
    return name, _constraint(_STRUCTURED[keys[0]], value[keys[0]], f"{name}.{keys[0]}")


def conflict(first: str, second: str) -> Exception:
    return invalid(
        f"{first} and {second} both constrain the output; send one of them",
        second,
        "conflicting_parameters",
    )


def _constraint(kind: str, value: Any, where: str) -> Constraint:
    """``value`` of guided field ``kind`` as a Constraint; a 400 naming ``where``'s field."""
    param = where.split(".")[0]
    if kind == "json_object":
        if value is not True:
            raise invalid(f"{where} must be true or false, got {value!r:.40}", param)
        return Constraint("json", "")
    if kind == "guided_json":
        kind, spec = "json_schema", _schema(value, where)
    elif kind == "guided_regex":
        if not isinstance(value, str) or not value:
            raise invalid(f"{where} must be a non-empty string (a regular expression)", param)
        kind, spec = "regex", value
    elif kind == "guided_choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise invalid(f"{where} must be a non-empty list of non-empty strings", param)
        kind, spec = "regex", choice_regex(value)
    else:
        if not isinstance(value, str) or not value.strip():
            raise invalid(f"{where} must be a non-empty string (an EBNF grammar)", param)
        kind, spec = "ebnf", value
    size = len(spec.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise invalid(
            f"{where} is {size} bytes; at most {MAX_CONSTRAINT_BYTES} can be enforced", param
        )
    _parse(kind, spec, where, param)
    try:
        return Constraint(kind, spec)
    except InvalidArgument as exc:
        raise invalid(f"{where}: {str(exc).removeprefix('sampling.')}", param) from None


def _schema(value: Any, where: str) -> str:
    param = where.split(".")[0]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise invalid(f"{where} is a string that is not JSON (a JSON Schema)", param) from None
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON Schema (an object or its JSON text)", param)
    check_keywords(value, param, where)
    return json.dumps(value, ensure_ascii=False)


def choice_regex(choices: list[str]) -> str:
    """A regular expression matching exactly one of ``choices`` (xgrammar's syntax)."""
    return "(" + "|".join(_escape(c) for c in dict.fromkeys(choices)) + ")"


def _escape(text: str) -> str:
    out = []
    for c in text:
        if c in _REGEX_META:
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def _parse(kind: str, spec: str, where: str, param: str) -> None:
    """A 400 naming ``param`` when xgrammar does not read ``spec`` (parsing only)."""
    import xgrammar as xgr  # as schemas.embed: the recipe parses, the engine compiles

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).splitlines()[-1] if str(exc) else type(exc).__name__
        reason = reason.split(": ", 1)[-1] if reason.startswith("[") else reason
        raise invalid(f"{where} does not parse: {reason}", param) from None
