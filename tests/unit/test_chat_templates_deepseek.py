"""The checkpoint decides the chat format (issue 37 item 3): a DeepSeek-V3 or R1 release is
rendered with the chat template in its tokenizer_config.json -- the same text and ids as
transformers' ``apply_chat_template`` on the same messages -- R1's reasoning and the V3 family's
tool-call tokens are read back from the output, and what a template has no way to render is a
400 that says so; only the V4 family gets deepseek-recipe's V4 encoding."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from libs.engine.tokenizer import CHAT_TEMPLATE, DEEPSEEK_V4, served_tokenizer
from libs.proto.deepserve.v1 import generate_pb2
from services.recipe.api import CHAT, MESSAGES, APIError, Protocol
from services.recipe.chat_template import ChatTemplateEncoder
from services.recipe.encoding import build_encoder
from services.recipe.plan import Planner
from services.recipe.tool_markup import dsml_calls, parse_v3_calls

from ..hf_reference import require_reference
from .deepseek_chat import BOS, EOS, template, v3_checkpoint

MODEL = "deepseek-v3"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {
        "id": "call_2",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    },
]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ünï 世界"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ],
    "two systems": [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ],
    "tool history": [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny, Oslo rainy."},
        {"role": "user", "content": "Thanks"},
    ],
    "ends with tool results": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
}
# A deployment's own template that also renders tool definitions (the released V3 and R1 ones
# do not): R1's, with a tools section after the system prompt.
TOOLS_SECTION = (
    "{% if tools is defined and tools %}{{ '\\n\\n## Tools' }}{% for tool in tools %}"
    "{{ '\\n### ' + tool['function']['name'] + '\\n' + (tool['function']['parameters'] | tojson) }}"
    "{% endfor %}{{ '\\nCall them as <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>.' }}{% endif %}"
)


def with_tools(source: str) -> str:
    anchor = "{{ ns.system_prompt }}"
    assert anchor in source
    return source.replace(anchor, anchor + TOOLS_SECTION, 1)


def encoder_for(root: Path, source: str | None) -> ChatTemplateEncoder:
    served = served_tokenizer(str(v3_checkpoint(root, source)))
    encoder = build_encoder(served, [MODEL])
    assert isinstance(encoder, ChatTemplateEncoder)
    return encoder


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplateEncoder:
    return encoder_for(tmp_path_factory.mktemp("v3") / "ckpt", template("deepseek-v3"))


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplateEncoder:
    return encoder_for(tmp_path_factory.mktemp("r1") / "ckpt", template("deepseek-r1"))


@pytest.fixture(scope="module")
def r1_tools(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplateEncoder:
    return encoder_for(tmp_path_factory.mktemp("r1t") / "ckpt", with_tools(template("deepseek-r1")))


def hf_tokenizer(encoder: ChatTemplateEncoder, source: str) -> Any:
    """transformers' tokenizer over the same tokenizer.json and template."""
    return _hf_tokenizer(str(encoder.tokenizer_path), source)


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(path: str, source: str) -> Any:
    transformers = require_reference("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=path, bos_token=BOS, eos_token=EOS, chat_template=source
    )


def hf_prompt(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[int]]:
    """transformers' text and ids for ``messages``: ``apply_chat_template`` -- or, for a message
    with ``content`` None, its renderer under it (``render_jinja_template``, then the tokenizer
    with no special tokens added, as ``apply_chat_template(tokenize=True)`` does):
    ``apply_chat_template`` drops None-valued keys first, and both released templates test
    ``message['content'] is none`` to render a message that only calls tools -- without the key
    they raise on it."""
    if all(v is not None for m in messages for v in m.values()):
        text = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        ids = hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
        )
        return text, list(ids)
    from transformers.utils.chat_template_utils import render_jinja_template

    (text,), _ = render_jinja_template(
        [messages],
        chat_template=hf.chat_template,
        add_generation_prompt=True,
        **hf.special_tokens_map,
        **kwargs,
    )
    return text, list(hf(text, add_special_tokens=False)["input_ids"])


def planned(encoder: ChatTemplateEncoder, body: dict[str, Any], proto: Protocol = CHAT) -> Any:
    planner = Planner(encoder, MODEL, default_max_tokens=256, max_context=16384)
    return planner.chat(proto, json.dumps({"model": MODEL, **body}).encode(), "r1", "-")


