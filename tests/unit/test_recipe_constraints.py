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

from libs.common.sampling import Constraint, SamplingParams
from libs.engine.tokenizer import served_tokenizer
from libs.proto.deepserve.v1 import generate_pb2
from services.recipe import constraints
from services.recipe.app import build_app
from services.recipe.chat_template import ChatTemplateEncoder
from services.recipe.constraints import DSML_TOKEN_ID as DSML_ID
from services.recipe.constraints import output_constraint, tool_call_grammar
from services.recipe.encoding import PromptEncoder, build_encoder
from services.recipe.handlers import AppConfig, Metrics

from ..sdk_strict import anthropic_client, openai_client, strict_http
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
RESPONSES_TOOL: Any = {"type": "function", "name": "get_weather", "parameters": PARAMS}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
ANTHROPIC_NAMED: Any = {"type": "tool", "name": "get_weather"}
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
    return strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai_client(
        base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=client
    )


@pytest.fixture
def claude(client: TestClient) -> anthropic.Anthropic:
    return anthropic_client(
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
    ("path", "fields", "kind"),
    [
        ("/v1/chat/completions", {"tools": [TOOL, OTHER], "tool_choice": "required"}, "ebnf"),
        ("/v1/chat/completions", {"tools": [TOOL, OTHER], "tool_choice": NAMED}, "ebnf"),
        ("/v1/chat/completions", {"tools": [TOOL, OTHER]}, None),  # auto
        ("/v1/responses", {"tools": [RESPONSES_TOOL], "tool_choice": "required"}, "ebnf"),
        (
            "/v1/responses",
            {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
            "ebnf",
        ),
        ("/v1/messages", {"tools": [ANTHROPIC_TOOL], "tool_choice": ANTHROPIC_NAMED}, "ebnf"),
        # the library reads Anthropic "any" as auto (kind tool_call): the model may answer in text
        ("/v1/messages", {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}}, None),
        ("/v1/messages", {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto"}}, None),
    ],
)
def test_tool_choice_sends_a_grammar_only_when_a_call_is_required(
    client: TestClient,
    backend: FakeBackend,
    encoder: PromptEncoder,
    path: str,
    fields: dict[str, Any],
    kind: str | None,
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 64}
    base["input" if path == "/v1/responses" else "messages"] = (
        "give me JSON" if path == "/v1/responses" else USER
    )
    r = client.post(path, json={**base, **fields})
    assert r.status_code == 200, r.text
    request = backend.requests[0]
    c = sent(backend).constraint
    assert (c.kind if c is not None else None) == kind
    if kind is None:
        return
    assert c is not None
    # the grammar starts after the block the prompt opened and names only the allowed tools
    tail = encoder.full.decode(list(request.prompt_token_ids[-8:]), skip_special_tokens=False)
    assert tail.endswith("<｜DSML｜tool_calls>\n")
    # the DSML markup as the special token itself, the allowed tools by name
    assert f'"<" Token({DSML_ID}) "invoke name=\\"get_weather\\">\\n"' in c.spec
    assert ("get_time" in c.spec) == (
        fields.get("tool_choice") == "required" and OTHER in fields["tools"]
    )


def test_dsml_token_id_is_the_vocabularys(encoder: PromptEncoder) -> None:
    assert encoder.full.token_to_id("｜DSML｜") == DSML_ID


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
    client = strict_http(TestClient(app, raise_server_exceptions=False))
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
    body = {"model": CKPT, "messages": USER, "response_format": fmt}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    c = sent(backend).constraint
    assert c is not None and c.kind == "json_schema" and json.loads(c.spec) == SCHEMA
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"a": 1, "b": "x"}


# -- the tool-call grammar ------------------------------------------------------------------------
# Every kind of parameter the grammar distinguishes; "city" is the only required one.
ALL_TYPES: Any = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "unit": {"enum": ["c", "f"]},
        "level": {"enum": [1, 2, None]},
        "extra": {"type": "object"},
        "tags": {"type": "array"},
        "note": {"type": ["string", "null"]},
        "any": {},
    },
    "required": ["city"],
}
TYPED: Any = {"type": "function", "function": {"name": "get_weather", "parameters": ALL_TYPES}}
ARGS = {
    "city": "Paris, 1 < 2",
    "days": -3,
    "ratio": 1.5e3,
    "metric": True,
    "unit": "f",
    "level": None,
    "extra": {"k": [1, "x", None, {}], "e": []},
    "tags": ["a", 2],
    "note": None,
    "any": "free text",
}


