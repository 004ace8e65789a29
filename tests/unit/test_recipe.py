"""recipe: the three HTTP protocols over a deterministic in-process Generate backend.

No servers: starlette's TestClient drives the app (and is the http client of the official
openai and anthropic SDKs); :class:`FakeBackend` answers scripted token ids that spell
thinking, tool calls or JSON in the DeepSeek V4 encoding.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.testclient import TestClient

from libs.common.auth import KeyTable, parse_keys
from libs.common.errors import Overloaded
from libs.common.grpc_errors import from_status
from libs.gateway.keylimits import KeyLimit, KeyLimitPolicy, key_id
from libs.proto.deepserve.v1 import common_pb2
from services.recipe.app import build_app
from services.recipe.encoding import PromptEncoder
from services.recipe.handlers import AppConfig, Metrics, tenant_label
from services.recipe.usage import UsageRecord

from ..sdk_strict import anthropic_client, openai_client, strict_http
from .recipe_fakes import ANSWER, MODEL, REASONING, TOOL_CALL, FakeBackend

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
NO_THINK = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL], default_thinking=True)  # deepseek-recipe's default


@pytest.fixture
def backend(encoder: PromptEncoder) -> FakeBackend:
    return FakeBackend(encoder)


def make_app(
    encoder: PromptEncoder,
    backend: FakeBackend,
    keys: dict[str, str] | None = None,
    registry: CollectorRegistry | None = None,
):
    return build_app(
        AppConfig(
            model_name=MODEL,
            default_max_tokens=64,
            max_body_bytes=1 << 20,
            keys=KeyTable(keys or {}),
        ),
        encoder,
        backend,
        Metrics(registry or CollectorRegistry()),
    )


@pytest.fixture
def app(encoder: PromptEncoder, backend: FakeBackend):
    return make_app(encoder, backend)


@pytest.fixture
def client(app) -> TestClient:
    return strict_http(TestClient(app, raise_server_exceptions=False))


@pytest.fixture
def oai(app) -> openai.OpenAI:
    return openai_client(
        base_url="http://testserver/v1",
        api_key="unused",
        max_retries=0,
        http_client=TestClient(app),
    )


@pytest.fixture
def claude(app) -> anthropic.Anthropic:
    return anthropic_client(
        base_url="http://testserver",
        api_key="unused",
        max_retries=0,
        http_client=TestClient(app),
    )


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], **kw}


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    out: list[tuple[str | None, Any]] = []
    name = None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            out.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return out


# -- OpenAI Chat Completions -------------------------------------------------------------------
def test_chat_thinking_on_and_off(oai: openai.OpenAI, backend: FakeBackend) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    msg = out.choices[0].message
    assert msg.content == ANSWER and msg.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert out.choices[0].finish_reason == "stop"
    out = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=NO_THINK
    )
    assert out.choices[0].message.content == ANSWER
    assert getattr(out.choices[0].message, "reasoning_content", None) in (None, "")
    assert backend.requests[-1].prompt_token_ids[-1] == backend.encoder.full.token_to_id("</think>")


def test_thinking_default_off(backend: FakeBackend) -> None:
    """The service's default (--no-default-thinking): no thinking field, no reasoning."""
    app = make_app(PromptEncoder([MODEL]), backend)
    sdk = openai_client(
        base_url="http://testserver/v1",
        api_key="x",
        max_retries=0,
        http_client=TestClient(app),
    )
    out = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0
    )
    assert (
        out.choices[0].message.content == ANSWER and backend.requests[-1].sampling.temperature == 0
    )


def test_chat_usage_fields(oai: openai.OpenAI, backend: FakeBackend) -> None:
    long = "word " * 400
    out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}])
    u = out.usage
    n = len(backend.requests[-1].prompt_token_ids)
    assert (
        u.prompt_tokens == n and u.prompt_tokens_details.cached_tokens == (n - 1) // 128 * 128 > 0
    )
    extra = u.model_extra or {}
    assert extra["prompt_cache_hit_tokens"] == u.prompt_tokens_details.cached_tokens
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == n
    assert u.completion_tokens > 0 and u.total_tokens == n + u.completion_tokens


def test_chat_tool_call_and_agent_class(oai: openai.OpenAI, backend: FakeBackend) -> None:
    backend.script = TOOL_CALL
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        tools=TOOLS,
        extra_body=NO_THINK,
    )
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    assert backend.requests[-1].traffic_class == common_pb2.TRAFFIC_CLASS_AGENT
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w?"}], tools=TOOLS, stream=True
    )
    parts = list(stream)
    args = "".join(
        tc.function.arguments or ""
        for p in parts
        if p.choices
        for tc in (p.choices[0].delta.tool_calls or [])
    )
    assert json.loads(args) == {"city": "Paris"}
    assert parts[-1].choices[0].finish_reason == "tool_calls"


