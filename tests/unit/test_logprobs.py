"""Log probabilities from the engine: the drawn token's and the top N, under the distribution
the sampler drew from, carried by the token events (and through the fake engine)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from libs.common.errors import InvalidArgument
from libs.common.sampling import SamplingParams, TokenLogprob
from libs.engine.llm import LLM
from libs.proto.deepserve.v1 import common_pb2


def _run(engine: Any, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[Any]]:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[Any]] = {rid: [] for rid in reqs}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev)
    return out


@pytest.fixture(scope="module")
def engine() -> Any:
    return LLM("tiny", seed=0).engine


def test_greedy_logprobs_are_the_models_log_softmax(engine: Any) -> None:
    """The sampler's logits, captured independently, give the same values: the drawn token
    is the top one, the top N come most likely first."""
    seen: list[torch.Tensor] = []
    real = engine.sampler.sample_device

    def spy(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(logits.detach().float().clone())
        return real(logits, *args, **kwargs)  # type: ignore[no-any-return]

    engine.sampler.sample_device = spy
    try:
        got = _run(engine, {"g": ([5, 6, 7, 8], SamplingParams(max_tokens=4, logprobs=5))})["g"]
    finally:
        del engine.sampler.sample_device
    assert len(got) == 4 == len(seen)
    for ev, logits in zip(got, seen, strict=True):
        ref = logits[0].log_softmax(-1)
        lp = ev.logprobs
        assert lp is not None and len(lp.top_ids) == 5
        assert lp.top_ids[0] == ev.token_id
        assert math.isclose(lp.logprob, float(ref[ev.token_id]), abs_tol=1e-5)
        want = torch.topk(ref, 5)
        assert list(lp.top_ids) == want.indices.tolist()
        assert list(lp.top_logprobs) == pytest.approx(want.values.tolist(), abs=1e-5)


def test_sampled_logprobs_follow_the_cut_distribution(engine: Any) -> None:
    """top_k=3: the distribution drawn from has 3 tokens; they hold all its mass and the
    drawn token is one of them. Rows that did not ask get none."""
    p = SamplingParams(max_tokens=5, temperature=0.7, top_k=3, seed=4, logprobs=4)
    got = _run(
        engine, {"s": ([9, 10, 11], p), "plain": ([9, 10, 12], SamplingParams(max_tokens=2))}
    )
    assert all(ev.logprobs is None for ev in got["plain"])
    for ev in got["s"]:
        lp = ev.logprobs
        assert ev.token_id in lp.top_ids[:3]
        assert sum(math.exp(v) for v in lp.top_logprobs[:3]) == pytest.approx(1.0, abs=1e-4)
        assert lp.top_logprobs[3] == -math.inf  # cut away
        assert lp.logprob == lp.top_logprobs[lp.top_ids.index(ev.token_id)]


def test_logprobs_zero_gives_the_drawn_token_only(engine: Any) -> None:
    got = _run(engine, {"z": ([3, 4], SamplingParams(max_tokens=2, logprobs=0))})["z"]
    assert all(ev.logprobs.top_ids == () and ev.logprobs.logprob <= 0 for ev in got)


def test_fake_engine_is_a_point_mass() -> None:
    from libs.engine.engine import EngineConfig
    from libs.serving.fake_engine import build_fake_engine

    fake = build_fake_engine(EngineConfig(model="tiny"), step_seconds=0, token_seconds=0)
    got = _run(fake, {"f": ([1, 2, 3], SamplingParams(max_tokens=3, logprobs=2))})["f"]
    assert [ev.logprobs for ev in got] == [TokenLogprob(0.0, (ev.token_id,), (0.0,)) for ev in got]


def test_logprobs_on_the_wire_and_its_range() -> None:
    p = SamplingParams(logprobs=20)
    assert SamplingParams.from_proto(p.to_proto()).logprobs == 20
    assert SamplingParams.from_proto(SamplingParams().to_proto()).logprobs is None
    with pytest.raises(InvalidArgument, match="logprobs"):
        SamplingParams(logprobs=21)
    msg = common_pb2.SamplingParams(max_tokens=1, logprobs=-1)
    with pytest.raises(InvalidArgument) as info:
        SamplingParams.from_proto(msg)
    assert info.value.field == "sampling.logprobs"
    lp = TokenLogprob(-0.5, (3, 4), (-0.5, -1.5))
    assert TokenLogprob.from_proto(lp.to_proto()) == lp