@pytest.fixture(scope="module")
def grammars() -> Any:
    """The engine's grammar backend over the bundled vocabulary (imports torch: tests only)."""
    from libs.engine.grammar import GrammarBackend
    from libs.engine.tokenizer import load_tokenizer

    return GrammarBackend(load_tokenizer(None).to_str(), 129280, [1])


def required_constraint(encoder: PromptEncoder, tools: list[Any], choice: Any) -> Constraint:
    body = {"model": MODEL, "messages": USER, "tools": tools, "tool_choice": choice}
    conv = dr.ChatCompletionRequest(json.dumps(body).encode()).convert(encoder.options)
    c = output_constraint(conv, thinking=False)
    assert c is not None and c.kind == "ebnf"
    return c


def rendered_calls(encoder: PromptEncoder, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """What the library renders for an assistant turn with these calls, after the opening
    ``<｜DSML｜tool_calls>\\n`` (which a required tool choice prefills) up to the block's end."""
    tool_calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)
    ]
    results = [
        {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"} for i in range(len(calls))
    ]
    body = {
        "model": MODEL,
        "messages": [
            *USER,
            {"role": "assistant", "content": "", "tool_calls": tool_calls},
            *results,
        ],
        "tools": [TYPED, OTHER],
    }
    conv = dr.ChatCompletionRequest(json.dumps(body).encode()).convert(encoder.options)
    prompt = encoder.render(conv.conversation).prompt
    opened = "<｜DSML｜tool_calls>\n"
    start = prompt.index(opened, prompt.index("<｜Assistant｜>")) + len(opened)
    end = prompt.index("</｜DSML｜tool_calls>", start) + len("</｜DSML｜tool_calls>")
    return prompt[start:end]


def follows(grammars: Any, encoder: PromptEncoder, c: Constraint, text: str | list[int]) -> bool:
    """Whether the tokens of ``text`` then EOS complete the grammar (as the engine's matcher)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammars.compile(c))
    ids = encoder.full.encode(text, add_special_tokens=False).ids if isinstance(text, str) else text
    return all(matcher.accept_token(t) for t in [*ids, encoder.eos]) and matcher.is_terminated()


@pytest.mark.parametrize(
    "tools",
    [
        [TYPED],
        [TYPED, OTHER],  # OTHER declares no properties: any parameters
        [{"type": "function", "function": {"name": "odd-1"}}],  # no parameters schema
        [  # names that need escaping in the grammar; an empty enum; anyOf
            {
                "type": "function",
                "function": {
                    "name": "odd_2",
                    "parameters": {
                        "type": "object",
                        "properties": {'a "b" <\\c>\n': {"enum": []}, "u": {"anyOf": [{}]}},
                    },
                },
            }
        ],
    ],
)
def test_tool_grammar_compiles_with_the_engine_backend(
    grammars: Any, encoder: PromptEncoder, tools: list[Any]
) -> None:
    c = required_constraint(encoder, tools, "required")
    assert grammars.compile(c) is not None


def test_grammar_accepts_what_the_library_renders(grammars: Any, encoder: PromptEncoder) -> None:
    c = required_constraint(encoder, [TYPED, OTHER], "required")
    # every parameter kind, an undeclared-schema tool, several calls, only the required one
    text = rendered_calls(
        encoder,
        [
            ("get_weather", ARGS),
            ("get_time", {"tz": "UTC", "n": [1]}),
            ("get_weather", {"city": ""}),
        ],
    )
    assert 'string="false">1500.0<' in text and 'string="true">f<' in text  # as rendered
    assert follows(grammars, encoder, c, text)
    assert not follows(grammars, encoder, c, text.removesuffix("</｜DSML｜tool_calls>"))
    named = required_constraint(encoder, [TYPED, OTHER], NAMED)
    assert follows(grammars, encoder, named, rendered_calls(encoder, [("get_weather", ARGS)]))
    assert not follows(grammars, encoder, named, rendered_calls(encoder, [("get_time", {})]))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('name="get_weather"', 'name="get_wether"'),  # not a listed tool
        ('<｜DSML｜parameter name="city" string="true">Paris, 1 < 2</｜DSML｜parameter>\n', ""),
        ("Paris, 1 < 2", "Paris <b>"),  # "<" could begin markup
        ("Paris, 1 < 2", "Paris ｜DSML｜"),  # the DSML token inside a value
        ('name="days" string="false">-3', 'name="days" string="true">-3'),  # integer as text
        ('name="days" string="false">-3', 'name="days" string="false">3.5'),
        ('string="false">true', 'string="false">yes'),  # not JSON: spliced verbatim
        ('string="true">f<', 'string="true">k<'),  # not in the enum
        ('"e": []', '"e": [,]'),
        ('string="false">{"k"', 'string="false">["k"'),  # object expected
        ("</｜DSML｜invoke>\n</｜DSML｜tool_calls>", "</｜DSML｜invoke></｜DSML｜tool_calls>"),
    ],
)
def test_grammar_refuses_what_breaks_the_call(
    grammars: Any, encoder: PromptEncoder, old: str, new: str
) -> None:
    c = required_constraint(encoder, [TYPED, OTHER], "required")
    text = rendered_calls(encoder, [("get_weather", ARGS)])
    assert old in text and follows(grammars, encoder, c, text)
    assert not follows(grammars, encoder, c, text.replace(old, new, 1))


def test_markup_must_be_the_dsml_token(
    grammars: Any, encoder: PromptEncoder, oai: openai.OpenAI, backend: FakeBackend
) -> None:
    """The library's parser reads markup only where the special token stands: the same
    characters in plain pieces are argument text. So the grammar refuses them."""
    c = required_constraint(encoder, [TYPED], "required")
    ids = encoder.full.encode(
        rendered_calls(encoder, [("get_weather", {"city": "Paris"})]), add_special_tokens=False
    ).ids
    assert DSML_ID in ids and follows(grammars, encoder, c, ids)
    plain = [t for p in ("｜", "DSML", "｜") for t in encoder.full.encode(p).ids]
    assert DSML_ID not in plain
    spelled = [t for i in ids for t in (plain if i == DSML_ID else [i])]
    assert encoder.full.decode(spelled) == encoder.full.decode(ids, skip_special_tokens=False)
    assert not follows(grammars, encoder, c, spelled)
    # what the parser makes of a call whose closing tag is spelled in plain pieces
    close = [
        t for p in ("</", "｜", "DSML", "｜", "parameter>\n") for t in encoder.full.encode(p).ids
    ]
    head = encoder.full.encode(
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris'
    ).ids
    tail = encoder.full.encode("</｜DSML｜invoke>\n</｜DSML｜tool_calls>").ids
    backend.answer_ids = lambda request: [*head, *close, *tail, encoder.eos]  # type: ignore[method-assign]
    out = oai.chat.completions.create(
        model=MODEL, messages=USER, tools=[TYPED], tool_choice="required"
    )
    (call,) = out.choices[0].message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert "DSML" in json.loads(call.function.arguments)["city"]  # not a closing tag


def test_too_many_tools_to_enforce_go_unconstrained(encoder: PromptEncoder) -> None:
    """Over 256 KiB of grammar: the request still runs, with the library's prefill only."""
    props = {f"p{j}_{'x' * 40}": {"type": "string"} for j in range(20)}
    params = {"type": "object", "properties": props}
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": params}}
        for i in range(300)
    ]
    body = {"model": MODEL, "messages": USER, "tools": tools, "tool_choice": "required"}
    conv = dr.ChatCompletionRequest(json.dumps(body).encode()).convert(encoder.options)
    assert output_constraint(conv, thinking=False) is None
    assert output_constraint(conv, thinking=True) is None
    small = dr.ChatCompletionRequest(json.dumps({**body, "tools": tools[:1]}).encode()).convert(
        encoder.options
    )
    assert output_constraint(small, thinking=True) is None  # thinking: never constrained
    c = output_constraint(small, thinking=False)
    assert c is not None and c.kind == "ebnf"
    assert tool_call_grammar([]) == ""  # no tool: nothing to send


