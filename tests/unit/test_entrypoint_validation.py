"""Entrypoint policy: request validation (INVALID_ARGUMENT naming the field) and token ordering."""

from __future__ import annotations

import random

import pytest

from libs.common.errors import InvalidArgument, NotFound
from libs.gateway.policy import (
    Chunk,
    Finish,
    Limits,
    Ready,
    ReorderOverflow,
    RequestStream,
    TokenReorderBuffer,
    Tokens,
    lookup_prefix,
    validate_request,
)
from libs.proto.deepserve.v1 import common_pb2, generate_pb2

LIMITS = Limits(model_name="deepseek-tiny", vocab_size=1000, max_context=4096, block_size=128)


def request(prompt: list[int] | None = None, **sampling: object) -> generate_pb2.GenerateRequest:
    s = {"max_tokens": 16, **sampling}
    return generate_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
        sampling=common_pb2.SamplingParams(**s),
    )  # type: ignore[arg-type]


def invalid_field(req: generate_pb2.GenerateRequest) -> str:
    with pytest.raises(InvalidArgument) as info:
        validate_request(req, LIMITS)
    assert str(info.value).startswith(info.value.field + ":")  # the message names the field
    return info.value.field


# -- validation --------------------------------------------------------------------------------


def test_a_good_request_passes_with_defaults_filled_in() -> None:
    v = validate_request(request(temperature=0.7, top_k=50, seed=7, stop_token_ids=[5]), LIMITS)
    assert v.prompt_token_ids == (1, 2, 3)
    assert v.model == "deepseek-tiny"  # empty model = the served one
    assert v.request_id == ""  # assigned later
    assert v.sampling.top_p == 1.0  # 0 on the wire means 1
    assert (v.sampling.temperature, v.sampling.top_k, v.sampling.seed) == (
        pytest.approx(0.7),
        50,
        7,
    )
    assert v.sampling.stop_token_ids == (5,)
    assert validate_request(request(), LIMITS).sampling.seed is None


def test_empty_prompt() -> None:
    assert invalid_field(request([])) == "prompt_token_ids"


@pytest.mark.parametrize("bad", [-1, 1000, 10**6])
def test_out_of_vocab_prompt_ids_name_the_position(bad: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"prompt_token_ids\[2\]: token id {bad} is outside"):
        validate_request(request([0, 999, bad]), LIMITS)


def test_prompt_at_the_context_limit() -> None:
    assert invalid_field(request([1] * 4096, max_tokens=1)) == "prompt_token_ids"


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_max_tokens_must_be_positive(max_tokens: int) -> None:
    assert invalid_field(request(max_tokens=max_tokens)) == "sampling.max_tokens"


def test_missing_sampling_means_no_max_tokens() -> None:
    req = generate_pb2.GenerateRequest(prompt_token_ids=[1])
    assert invalid_field(req) == "sampling.max_tokens"


def test_max_tokens_past_the_context_limit() -> None:
    validate_request(request([1] * 4000, max_tokens=96), LIMITS)  # exactly fits
    with pytest.raises(
        InvalidArgument, match="sampling.max_tokens.*context limit of 4096; at most 96"
    ):
        validate_request(request([1] * 4000, max_tokens=97), LIMITS)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"temperature": float("inf")}, "sampling.temperature"),
        ({"top_p": -0.5}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_p": float("nan")}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"seed": 2**63}, "sampling.seed"),
        ({"stop_token_ids": [3, 1000]}, "sampling.stop_token_ids[1]"),
    ],
)
def test_bad_sampling_names_the_field(sampling: dict[str, object], field: str) -> None:
    assert invalid_field(request(**sampling)) == field


def test_bad_request_id() -> None:
    req = request()
    req.request_id = "a.b>"  # would change the NATS subject it travels on
    assert invalid_field(req) == "request_id"
    req.request_id = "ok_id-1"
    assert validate_request(req, LIMITS).request_id == "ok_id-1"


def test_unknown_model() -> None:
    req = request()
    req.model = "gpt-5"
    with pytest.raises(NotFound, match="'gpt-5' is not served here; available: 'deepseek-tiny'"):
        validate_request(req, LIMITS)


def test_lookup_covers_full_blocks_inside_prompt_minus_one() -> None:
    assert lookup_prefix(1, 128) == 0
    assert lookup_prefix(128, 128) == 0  # the last token is always computed
    assert lookup_prefix(129, 128) == 128
    assert lookup_prefix(257, 128) == 256
    assert lookup_prefix(300, 128) == 256


# -- reordering --------------------------------------------------------------------------------


