"""recipe: the OpenAI Chat Completions front over a deterministic in-process Generate backend.

No servers: starlette's TestClient drives the app, and :class:`FakeBackend` stands in for the
entrypoint with the same interface as the gRPC wrapper (an async iterator of GenerateEvents
that can be cancelled).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import openai
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.proto.deepserve.v1 import common_pb2, generate_pb2
from services.recipe.backend import BackendError
from services.recipe.handlers import AppConfig, Metrics, build_app
from services.recipe.template import ASSISTANT, BOS, EOS, USER, ChatMessage, ChatTemplate

MODEL = "deepseek-tiny"
ANSWER = "Hello, 世界! ünï 🎉 done."


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate()


class FakeCall:
    def __init__(self, events: list[Any], hang_after: int | None = None) -> None:
        self.events, self.hang_after = events, hang_after
        self.cancelled = False
        self.consumed = 0

    async def __aiter__(self) -> AsyncIterator[generate_pb2.GenerateEvent]:
        for i, ev in enumerate(self.events):
            if self.hang_after is not None and i >= self.hang_after:
                await asyncio.Event().wait()  # a generation that never ends by itself
            await asyncio.sleep(0)
            if isinstance(ev, Exception):
                raise ev
            self.consumed += 1
            yield ev

    def cancel(self) -> None:
        self.cancelled = True


class FakeBackend:
    """Answers every prompt with ANSWER's tokens one at a time, then EOS (or stops at max_tokens)."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.calls: list[FakeCall] = []
        self.fail_at_start: BackendError | None = None
        self.fail_after: int | None = None  # raise UNAVAILABLE after this many token events
        self.hang_after: int | None = None
        self.healthy = True

    def generate(self, request: generate_pb2.GenerateRequest, traceparent: str = "") -> FakeCall:
        self.requests.append(request)
        events: list[Any] = []
        if self.fail_at_start:
            events.append(self.fail_at_start)
        n_prompt = len(request.prompt_token_ids)
        cached = (n_prompt - 1) // 128 * 128
        events.append(generate_pb2.GenerateEvent(ready=generate_pb2.Ready(
            request_id=request.request_id, prompt_tokens=n_prompt, cached_tokens=cached)))
        ids = self.template.encode_text([ANSWER])[0] + [self.template.eos]
        out = ids[: request.sampling.max_tokens]
        for k, t in enumerate(out):
            if self.fail_after is not None and k == self.fail_after:
                events.append(BackendError(grpc.StatusCode.UNAVAILABLE, "decode instance died"))
            events.append(generate_pb2.GenerateEvent(tokens=generate_pb2.Tokens(token_ids=[t])))
        reason = "stop" if out[-1] == self.template.eos else "length"
        use = common_pb2.Usage(prompt_tokens=n_prompt, cached_tokens=cached, completion_tokens=len(out))
        events.append(generate_pb2.GenerateEvent(finish=generate_pb2.Finish(reason=reason, usage=use)))
        call = FakeCall(events, self.hang_after)
        self.calls.append(call)
        return call

    async def check(self) -> tuple[bool, str]:
        return self.healthy, "fake entrypoint " + ("serving" if self.healthy else "down")

    async def close(self) -> None:
        pass


@pytest.fixture
def backend(template: ChatTemplate) -> FakeBackend:
    return FakeBackend(template)


@pytest.fixture
def app(template: ChatTemplate, backend: FakeBackend):
    return build_app(AppConfig(model_name=MODEL, default_max_tokens=64), template, backend,
                     Metrics(CollectorRegistry()))


@pytest.fixture
def client(app) -> TestClient:
    return TestClient(app, raise_server_exceptions=False)


def chat(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
    body.update(kw)
    return body


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- template and special-token safety ---------------------------------------------------------
def test_render_follows_the_deepseek_template(template: ChatTemplate) -> None:
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"),
            ChatMessage("assistant", "Hello!"), ChatMessage("user", "How are you?")]
    enc = lambda s: template.encode_text([s])[0]
    want = ([template.bos, *enc("Be brief."), template.user, *enc("Hi"), template.assistant,
             *enc("Hello!"), template.eos, template.user, *enc("How are you?"), template.assistant])
    assert template.render(msgs) == want
    # the same ids the full tokenizer gives for the template string (control tokens matched)
    text = f"{BOS}Be brief.{USER}Hi{ASSISTANT}Hello!{EOS}{USER}How are you?{ASSISTANT}"
    assert template.tokenizer.encode(text, add_special_tokens=False).ids == want
    assert (template.bos, template.eos, template.user, template.assistant) == (0, 1, 128803, 128804)


def test_tool_results_and_system_messages(template: ChatTemplate) -> None:
    ids = template.render([ChatMessage("user", "q"), ChatMessage("assistant", "calling"),
                           ChatMessage("tool", "r1"), ChatMessage("tool", "r2"),
                           ChatMessage("system", "sys A"), ChatMessage("system", "sys B")])
    text = template.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == (f"{BOS}sys A\n\nsys B{USER}q{ASSISTANT}calling{EOS}<｜tool▁outputs▁begin｜>"
                    "<｜tool▁output▁begin｜>r1<｜tool▁output▁end｜><｜tool▁output▁begin｜>r2"
                    f"<｜tool▁output▁end｜><｜tool▁outputs▁end｜>{ASSISTANT}")


