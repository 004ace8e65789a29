"""recipe: vLLM's structured-output fields -- guided_json, guided_regex, guided_choice,
guided_grammar and structured_outputs of Chat Completions and Completions reach the engine as
the constraint response_format would send, or are a 400 naming the field (both fields where
two constrain the output)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from starlette.testclient import TestClient

from libs.common.sampling import Constraint, SamplingParams
from services.recipe.encoding import PromptEncoder
from services.recipe.guided import choice_regex

from ..sdk_strict import openai_client, strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_recipe import make_app

USER: Any = [{"role": "user", "content": "answer in JSON"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GRAMMAR = 'root ::= "yes" | "no"'
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASE: dict[str, dict[str, Any]] = {
    "chat": {"model": MODEL, "messages": USER, "max_tokens": 8},
    "completions": {"model": MODEL, "prompt": "Say yes", "max_tokens": 8},
}
TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])  # thinking off by default, as the recipe serves


@pytest.fixture
def backend(encoder: PromptEncoder) -> FakeBackend:
    return FakeBackend(encoder)


@pytest.fixture
def client(encoder: PromptEncoder, backend: FakeBackend) -> TestClient:
    return strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))


def sent(backend: FakeBackend) -> Constraint | None:
    """The constraint of the (only) backend request, as the engine reads it."""
    (request,) = backend.requests
    return SamplingParams.from_proto(request.sampling).constraint


def post(client: TestClient, route: str, **fields: Any) -> Any:
    return client.post(PATHS[route], json={**BASE[route], **fields})


# -- the guided fields constrain ------------------------------------------------------------------
GUIDED = [
    ({"guided_json": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": r"\d{3}-[a-z]+"}, Constraint("regex", r"\d{3}-[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, Constraint("regex", "(yes|no)")),
    ({"guided_grammar": GRAMMAR}, Constraint("ebnf", GRAMMAR)),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+")),
    ({"structured_outputs": {"choice": ["a.b", "c"]}}, Constraint("regex", r"(a\.b|c)")),
    ({"structured_outputs": {"grammar": GRAMMAR}}, Constraint("ebnf", GRAMMAR)),
    ({"structured_outputs": {"json_object": True}}, Constraint("json", "")),
    ({"structured_outputs": {"regex": "a+", "json": None}}, Constraint("regex", "a+")),
]


@pytest.mark.parametrize("route", sorted(PATHS))
@pytest.mark.parametrize(("fields", "expected"), GUIDED)
def test_each_guided_field_constrains(
    client: TestClient,
    backend: FakeBackend,
    route: str,
    fields: dict[str, Any],
    expected: Constraint,
) -> None:
    r = post(client, route, **fields)
    assert r.status_code == 200, r.text
    assert sent(backend) == expected


@pytest.mark.parametrize("route", sorted(PATHS))
def test_no_guided_field_no_constraint(
    client: TestClient, backend: FakeBackend, route: str
) -> None:
    nulls = dict.fromkeys(["guided_json", "guided_regex", "guided_choice", "guided_grammar"])
    assert post(client, route, **nulls, structured_outputs=None).status_code == 200
    assert sent(backend) is None


def test_openai_sdk_extra_body(client: TestClient, backend: FakeBackend) -> None:
    oai = openai_client(
        base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=client
    )
    oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, extra_body={"guided_choice": ["x", "y"]}
    )
    oai.completions.create(
        model=MODEL, prompt="p", max_tokens=4, extra_body={"guided_regex": "[0-9]+"}
    )
    constraints = [SamplingParams.from_proto(r.sampling).constraint for r in backend.requests]
    assert constraints == [Constraint("regex", "(x|y)"), Constraint("regex", "[0-9]+")]


def test_choice_regex_matches_exactly_the_choices() -> None:
    choices = ["a.b", "(x)|y", "tab\there", "c*", "[d]", "{e}", "f+?", "^g$", "back\\slash", "世界"]
    pattern = re.compile(choice_regex(choices))
    for c in choices:
        assert pattern.fullmatch(c), c
    for other in ["aXb", "x", "y", "tab", "cc", "d", "back\\\\slash", "a.bc"]:
        assert not pattern.fullmatch(other), other


def test_guided_beside_tools_auto_constrains(client: TestClient, backend: FakeBackend) -> None:
    r = post(client, "chat", tools=[TOOL], guided_choice=["sunny"])
    assert r.status_code == 200, r.text
    assert sent(backend) == Constraint("regex", "(sunny)")


# -- refusals -------------------------------------------------------------------------------------
CONFLICTS = [
    ("chat", {"guided_json": SCHEMA, "guided_regex": "a"}, ("guided_json", "guided_regex")),
    (
        "chat",
        {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
        ("guided_choice", "structured_outputs"),
    ),
    (
        "completions",
        {"guided_regex": "a", "guided_grammar": GRAMMAR},
        ("guided_regex", "guided_grammar"),
    ),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            },
            "guided_json": SCHEMA,
        },
        ("response_format", "guided_json"),
    ),
    (
        "chat",
        {"response_format": {"type": "regex", "regex": "a+"}, "guided_regex": "b"},
        ("response_format", "guided_regex"),
    ),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": "required", "guided_json": SCHEMA},
        ("tool_choice", "guided_json"),
    ),
    (
        "chat",
        {
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "structured_outputs": {"choice": ["a"]},
        },
        ("tool_choice", "structured_outputs"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("route", "fields", "names"), CONFLICTS)
def test_two_constraints_are_a_400_naming_both(
    client: TestClient,
    backend: FakeBackend,
    route: str,
    fields: dict[str, Any],
    names: tuple[str, str],
) -> None:
    r = post(client, route, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert all(n in err["message"] for n in names), err
    assert err["param"] == names[1] and err["code"] == "conflicting_parameters"
    assert not backend.requests


BAD = [
    ({"guided_json": {"type": 5}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": ["a"]}, "guided_json"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ({"guided_regex": "["}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": 'start: "a"'}, "guided_grammar"),  # Lark: vLLM's, not xgrammar's
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_json": {"type": "string", "pattern": "x" * (300 << 10)}}, "guided_json"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
]


@pytest.mark.parametrize("route", sorted(PATHS))
@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_guided_values_are_a_400_naming_the_field(
    client: TestClient, backend: FakeBackend, route: str, fields: dict[str, Any], param: str
) -> None:
    r = post(client, route, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert not backend.requests


def test_guided_in_thinking_mode_is_refused(client: TestClient, backend: FakeBackend) -> None:
    r = post(client, "chat", guided_regex="a+", thinking={"type": "enabled"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    assert "thinking" in r.json()["error"]["message"]
    assert not backend.requests


def test_responses_has_no_guided_fields(client: TestClient) -> None:
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "guided_regex": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
