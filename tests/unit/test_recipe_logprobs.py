"""recipe: log probabilities (Chat Completions ``logprobs``/``top_logprobs``, Responses, legacy
Completions ``logprobs``) over the deterministic in-process backend, whose token events carry
the log probabilities the engine would send."""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from libs.common.grpc_auth import ANONYMOUS, OnBehalf
from libs.proto.deepserve.v1 import common_pb2, generate_pb2
from services.recipe.encoding import PromptEncoder
from services.recipe.logprobs import FLOOR, clamp, token_text

from ..sdk_strict import openai_client, strict_http
from .recipe_fakes import ANSWER, MODEL, REASONING, TOOL_CALL, FakeBackend, FakeCall
from .test_recipe import make_app, sse_events

USER: Any = [{"role": "user", "content": "hi"}]
TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def fake_logprob(k: int) -> float:
    """The log probability the backend gives the k-th generated token."""
    return -0.125 * (k + 1)


class LogprobBackend(FakeBackend):
    """Adds, when the request asks for logprobs, one TokenLogprobs per token id: the k-th token
    has ``fake_logprob(k)``; its alternatives are the token itself, then ids +1, +2... each one
    nat less likely, the last one ``-inf`` (cut away by top-k / top-p)."""

    bad_count = False  # send one logprob too many (a backend bug)

    def generate(
        self,
        request: generate_pb2.GenerateRequest,
        traceparent: str = "",
        on_behalf: OnBehalf = ANONYMOUS,
    ) -> FakeCall:
        call = super().generate(request, traceparent, on_behalf)
        if not request.sampling.HasField("logprobs"):
            return call
        n, k = request.sampling.logprobs, 0
        for ev in call.events:
            if not isinstance(ev, generate_pb2.GenerateEvent) or not ev.HasField("tokens"):
                continue
            for t in ev.tokens.token_ids:
                lp = fake_logprob(k)
                tops = [lp - i for i in range(n)]
                if n > 1:
                    tops[-1] = -math.inf
                ev.tokens.logprobs.append(
                    common_pb2.TokenLogprobs(
                        logprob=lp, top_ids=[t + i for i in range(n)], top_logprobs=tops
                    )
                )
                if self.bad_count:
                    ev.tokens.logprobs.append(common_pb2.TokenLogprobs(logprob=lp))
                k += 1
        return call


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


@pytest.fixture
def backend(encoder: PromptEncoder) -> LogprobBackend:
    return LogprobBackend(encoder)


@pytest.fixture
def client(encoder: PromptEncoder, backend: LogprobBackend) -> TestClient:
    return strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai_client(
        base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=client
    )


def ids_of(encoder: PromptEncoder, text: str) -> list[int]:
    return encoder.full.encode(text, add_special_tokens=False).ids


def utf8(entries: list[Any]) -> str:
    """The text that a list of logprobs entries spells, from their bytes."""
    return bytes(b for e in entries for b in e["bytes"]).decode()


# -- Chat Completions --------------------------------------------------------------------------
def test_chat_logprobs_one_entry_per_content_token(
    oai: openai.OpenAI, backend: LogprobBackend, encoder: PromptEncoder
) -> None:
    out = oai.chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, top_logprobs=2, max_tokens=64
    )
    assert backend.requests[0].sampling.logprobs == 2
    choice = out.choices[0]
    assert choice.message.content == ANSWER
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    ids = ids_of(encoder, ANSWER)
    assert len(content) == len(ids)  # EOS is not a content token
    assert bytes(b for e in content for b in (e.bytes or [])).decode() == ANSWER
    for k, (entry, t) in enumerate(zip(content, ids)):
        assert entry.logprob == pytest.approx(fake_logprob(k))
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(
            [fake_logprob(k), FLOOR]  # -inf from the engine arrives as -9999.0
        )
        assert entry.top_logprobs[0].bytes == entry.bytes
        want = encoder.full.decode([t], skip_special_tokens=False)
        if "\ufffd" not in want:
            assert entry.token == want


def test_chat_logprobs_json_is_finite(client: TestClient) -> None:
    body = {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 3}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    text = r.text
    assert "Infinity" not in text and "NaN" not in text
    content = json.loads(text)["choices"][0]["logprobs"]["content"]
    assert all(isinstance(a["logprob"], float) for e in content for a in e["top_logprobs"])
    assert content[0]["top_logprobs"][-1]["logprob"] == FLOOR


def test_chat_logprobs_without_top_asks_for_none(
    oai: openai.OpenAI, backend: LogprobBackend
) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=USER, logprobs=True)
    assert backend.requests[0].sampling.logprobs == 0
    assert out.choices[0].logprobs is not None
    content = out.choices[0].logprobs.content
    assert content and all(e.top_logprobs == [] for e in content)


def test_chat_without_logprobs_asks_for_none(oai: openai.OpenAI, backend: LogprobBackend) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=USER, logprobs=False)
    assert not backend.requests[0].sampling.HasField("logprobs")
    assert out.choices[0].logprobs is None


def test_chat_stream_chunks_carry_their_tokens_logprobs(
    client: TestClient, encoder: PromptEncoder
) -> None:
    body = {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 1, "stream": True}
    r = client.post("/v1/chat/completions", json=body)
    chunks = [d for _, d in sse_events(r.text) if d != "[DONE]"]
    seen = 0
    for c in chunks:
        for choice in c["choices"]:
            delta = choice["delta"].get("content") or ""
            entries = (choice.get("logprobs") or {}).get("content") or []
            assert utf8(entries) == delta  # each chunk: the logprobs of its own delta
            seen += len(entries)
    assert seen == len(ids_of(encoder, ANSWER))