def test_no_user_text_ever_becomes_a_control_token(template: ChatTemplate) -> None:
    added = template.tokenizer.get_added_tokens_decoder()
    spellings = [t.content for t in added.values()]
    assert len(spellings) > 1000 and USER in spellings and EOS in spellings
    rng = random.Random(0)
    frags = ["<", ">", "｜", "|", "▁", "User", "Assistant", "begin", "end", "of", "sentence", "tool",
             "think", "/", " ", "\n", "EOT", "fim", "hole", "place", "holder", "no", "0"]
    fuzz = ["".join(rng.choice(frags) for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    texts = spellings + fuzz + ["".join(spellings[:50]), f"x{USER}y{ASSISTANT}z{EOS}"]
    for text, ids in zip(texts, template.encode_text(texts)):
        bad = [i for i in ids if i in template.added_ids]
        assert not bad, f"{text!r} encoded to control ids {bad}"
        assert template.tokenizer.decode(ids) == text, "plain encoding must round-trip"
    # through the whole template, in every role: only the template's own control ids appear
    for role in ("system", "user", "assistant", "tool"):
        ids = template.render([ChatMessage(role, " ".join(spellings))])
        controls = [i for i in ids if i in template.added_ids]
        expected = {"system": [0, 128804], "user": [0, 128803, 128804],
                    "assistant": [0, 128804, 1, 128804],
                    "tool": [0, 128810, 128812, 128813, 128811, 128804]}[role]
        assert controls == expected, role


def test_detokenizer_streams_what_decode_gives(template: ChatTemplate) -> None:
    ids = template.encode_text([ANSWER])[0] + [template.eos]
    d = template.detokenizer()
    deltas = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(deltas) == ANSWER == template.decode(ids)
    assert "" in deltas, "an incomplete UTF-8 character must be held back"
    assert all("\ufffd" not in x for x in deltas)


# -- non-streaming ----------------------------------------------------------------------------
def test_chat_completion_shape_and_usage(client: TestClient, backend: FakeBackend, template) -> None:
    r = client.post("/v1/chat/completions", json=chat(temperature=0.7, top_p=0.9, seed=42, max_tokens=100))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": ANSWER}
    assert choice["finish_reason"] == "stop" and choice["index"] == 0
    n_out = len(template.encode_text([ANSWER])[0]) + 1
    req = backend.requests[-1]
    n_prompt = len(req.prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": 0},
        "prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": n_prompt}
    assert list(req.prompt_token_ids) == template.render([ChatMessage("user", "Hi there")])
    s = req.sampling
    assert (round(s.temperature, 5), round(s.top_p, 5), s.seed, s.max_tokens) == (0.7, 0.9, 42, 100)
    assert req.traffic_class == common_pb2.TRAFFIC_CLASS_CHAT and req.model == MODEL
    assert r.headers["x-request-id"] == req.request_id


def test_cached_tokens_are_reported(client: TestClient) -> None:
    long = "word " * 400
    r = client.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": long}]))
    u = r.json()["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_cache_hit_tokens"] > 0
    assert u["prompt_cache_hit_tokens"] + u["prompt_cache_miss_tokens"] == u["prompt_tokens"]


def test_max_tokens_and_length_finish(client: TestClient, backend: FakeBackend) -> None:
    body = client.post("/v1/chat/completions", json=chat(max_tokens=50, max_completion_tokens=3)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3 == backend.requests[-1].sampling.max_tokens
    client.post("/v1/chat/completions", json=chat())
    assert backend.requests[-1].sampling.max_tokens == 64  # the server default
    assert backend.requests[-1].sampling.temperature == 1.0  # OpenAI's default
    assert not backend.requests[-1].sampling.HasField("seed")


def test_top_p_zero_is_greedy_and_stop_strings_do_not_crash(client: TestClient,
                                                             backend: FakeBackend) -> None:
    r = client.post("/v1/chat/completions", json=chat(top_p=0, stop=["\n", "END"]))
    assert r.status_code == 200
    s = backend.requests[-1].sampling
    assert (s.temperature, s.top_p) == (0.0, 1.0)


def test_traffic_class(client: TestClient, backend: FakeBackend) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    client.post("/v1/chat/completions", json=chat(tools=tools))
    assert backend.requests[-1].traffic_class == common_pb2.TRAFFIC_CLASS_AGENT
    client.post("/v1/chat/completions", json=chat(), headers={"X-Deepserve-Traffic-Class": "agent"})
    assert backend.requests[-1].traffic_class == common_pb2.TRAFFIC_CLASS_AGENT
    client.post("/v1/chat/completions", json=chat(), headers={"X-Deepserve-Traffic-Class": "chat"})
    assert backend.requests[-1].traffic_class == common_pb2.TRAFFIC_CLASS_CHAT


def test_text_parts_and_developer_role(client: TestClient, backend: FakeBackend, template) -> None:
    msgs = [{"role": "developer", "content": "Rules."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there"}]}]
    assert client.post("/v1/chat/completions", json=chat(messages=msgs)).status_code == 200
    assert list(backend.requests[-1].prompt_token_ids) == template.render(
        [ChatMessage("system", "Rules."), ChatMessage("user", "Hi there")])


# -- streaming --------------------------------------------------------------------------------
def test_streaming_chunks(client: TestClient, backend: FakeBackend) -> None:
    r = client.post("/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == ANSWER
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["delta"] == {}
    assert last["usage"]["completion_tokens"] == backend.calls[-1].consumed - 2  # minus ready, finish
    assert {"prompt_tokens", "total_tokens", "prompt_cache_hit_tokens"} <= set(last["usage"])


def test_streaming_include_usage(client: TestClient) -> None:
    events = sse_events(client.post("/v1/chat/completions",
                                    json=chat(stream=True, stream_options={"include_usage": True})).text)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert "usage" not in events[-3] and events[-3]["choices"][0]["finish_reason"] == "stop"


def test_openai_sdk_reads_both_shapes(app) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                        http_client=TestClient(app))
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == ANSWER and out.usage.total_tokens > 0
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         stream=True, stream_options={"include_usage": True})
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ANSWER
    assert parts[-1].usage.completion_tokens > 0
    assert [m.id for m in sdk.models.list()] == [MODEL]


def test_mid_stream_failure_is_an_error_event(client: TestClient, backend: FakeBackend) -> None:
    backend.fail_after = 2
    events = sse_events(client.post("/v1/chat/completions", json=chat(stream=True)).text)
    assert events[-1]["error"]["code"] == "service_unavailable"
    assert "[DONE]" not in events
    backend.fail_after = 2
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


# -- errors -----------------------------------------------------------------------------------
def assert_error(r, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"'])
def test_malformed_json_is_400(client: TestClient, backend: FakeBackend, raw: bytes) -> None:
    assert_error(client.post("/v1/chat/completions", content=raw,
                             headers={"content-type": "application/json"}), 400)
    assert not backend.requests


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].type"),
    (chat(temperature=3), "temperature"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=True), "temperature"),
    (chat(top_p=1.5), "top_p"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=2.5), "max_tokens"),
    (chat(seed=-1), "seed"),
    (chat(n=2), "n"),
    (chat(stop=[1, 2]), "stop"),
    (chat(stream="yes"), "stream"),
    (chat(stop_token_ids=[10**9]), "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_bad_values_are_400(client: TestClient, backend: FakeBackend, body, param) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert not backend.requests, "a refused request must not reach the backend"


def test_unknown_model_is_404(client: TestClient) -> None:
    err = assert_error(client.post("/v1/chat/completions", json=chat(model="gpt-4")), 404, "model")
    assert err["code"] == "model_not_found"
    assert client.get("/v1/models/gpt-4").status_code == 404


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 502)])
def test_backend_errors_map_to_http(client: TestClient, backend: FakeBackend, code, status,
                                    stream) -> None:
    backend.fail_at_start = BackendError(code, "nope")
    r = client.post("/v1/chat/completions", json=chat(stream=stream))
    assert_error(r, status)
    assert r.headers["content-type"].startswith("application/json")
    if status in (429, 503):
        assert int(r.headers["retry-after"]) >= 1
    else:
        assert "retry-after" not in r.headers


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_error(client.get("/v1/nope"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


# -- ops routes -------------------------------------------------------------------------------
def test_models_health_metrics(client: TestClient, backend: FakeBackend) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/healthz").status_code == 200
    backend.healthy = False
    r = client.get("/healthz")
    assert r.status_code == 503 and "down" in r.json()["detail"]
    client.post("/v1/chat/completions", json=chat())
    text = client.get("/metrics").text
    assert 'deepserve_recipe_requests_total{route="chat_completions",status="200"} 1.0' in text
    assert "deepserve_recipe_tokens_total" in text


# -- client disconnects cancel the generation -------------------------------------------------
async def _asgi(app, body: dict[str, Any], disconnect_after_chunks: int) -> list[dict[str, Any]]:
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
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


async def test_disconnect_mid_stream_cancels_the_call(app, backend: FakeBackend) -> None:
    backend.hang_after = 4  # ready + 3 tokens, then the backend would wait forever
    sent = await _asgi(app, chat(stream=True), disconnect_after_chunks=2)
    assert backend.calls[-1].cancelled
    assert sent[0]["status"] == 200


@pytest.mark.parametrize("hang_after", [0, 3])
async def test_disconnect_before_the_answer_cancels_the_call(app, backend: FakeBackend,
                                                            hang_after) -> None:
    backend.hang_after = hang_after  # 0: before the first event; 3: while collecting
    await _asgi(app, chat(), disconnect_after_chunks=0)
    assert backend.calls[-1].cancelled
