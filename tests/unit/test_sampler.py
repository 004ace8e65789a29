from __future__ import annotations

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.sampler import Sampler, position_seed

CPU = torch.device("cpu")


def logits_row() -> torch.Tensor:
    # Token i has logit -0.5 * i: a smooth, known distribution over 50 tokens.
    return -0.5 * torch.arange(50, dtype=torch.float32)


def draws(p: SamplingParams, n: int = 400) -> list[int]:
    s = Sampler(CPU, seed=0)
    return [s.sample(logits_row()[None], [p], [i])[0] for i in range(n)]


def test_greedy_is_argmax() -> None:
    s = Sampler(CPU, seed=0)
    x = torch.randn(3, 100)
    assert s.sample(x, [SamplingParams()] * 3, [0, 0, 0]) == x.argmax(-1).tolist()


def test_top_k_restricts_the_support() -> None:
    got = draws(SamplingParams(temperature=1.0, top_k=3, seed=1))
    assert set(got) == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = logits_row().softmax(-1)
    # Mass of tokens 0..k-1 first reaching 0.8 decides the nucleus.
    k = int((probs.cumsum(-1) < 0.8).sum()) + 1
    got = draws(SamplingParams(temperature=1.0, top_p=0.8, seed=2))
    assert set(got) == set(range(k))


def test_sampling_follows_the_distribution() -> None:
    got = draws(SamplingParams(temperature=1.0, seed=3), n=3000)
    p0 = logits_row().softmax(-1)[0].item()  # ~0.39
    assert abs(got.count(0) / 3000 - p0) < 0.04


def test_low_temperature_concentrates() -> None:
    hot = draws(SamplingParams(temperature=2.0, seed=4))
    cold = draws(SamplingParams(temperature=0.1, seed=4))
    assert cold.count(0) > 390 and hot.count(0) < 300


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    p = SamplingParams(temperature=1.0, seed=7)
    batch = torch.stack([logits_row(), torch.randn(50), logits_row()])
    other = Sampler(CPU, seed=123)
    a = other.sample(batch, [p, SamplingParams(temperature=1.0), p], [5, 9, 6])
    b = Sampler(CPU, seed=999).sample(logits_row()[None], [p], [5])
    c = Sampler(CPU, seed=999).sample(logits_row()[None], [p], [6])
    assert a[0] == b[0] and a[2] == c[0]
    assert position_seed(7, 5) != position_seed(7, 6) != position_seed(8, 5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_tokens=0),
        dict(seed=-3),
        dict(stop_token_ids=(-1,)),
        dict(temperature=float("nan")),
    ],
)
def test_bad_sampling_values_are_refused(kw) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)
