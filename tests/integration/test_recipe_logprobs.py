"""Log probabilities through the real stack (tiny model, 1 prefill + 1 decode: conftest's
``stack``), driven by the official openai SDK: Chat Completions ``logprobs``/``top_logprobs``
and Completions ``logprobs``.

The tiny model says random things, so these tests check what holds whatever it says: one entry
per completion token, log probabilities <= 0, alternatives most likely first, and under greedy
decoding the chosen token is the most likely one.
"""

from __future__ import annotations

import pytest

from deepserve.up import Stack

from .conftest import MODEL_NAME
from .test_recipe_stack import oai

pytestmark = pytest.mark.timeout(600)
FULL_LENGTH = {"ignore_eos": True}  # every token is generated, so counts are known


def test_chat_logprobs(stack: Stack) -> None:
    out = oai(stack).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=FULL_LENGTH,
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert out.usage is not None
    assert len(content) == out.usage.completion_tokens == 8  # one entry per completion token
    for entry in content:
        assert entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 2 and all(v <= 0 for v in tops)
        assert tops == sorted(tops, reverse=True)  # most likely first
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy took the top one


def test_completion_logprobs(stack: Stack) -> None:
    out = oai(stack).completions.create(
        model=MODEL_NAME,
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body=FULL_LENGTH,
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0
        assert 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the top one
