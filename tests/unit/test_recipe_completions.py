"""recipe: OpenAI Completions (``POST /v1/completions``) and ``n`` choices (Completions and Chat
Completions) over the deterministic in-process backend, driven by the official openai SDK.

The backend of these tests answers, for a request with a seed, text that names the seed, so
each choice's text shows which backend request (and seed) made it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.engine.tokenizer import served_tokenizer
from libs.gateway.keylimits import KeyLimit
from libs.proto.deepserve.v1 import generate_pb2
from services.recipe.app import build_app
from services.recipe.chat_template import ChatTemplateEncoder
from services.recipe.choices import MAX_N, choice_seed, merged_usage
from services.recipe.completions import TextDecoder, parse_completion
from services.recipe.encoding import PromptEncoder, build_encoder
from services.recipe.handlers import AppConfig, Metrics

from ..sdk_strict import openai_client, strict_http
from .recipe_fakes import ANSWER, MODEL, FakeBackend
from .test_recipe import Records, _asgi, limited_app, make_app, sse_events

USER = [{"role": "user", "content": "hi"}]


class SeededBackend(FakeBackend):
    """Answers ``seed <seed>.`` for a seeded request (else the usual ANSWER)."""

    def answer_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        if not request.sampling.HasField("seed") or self.script is not None:
            return super().answer_ids(request)
        text = f"seed {request.sampling.seed}."
        return self.encoder.full.encode(text, add_special_tokens=False).ids + [self.encoder.eos]


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])  # the service's default: thinking off


@pytest.fixture
def backend(encoder: PromptEncoder) -> SeededBackend:
    return SeededBackend(encoder)


@pytest.fixture
def client(encoder: PromptEncoder, backend: SeededBackend) -> TestClient:
    return strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    # The SDK would refuse OpenAI's own streamed Completions (sdk_strict.openai_client says
    # why); the client's check validates every body and chunk more strictly.
    return openai_client(
        sdk_validation=False,
        base_url="http://testserver/v1",
        api_key="unused",
        max_retries=0,
        http_client=client,
    )


def plain_ids(encoder: PromptEncoder, text: str) -> list[int]:
    return encoder.plain.encode(text, add_special_tokens=False).ids


def answer_len(encoder: PromptEncoder, text: str = ANSWER) -> int:
    return len(plain_ids(encoder, text))


# -- Completions -----------------------------------------------------------------------------------
def test_completion_tokenizes_the_raw_prompt_without_a_template(
    oai: openai.OpenAI, backend: SeededBackend, encoder: PromptEncoder
) -> None:
    out = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=50)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    choice = out.choices[0]
    assert (choice.text, choice.index, choice.finish_reason) == (ANSWER, 0, "stop")
    sent = list(backend.requests[-1].prompt_token_ids)
    assert sent == [encoder.bos, *plain_ids(encoder, "Once upon a time")]  # no chat template
    u = out.usage
    assert u is not None and u.prompt_tokens == len(sent)
    assert u.completion_tokens == answer_len(encoder)  # EOS not counted
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # A control token spelled in the text stays text.
    oai.completions.create(model=MODEL, prompt="<｜User｜>hi")
    assert encoder.full.token_to_id("<｜User｜>") not in backend.requests[-1].prompt_token_ids[1:]


def test_completion_sampling_fields_reach_the_backend(
    oai: openai.OpenAI, backend: SeededBackend
) -> None:
    oai.completions.create(model=MODEL, prompt="x")
    assert backend.requests[-1].sampling.max_tokens == 16  # OpenAI's default for Completions
    oai.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=20,
        temperature=0.3,
        top_p=0.5,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        extra_body={
            "top_k": 40,
            "min_p": 0.1,
            "ignore_eos": True,
            "min_tokens": 8,
            "repetition_penalty": 1.3,
            "stop_token_ids": [7, 9],
        },
    )
    sp = backend.requests[-1].sampling
    assert (sp.max_tokens, sp.seed, sp.top_k, sp.ignore_eos, sp.min_tokens) == (20, 42, 40, True, 8)
    assert list(sp.stop_token_ids) == [7, 9]
    got = (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty, sp.presence_penalty)
    assert [round(x, 3) for x in got] == [0.3, 0.5, 0.1, 1.3, 0.5]
    assert round(sp.frequency_penalty, 3) == -1.5
    oai.completions.create(model=MODEL, prompt="x", top_p=0)
    assert backend.requests[-1].sampling.temperature == 0  # a zero nucleus is greedy
    out = oai.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert (
        out.choices[0].finish_reason == "length" and out.usage and out.usage.completion_tokens == 3
    )


def test_completion_echo_and_token_id_prompts(
    oai: openai.OpenAI, backend: SeededBackend, encoder: PromptEncoder
) -> None:
    out = oai.completions.create(model=MODEL, prompt="Say: ", echo=True, max_tokens=50)
    assert out.choices[0].text == "Say: " + ANSWER
    ids = plain_ids(encoder, "Token ids")
    out = oai.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=50)
    assert list(backend.requests[-1].prompt_token_ids) == ids  # sent as given: no BOS added
    assert out.choices[0].text == "Token ids" + ANSWER
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    oai.completions.create(model=MODEL, prompt=[ids])  # a list of one prompt
    assert list(backend.requests[-1].prompt_token_ids) == ids
    oai.completions.create(model=MODEL, prompt=["one prompt"])
    assert list(backend.requests[-1].prompt_token_ids)[1:] == plain_ids(encoder, "one prompt")


def test_completion_stop_sequence_cuts_the_text_and_the_generation(
    oai: openai.OpenAI, client: TestClient, backend: SeededBackend
) -> None:
    out = oai.completions.create(model=MODEL, prompt="x", stop="世界", max_tokens=50)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("Hello, ", "stop")
    assert backend.calls[-1].cancelled
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "stop": ["nope", "ünï"], "stream": True},
    )
    chunks = [d for _, d in sse_events(r.text) if d != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, 世界! "
    assert not any("ü" in c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_stream(oai: openai.OpenAI, client: TestClient, encoder: PromptEncoder) -> None:
    parts = list(
        oai.completions.create(
            model=MODEL,
            prompt="Hi",
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(p.object == "text_completion" for p in parts)
    texts = [p.choices[0].text for p in parts if p.choices]
    assert "".join(texts) == ANSWER and len(texts) > 3  # streamed piece by piece
    finishes = [p.choices[0].finish_reason for p in parts if p.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    last = parts[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == answer_len(encoder)
    assert all(p.usage is None for p in parts[:-1])
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "stream": True, "echo": True, "max_tokens": 50},
    )
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [d for _, d in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == "Hi"  # echo comes first
    assert all("usage" not in c for c in chunks)  # no usage without include_usage
    assert r.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"suffix": "and then"}, "suffix"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": 2, "echo": True}, "echo"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": [1, "x"]}, "prompt"),
        ({"prompt": ["a", 5]}, "prompt"),  # once silently "a"
        ({"prompt": [[1], 5]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 5]}, "stop"),
        ({"echo": "yes"}, "echo"),
        ({"stream": 1}, "stream"),
        ({"stream_options": "x"}, "stream_options"),
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": "2"}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"top_k": "many"}, "top_k"),
        ({"min_tokens": 30, "max_tokens": 5}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_completion_bad_input_is_a_400_naming_the_field(
    client: TestClient, backend: SeededBackend, body: dict[str, Any], param: str
) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert not backend.requests  # refused before the backend


def test_completion_prompt_longer_than_the_context_is_refused(
    encoder: PromptEncoder, backend: SeededBackend
) -> None:
    app = build_app(
        AppConfig(model_name=MODEL, max_context=100), encoder, backend, Metrics(CollectorRegistry())
    )
    client = strict_http(TestClient(app, raise_server_exceptions=False))
    # Surely too long (128 characters per token at most): refused before tokenizing.
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (128 * 100 + 1)})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == (
        "prompt",
        "context_length_exceeded",
    )
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(100))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 90})
    assert r.status_code == 200 and not backend.requests[1:]


def test_completion_errors_through_the_sdk(oai: openai.OpenAI, client: TestClient) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="def f(", suffix="return x")
    assert e.value.body["param"] == "suffix"  # type: ignore[index]
    assert "suffix" in e.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="x")
    for raw in (b"{", b"[1]", b'{"model": 5, "prompt": "x"}'):
        r = client.post("/v1/completions", content=raw)
        assert r.status_code == 400 and "error" in r.json()


def test_completion_backend_failure_mid_stream_is_an_error_event(
    client: TestClient, backend: SeededBackend
) -> None:
    backend.fail_after = 2
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1][1]["error"]["code"] == "service_unavailable"
    assert (None, "[DONE]") not in events


# -- n choices -------------------------------------------------------------------------------------
def test_choice_seeds() -> None:
    seeds = [choice_seed(7, i) for i in range(MAX_N)]
    assert seeds[0] == 7 and len(set(seeds)) == MAX_N
    assert all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(7, 1) != choice_seed(8, 1) and choice_seed(7, 1) == choice_seed(7, 1)


def test_chat_n_choices(oai: openai.OpenAI, backend: SeededBackend, encoder: PromptEncoder) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=USER, n=3, seed=11, max_tokens=40)
    reqs = backend.requests[-3:]
    assert len(backend.requests) == 3
    seeds = [r.sampling.seed for r in reqs]
    assert seeds[0] == 11 and len(set(seeds)) == 3
    assert len({r.request_id for r in reqs}) == 3
    assert all(r.prompt_token_ids == reqs[0].prompt_token_ids for r in reqs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.message.content for c in out.choices] == [f"seed {s}." for s in seeds]
    u = out.usage
    assert u is not None and u.prompt_tokens == len(reqs[0].prompt_token_ids)  # counted once
    assert u.completion_tokens == sum(answer_len(encoder, f"seed {s}.") for s in seeds)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    one = oai.chat.completions.create(model=MODEL, messages=USER, n=1, seed=11)
    assert len(one.choices) == 1 and one.choices[0].message.content == "seed 11."


def test_chat_n_choices_stream(
    oai: openai.OpenAI, client: TestClient, backend: SeededBackend, encoder: PromptEncoder
) -> None:
    parts = list(oai.chat.completions.create(model=MODEL, messages=USER, n=3, seed=5, stream=True))
    seeds = [r.sampling.seed for r in backend.requests]
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finish: dict[int, str | None] = {}
    for p in parts:
        for c in p.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert text == {i: f"seed {s}." for i, s in enumerate(seeds)}
    assert finish == {0: "stop", 1: "stop", 2: "stop"}
    # The merged usage comes once, last, with no choices; no chunk before it carries one.
    assert parts[-1].choices == [] and parts[-1].usage is not None
    assert all(p.usage is None for p in parts[:-1])
    u = parts[-1].usage
    assert u.prompt_tokens == len(backend.requests[0].prompt_token_ids)
    assert u.completion_tokens == sum(answer_len(encoder, f"seed {s}.") for s in seeds)
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "n": 2, "stream": True, "seed": 1},
    )
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    ids = {d["id"] for _, d in events[:-1]}
    assert len(ids) == 1  # one response id across choices


def test_completions_n_choices(oai: openai.OpenAI, backend: SeededBackend) -> None:
    out = oai.completions.create(model=MODEL, prompt="x", n=2, seed=3, max_tokens=40, echo=True)
    seeds = [r.sampling.seed for r in backend.requests]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [f"xseed {s}." for s in seeds]
    parts = list(oai.completions.create(model=MODEL, prompt="x", n=2, seed=3, stream=True))
    text = {0: "", 1: ""}
    for p in parts:
        for c in p.choices:
            text[c.index] += c.text
    assert text == {0: f"seed {seeds[0]}.", 1: f"seed {seeds[1]}."}
    out = oai.completions.create(model=MODEL, prompt="x", n=2, max_tokens=40)
    assert not backend.requests[-1].sampling.HasField("seed")  # unseeded stays unseeded
    assert [c.text for c in out.choices] == [ANSWER, ANSWER]


def test_later_choices_start_after_the_first_ones_prefill(
    oai: openai.OpenAI, backend: SeededBackend
) -> None:
    """Choice 0's Ready (its prefill done) comes before the other choices are sent, so they
    can find the prompt's KV in the prefix cache."""
    seen: list[int] = []  # events choice 0 had given when each call started
    generate = backend.generate

    def watching(request: generate_pb2.GenerateRequest, *args: Any) -> Any:
        seen.append(backend.calls[0].consumed if backend.calls else 0)
        return generate(request, *args)  # traceparent, on_behalf

    backend.generate = watching  # type: ignore[method-assign]
    oai.chat.completions.create(model=MODEL, messages=USER, n=3)
    assert seen[0] == 0 and seen[1:] == [1, 1]


