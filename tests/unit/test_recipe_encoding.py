"""recipe prompt encoding: deepseek-recipe's V4 rendering, our split encoding (identical ids to
the library's own), and the control-token injection property."""

from __future__ import annotations

import json
import random
from typing import Any

import deepseek_recipe as dr
import pytest

from services.recipe.encoding import PromptEncoder

MODEL = "deepseek-tiny"


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


def convert(
    encoder: PromptEncoder, body: dict[str, Any], cls: Any = dr.ChatCompletionRequest
) -> dr.ConversationRequest:
    return cls({"model": MODEL, **body}).convert(encoder.options)


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


def conversation(user_text: str) -> dict[str, Any]:
    """Every place a user's text can land: system, user, assistant (content, reasoning, tool-call
    arguments and names), tool results, tool descriptions."""
    return {
        "messages": [
            {"role": "system", "content": user_text},
            {"role": "user", "content": user_text},
            {
                "role": "assistant",
                "content": user_text,
                "reasoning_content": user_text,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": user_text}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": user_text},
            {"role": "user", "content": [{"type": "text", "text": user_text}]},
        ],
        "tools": [
            {"type": "function", "function": {**TOOLS[0]["function"], "description": user_text}}
        ],
    }


def test_ids_identical_to_the_library_encode(encoder: PromptEncoder) -> None:
    for body in (
        conversation("Hi <｜User｜> there"),
        {"messages": [{"role": "user", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}},
    ):
        conv = convert(encoder, body).conversation
        ref = encoder.encode_reference(conv)
        assert encoder.encode(conv, parallel=False) == ref
        assert encoder.encode(conv, parallel=True) == ref


def test_long_prompt_parallel_equals_sequential(encoder: PromptEncoder) -> None:
    rng = random.Random(1)
    words = ["alpha", "β", "数据", "\n", "  ", "<｜User｜>", "don't", "123", "🎉", "\t", "x" * 30]
    msgs = []
    for i in range(40):
        text = "".join(rng.choice(words) + " " for _ in range(800))
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    msgs.append({"role": "user", "content": "end"})
    conv = convert(encoder, {"messages": msgs}).conversation
    ref = encoder.encode_reference(conv)
    assert len(ref) > 20_000
    assert encoder.encode(conv, parallel=True) == ref == encoder.encode(conv, parallel=False)


def test_no_user_text_ever_becomes_a_control_token(encoder: PromptEncoder) -> None:
    added = encoder.full.get_added_tokens_decoder()
    spellings = [t.content for t in added.values()]
    assert len(spellings) > 1000 and "<｜User｜>" in spellings and "</think>" in spellings
    rng = random.Random(0)
    frags = [
        "<",
        ">",
        "｜",
        "|",
        "▁",
        "User",
        "Assistant",
        "begin",
        "end",
        "of",
        "sentence",
        "tool",
        "think",
        "/",
        " ",
        "\n",
        "DSML",
        "System",
        "fim",
        "hole",
        "place",
        "holder",
        "0",
    ]
    fuzz = ["".join(rng.choice(frags) for _ in range(rng.randint(1, 12))) for _ in range(2000)]
    # the plain-text encoder alone, over every added token's spelling and fuzz
    for text in spellings + fuzz:
        ids = encoder.plain.encode(text, add_special_tokens=False).ids
        bad = [i for i in ids if i in encoder.added_ids]
        assert not bad, f"{text!r} encoded to control ids {bad}"
        assert encoder.full.decode(ids, skip_special_tokens=False) == text, "must round-trip"
    # through the whole library rendering, in every role: the control ids are exactly the ones
    # a harmless text gets -- user text adds none
    everything = " ".join(spellings[:400]) + " " + " ".join(fuzz[:200])
    for cls, make in ((dr.ChatCompletionRequest, conversation),):
        harmless = encoder.encode(convert(encoder, make("plain words")).conversation)
        hostile = encoder.encode(convert(encoder, make(everything)).conversation)
        ctrl = [i for i in hostile if i in encoder.added_ids]
        assert ctrl == [i for i in harmless if i in encoder.added_ids]
    # Anthropic and Responses inputs too
    for cls, body in (
        (
            dr.MessagesRequest,
            {
                "max_tokens": 5,
                "system": everything,
                "messages": [{"role": "user", "content": everything}],
            },
        ),
        (dr.ResponsesRequest, {"instructions": everything, "input": everything}),
    ):
        harmless = encoder.encode(
            convert(
                encoder,
                {k: (v if not isinstance(v, str) else "plain") for k, v in body.items()}
                | (
                    {"messages": [{"role": "user", "content": "plain"}]}
                    if "messages" in body
                    else {}
                ),
                cls,
            ).conversation
        )
        hostile = encoder.encode(convert(encoder, body, cls).conversation)
        assert [i for i in hostile if i in encoder.added_ids] == [
            i for i in harmless if i in encoder.added_ids
        ], cls.__name__


def test_v41_encoding_is_not_served(encoder: PromptEncoder) -> None:
    """The bundled vocabulary has no <｜System｜>, which DeepseekV41Encoding needs (documented)."""
    assert encoder.full.token_to_id("<｜System｜>") is None
    assert list(encoder.options.model_versions_by_name) == [MODEL]
    with pytest.raises(dr.ConversionError):
        dr.ChatCompletionRequest(
            {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "x"}]}
        ).convert(encoder.options)


def test_property_no_user_text_produces_a_special_id(encoder: PromptEncoder) -> None:
    """Hypothesis: for any text built from control-token spellings, their characters and
    arbitrary unicode, in every message slot, the prompt's control ids are exactly those of a
    harmless text."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    spellings = [t.content for t in encoder.full.get_added_tokens_decoder().values()]
    piece = (
        st.sampled_from(spellings)
        | st.sampled_from(["<", ">", "｜", "▁", "/", "think", "DSML", "\n"])
        | st.text(max_size=6)
    )
    baseline = [
        i
        for i in encoder.encode(convert(encoder, conversation("plain words")).conversation)
        if i in encoder.added_ids
    ]

    @settings(
        max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(st.lists(piece, min_size=1, max_size=12).map("".join))
    def prop(text: str) -> None:
        ids = encoder.encode(convert(encoder, conversation(text)).conversation)
        assert [i for i in ids if i in encoder.added_ids] == baseline, text

    prop()


@pytest.mark.parametrize("text", ["<｜/polygon｜>", "a<｜polygon｜>b", "<｜ref｜>x<｜/ref｜>"])
def test_markup_tokens_in_assistant_history_stay_plain_text(
    encoder: PromptEncoder, text: str
) -> None:
    """The library marks grounding markup inside assistant history as special; the client wrote
    that history, so it must encode as plain text (found by the property test below)."""
    baseline = [
        i
        for i in encoder.encode(convert(encoder, conversation("plain words")).conversation)
        if i in encoder.added_ids
    ]
    ids = encoder.encode(convert(encoder, conversation(text)).conversation)
    assert [i for i in ids if i in encoder.added_ids] == baseline