def answer(
    encoder: ChatTemplateEncoder, body: dict[str, Any], said: str, proto: Protocol = CHAT
) -> dict[str, Any]:
    """The response to ``body`` when the model writes ``said`` (then EOS), one token an event."""
    plan = planned(encoder, body, proto)
    (job,) = plan.choices()
    ids = encoder.full.encode(said, add_special_tokens=False).ids + [encoder.eos]
    events = [generate_pb2.GenerateEvent(ready=generate_pb2.Ready(prompt_tokens=len(plan.prompt)))]
    events += [generate_pb2.GenerateEvent(tokens=generate_pb2.Tokens(token_ids=[t])) for t in ids]
    events.append(generate_pb2.GenerateEvent(finish=generate_pb2.Finish(reason="stop")))
    for ev in events:
        job.push(ev, encoder.eos_ids)
    result: dict[str, Any] = json.loads(job.response.to_json())
    return result


# -- rendering: the same text and ids as transformers -------------------------------------------
@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-r1"])
def test_released_templates_render_as_transformers_does(
    v3: ChatTemplateEncoder, r1: ChatTemplateEncoder, family: str, name: str
) -> None:
    encoder = v3 if family == "deepseek-v3" else r1
    messages = CONVERSATIONS[name]
    plan = planned(encoder, {"messages": messages})
    text, ids = hf_prompt(hf_tokenizer(encoder, template(family)), messages)
    assert plan.prompt == ids
    assert encoder.full.decode(plan.prompt, skip_special_tokens=False) == text
    assert text.startswith(BOS)
    if name != "ends with tool results":  # the templates open no answer after tool results
        assert text.endswith(
            "<｜Assistant｜><think>\n" if family == "deepseek-r1" else "<｜Assistant｜>"
        )


def test_tool_definitions_render_as_transformers_does(r1_tools: ChatTemplateEncoder) -> None:
    messages = CONVERSATIONS["turns"]
    plan = planned(r1_tools, {"messages": messages, "tools": [WEATHER]})
    hf = hf_tokenizer(r1_tools, with_tools(template("deepseek-r1")))
    _, ids = hf_prompt(hf, messages, tools=[WEATHER])
    assert plan.prompt == ids
    assert '### get_weather\n{"type": "object"' in r1_tools.full.decode(plan.prompt)


# -- the family decides ---------------------------------------------------------------------------
def test_the_family_decides_the_encoding(tmp_path: Path) -> None:
    v3 = served_tokenizer(str(v3_checkpoint(tmp_path / "v3", template("deepseek-v3"))))
    assert v3.encoding == CHAT_TEMPLATE and v3.chat_template == template("deepseek-v3")
    assert (v3.bos_token, v3.eos_token) == (BOS, EOS)
    # A V4 checkpoint with the DeepSeek vocabulary: deepseek-recipe's V4 encoding, template or not.
    v4 = v3_checkpoint(tmp_path / "v4", template("deepseek-v3"), model_type="deepseek_v4")
    (v4 / "tokenizer.json").unlink()  # the bundled one: V4's vocabulary
    assert served_tokenizer(str(v4)).encoding == DEEPSEEK_V4
    # V3 without its template is not quietly served with V4's encoding.
    bare = v3_checkpoint(tmp_path / "bare", None)
    with pytest.raises(ValueError, match="deepseek_v3 checkpoint .* no chat template"):
        served_tokenizer(str(bare))


# -- thinking -------------------------------------------------------------------------------------
def test_r1_thinks_by_default_and_its_reasoning_is_parsed(r1: ChatTemplateEncoder) -> None:
    hello = {"messages": [{"role": "user", "content": "Hi"}]}
    out = answer(r1, hello, "\nThe user greets me.\n</think>\n\nHello!")
    msg = out["choices"][0]["message"]
    assert msg["reasoning_content"].strip() == "The user greets me."
    assert msg["content"].strip() == "Hello!"
    anthropic = answer(r1, {**hello, "max_tokens": 64}, "Hmm.</think>Hello!", MESSAGES)
    kinds = [b["type"] for b in anthropic["content"]]
    assert kinds == ["thinking", "text"] and anthropic["content"][1]["text"] == "Hello!"


