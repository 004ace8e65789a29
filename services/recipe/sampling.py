"""Sampling fields the conversion library does not carry, read from the request body.

deepseek-recipe resolves ``temperature``, ``top_p``, ``seed`` and ``max_tokens``; the rest of a
request's sampling settings come straight from the JSON body: for OpenAI Chat Completions and
Completions the standard ``presence_penalty`` and ``frequency_penalty`` and, as vLLM accepts them in
``extra_body``, ``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``, ``repetition_penalty`` and
``stop_token_ids``; for Anthropic Messages ``top_k``. A field sent as ``null`` is not set. Types
are checked here (a 400 naming the field); ranges by :class:`~libs.common.sampling.SamplingParams`
(:func:`checked`), so the recipe refuses what the entrypoint would.
"""

from __future__ import annotations

from typing import Any

from libs.common.errors import InvalidArgument
from libs.common.sampling import SamplingParams
from libs.proto.deepserve.v1 import common_pb2

from .api import APIError, invalid

_NUMBER = ("presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")
_INT = ("top_k", "min_tokens")
_OPENAI = (*_NUMBER, *_INT, "ignore_eos", "stop_token_ids")
FIELDS: dict[str, tuple[str, ...]] = {
    "chat_completions": _OPENAI,
    "completions": _OPENAI,
    "messages": ("top_k",),
}


def extra_sampling(body: dict[str, Any], protocol: str) -> dict[str, Any]:
    """The extra sampling fields ``body`` sets for ``protocol`` (by proto field name)."""
    out: dict[str, Any] = {}
    for name in FIELDS.get(protocol, ()):
        value = body.get(name)
        if value is None:
            continue
        if name in _NUMBER and not _is_number(value):
            raise invalid(f"{name} must be a number, got {value!r}", name)
        if name in _INT and not _is_int(value):
            raise invalid(f"{name} must be an integer, got {value!r}", name)
        if name == "ignore_eos" and not isinstance(value, bool):
            raise invalid(f"ignore_eos must be true or false, got {value!r}", name)
        if name == "stop_token_ids" and not (
            isinstance(value, list) and all(_is_int(t) and 0 <= t < 2**31 for t in value)
        ):
            raise invalid("stop_token_ids must be a list of token ids (integers >= 0)", name)
        if name == "repetition_penalty" and not value > 0:  # 0 on the wire would mean "unset"
            raise invalid(f"repetition_penalty must be > 0 (1 = off), got {value}", name)
        if name in _INT and not -(2**31) <= value < 2**31:
            raise invalid(f"{name} is out of range, got {value}", name)
        out[name] = value
    return out


def checked(sp: common_pb2.SamplingParams, extra: dict[str, Any]) -> common_pb2.SamplingParams:
    """``sp`` with ``extra`` set, refused with a 400 naming the field when out of range."""
    for name, value in extra.items():
        if name == "stop_token_ids":
            sp.stop_token_ids.extend(value)
        else:
            setattr(sp, name, value)
    try:
        SamplingParams.from_proto(sp)
    except InvalidArgument as exc:
        field = (exc.field or "").removeprefix("sampling.").split("[")[0] or None
        raise APIError(400, str(exc).removeprefix("sampling."), param=field) from None
    return sp


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