def test_chat_streaming_sequence(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True})
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [d for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    assert (text, reasoning) == (ANSWER, REASONING)
    assert any(c.get("usage") for c in chunks)


def test_chat_stream_sdk(oai: openai.OpenAI) -> None:
    parts = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_THINK,
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ANSWER
    assert [p.usage for p in parts if p.usage][-1].completion_tokens > 0


def test_json_object_output(oai: openai.OpenAI, backend: FakeBackend) -> None:
    backend.script = 'Here:\n```json\n{"a": 1}\n```'
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_object"},
        extra_body=NO_THINK,
    )
    assert json.loads(out.choices[0].message.content) == {"a": 1}


def test_stop_sequence_ends_the_answer_and_the_generation(
    oai: openai.OpenAI, backend: FakeBackend
) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stop=["世界"],
        extra_body=NO_THINK,
    )
    assert out.choices[0].message.content == "Hello, " and out.choices[0].finish_reason == "stop"
    assert backend.calls[-1].cancelled


def test_sampling_maps_into_the_token_request(oai: openai.OpenAI, backend: FakeBackend) -> None:
    oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=7,
        temperature=0.3,
        top_p=0.5,
        seed=42,
        extra_body=NO_THINK,
    )
    sp = backend.requests[-1].sampling
    assert (sp.max_tokens, round(sp.temperature, 3), round(sp.top_p, 3), sp.seed) == (
        7,
        0.3,
        0.5,
        42,
    )
    assert backend.requests[-1].traffic_class == common_pb2.TRAFFIC_CLASS_CHAT
    oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-deepserve-traffic-class": "agent"},
    )
    assert backend.requests[-1].traffic_class == common_pb2.TRAFFIC_CLASS_AGENT
    assert backend.requests[-1].sampling.max_tokens == 64  # --default-max-tokens caps the default
    out = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body=NO_THINK
    )
    assert out.choices[0].finish_reason == "length"


# -- OpenAI Responses ----------------------------------------------------------------------------
def test_responses(oai: openai.OpenAI, backend: FakeBackend) -> None:
    out = oai.responses.create(model=MODEL, input="hi")
    assert out.output_text == ANSWER and out.status == "completed"
    assert [o.type for o in out.output] == ["reasoning", "message"]
    assert out.usage.input_tokens == len(backend.requests[-1].prompt_token_ids)
    backend.script = TOOL_CALL
    out = oai.responses.create(
        model=MODEL,
        input="weather?",
        tools=[
            {
                "type": "function",
                "name": "get_weather",
                "parameters": TOOLS[0]["function"]["parameters"],
            }
        ],
    )
    calls = [o for o in out.output if o.type == "function_call"]
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}


def test_responses_stream(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input="hi", stream=True))
    types = [e.type for e in events]
    assert (
        types[:2] == ["response.created", "response.in_progress"]
        and types[-1] == "response.completed"
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert [e.sequence_number for e in events] == list(range(len(events)))


# -- Anthropic Messages ----------------------------------------------------------------------------
def test_messages_thinking_on_and_off(claude: anthropic.Anthropic) -> None:
    out = claude.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == REASONING and out.content[1].text == ANSWER
    assert out.stop_reason == "end_turn" and out.usage.output_tokens > 0
    out = claude.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "hi"}],
        thinking={"type": "disabled"},
    )
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == ANSWER


def test_messages_usage_and_tool_use(claude: anthropic.Anthropic, backend: FakeBackend) -> None:
    backend.script = TOOL_CALL
    out = claude.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "w " * 400}],
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
    )
    use = next(b for b in out.content if b.type == "tool_use")
    assert (
        out.stop_reason == "tool_use"
        and use.name == "get_weather"
        and use.input == {"city": "Paris"}
    )
    n = len(backend.requests[-1].prompt_token_ids)
    cached = (n - 1) // 128 * 128
    assert out.usage.cache_read_input_tokens == cached > 0 and out.usage.input_tokens == n - cached
    assert backend.requests[-1].traffic_class == common_pb2.TRAFFIC_CLASS_AGENT


def test_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert final.content[-1].text == ANSWER and final.content[0].thinking == REASONING