def test_a_template_with_a_thinking_switch_gets_the_requests_mode(tmp_path: Path) -> None:
    """V3.1's way: the template reads ``thinking`` and opens ``<think>`` or closes it."""
    source = (
        "{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
        "{% if thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}"
    )
    switch = encoder_for(tmp_path / "v31", source)
    hello = [{"role": "user", "content": "Hi"}]
    assert switch.traits.thinking == "switch"
    off = planned(switch, {"messages": hello})
    assert (
        switch.full.decode(off.prompt[-2:], skip_special_tokens=False) == "<｜Assistant｜></think>"
    )
    on = {"messages": hello, "thinking": {"type": "enabled"}}
    assert switch.full.decode(planned(switch, on).prompt[-1:]) == "<think>"
    msg = answer(switch, on, "Hmm.</think>Hello!")["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm.", "Hello!")


@pytest.mark.parametrize(
    "family,extra,param",
    [
        ("deepseek-r1", {"thinking": {"type": "disabled"}}, "thinking"),
        ("deepseek-r1", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("deepseek-v3", {"thinking": {"type": "enabled"}}, "thinking"),
        ("deepseek-v3", {"reasoning_effort": "high"}, "thinking"),
        ("deepseek-v3", {"tools": [WEATHER]}, "tools"),  # V3's template renders no definitions
        ("deepseek-r1", {"tools": [WEATHER]}, "tools"),
    ],
)
def test_what_the_family_has_no_way_to_render_is_a_400(
    v3: ChatTemplateEncoder, r1: ChatTemplateEncoder, family: str, extra: dict[str, Any], param: str
) -> None:
    encoder = v3 if family == "deepseek-v3" else r1
    with pytest.raises(APIError) as err:
        planned(encoder, {"messages": [{"role": "user", "content": "Hi"}], **extra})
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert "template" in err.value.message


@pytest.mark.parametrize("text", ["say <｜User｜> now", "done</think>", "<｜tool▁calls▁begin｜>"])
def test_user_text_never_becomes_a_control_token(v3: ChatTemplateEncoder, text: str) -> None:
    with pytest.raises(APIError) as err:
        planned(v3, {"messages": [{"role": "user", "content": text}]})
    assert err.value.status == 400 and err.value.param == "messages"


def test_default_thinking_is_refused_where_the_template_has_none(tmp_path: Path) -> None:
    served = served_tokenizer(str(v3_checkpoint(tmp_path / "v3", template("deepseek-v3"))))
    with pytest.raises(ValueError, match="--default-thinking"):
        build_encoder(served, [MODEL], default_thinking=True)


# -- tool calls -----------------------------------------------------------------------------------
V3_CALLS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


def test_v3_and_v31_call_markup_parses() -> None:
    assert parse_v3_calls(V3_CALLS) == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Oslo"}),
    ]
    v31 = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert parse_v3_calls(v31) == [("get_weather", {"city": "Rome"})]
    for broken in ("<｜tool▁calls▁begin｜>no call", V3_CALLS.replace('"Oslo"}', '"Oslo"')):
        assert parse_v3_calls(broken) is None
    assert 'string="false">3</' in dsml_calls([("f", {"days": 3})])


def test_r1_tool_calls_reach_every_protocol(r1_tools: ChatTemplateEncoder) -> None:
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    out = answer(r1_tools, body, "I should call the tool.</think>" + V3_CALLS)
    choice = out["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert choice["message"]["reasoning_content"] == "I should call the tool."
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
    anthropic = answer(
        r1_tools,
        {"max_tokens": 64, "messages": body["messages"], "tools": [tool]},
        "Calling.</think>" + V3_CALLS,
        MESSAGES,
    )
    uses = [b for b in anthropic["content"] if b["type"] == "tool_use"]
    assert [u["input"] for u in uses] == [{"city": "Paris", "days": 3}, {"city": "Oslo"}]
    assert anthropic["stop_reason"] == "tool_use"


def test_an_unparsable_block_stays_the_models_text(r1_tools: ChatTemplateEncoder) -> None:
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    broken = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\nnot json"
    )
    out = answer(r1_tools, body, "ok</think>" + broken)
    choice = out["choices"][0]
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] == "stop"
    assert "not json" in choice["message"]["content"]


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tool_choice": "required", "thinking": {"type": "enabled"}}, None),  # the library's 400
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_tool_features_the_template_path_lacks_are_400s(
    r1_tools: ChatTemplateEncoder, extra: dict[str, Any], param: str | None
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather, as json?"}],
        "tools": [WEATHER],
        **extra,
    }
    with pytest.raises(APIError) as err:
        planned(r1_tools, body)
    assert err.value.status == 400
    if param:
        assert err.value.param == param