def tokens_of(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_in_order_events_pass_straight_through() -> None:
    buf = TokenReorderBuffer()
    assert buf.push(Chunk(0, (10,))) == [Chunk(0, (10,))]
    assert buf.push(Chunk(1, (11, 12))) == [Chunk(1, (11, 12))]
    assert buf.next_index == 3


def test_decode_overtaking_prefill_is_held_until_the_gap_fills() -> None:
    buf = TokenReorderBuffer()
    assert buf.push(Chunk(2, (12,))) == []
    assert buf.push(Chunk(1, (11,))) == []
    assert buf.pending == 2
    out = buf.push(Chunk(0, (10,), prompt_tokens=5))
    assert tokens_of(out) == [10, 11, 12] and [c.index for c in out] == [0, 1, 2]
    assert buf.pending == 0


def test_duplicates_and_overlaps_are_cut() -> None:
    buf = TokenReorderBuffer()
    buf.push(Chunk(0, (10, 11, 12)))
    assert buf.push(Chunk(1, (11,))) == []  # duplicate
    out = buf.push(Chunk(2, (12, 13)))  # overlaps by one
    assert out == [Chunk(3, (13,))]


def test_held_overlap_is_trimmed_when_released() -> None:
    buf = TokenReorderBuffer()
    buf.push(Chunk(2, (12, 13)))
    assert tokens_of(buf.push(Chunk(0, (10, 11, 12)))) == [10, 11, 12, 13]


def test_nothing_after_finish() -> None:
    buf = TokenReorderBuffer()
    buf.push(Chunk(1, (11,), finished=True, finish_reason="stop"))
    buf.push(Chunk(2, (12,)))  # a stray event past the end
    out = buf.push(Chunk(0, (10,)))
    assert tokens_of(out) == [10, 11] and out[-1].finished and buf.finished
    assert buf.push(Chunk(3, (13,))) == []


def test_empty_finish_is_released_at_its_position() -> None:
    buf = TokenReorderBuffer()
    assert buf.push(Chunk(1, (), finished=True, finish_reason="abort")) == []
    out = buf.push(Chunk(0, (10,)))
    assert [c.finished for c in out] == [False, True] and buf.finished


def test_any_arrival_order_gives_the_same_stream() -> None:
    events = [Chunk(0, (100,))] + [Chunk(i, (100 + i,)) for i in range(1, 40)]
    events[-1] = Chunk(39, (139,), finished=True, finish_reason="length")
    rng = random.Random(0)
    for _ in range(20):
        shuffled = events[:] + rng.sample(events, 5)  # with some duplicates
        rng.shuffle(shuffled)
        buf = TokenReorderBuffer()
        out = [c for e in shuffled for c in buf.push(e)]
        assert tokens_of(out) == list(range(100, 140))
        assert out[-1].finished and out[-1].finish_reason == "length"


def test_a_gap_that_never_fills_overflows() -> None:
    buf = TokenReorderBuffer(max_pending=3)
    for i in range(2, 5):
        buf.push(Chunk(i, (i,)))
    with pytest.raises(ReorderOverflow, match="position 0"):
        buf.push(Chunk(5, (5,)))


# -- what the client sees ----------------------------------------------------------------------


def test_stream_emits_ready_tokens_finish_with_usage() -> None:
    s = RequestStream(prompt_tokens=300, max_tokens=3)
    assert s.push(Chunk(1, (11,))) == []
    out = s.push(Chunk(0, (10,), prompt_tokens=300, cached_tokens=256))
    assert out == [Ready(300, 256), Tokens((10,)), Tokens((11,))]
    out = s.push(Chunk(2, (12,), finished=True, finish_reason="length"))
    assert out == [Tokens((12,)), Finish("length", 300, 256, 3)]
    assert s.done and not s.truncated


def test_first_token_may_also_be_the_last() -> None:
    s = RequestStream(prompt_tokens=4, max_tokens=1)
    out = s.push(Chunk(0, (2,), finished=True, finish_reason="stop", prompt_tokens=4))
    assert out == [Ready(4, 0), Tokens((2,)), Finish("stop", 4, 0, 1)]


def test_stray_tokens_past_max_tokens_are_cut() -> None:
    s = RequestStream(prompt_tokens=4, max_tokens=2)
    out = s.push(Chunk(0, (1, 2, 3)))
    assert out == [Ready(4, 0), Tokens((1, 2)), Finish("length", 4, 0, 2)]
    assert s.done and s.truncated
    assert s.push(Chunk(3, (4,))) == []