def test_count_tokens(claude: anthropic.Anthropic, encoder: PromptEncoder) -> None:
    n = claude.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    ).input_tokens
    conv = anthropic_conv = (
        __import__("deepseek_recipe")
        .MessagesRequest({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        .convert(encoder.options)
    )
    assert n == len(encoder.encode_reference(conv.conversation)) > 5
    del anthropic_conv


# -- errors, each protocol's shape ----------------------------------------------------------------
def test_errors_openai_shape(oai: openai.OpenAI, backend: FakeBackend) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["message"] == "Empty input messages"  # the library's message
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**7
        )
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input=5)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="x")
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"top_logprobs": 2},  # without logprobs: true
        )
    assert not backend.requests, "a refused request must not reach the backend"


def test_errors_anthropic_shape(claude: anthropic.Anthropic, client: TestClient) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[])
    assert (
        e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    )
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(
            model="claude-9", max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["error"]["type"] == "not_found_error"
    r = client.post("/v1/messages", content=b"x" * (2 << 20))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = client.post("/v1/chat/completions", content=b"x" * (2 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.INTERNAL, 502),
    ],
)
def test_backend_errors_map_to_http(
    client: TestClient, backend: FakeBackend, code, status, stream
) -> None:
    backend.fail_at_start = from_status(code, "nope")
    for path, body, anth in (
        ("/v1/chat/completions", chat(stream=stream), False),
        ("/v1/responses", {"model": MODEL, "input": "x", "stream": stream}, False),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 9,
                "stream": stream,
                "messages": [{"role": "user", "content": "x"}],
            },
            True,
        ),
    ):
        r = client.post(path, json=body)
        assert r.status_code == status, (path, r.text)
        assert ("type" in r.json() and r.json()["type"] == "error") == anth
        if status in (429, 503):
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert "retry-after" not in r.headers


def test_429_carries_the_backends_own_retry_hint(client: TestClient, backend: FakeBackend) -> None:
    """The entrypoint's hint (from its measured drain rate) reaches the client, rounded up."""
    backend.fail_at_start = Overloaded("busy", retry_after_ms=2300)
    r = client.post("/v1/chat/completions", json=chat(stream=False))
    assert r.status_code == 429 and r.headers["retry-after"] == "3"


def test_sdk_sees_429_and_503(
    oai: openai.OpenAI, claude: anthropic.Anthropic, backend: FakeBackend
) -> None:
    backend.fail_at_start = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    with pytest.raises(openai.RateLimitError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    backend.fail_at_start = from_status(grpc.StatusCode.UNAVAILABLE, "down")
    with pytest.raises(anthropic.InternalServerError) as e:
        claude.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"


def test_mid_stream_failure_is_an_error_event(client: TestClient, backend: FakeBackend) -> None:
    backend.fail_after = 2
    events = sse_events(client.post("/v1/chat/completions", json=chat(stream=True)).text)
    assert (
        events[-1][1]["error"]["code"] == "service_unavailable" and (None, "[DONE]") not in events
    )
    backend.fail_after = 2
    events = sse_events(
        client.post(
            "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 50,
                "stream": True,
                "messages": [{"role": "user", "content": "x"}],
            },
        ).text
    )
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"


# -- auth ------------------------------------------------------------------------------------------
def test_auth_keys_and_tenants(encoder: PromptEncoder, backend: FakeBackend) -> None:
    keys = parse_keys("k-alpha=acme  # comment\nk-beta=globex,k-gamma")
    assert keys["k-alpha"] == "acme" and keys["k-gamma"].startswith("key-")
    registry = CollectorRegistry()
    app = make_app(encoder, backend, keys, registry)
    http = strict_http(TestClient(app))
    good = openai_client(
        base_url="http://testserver/v1", api_key="k-alpha", max_retries=0, http_client=http
    )
    good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert backend.requests[-1].tenant == "acme"
    bad = openai_client(
        base_url="http://testserver/v1", api_key="wrong", max_retries=0, http_client=http
    )
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    claude = anthropic_client(
        base_url="http://testserver", api_key="k-beta", max_retries=0, http_client=http
    )
    claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert backend.requests[-1].tenant == "globex"
    claude_bad = anthropic_client(
        base_url="http://testserver", api_key="nope", max_retries=0, http_client=http
    )
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude_bad.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    assert http.post("/v1/messages/count_tokens", json={}).status_code == 401
    assert http.get("/healthz").status_code == 200
    assert http.get("/metrics").status_code == 404  # not on the public port: the ops port's
    metrics = generate_latest(registry).decode()
    assert f'route="messages",status="200",tenant="{tenant_label("globex")}"' in metrics
    assert "globex" not in metrics and "acme" not in metrics
    assert len(backend.requests) == 2


