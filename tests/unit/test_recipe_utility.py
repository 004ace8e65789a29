"""recipe: vLLM's utility routes -- /tokenize gives the ids a request would send, /detokenize
round-trips them, /version is pyproject's, /health answers; all behind the API key, errors in
OpenAI's shape."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from services.recipe.encoding import PromptEncoder

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_recipe import make_app

ROOT = Path(__file__).resolve().parents[2]
USER: Any = [{"role": "user", "content": "Hello"}]
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


# -- /tokenize, /detokenize, /version, /health ----------------------------------------------------
@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": [TOOL]}, {"thinking": {"type": "enabled"}}, {"add_generation_prompt": True}],
)
def test_tokenize_messages_is_what_a_chat_request_sends(
    client: TestClient, backend: FakeBackend, extra: dict[str, Any]
) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Hello, 世界 <｜User｜>"},
    ]
    body = {"model": MODEL, "messages": messages, **extra}
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    chat = {k: v for k, v in body.items() if k != "add_generation_prompt"}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    sent_ids = list(backend.requests[-1].prompt_token_ids)
    assert r.json() == {"tokens": sent_ids, "count": len(sent_ids), "max_model_len": 163840}


def test_tokenize_prompt_is_what_a_completions_request_sends(
    client: TestClient, backend: FakeBackend, encoder: PromptEncoder
) -> None:
    prompt = "Hello <｜end▁of▁sentence｜> 🎉"
    r = client.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert (
        client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}).status_code == 200
    )
    sent_ids = list(backend.requests[-1].prompt_token_ids)
    assert r.json()["tokens"] == sent_ids and r.json()["count"] == len(sent_ids)
    assert sent_ids[0] == encoder.bos
    bare = client.post(
        "/tokenize", json={"model": MODEL, "prompt": prompt, "add_special_tokens": False}
    )
    assert bare.json()["tokens"] == sent_ids[1:]


def test_detokenize_round_trips(client: TestClient, encoder: PromptEncoder) -> None:
    for prompt in ["Hello, 世界! ünï 🎉", "  leading spaces\nand lines\t", "<｜User｜> as text"]:
        ids = client.post(
            "/tokenize", json={"model": MODEL, "prompt": prompt, "add_special_tokens": False}
        ).json()["tokens"]
        r = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": prompt}
    ids = client.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}).json()["tokens"]
    spelled = client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert spelled == "<｜begin▁of▁sentence｜>Hi"  # special tokens spelled out


@pytest.mark.parametrize(
    ("route", "body", "param", "status"),
    [
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens", 400),
        ("/detokenize", {"tokens": [-1]}, "tokens", 400),
        ("/detokenize", {"tokens": ["a"]}, "tokens", 400),
        ("/detokenize", {"tokens": [True]}, "tokens", 400),
        ("/detokenize", {"tokens": [1], "extra": 1}, "extra", 400),
        ("/tokenize", {"prompt": 5}, "prompt", 400),
        ("/tokenize", {"prompt": "x", "messages": USER}, "prompt", 400),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs", 400),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", 400),
        (
            "/tokenize",
            {"messages": USER, "add_generation_prompt": False},
            "add_generation_prompt",
            400,
        ),
        ("/tokenize", {"messages": USER, "made_up": 1}, "made_up", 400),
        ("/tokenize", {"messages": "x"}, None, 400),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, "model", 404),
        ("/detokenize", {"model": None, "tokens": [1]}, "model", 400),
    ],
)  # fmt: skip
def test_tokenize_refusals_in_openai_shape(
    client: TestClient, route: str, body: dict[str, Any], param: str | None, status: int
) -> None:
    r = client.post(route, json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_version_is_pyprojects(client: TestClient) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": project["version"]}


def test_health(client: TestClient, backend: FakeBackend) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    backend.healthy = False
    r = client.get("/health")
    assert r.status_code == 503 and "down" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"


def test_utility_routes_need_the_key(encoder: PromptEncoder, backend: FakeBackend) -> None:
    registry = CollectorRegistry()
    http = strict_http(TestClient(make_app(encoder, backend, {"k-1": "acme"}, registry)))
    calls = [
        ("GET", "/health", None),
        ("GET", "/version", None),
        ("POST", "/tokenize", {"model": MODEL, "prompt": "x"}),
        ("POST", "/detokenize", {"model": MODEL, "tokens": [1]}),
    ]
    for method, path, body in calls:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
        for headers in ({"authorization": "Bearer k-1"}, {"x-api-key": "k-1"}):
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code == 200, (path, r.text)
    assert http.get("/healthz").status_code == 200  # the probe stays open
    counted = registry.get_sample_value(
        "deepserve_recipe_requests_total", {"route": "tokenize", "status": "401", "tenant": "-"}
    )
    assert counted == 2
