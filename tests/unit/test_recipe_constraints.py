"""recipe: structured outputs -- the constraint each request shape sends to the engine, and
that a generation following it parses back, through the recipe's own output parser, into what
the request asked for (the fake backend answers the token ids of the expected text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import deepseek_recipe as dr
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.common.sampling import SamplingParams
from libs.engine.tokenizer import served_tokenizer
from services.recipe.chat_template import ChatTemplateEncoder
from services.recipe.encoding import PromptEncoder, build_encoder
from services.recipe.handlers import AppConfig, Metrics, build_app

from .recipe_fakes import MODEL, FakeBackend
from .test_recipe import make_app

USER: Any = [{"role": "user", "content": "give me JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "the weather", "parameters": PARAMS},
}
OTHER: Any = {
    "type": "function",
    "function": {"name": "get_time", "description": "the time", "parameters": {"type": "object"}},
}
ANTHROPIC_TOOL: Any = {"name": "get_weather", "description": "the weather", "input_schema": PARAMS}
# What the model writes after a prompt that opened the tool-call block (tool_choice required).
INVOKE = (
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


@pytest.fixture
def backend(encoder: PromptEncoder) -> FakeBackend:
    return FakeBackend(encoder)


@pytest.fixture
def client(encoder: PromptEncoder, backend: FakeBackend) -> TestClient:
    return TestClient(make_app(encoder, backend), raise_server_exceptions=False)


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=client
    )


@pytest.fixture
def claude(client: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", max_retries=0, http_client=client
    )


def sent(backend: FakeBackend) -> SamplingParams:
    """The sampling settings of the (only) backend request, as the engine reads them."""
    (request,) = backend.requests
    return SamplingParams.from_proto(request.sampling)


def chat(client: TestClient, **fields: Any) -> Any:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields})
    assert r.status_code == 200, r.text
    return r.json()


# -- what is sent --------------------------------------------------------------------------------
def test_json_object_sends_json(client: TestClient, backend: FakeBackend) -> None:
    chat(client, response_format={"type": "json_object"})
    c = sent(backend).constraint
    assert c is not None and (c.kind, c.spec) == ("json", "")


def test_json_schema_sends_the_schema(client: TestClient, backend: FakeBackend) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
    chat(client, response_format=fmt)
    c = sent(backend).constraint
    assert c is not None and c.kind == "json_schema"
    assert json.loads(c.spec) == SCHEMA


def test_strict_json_schema_sends_the_closed_schema(
    client: TestClient, backend: FakeBackend
) -> None:
    fmt: Any = {
        "type": "json_schema",
        "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True},
    }
    chat(client, response_format=fmt)
    c = sent(backend).constraint
    assert c is not None and c.kind == "json_schema"
    # OpenAI's strict mode: no other properties, every property present
    assert json.loads(c.spec) == {**SCHEMA, "additionalProperties": False, "required": ["a", "b"]}


def test_responses_text_format_sends_the_schema(client: TestClient, backend: FakeBackend) -> None:
    body = {
        "model": MODEL,
        "input": "give me JSON",
        "text": {"format": {"type": "json_schema", "name": "ab", "schema": SCHEMA}},
    }
    assert client.post("/v1/responses", json=body).status_code == 200
    c = sent(backend).constraint
    assert c is not None and c.kind == "json_schema" and json.loads(c.spec) == SCHEMA


def test_every_choice_is_constrained(client: TestClient, backend: FakeBackend) -> None:
    chat(client, response_format={"type": "json_object"}, n=2)
    assert [r.sampling.constraint.kind for r in backend.requests] == ["json", "json"]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"response_format": {"type": "text"}},
        {"tools": [TOOL]},  # tool_choice auto: the model may answer in text
        {"tools": [TOOL], "tool_choice": "none"},
        # thinking: the constraint would forbid the reasoning that comes before the answer
        {"response_format": {"type": "json_object"}, "thinking": {"type": "enabled"}},
    ],
)
def test_free_generation_sends_no_constraint(
    client: TestClient, backend: FakeBackend, fields: dict[str, Any]
) -> None:
    chat(client, **fields)
    assert not backend.requests[0].sampling.HasField("constraint")


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
)
def test_required_tool_choice_is_not_a_grammar(
    client: TestClient, backend: FakeBackend, encoder: PromptEncoder, tool_choice: Any
) -> None:
    """Kept as before: the prompt opens the tool-call block, no constraint is sent. Why: the V4
    encoding writes arguments as DSML parameters, not the JSON the engine's tool_call kind
    matches -- rendering a call through the library shows it."""
    chat(client, tools=[TOOL, OTHER], tool_choice=tool_choice)
    request = backend.requests[0]
    assert not request.sampling.HasField("constraint")
    tail = encoder.full.decode(list(request.prompt_token_ids[-8:]), skip_special_tokens=False)
    assert tail.endswith("<｜DSML｜tool_calls>\n")
    arguments = json.dumps({"city": "Paris"})
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    body = {
        "model": MODEL,
        "messages": [
            *USER,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        ],
        "tools": [TOOL],
    }
    conv = dr.ChatCompletionRequest(json.dumps(body).encode()).convert(encoder.options)
    rendered = encoder.render(conv.conversation).prompt
    assert '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>' in rendered
    assert rendered.count("Paris") == 1  # no JSON arguments for a begin/JSON/end grammar


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_tool_choice_sends_no_constraint(
    client: TestClient, backend: FakeBackend, tool_choice: dict[str, Any]
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": USER,
        "tools": [ANTHROPIC_TOOL],
        "tool_choice": tool_choice,
    }
    assert client.post("/v1/messages", json=body).status_code == 200
    assert not backend.requests[0].sampling.HasField("constraint")


def test_oversized_schema_is_refused(client: TestClient, backend: FakeBackend) -> None:
    schema = {"type": "object", "description": "x" * 300_000}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    body = {"model": MODEL, "messages": USER, "response_format": fmt}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert not backend.requests


# -- what comes back ------------------------------------------------------------------------------
def test_json_schema_output_parses_back(oai: openai.OpenAI, backend: FakeBackend) -> None:
    want = {"a": 1, "b": "x"}
    backend.script = json.dumps(want, separators=(",", ":"))  # as the engine's grammar emits it
    fmt: Any = {
        "type": "json_schema",
        "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True},
    }
    out = oai.chat.completions.create(model=MODEL, messages=USER, response_format=fmt)
    assert json.loads(out.choices[0].message.content or "") == want
    assert out.choices[0].finish_reason == "stop"


def test_json_object_output_parses_back(oai: openai.OpenAI, backend: FakeBackend) -> None:
    want = {"answer": [1, 2], "ok": True}
    backend.script = json.dumps(want, separators=(",", ":"))
    out = oai.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}
    )
    assert backend.requests[0].sampling.constraint.kind == "json"
    assert json.loads(out.choices[0].message.content or "") == want


def test_required_tool_call_parses_back(oai: openai.OpenAI, backend: FakeBackend) -> None:
    backend.script = INVOKE
    out = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[TOOL, OTHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_anthropic_named_tool_parses_back(
    claude: anthropic.Anthropic, backend: FakeBackend
) -> None:
    backend.script = INVOKE
    out = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=USER,
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and uses[0].input == {"city": "Paris"}


def test_checkpoints_own_template_is_constrained_too(tmp_path: Path) -> None:
    """A checkpoint served with its own tokenizer and chat template: its output is plain text,
    so the schema is sent and the JSON it spells comes back as the content."""
    from .test_served_tokenizer import MODEL as CKPT
    from .test_served_tokenizer import checkpoint, small_tokenizer

    served = served_tokenizer(str(checkpoint(tmp_path / "ckpt", 300, small_tokenizer())))
    encoder = build_encoder(served, [CKPT])
    assert isinstance(encoder, ChatTemplateEncoder)
    backend = FakeBackend(encoder)  # type: ignore[arg-type]
    backend.script = '{"a":1,"b":"x"}'
    app = build_app(AppConfig(model_name=CKPT), encoder, backend, Metrics(CollectorRegistry()))
    client = TestClient(app, raise_server_exceptions=False)
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
    body = {"model": CKPT, "messages": USER, "response_format": fmt}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    c = sent(backend).constraint
    assert c is not None and c.kind == "json_schema" and json.loads(c.spec) == SCHEMA
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"a": 1, "b": "x"}
