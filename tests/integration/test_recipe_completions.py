"""OpenAI Completions and ``n`` choices through the real stack (tiny model, 1 prefill + 1
decode: conftest's ``stack``), driven by the official openai SDK.

The tiny model emits random tokens, so these tests check what holds whatever it says: shapes,
usage, greedy and seeded determinism (a stop sequence is cut out of the model's own greedy
text), and that the choices of one seeded request differ.
"""

from __future__ import annotations

import openai
import pytest

from deepserve.up import Stack
from libs.engine.tokenizer import load_tokenizer

from .conftest import MODEL_NAME
from .test_recipe_stack import oai

pytestmark = pytest.mark.timeout(600)
PROMPT = "The quick brown fox"
# Every choice runs to max_tokens, so token counts are known whatever the model says.
FULL_LENGTH = {"ignore_eos": True}


def test_completions_and_usage(stack: Stack) -> None:
    c = oai(stack)
    out = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].index == 0
    u = out.usage
    assert u is not None and 1 <= u.completion_tokens <= 6
    bos_and_text = 1 + len(load_tokenizer().encode(PROMPT, add_special_tokens=False).ids)
    assert u.prompt_tokens == bos_and_text  # the raw text, no chat template around it
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    again = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy: the same text
    echoed = c.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + out.choices[0].text


def test_completions_stream(stack: Stack) -> None:
    c = oai(stack, sdk_validation=False)  # streamed Completions: sdk_strict.openai_client
    whole = c.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=FULL_LENGTH
    )
    parts = list(
        c.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=FULL_LENGTH,
        )
    )
    assert all(p.object == "text_completion" for p in parts)
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
    assert parts[-1].choices == [] and parts[-1].usage is not None
    assert parts[-1].usage.completion_tokens == 8
    assert whole.usage is not None and parts[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_stop_and_token_ids(stack: Stack) -> None:
    c = oai(stack)
    ids = [0, 1000, 2000, 3000, 4000]
    full = c.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=16, temperature=0, extra_body=FULL_LENGTH
    )
    assert full.usage is not None and full.usage.prompt_tokens == len(ids)  # sent as given
    text = full.choices[0].text
    assert len(text) >= 6, text
    stop = text[len(text) // 2 :][:2]
    cut = c.completions.create(
        model=MODEL_NAME,
        prompt=ids,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body=FULL_LENGTH,
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completions_refusals(stack: Stack) -> None:
    c = oai(stack)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_NAME, prompt="def f(x):", suffix="    return y")
    assert e.value.body["param"] == "suffix"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_NAME, prompt="x", logprobs=6)  # legacy limit: 5
    assert e.value.body["param"] == "logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # prompt logprobs are not computed
        c.completions.create(model=MODEL_NAME, prompt="x", logprobs=1, echo=True)
    assert e.value.body["param"] == "echo"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # issue 33: once silently the prompt "a"
        c.completions.create(model=MODEL_NAME, prompt=["a", 5])  # type: ignore[list-item]
    assert e.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], n=17
        )
    assert e.value.body["param"] == "n"  # type: ignore[index]


def test_chat_n_choices(stack: Stack) -> None:
    c = oai(stack)
    ask = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me something."}],
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": FULL_LENGTH,
    }
    out = c.chat.completions.create(n=3, **ask)  # type: ignore[call-overload]
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    texts = [(ch.message.content or "") + str(ch.message.tool_calls) for ch in out.choices]
    assert len(set(texts)) == 3, texts  # each choice its own seed
    one = c.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert one.usage is not None and out.usage is not None
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    # Summed over the choices: 3 x 6 (deepseek-recipe leaves out a trailing token that is half
    # a UTF-8 character, which random tokens sometimes are); one choice alone is at most 6.
    assert 3 * 6 - 3 <= out.usage.completion_tokens <= 3 * 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_n_choices_stream(stack: Stack) -> None:
    c = oai(stack)
    parts = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Tell me something else."}],
            max_tokens=5,
            temperature=1.0,
            seed=99,
            n=3,
            stream=True,
            extra_body=FULL_LENGTH,
        )
    )
    finish: dict[int, str] = {}
    text: dict[int, str] = {}
    for p in parts:
        for ch in p.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
            text[ch.index] += str(ch.delta.tool_calls or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert sorted(finish) == [0, 1, 2] and len(set(text.values())) == 3, text
    usage = parts[-1].usage
    assert parts[-1].choices == [] and usage is not None
    assert 3 * 5 - 3 <= usage.completion_tokens <= 3 * 5 and usage.prompt_tokens > 0
    assert all(p.usage is None for p in parts[:-1])