def test_chat_reasoning_and_tool_markup_are_not_content(
    oai: openai.OpenAI, backend: LogprobBackend, encoder: PromptEncoder, client: TestClient
) -> None:
    body = {
        "model": MODEL,
        "messages": USER,
        "logprobs": True,
        "thinking": {"type": "enabled"},
    }
    lp = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert utf8(lp["content"]) == ANSWER
    assert utf8(lp["reasoning_content"]) == REASONING  # DeepSeek's extension
    backend.script = TOOL_CALL
    out = oai.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], logprobs=True)
    assert out.choices[0].message.tool_calls
    assert out.choices[0].logprobs is not None
    content = out.choices[0].logprobs.content
    assert bytes(b for e in content or [] for b in (e.bytes or [])).decode().strip() == "Calling."


def test_chat_logprobs_for_every_choice(oai: openai.OpenAI, backend: LogprobBackend) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=USER, logprobs=True, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs and c.logprobs.content for c in out.choices)
    assert all(r.sampling.logprobs == 0 for r in backend.requests)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": 1}, "logprobs"),
    ],
)
def test_chat_logprobs_refusals_name_the_field(
    client: TestClient, backend: LogprobBackend, fields: dict[str, Any], param: str
) -> None:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not backend.requests


def test_backend_logprob_count_mismatch_is_an_error(
    client: TestClient, backend: LogprobBackend
) -> None:
    backend.bad_count = True
    body = {"model": MODEL, "messages": USER, "logprobs": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code >= 500


def test_responses_output_text_logprobs(client: TestClient, backend: LogprobBackend) -> None:
    body = {
        "model": MODEL,
        "input": "hi",
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
    }
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert backend.requests[0].sampling.logprobs == 2
    text = r.json()["output"][-1]["content"][0]
    assert utf8(text["logprobs"]) == text["text"] == ANSWER


def test_messages_never_ask_for_logprobs(client: TestClient, backend: LogprobBackend) -> None:
    body = {"model": MODEL, "max_tokens": 32, "messages": USER}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200
    assert not backend.requests[0].sampling.HasField("logprobs")
    assert "logprob" not in r.text


# -- Completions -------------------------------------------------------------------------------
def completion(client: TestClient, **fields: Any) -> Any:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 64, **fields}
    return client.post("/v1/completions", json=body)


def check_legacy(lp: dict[str, Any], text: str, n_top: int, first: int = 0) -> None:
    """``lp`` is OpenAI's legacy logprobs object of ``text``, tokens ``first``... of the answer."""
    n = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"] == pytest.approx([fake_logprob(first + k) for k in range(n)])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for tok, off, top in zip(lp["tokens"], lp["text_offset"], lp["top_logprobs"]):
        assert len(top) == n_top
        if not tok.startswith("bytes:"):
            assert text[off : off + len(tok)] == tok  # the token sits at its offset
        if n_top:
            assert top[tok] == max(top.values())  # the drawn token was the most likely


def test_completion_logprobs(
    client: TestClient, backend: LogprobBackend, encoder: PromptEncoder
) -> None:
    r = completion(client, logprobs=2)
    assert r.status_code == 200, r.text
    assert backend.requests[0].sampling.logprobs == 2
    choice = r.json()["choices"][0]
    assert choice["text"] == ANSWER
    lp = choice["logprobs"]
    ids = ids_of(encoder, ANSWER)
    assert lp["tokens"] == [token_text(encoder.full, t) for t in ids]
    check_legacy(lp, ANSWER, 2)
    assert any(t.startswith("bytes:\\x") for t in lp["tokens"])  # the emoji's pieces
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(ANSWER) - 1
    assert min(v for top in lp["top_logprobs"] for v in top.values()) == FLOOR


def test_completion_logprobs_streamed_match_the_body(client: TestClient) -> None:
    whole = completion(client, logprobs=1).json()["choices"][0]["logprobs"]
    r = completion(client, logprobs=1, stream=True)
    chunks = [d for _, d in sse_events(r.text) if d != "[DONE]"]
    merged: dict[str, list[Any]] = {k: [] for k in whole}
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp is None:
            continue
        for k in merged:
            merged[k] += lp[k]
        text = c["choices"][0]["text"]  # each chunk's tokens start inside its own text
        seen = sum(len(d["choices"][0]["text"]) for d in chunks[: chunks.index(c)])
        assert all(seen <= off < seen + max(1, len(text)) for off in lp["text_offset"])
    assert merged == whole


def test_completion_stop_sequence_drops_the_tokens_after_it(client: TestClient) -> None:
    choice = completion(client, logprobs=0, stop=["!"]).json()["choices"][0]
    assert choice["text"] == "Hello, 世界"
    lp = choice["logprobs"]
    assert lp["text_offset"] and all(off < len(choice["text"]) for off in lp["text_offset"])
    assert all(top == {} for top in lp["top_logprobs"])
    check_legacy(lp, choice["text"], 0)


def test_completion_without_logprobs(client: TestClient, backend: LogprobBackend) -> None:
    choice = completion(client).json()["choices"][0]
    assert choice["logprobs"] is None
    assert not backend.requests[0].sampling.HasField("logprobs")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": "2"}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 2, "echo": True}, "echo"),
    ],
)
def test_completion_logprobs_refusals(
    client: TestClient, backend: LogprobBackend, fields: dict[str, Any], param: str
) -> None:
    r = completion(client, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not backend.requests


def test_clamp() -> None:
    assert [clamp(v) for v in (-math.inf, math.nan, -1e6, -0.5, 1e-7)] == [
        FLOOR,
        FLOOR,
        FLOOR,
        -0.5,
        0.0,
    ]