def test_open_api_has_empty_tenant(oai: openai.OpenAI, backend: FakeBackend) -> None:
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert backend.requests[-1].tenant == ""


# -- ops routes ------------------------------------------------------------------------------------
def test_models_health_metrics(
    client: TestClient, backend: FakeBackend, oai: openai.OpenAI
) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/gpt-4").status_code == 404
    assert client.get("/healthz").status_code == 200
    backend.healthy = False
    r = client.get("/healthz")
    assert r.status_code == 503 and "down" in r.json()["detail"]
    assert client.get("/v1/nope").status_code == 404
    assert client.get("/v1/chat/completions").status_code == 405
    assert client.get("/metrics").status_code == 404  # on the ops port (--http-port) instead


# -- client disconnects cancel the generation --------------------------------------------------
async def _asgi(
    app, path: str, body: dict[str, Any], disconnect_after_chunks: int
) -> list[dict[str, Any]]:
    """Drive the ASGI app directly; the client disconnects after some body chunks."""
    sent: list[dict[str, Any]] = []
    raw = json.dumps(body).encode()
    delivered = False
    enough = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await enough.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)
        if sum(m["type"] == "http.response.body" for m in sent) >= disconnect_after_chunks:
            enough.set()

    if disconnect_after_chunks == 0:
        enough.set()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": b"",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 1.0)  # aborted within a second
    return sent


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat(stream=True)),
        ("/v1/responses", {"model": MODEL, "input": "x", "stream": True}),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 50,
                "stream": True,
                "messages": [{"role": "user", "content": "x"}],
            },
        ),
    ],
)
async def test_disconnect_mid_stream_cancels_the_call(
    app, backend: FakeBackend, path, body
) -> None:
    backend.hang_after = 4  # ready + 3 tokens, then the backend would wait forever
    sent = await _asgi(app, path, body, disconnect_after_chunks=2)
    assert backend.calls[-1].cancelled
    assert sent[0]["status"] == 200


@pytest.mark.parametrize("hang_after", [0, 3])
async def test_disconnect_before_the_answer_cancels_the_call(
    app, backend: FakeBackend, hang_after
) -> None:
    backend.hang_after = hang_after  # 0: before the first event; 3: while collecting
    await _asgi(app, "/v1/chat/completions", chat(), disconnect_after_chunks=0)
    assert backend.calls[-1].cancelled


# -- per-key limits and usage records --------------------------------------------------------------
class Records:
    """A usage sink that keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    def submit(self, record: UsageRecord) -> None:
        self.records.append(record)


def limited_app(
    encoder: PromptEncoder,
    backend: FakeBackend,
    limit: KeyLimit,
    sink: Records,
    clock: Any = None,
):
    cfg = AppConfig(
        model_name=MODEL,
        default_max_tokens=64,
        keys=KeyTable({"k-alpha": "acme", "k-beta": "globex"}),
        key_limits=KeyLimitPolicy(limit),
    )
    return build_app(
        cfg, encoder, backend, Metrics(CollectorRegistry()), usage=sink, clock=clock or Clock()
    )


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


MESSAGE = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "x"}]}


async def test_key_concurrency_cap_is_429_in_each_protocol(
    encoder: PromptEncoder, backend: FakeBackend
) -> None:
    """Two requests of a key in flight under a cap of 2: its third is a 429 with Retry-After
    in the caller's protocol; another key is served; the held ones free their slots."""
    sink = Records()
    app = limited_app(encoder, backend, KeyLimit(concurrency=2), sink)
    backend.hang_after = 1  # Ready, then the backend holds the request open
    transport = httpx.ASGITransport(app=app)
    async with strict_http(
        httpx.AsyncClient(transport=transport, base_url="http://testserver")
    ) as http:
        alpha = {"authorization": "Bearer k-alpha"}
        held = [
            asyncio.create_task(http.post("/v1/chat/completions", json=chat(), headers=alpha))
            for _ in range(2)
        ]
        while len(backend.calls) < 2 or any(c.consumed < 1 for c in backend.calls):
            await asyncio.sleep(0.01)
        r = await http.post("/v1/chat/completions", json=chat(), headers=alpha)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert "concurrent" in err["message"]
        r = await http.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "k-alpha"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
        assert len(backend.calls) == 2  # refused before the backend
        backend.hang_after = None
        r = await http.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "k-beta"})
        assert r.status_code == 200, r.text
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        for _ in range(2):  # both held slots were freed when their requests were cancelled
            r = await http.post("/v1/chat/completions", json=chat(), headers=alpha)
            assert r.status_code == 200, r.text
    assert sorted(rec.status for rec in sink.records) == ["client_gone"] * 2 + ["ok"] * 3


