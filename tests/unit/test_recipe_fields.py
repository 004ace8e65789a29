"""recipe: every field of the OpenAI requests is read or refused with a 400 naming it -- the
field lists come from the openai SDK's own request types, so a field a new SDK adds fails here
until services/recipe/fields.py says what the server does with it; docs/api.md's table is
fields.markdown()."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.responses.response_create_params as response_params
import pytest
from starlette.testclient import TestClient

from libs.common.sampling import SamplingParams
from services.recipe import fields
from services.recipe.encoding import PromptEncoder

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_recipe import make_app

ROOT = Path(__file__).resolve().parents[2]
SDK_TYPES = {
    "chat_completions": chat_params.CompletionCreateParamsStreaming,
    "completions": completion_params.CompletionCreateParamsStreaming,
    "responses": response_params.ResponseCreateParamsStreaming,
}
PATHS = {
    "chat_completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}
BASE: dict[str, dict[str, Any]] = {
    "chat_completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "completions": {"model": MODEL, "prompt": "Hi"},
    "responses": {"model": MODEL, "input": "Hi"},
}


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


@pytest.fixture
def backend(encoder: PromptEncoder) -> FakeBackend:
    return FakeBackend(encoder)


@pytest.fixture
def client(encoder: PromptEncoder, backend: FakeBackend) -> TestClient:
    return strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))


def sdk_fields(protocol: str) -> set[str]:
    return set(typing.get_type_hints(SDK_TYPES[protocol]))


@pytest.mark.parametrize("protocol", sorted(SDK_TYPES))
def test_every_sdk_field_has_a_rule(protocol: str) -> None:
    missing = sdk_fields(protocol) - set(fields.TABLES[protocol])
    assert not missing, f"{protocol}: fields of the openai SDK that fields.py does not list"
    assert {"stream", "model", "temperature"} <= sdk_fields(protocol)  # the lists are real


# A value OpenAI's reference allows for each field that this server refuses.
REFUSED = {
    "chat_completions": {
        "audio": {"voice": "alloy", "format": "wav"},
        "modalities": ["text", "audio"],
        "prediction": {"type": "content", "content": "x"},
        "store": True,
        "service_tier": "flex",
        "logit_bias": {"5": 1},
        "function_call": "auto",
        "functions": [{"name": "f"}],
        "web_search_options": {},
        "verbosity": "low",
        "moderation": {"model": "m"},
        "prompt_cache_options": {"ttl": "1h"},
        "metadata": {"k": 5},
        "stream_options": {"other": True},
        "made_up_field": 1,
    },
    "completions": {"suffix": "x", "best_of": 3, "logit_bias": {"5": 1}, "made_up": 1},
    "responses": {
        "store": True,
        "background": True,
        "previous_response_id": "resp_1",
        "conversation": "conv_1",
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
        "truncation": "auto",
        "max_tool_calls": 3,
        "prompt": {"id": "pmpt_1"},
        "service_tier": "priority",
        "context_management": [{"type": "compaction"}],
        "max_completion_tokens": 5,
    },
}


@pytest.mark.parametrize(
    ("protocol", "name", "value"),
    [(p, n, v) for p, values in REFUSED.items() for n, v in values.items()],
)
def test_refused_fields_are_a_400_naming_them(
    client: TestClient, backend: FakeBackend, protocol: str, name: str, value: Any
) -> None:
    r = client.post(PATHS[protocol], json={**BASE[protocol], name: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name, r.text
    assert not backend.requests


# Values each accepted field may take; null always means "unset".
ACCEPTED = {
    "chat_completions": {
        "user": "u-1",
        "safety_identifier": "s",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "parallel_tool_calls": True,
        "stream_options": None,
        "verbosity": "medium",
        "logit_bias": {},
        "audio": None,
    },
    "responses": {
        "store": False,
        "truncation": "disabled",
        "include": ["message.output_text.logprobs"],
        "background": False,
    },
    "completions": {"user": "u"},
}


@pytest.mark.parametrize(
    ("protocol", "name", "value"),
    [(p, n, v) for p, values in ACCEPTED.items() for n, v in values.items()],
)
def test_accepted_fields(client: TestClient, protocol: str, name: str, value: Any) -> None:
    r = client.post(PATHS[protocol], json={**BASE[protocol], name: value, "stream": False})
    assert r.status_code == 200, r.text


def max_tokens_sent(backend: FakeBackend) -> int:
    return SamplingParams.from_proto(backend.requests[-1].sampling).max_tokens


@pytest.mark.parametrize(
    ("protocol", "body"),
    [
        ("chat_completions", {"max_completion_tokens": 7}),
        ("chat_completions", {"max_tokens": 7}),
        ("chat_completions", {"max_tokens": 7, "max_completion_tokens": 7}),
        ("responses", {"max_output_tokens": 7}),
        ("responses", {"max_tokens": 7}),
        ("completions", {"max_tokens": 7}),
    ],
)
def test_every_length_field_is_the_limit(
    client: TestClient, backend: FakeBackend, protocol: str, body: dict[str, Any]
) -> None:
    r = client.post(PATHS[protocol], json={**BASE[protocol], **body})
    assert r.status_code == 200, r.text
    assert max_tokens_sent(backend) == 7


def test_two_different_limits_are_refused(client: TestClient) -> None:
    body = {**BASE["chat_completions"], "max_tokens": 7, "max_completion_tokens": 9}
    r = client.post(PATHS["chat_completions"], json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_parallel_tool_calls_false_needs_a_forced_call(client: TestClient) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {**BASE["chat_completions"], "tools": [tool], "parallel_tool_calls": False}
    r = client.post(PATHS["chat_completions"], json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls"
    named = {"type": "function", "function": {"name": "f"}}
    r = client.post(PATHS["chat_completions"], json={**body, "tool_choice": named})
    assert r.status_code == 200, r.text


def test_api_doc_lists_the_fields_as_the_code_reads_them() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    begin, end = "<!-- fields:begin -->\n", "<!-- fields:end -->"
    assert begin in doc and end in doc, "docs/api.md lacks the generated fields table"
    table = doc.split(begin, 1)[1].split(end, 1)[0]
    assert table == fields.markdown(), (
        "docs/api.md's fields table is stale: paste python -c 'from services.recipe import "
        'fields; print(fields.markdown(), end="")\' between its markers'
    )
