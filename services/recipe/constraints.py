"""Structured outputs: the constraint the engine enforces for a converted request (no I/O).

deepseek-recipe reads ``response_format`` / ``text.format`` / ``tool_choice`` into
``InferenceOptions.output_constraint`` (kind ``json``, ``regex``, ``tool_call`` or
``tool_call_required``); :func:`output_constraint` turns that into the engine's
:class:`~libs.common.sampling.Constraint` where the engine can enforce it:

* ``json`` with an empty schema (``{"type": "json_object"}``) -> ``Constraint("json")``, any JSON
  object;
* ``json`` with a schema (``{"type": "json_schema", ...}``; the library has already closed a
  ``strict`` schema: ``additionalProperties: false``, every property required) ->
  ``Constraint("json_schema", schema)``;
* ``regex`` -> ``Constraint("regex", pattern)``.

Not enforced (the engine samples freely and the library's parser reads the output, as before):

* anything in thinking mode: the output is the reasoning, ``</think>``, then the answer, and a
  constraint covers the whole output, so it would forbid the reasoning;
* ``tool_call`` (``tool_choice`` auto, Anthropic ``any``: the model may answer in text);
* ``tool_call_required`` (OpenAI ``tool_choice`` "required" or a named function, Anthropic
  ``{"type": "tool"}``): the engine's ``tool_call`` kind is "begin text, JSON arguments, end
  text", but the DeepSeek V4 encoding writes a call's arguments as one DSML element per
  parameter (``<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>``), not as
  a JSON object, and ``｜DSML｜`` is a special token that a text grammar does not match. The
  library's own measure stays: the prompt opens the tool-call block
  (``<｜DSML｜tool_calls>``) and its parser starts inside it.
"""

from __future__ import annotations

import deepseek_recipe as dr

from libs.common.errors import InvalidArgument
from libs.common.sampling import MAX_CONSTRAINT_BYTES, Constraint

from .api import invalid


def output_constraint(conv: dr.ConversationRequest, thinking: bool) -> Constraint | None:
    """The constraint to send with ``conv``; None where the engine cannot enforce the
    request's (see the module docstring). ``thinking``: the output begins with reasoning."""
    oc = conv.inference_options.output_constraint
    if oc is None or thinking:
        return None
    if oc.kind == "json":
        kind, spec = ("json_schema", oc.schema) if oc.schema else ("json", "")
    elif oc.kind == "regex":
        kind, spec = "regex", oc.schema
    else:  # tool_call, tool_call_required: not expressible in the V4 encoding
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