# -- end to end through the tiny random-weight engine --------------------------------------------
E2E_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["c", "f"]},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "unit"],
        },
    },
}
E2E_OTHER: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string"}, "dst": {"type": "boolean"}},
            "required": ["tz", "dst"],
        },
    },
}


class EngineBackend(FakeBackend):
    """The recipe's backend answered by the real tiny engine: the prompt ids and sampling
    settings (constraint included) exactly as the recipe sent them."""

    def __init__(self, encoder: PromptEncoder, engine: Any) -> None:
        super().__init__(encoder)
        self.engine = engine

    def answer_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        rid = f"r{len(self.requests)}"
        self.engine.add_request(
            rid, list(request.prompt_token_ids), SamplingParams.from_proto(request.sampling)
        )
        out: list[int] = []
        while self.engine.has_unfinished():
            out += [ev.token_id for ev in self.engine.step() if ev.token_id is not None]
        return out


@pytest.fixture(scope="module")
def engine() -> Any:
    import torch

    from libs.engine.engine import Engine, EngineConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model decodes ~4x faster on one thread than on two
    try:
        yield Engine(EngineConfig(model="tiny", seed=0, num_kv_blocks=64))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("choice", "allowed"),
    [("required", {"get_weather", "get_time"}), (NAMED, {"get_weather"})],
)
def test_random_model_makes_a_valid_required_call(
    encoder: PromptEncoder,
    engine: Any,
    monkeypatch: pytest.MonkeyPatch,
    choice: Any,
    allowed: set[str],
) -> None:
    """Random weights would never end a free string by chance (the closing tag is 2 of ~128K
    tokens), so strings are capped at 16 characters here; the served grammar leaves them free."""
    monkeypatch.setattr(constraints, "TEXT_LIMIT", 16)
    backend = EngineBackend(encoder, engine)
    client = strict_http(TestClient(make_app(encoder, backend), raise_server_exceptions=False))
    oai = openai_client(
        base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=client
    )
    required = {"get_weather": {"city", "unit"}, "get_time": {"tz", "dst"}}
    names = set()
    for seed in range(2):
        out = oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[E2E_TOOL, E2E_OTHER],
            tool_choice=choice,
            seed=seed,
            max_tokens=1000,
            temperature=1.0,
        )
        assert backend.requests[-1].sampling.constraint.kind == "ebnf"
        choice0 = out.choices[0]
        assert choice0.finish_reason == "tool_calls", choice0
        assert not choice0.message.content
        for call in choice0.message.tool_calls or []:
            assert isinstance(call, ChatCompletionMessageFunctionToolCall)
            assert call.function.name in allowed
            args = json.loads(call.function.arguments)
            assert required[call.function.name] <= set(args), args
            assert set(args) <= set(E2E_TOOL["function"]["parameters"]["properties"]) | {
                "tz",
                "dst",
            }
            assert all(isinstance(args[k], bool) for k in ("metric", "dst") if k in args)
            assert args.get("unit", "c") in ("c", "f")
            assert all(
                len(args[k]) <= 16 and "<" not in args[k] for k in ("city", "tz") if k in args
            )
            names.add(call.function.name)
        assert choice0.message.tool_calls
    assert names <= allowed
