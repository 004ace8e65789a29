"""recipe: JSON Schema keywords reach the grammar as sent -- in ``response_format`` and in tool
parameters (DSML: strings as text, other types as JSON) -- or are refused with a 400 naming
them. deepseek-recipe 0.2.0 drops them when it closes a strict schema; the random-weight tiny
engine then shows every answer following the bounds (only the grammar can make it)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from libs.common.sampling import SamplingParams
from services.recipe.encoding import PromptEncoder

from ..sdk_strict import openai_client, strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_recipe import make_app
from .test_recipe_constraints import (  # noqa: F401 (engine, grammars: fixtures)
    EngineBackend,
    engine,
    follows,
    grammars,
    rendered_calls,
)

USER: Any = [{"role": "user", "content": "give me JSON"}]
BOUNDED: Any = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 12},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 2,
        },
        "where": {"$ref": "#/$defs/Where"},
    },
    "$defs": {
        "Where": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        }
    },
}
STRICT = {"name": "weather", "strict": True, "schema": BOUNDED}
TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "strict": True, "parameters": BOUNDED},
}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


@pytest.fixture
def backend(encoder: PromptEncoder) -> FakeBackend:
    return FakeBackend(encoder)


@pytest.fixture
def client(encoder: PromptEncoder, backend: FakeBackend) -> TestClient:
    return strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))


def test_strict_schema_keeps_its_keywords(client: TestClient, backend: FakeBackend) -> None:
    fmt = {"type": "json_schema", "json_schema": STRICT}
    r = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": USER, "response_format": fmt}
    )
    assert r.status_code == 200, r.text
    c = SamplingParams.from_proto(backend.requests[-1].sampling).constraint
    assert c is not None and c.kind == "json_schema"
    spec = json.loads(c.spec)
    assert spec["properties"]["city"] == {"type": "string", "minLength": 2, "maxLength": 12}
    assert spec["additionalProperties"] is False and spec["required"] == list(BOUNDED["properties"])
    assert spec["$defs"]["Where"]["required"] == ["zone"]  # closed at every depth


@pytest.mark.parametrize(
    ("path", "field", "param"),
    [
        ("/v1/chat/completions", "response_format", "response_format"),
        ("/v1/chat/completions", "tools", "tools"),
        ("/v1/responses", "text", "text"),
    ],
)
def test_a_keyword_the_grammar_cannot_enforce_is_a_400(
    client: TestClient, path: str, field: str, param: str
) -> None:
    schema = {"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}}
    body: dict[str, Any] = {"model": MODEL}
    body["messages" if path != "/v1/responses" else "input"] = USER
    if field == "response_format":
        body[field] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    elif field == "text":
        body[field] = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "uniqueItems" in err["message"]


@pytest.mark.parametrize(
    ("prop", "named"),
    [
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
        ({"type": "string", "format": "zip-code"}, "zip-code"),
    ],
)
def test_what_xgrammar_would_drop_in_response_format_is_a_400(
    client: TestClient, prop: dict[str, Any], named: str
) -> None:
    schema = {"type": "object", "properties": {"s": prop}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": MODEL, "messages": USER, "response_format": fmt}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and named in err["message"]


def test_pattern_with_a_length_in_a_tool_string_is_a_400(client: TestClient) -> None:
    bad = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "a+", "maxLength": 3}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "tools": [tool], "tool_choice": "required"},
    )
    assert r.status_code == 400 and "maxLength" in r.json()["error"]["message"]


def test_random_model_follows_every_bound(encoder: PromptEncoder, engine: Any) -> None:  # noqa: F811
    backend = EngineBackend(encoder, engine)
    client = strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))
    oai = openai_client(
        base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=client
    )
    for seed in range(2):
        out = oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[TOOL],
            tool_choice=NAMED,
            seed=seed,
            max_tokens=400,
            temperature=1.0,
            parallel_tool_calls=False,
        )
        calls = out.choices[0].message.tool_calls or []
        assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1, out
        args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        jsonschema.validate(args, {**BOUNDED, "required": list(BOUNDED["properties"])})
        answer = oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            seed=seed,
            max_tokens=400,
            temperature=1.0,
            response_format={"type": "json_schema", "json_schema": STRICT},  # type: ignore[typeddict-item]
        )
        assert answer.choices[0].finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), BOUNDED)


def test_auto_tools_beside_a_structured_answer_enforce_both(
    client: TestClient,
    backend: FakeBackend,
    encoder: PromptEncoder,
    grammars: Any,  # noqa: F811
) -> None:
    """The OpenAI Agents SDK's request for an agent with tools and an output_type: strict tools,
    tool_choice auto, a strict json_schema. deepseek-recipe refuses strict tools beside a
    response_format and keeps only the tools under auto; the recipe sends the library the tools
    unflagged and enforces "the JSON answer, or tool calls"."""
    tool = {"type": "function", "function": {**TOOL["function"], "name": "get_weather"}}
    fmt = {"type": "json_schema", "json_schema": STRICT}
    body = {"model": MODEL, "messages": USER, "tools": [tool], "response_format": fmt}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    c = SamplingParams.from_proto(backend.requests[-1].sampling).constraint
    assert c is not None and c.kind == "ebnf"
    answer = {
        "city": "Paris",
        "code": "PAR",
        "unit": "c",
        "days": 3,
        "tags": ["a"],
        "where": {"zone": 1},
    }
    assert follows(grammars, encoder, c, json.dumps(answer))
    assert not follows(grammars, encoder, c, json.dumps({**answer, "days": 9}))
    assert not follows(grammars, encoder, c, json.dumps({**answer, "city": "x" * 13}))
    call = rendered_calls(encoder, [("get_weather", answer)])
    assert not follows(grammars, encoder, c, call)  # the block must open first
    assert follows(grammars, encoder, c, "\n\n<｜DSML｜tool_calls>\n" + call)