def test_key_token_rate_is_429_with_the_wait(encoder: PromptEncoder, backend: FakeBackend) -> None:
    clock = Clock()
    app = limited_app(encoder, backend, KeyLimit(0, tokens_per_min=600), Records(), clock)
    http = strict_http(TestClient(app))
    backend.script = "word " * 600  # the answer runs to max_tokens
    body = {**MESSAGE, "max_tokens": 400}
    r = http.post("/v1/messages", json=body, headers={"x-api-key": "k-alpha"})
    assert r.status_code == 200, r.text
    prompt = backend.requests[-1].prompt_token_ids
    used = len(prompt) + r.json()["usage"]["output_tokens"]
    assert r.json()["usage"]["output_tokens"] == 400
    r = http.post("/v1/messages", json=body, headers={"x-api-key": "k-alpha"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    short = len(prompt) + 400 - (600 - used)
    assert r.headers["retry-after"] == str(-(-short // 10))  # refilled at 10 tokens/s
    assert http.post("/v1/messages", json=body, headers={"x-api-key": "k-beta"}).status_code == 200
    clock.t += 60  # a minute later the bucket is full again
    r = http.post("/v1/messages", json=body, headers={"x-api-key": "k-alpha"})
    assert r.status_code == 200


def test_one_usage_record_per_accepted_request(
    encoder: PromptEncoder, backend: FakeBackend
) -> None:
    sink = Records()
    http = strict_http(TestClient(limited_app(encoder, backend, KeyLimit(), sink)))
    alpha = {"authorization": "Bearer k-alpha"}
    r = http.post("/v1/chat/completions", json=chat(), headers=alpha)
    usage = r.json()["usage"]
    http.post("/v1/chat/completions", json=chat(stream=True), headers=alpha)
    backend.fail_after = 2
    http.post("/v1/messages", json={**MESSAGE, "stream": True}, headers={"x-api-key": "k-beta"})
    backend.fail_at_start = from_status(grpc.StatusCode.UNAVAILABLE, "down")
    r = http.post("/v1/chat/completions", json=chat(), headers=alpha)
    assert r.status_code == 503  # refused before Ready: no record
    ok, streamed, failed = sink.records
    assert (ok.tenant, ok.key_id, ok.model, ok.route, ok.status) == (
        "acme",
        key_id("k-alpha"),
        MODEL,
        "chat_completions",
        "ok",
    )
    assert ok.request_id == backend.requests[0].request_id
    assert (ok.prompt_tokens, ok.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert ok.uncached_tokens == ok.prompt_tokens - ok.cached_tokens
    assert ok.started_at <= ok.finished_at
    assert streamed.status == "ok" and streamed.completion_tokens == ok.completion_tokens
    assert (failed.tenant, failed.route, failed.status) == ("globex", "messages", "error")
    assert failed.completion_tokens == 2  # what was produced before the failure
    assert "k-alpha" not in ok.to_json().decode()


def test_extra_sampling_fields_reach_the_backend(
    oai: openai.OpenAI, claude: anthropic.Anthropic, backend: FakeBackend
) -> None:
    oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=20,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        extra_body={
            **NO_THINK,
            "ignore_eos": True,
            "min_tokens": 8,
            "top_k": 40,
            "min_p": 0.1,
            "repetition_penalty": 1.3,
            "stop_token_ids": [7, 9],
        },
    )
    sp = backend.requests[-1].sampling
    got = (sp.ignore_eos, sp.min_tokens, sp.top_k, list(sp.stop_token_ids))
    assert got == (True, 8, 40, [7, 9])
    assert [round(x, 3) for x in (sp.min_p, sp.repetition_penalty)] == [0.1, 1.3]
    assert [round(x, 3) for x in (sp.presence_penalty, sp.frequency_penalty)] == [0.5, -1.5]
    claude.messages.create(  # this SDK version dropped the top_k argument; the API has it
        model=MODEL,
        max_tokens=5,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"top_k": 3},
    )
    assert backend.requests[-1].sampling.top_k == 3
    bad = [
        {"min_tokens": 30},  # > max_tokens
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"top_k": "many"},
        {"stop_token_ids": [-1]},
        {"ignore_eos": "yes"},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=20,
                extra_body=extra,
            )
        assert e.value.body["param"] == next(iter(extra)), extra  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], presence_penalty=2.5
        )
