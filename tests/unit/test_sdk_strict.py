"""tests/sdk_strict.py, the check every API test reads its responses through: every route passes
it under both official SDKs in strict mode, and each planted mismatch -- the kind a client would
trip on and the SDKs' own lax parse lets through -- is refused.

The bodies are the recipe's own (a FakeBackend answer) with one thing changed each, so each
negative case differs from a body that passes by exactly what it plants.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from services.recipe.encoding import PromptEncoder

from ..sdk_strict import anthropic_client, check, openai_client, strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_recipe import make_app

USER: Any = [{"role": "user", "content": "hi"}]
Body = dict[str, Any]
Refused = pytest.fail.Exception  # what check raises (pytest's Failed: a BaseException)


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend(PromptEncoder([MODEL], default_thinking=True))


@pytest.fixture(scope="module")
def app(backend: FakeBackend) -> Any:
    return make_app(backend.encoder, backend)


@pytest.fixture(scope="module")
def raw(app: Any) -> TestClient:
    """The app with no check: the bodies the negative cases change."""
    return TestClient(app, raise_server_exceptions=False)


def body_of(raw: TestClient, path: str, payload: Body) -> Body:
    r = raw.post(path, json=payload)
    assert r.status_code == 200, r.text
    return dict(r.json())


def refused(path: str, body: Any, status: int = 200, method: str = "POST") -> str:
    with pytest.raises(Refused) as err:
        check(method, path, status, "application/json", json.dumps(body))
    return str(err.value)


def accepted(path: str, body: Any, status: int = 200, method: str = "POST") -> None:
    check(method, path, status, "application/json", json.dumps(body))


# -- every route, both SDKs, strict --------------------------------------------------------------
def test_every_route_passes_both_sdks_strictly(app: Any) -> None:
    oai = openai_client(
        base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=TestClient(app)
    )
    claude = anthropic_client(
        base_url="http://testserver", api_key="x", max_retries=0, http_client=TestClient(app)
    )
    chat = oai.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.content and chat.created > 0
    assert list(oai.chat.completions.create(model=MODEL, messages=USER, stream=True, n=2))
    assert oai.completions.create(model=MODEL, prompt="hi", max_tokens=4).model == MODEL
    assert oai.responses.create(model=MODEL, input="hi").usage is not None
    kinds = [e.type for e in oai.responses.create(model=MODEL, input="hi", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    msg = claude.messages.create(model=MODEL, max_tokens=20, messages=USER)
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model=MODEL, max_tokens=20, messages=USER) as stream:
        assert stream.get_final_message().usage.output_tokens > 0
    assert claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
    assert [m.id for m in oai.models.list()] == [m.id for m in claude.models.list()] == [MODEL]
    assert oai.models.retrieve(MODEL).id == claude.models.retrieve(MODEL).id == MODEL
    http = strict_http(TestClient(app, raise_server_exceptions=False))
    for path, payload in (("/tokenize", {"model": MODEL, "prompt": "hi"}),
                          ("/detokenize", {"model": MODEL, "tokens": [1, 2]})):  # fmt: skip
        assert http.post(path, json=payload).status_code == 200
    assert http.get("/version").status_code == http.get("/health").status_code == 200
    assert http.post("/v1/chat/completions", json={"model": "nope"}).status_code == 404
    assert http.post("/v1/messages", json={"model": MODEL, "messages": 1}).status_code == 400


# -- what the check refuses ----------------------------------------------------------------------
def test_a_completion_without_created_or_model_is_refused(raw: TestClient) -> None:
    """The issue's planted bug: 100 tests passed with the SDK's default (lax) parse."""
    body = body_of(raw, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4})
    accepted("/v1/completions", body)
    for key in ("created", "model"):
        assert key in refused("/v1/completions", {k: v for k, v in body.items() if k != key})


Change = Callable[[Body], None]


def _set(*path: Any, value: Any) -> Change:
    def change(body: Body) -> None:
        node: Any = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _drop(*path: Any) -> Change:
    def change(body: Body) -> None:
        node: Any = body
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return change


CHAT_CHANGES: dict[str, Change] = {
    # lax pydantic would coerce each of these three; strict refuses them
    "created as a string": _set("created", value="1700000000"),
    "a float token count": _set("usage", "prompt_tokens", value=3.0),
    "a numeric content": _set("choices", 0, "message", "content", value=7),
    "an unknown finish_reason": _set("choices", 0, "finish_reason", value="eos"),
    "an unknown field deep down": _set("choices", 0, "message", "thoughts", value="x"),
    "an unknown top-level field": _set("prompt_token_ids", value=[1, 2]),
    # the SDK has these optional; OpenAI's OpenAPI spec requires them (null allowed)
    "no refusal": _drop("choices", 0, "message", "refusal"),
    "no logprobs": _drop("choices", 0, "logprobs"),
    "no usage total": _drop("usage", "total_tokens"),
    "the wrong object": _set("object", value="chat.completion.chunk"),
}


@pytest.mark.parametrize("name", list(CHAT_CHANGES))
def test_each_planted_chat_mismatch_is_refused(raw: TestClient, name: str) -> None:
    body = body_of(raw, "/v1/chat/completions", {"model": MODEL, "messages": USER})
    accepted("/v1/chat/completions", body)  # reasoning_content, prompt_cache_*: extensions
    CHAT_CHANGES[name](body)
    refused("/v1/chat/completions", body)


def test_the_other_routes_refuse_a_planted_mismatch(raw: TestClient) -> None:
    resp = body_of(raw, "/v1/responses", {"model": MODEL, "input": "hi"})
    accepted("/v1/responses", resp)
    _drop("usage", "input_tokens_details", "cache_write_tokens")(resp)
    assert "cache_write_tokens" in refused("/v1/responses", resp)
    msg = body_of(raw, "/v1/messages", {"model": MODEL, "max_tokens": 9, "messages": USER})
    accepted("/v1/messages", msg)
    refused("/v1/messages", {**msg, "stop_reason": "done"})
    card = raw.get(f"/v1/models/{MODEL}").json()
    accepted(f"/v1/models/{MODEL}", card, method="GET")
    assert "lifecycle" in refused(f"/v1/models/{MODEL}", {**card, "lifecycle": None}, 200, "GET")
    assert "owned_by" in refused(f"/v1/models/{MODEL}", {**card, "owned_by": 1}, 200, "GET")
    listed = raw.get("/v1/models").json()
    listed["data"][0]["created"] = "now"
    refused("/v1/models", listed, method="GET")
    tokens = body_of(raw, "/tokenize", {"model": MODEL, "prompt": "hi"})
    refused("/tokenize", {**tokens, "count": str(tokens["count"])})


def test_error_bodies_in_each_protocol_shape() -> None:
    openai_error = {"error": {"message": "m", "type": "invalid_request_error", "param": None,
                              "code": None}}  # fmt: skip
    accepted("/v1/chat/completions", openai_error, 400)
    accepted("/tokenize", openai_error, 400)
    refused("/v1/chat/completions", {"error": {"message": "m", "type": "x"}}, 400)  # no param
    refused("/v1/chat/completions", {"detail": "Not Found"}, 404)  # starlette's, not OpenAI's
    refused("/v1/messages", openai_error, 400)
    anthropic_error = {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}
    accepted("/v1/messages", anthropic_error, 400)
    refused("/v1/chat/completions", anthropic_error, 400)
    refused("/v1/messages", {"type": "error", "error": {"type": "bad_error", "message": "m"}}, 400)


def sse(*events: tuple[str | None, Any]) -> str:
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        out.append(head + "data: " + (data if isinstance(data, str) else json.dumps(data)))
    return "\n\n".join(out) + "\n\n"


def stream_check(path: str, text: str) -> None:
    check("POST", path, 200, "text/event-stream; charset=utf-8", text)


def test_streams_are_checked_event_by_event(raw: TestClient) -> None:
    r = raw.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "stream": True})
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and len(chunks) > 2
    stream_check("/v1/chat/completions", r.text)
    with pytest.raises(Refused, match="without"):
        stream_check("/v1/chat/completions", sse(*((None, c) for c in chunks)))
    with pytest.raises(Refused, match="after"):
        stream_check("/v1/chat/completions", sse(*((None, c) for c in chunks), (None, "[DONE]"),
                                                 (None, chunks[0])))  # fmt: skip
    bad = json.loads(json.dumps(chunks[1]))
    bad["choices"][0]["index"] = "0"
    with pytest.raises(Refused, match="index"):
        stream_check("/v1/chat/completions", sse((None, chunks[0]), (None, bad), (None, "[DONE]")))
    r = raw.post("/v1/messages", json={"model": MODEL, "max_tokens": 9, "messages": USER,
                                       "stream": True})  # fmt: skip
    stream_check("/v1/messages", r.text)
    first = json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])
    with pytest.raises(Refused, match="event name"):
        stream_check("/v1/messages", sse(("message_delta", first)))


def test_a_failed_responses_stream_ends_with_a_numbered_error(
    app: Any, backend: FakeBackend
) -> None:
    """OpenAI's ResponseErrorEvent carries the stream's next sequence_number (the SDK's strict
    parse refuses one without)."""
    backend.fail_after = 3
    try:
        r = strict_http(TestClient(app)).post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}
        )
    finally:
        backend.fail_after = None
    data = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert data[-1]["type"] == "error" and data[-1]["code"] == "service_unavailable"
    assert [d["sequence_number"] for d in data] == list(range(len(data)))


def test_the_hook_fails_the_test_through_an_sdk() -> None:
    """A client with the check fails on a bad body: through a plain request, and through the
    SDK, whose ``except Exception`` would otherwise turn the failure into a retried
    connection error."""
    card = {"id": "m", "object": "model", "created": 1, "owned_by": "o", "type": "model",
            "display_name": "m", "created_at": "1970-01-01T00:00:00Z"}  # fmt: skip

    async def model(request: Any) -> Response:
        return JSONResponse(card)

    app = Starlette(routes=[Route("/v1/models/{model}", model)])
    with pytest.raises(Refused, match="lifecycle"):
        strict_http(TestClient(app)).get("/v1/models/m")
    oai = openai_client(
        base_url="http://testserver/v1", api_key="x", max_retries=2, http_client=TestClient(app)
    )
    with pytest.raises(Refused, match="lifecycle"):
        oai.models.retrieve("m")
    card["lifecycle"] = "active"
    assert oai.models.retrieve("m").id == "m"
