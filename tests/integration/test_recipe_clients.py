"""The clients people use, unchanged, against the real stack (tiny model, 1 prefill + 1 decode):
LangChain (``invoke``, ``stream``, ``with_structured_output`` in all three methods,
``bind_tools`` with a forced tool), the OpenAI Agents SDK (an agent with a tool and a
structured final output) and LiteLLM (``openai/`` provider), each with the openai SDK's strict
response validation where the client lets us hand it the SDK client.

The tiny model has random weights: only the grammar gives an answer its structure, so the
schemas here bound every string (a random model would not end an unbounded one) and every
structured result is validated against its schema; every length field is checked to hold.
All in one module sharing one stack: the stack's start is most of the time.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Annotated, Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from deepserve.up import Stack

from ..sdk_strict import async_openai_client, openai_client, strict_http
from .conftest import MODEL_NAME, READY_TIMEOUT, dump_logs

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import

pytestmark = pytest.mark.timeout(300)


class City(BaseModel):
    """A city and a number of days."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=10)


COMPILE_S = 2.0
ENGINES = ("prefill", "decode")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack, with the default heartbeat timeouts (3 s): an engine builds its grammar
    backend when it loads, so no first constrained request silences it."""
    s = Stack(
        tmp_path_factory.mktemp("clients"),
        prefill=1,
        decode=1,
        model="tiny",
        model_name=MODEL_NAME,
        ready_timeout=READY_TIMEOUT,
        drain_seconds=5.0,
        env=dict(os.environ),
        # schemas here compile in ~0.01 s; the last test's wide one would take ~25 s
        extra_args={r: ["--grammar-compile-seconds", str(COMPILE_S)] for r in ENGINES},
    )
    try:
        s.start()
        yield s
        assert not s.exited(), dump_logs(s)
    finally:
        s.stop()


def sdk(stack: Stack) -> openai.OpenAI:
    return openai_client(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120)


def check_city(value: Any) -> None:
    data = value.model_dump() if isinstance(value, BaseModel) else value
    jsonschema.validate(data, City.model_json_schema())


# -- the length fields, by HTTP ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "usage_key"),
    [
        ("/chat/completions", {"max_tokens": 7}, "completion_tokens"),
        ("/chat/completions", {"max_completion_tokens": 7}, "completion_tokens"),
        ("/responses", {"max_output_tokens": 7}, "output_tokens"),
        ("/responses", {"max_tokens": 7}, "output_tokens"),  # issue 33: once ignored
        ("/completions", {"max_tokens": 7}, "completion_tokens"),
    ],
)
def test_every_length_field_holds(
    stack: Stack, path: str, body: dict[str, Any], usage_key: str
) -> None:
    prompt: dict[str, Any] = {
        "/chat/completions": {"messages": [{"role": "user", "content": "Say hi"}]},
        "/responses": {"input": "Say hi"},
        "/completions": {"prompt": "Say hi"},
    }[path]
    extra = {} if path == "/responses" else {"ignore_eos": True}
    r = strict_http(httpx.Client()).post(
        stack.api_url + path, json={"model": MODEL_NAME, **prompt, **body, **extra}, timeout=120
    )
    assert r.status_code == 200, r.text
    used = r.json()["usage"][usage_key]
    assert 1 <= used <= 7, r.json()
    if path != "/responses":  # ignore_eos: the limit, not the model, ended it (usage leaves
        # out EOS ids the random model may emit on the way, so it can read less than 7)
        assert r.json()["choices"][0]["finish_reason"] == "length", r.json()


# -- LangChain -----------------------------------------------------------------------------------
def chat_model(stack: Stack, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL_NAME, base_url=stack.api_url, api_key="unused", max_retries=0, **kw
    )
    strict = sdk(stack)  # the same client, validating every response strictly
    llm.root_client, llm.client = strict, strict.chat.completions
    return llm


def test_langchain_invoke_and_stream_keep_max_tokens(stack: Stack) -> None:
    out = chat_model(stack, max_tokens=60).invoke("Say hi")  # the 4,096 tokens
    assert 1 <= out.usage_metadata["output_tokens"] <= 60, out.usage_metadata
    chunks = list(chat_model(stack, max_tokens=20, stream_usage=True).stream("Say hi"))
    (usage,) = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert 1 <= usage["output_tokens"] <= 20, usage


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_validates(stack: Stack, method: str) -> None:
    llm = chat_model(stack, max_tokens=160, temperature=0)
    out = llm.with_structured_output(City, method=method, include_raw=True).invoke(
        "Give me a city as JSON"
    )
    assert out["parsing_error"] is None, out
    check_city(out["parsed"])
    assert out["raw"].usage_metadata["output_tokens"] <= 160


def test_langchain_json_mode_is_json_and_keeps_the_limit(stack: Stack) -> None:
    """``json_mode`` sends no schema: the grammar keeps the output a JSON object but nothing
    bounds it, and a random-weight model does not close one by chance. What must hold: the
    output is constrained JSON (a prefix of an object) and the length limit is kept."""
    llm = chat_model(stack, max_tokens=40, temperature=0)
    out = llm.with_structured_output(None, method="json_mode", include_raw=True)
    try:
        result = out.invoke("Give me a city as JSON")
    except openai.LengthFinishReasonError as exc:  # the SDK's own check: the limit was hit
        assert exc.completion.usage is not None and exc.completion.usage.completion_tokens == 40
        content = exc.completion.choices[0].message.content or ""
    else:
        raw = result["raw"]
        assert raw.usage_metadata["output_tokens"] <= 40
        content = raw.content
        if result["parsing_error"] is None:
            assert isinstance(result["parsed"], dict)
    assert content.startswith("{"), content


def test_langchain_forced_tool_keeps_the_length_bound(stack: Stack) -> None:
    llm = chat_model(stack, max_tokens=120, temperature=0)
    out = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Paris?")
    assert out.tool_calls and all(c["name"] == "GetWeather" for c in out.tool_calls), out
    for call in out.tool_calls:
        jsonschema.validate(call["args"], GetWeather.model_json_schema())


# -- the OpenAI Agents SDK -----------------------------------------------------------------------
def test_agents_sdk_tool_and_structured_output(stack: Stack) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    client = async_openai_client(base_url=stack.api_url, api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Look the weather up, then answer as JSON.",
        tools=[get_weather],
        output_type=City,
        model=OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client),
        # the first turn must call the tool; the SDK then resets tool_choice to auto, where the
        # answer is the output_type's JSON or another call (both enforced by the grammar)
        model_settings=ModelSettings(max_tokens=120, temperature=0, tool_choice="required"),
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=6))
    assert asked and all(len(c) <= 10 for c in asked), asked
    assert isinstance(result.final_output, City)
    check_city(result.final_output)


# -- LiteLLM -------------------------------------------------------------------------------------
def test_litellm_openai_provider(stack: Stack) -> None:
    import litellm

    common: dict[str, Any] = {
        "model": f"openai/{MODEL_NAME}",
        "api_base": stack.api_url,
        "api_key": "unused",
        "client": sdk(stack),
    }
    say_hi = [{"role": "user", "content": "Say hi"}]
    for limit in ({"max_tokens": 7}, {"max_completion_tokens": 7}):
        r = litellm.completion(messages=say_hi, **limit, **common)
        assert 1 <= r.usage.completion_tokens <= 7, (limit, r.usage)
    parts = list(litellm.completion(messages=say_hi, max_tokens=5, stream=True, **common))
    assert parts and parts[-1].choices[0].finish_reason in ("stop", "length")
    r = litellm.completion(
        messages=[{"role": "user", "content": "A city as JSON"}],
        max_tokens=120,
        response_format=City,
        temperature=0,
        **common,
    )
    assert r.choices[0].finish_reason == "stop", r
    check_city(json.loads(r.choices[0].message.content))
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": GetWeather.model_json_schema(),
        },
    }
    r = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=120,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        **common,
    )
    calls = r.choices[0].message.tool_calls
    assert calls, r
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), GetWeather.model_json_schema())


def test_a_slow_schema_is_a_400_naming_the_limit_and_others_are_served(stack: Stack) -> None:
    """Issue 33's probe: a schema of 4,000 optional properties compiled for 59 s (a 504), and
    another client's worst latency rose to 19 s meanwhile. 1,500 (~25 s to compile) past this
    stack's 2 s budget: a 400 naming the limit; a plain request meanwhile is served at once.
    Last in the module: the killed compiler process is started again by the next schema."""
    import concurrent.futures

    props = {f"p{i}": {"type": "string"} for i in range(1500)}
    schema = {"name": "wide", "schema": {"type": "object", "properties": props}}
    say_hi = [{"role": "user", "content": "Say hi"}]
    wide = {"model": MODEL_NAME, "messages": say_hi, "max_tokens": 8}
    wide["response_format"] = {"type": "json_schema", "json_schema": schema}
    http = strict_http(httpx.Client(timeout=120))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(http.post, f"{stack.api_url}/chat/completions", json=wide)
        sdk(stack).chat.completions.create(model=MODEL_NAME, messages=say_hi, max_tokens=2)
        t0 = time.monotonic()  # the wide schema is being compiled now (or refused already)
        sdk(stack).chat.completions.create(model=MODEL_NAME, messages=say_hi, max_tokens=2)
        plain_s = time.monotonic() - t0
        r = slow.result()
    assert r.status_code == 400, r.text
    assert "--grammar-compile-seconds" in r.json()["error"]["message"], r.text
    assert plain_s < COMPILE_S + 3, plain_s