@pytest.mark.parametrize("n", [0, MAX_N + 1, "2", 1.5, True])
def test_chat_bad_n_is_a_400(client: TestClient, backend: SeededBackend, n: object) -> None:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert str(MAX_N) in r.json()["error"]["message"]
    assert not backend.requests


def test_n_choices_reserve_and_record_usage_once(
    encoder: PromptEncoder, backend: SeededBackend
) -> None:
    sink = Records()
    http = strict_http(TestClient(limited_app(encoder, backend, KeyLimit(), sink)))
    alpha = {"authorization": "Bearer k-alpha"}
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "n": 3, "seed": 1},
        headers=alpha,
    )
    usage = r.json()["usage"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2}, headers=alpha)
    (chat, completions) = sink.records
    assert (chat.route, chat.prompt_tokens, chat.completion_tokens) == (
        "chat_completions",
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert completions.route == "completions" and completions.status == "ok"
    assert completions.completion_tokens == r.json()["usage"]["completion_tokens"]


def test_one_failing_choice_fails_the_request(client: TestClient, backend: SeededBackend) -> None:
    backend.fail_after = 1
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "n": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert all(c.cancelled for c in backend.calls)


def test_completions_with_a_checkpoints_own_tokenizer(tmp_path: Path) -> None:
    """A checkpoint served with its own tokenizer: its BOS, then the text; a special token's
    spelling in the text is refused (token ids are the way to send one)."""
    from .test_served_tokenizer import MODEL as CKPT
    from .test_served_tokenizer import checkpoint, small_tokenizer

    served = served_tokenizer(str(checkpoint(tmp_path / "ckpt", 300, small_tokenizer())))
    encoder = build_encoder(served, [CKPT])
    assert isinstance(encoder, ChatTemplateEncoder)
    backend = FakeBackend(encoder)  # type: ignore[arg-type]
    app = build_app(AppConfig(model_name=CKPT), encoder, backend, Metrics(CollectorRegistry()))
    client = strict_http(TestClient(app, raise_server_exceptions=False))
    r = client.post(
        "/v1/completions", json={"model": CKPT, "prompt": "Hi ü", "max_tokens": 64, "echo": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hi ü" + ANSWER
    bos = encoder.full.token_to_id("<s>")
    hi = encoder.full.encode("Hi ü", add_special_tokens=False).ids
    assert list(backend.requests[-1].prompt_token_ids) == [bos, *hi]
    r = client.post("/v1/completions", json={"model": CKPT, "prompt": "<|user|>x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 3, "stream": True}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "stream": True}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}),
    ],
)
async def test_disconnect_cancels_every_choice(
    encoder: PromptEncoder, backend: SeededBackend, path: str, body: dict[str, Any]
) -> None:
    backend.hang_after = 3  # ready + 2 tokens, then each call would wait forever
    app = make_app(encoder, backend)
    sent = await _asgi(app, path, body, disconnect_after_chunks=2 if body.get("stream") else 0)
    assert len(backend.calls) == body["n"] and all(c.cancelled for c in backend.calls)
    if body.get("stream"):
        assert sent[0]["status"] == 200


# -- the pure parts ------------------------------------------------------------------------------
def test_text_decoder_holds_back_what_may_start_a_stop(encoder: PromptEncoder) -> None:
    ids = plain_ids(encoder, "abc END def")
    d = TextDecoder(encoder.full, ["END"])
    out = "".join(d.push([t]) for t in ids)
    assert out == "abc " and d.stopped and d.flush() == ""
    d = TextDecoder(encoder.full, ["xyz"])
    pieces = [d.push([t]) for t in plain_ids(encoder, "ab xy")]
    assert "".join(pieces) == "ab " and d.flush() == "xy"  # "xy" could have begun "xyz"
    emoji = plain_ids(encoder, "🎉")
    assert len(emoji) > 1  # one character, several byte-level tokens
    d = TextDecoder(encoder.full)
    assert [d.push([t]) for t in emoji][-1] == "🎉" and d.text == "🎉"


def test_parse_completion_reads_the_fields() -> None:
    req = parse_completion(
        {"prompt": "p", "stop": "s", "echo": True, "n": 2, "best_of": 2, "suffix": ""}, {}
    )
    assert (req.prompt_text, req.stop, req.echo, req.n, req.max_tokens) == (
        "p",
        ("s",),
        True,
        2,
        16,
    )
    req = parse_completion(
        {"prompt": [[1, 2]], "stream": True, "stream_options": {"include_usage": True}}, {}
    )
    assert (req.prompt_ids, req.stream, req.include_usage) == ((1, 2), True, True)


def test_merged_usage_sums_completions_and_keeps_the_prompt() -> None:
    a = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    b = {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    got = merged_usage([a, b])
    assert (got["prompt_tokens"], got["completion_tokens"], got["total_tokens"]) == (10, 7, 17)
    assert got["completion_tokens_details"] == {"reasoning_tokens": 2}
