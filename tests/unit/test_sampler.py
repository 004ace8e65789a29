from __future__ import annotations

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.sampler import Sampler, TokenHistory, apply_penalties, position_seed

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


def test_min_p_keeps_tokens_within_a_factor_of_the_top() -> None:
    # p_i / p_0 = exp(-0.5 i) >= 0.3 holds for i <= 2.4: tokens 0, 1, 2 survive.
    got = draws(SamplingParams(temperature=1.0, min_p=0.3, seed=5))
    assert set(got) == {0, 1, 2}
    with_top_k = draws(SamplingParams(temperature=1.0, min_p=0.3, top_k=2, seed=5))
    assert set(with_top_k) == {0, 1}


def history(rows, lists, prompt_lens) -> TokenHistory:
    return TokenHistory.build(rows, lists, prompt_lens, CPU)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    sp = SamplingParams(repetition_penalty=2.0)
    # Token 0 in the prompt, token 1 in the output: both count (prompt + output).
    out = apply_penalties(x, [sp], history([0], [[0, 1]], [1]))
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]
    assert x.tolist() == [[2.0, -1.0, 0.5, 3.0]]  # out of place: a graph's logits stay


def test_presence_and_frequency_penalties_count_the_output_only() -> None:
    x = torch.zeros(1, 6)
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    # Prompt [5, 3]; output [3, 3, 4]: token 3 twice, token 4 once, token 5 only in the prompt.
    out = apply_penalties(x, [sp], history([0], [[5, 3, 3, 3, 4]], [2]))
    assert out.tolist() == [[0.0, 0.0, 0.0, -2.5, -1.5, 0.0]]
    negative = SamplingParams(presence_penalty=-1.0)  # a negative penalty encourages repeats
    assert apply_penalties(x, [negative], history([0], [[1, 2]], [1]))[0, 2].item() == 1.0


def test_penalties_change_the_greedy_choice_per_row_only() -> None:
    batch = torch.stack([logits_row(), logits_row(), torch.randn(50)])
    plain = SamplingParams()
    pen = SamplingParams(frequency_penalty=2.0)
    s = Sampler(CPU, seed=0)
    # Row 1 generated token 0 once: 0 - 2 < -0.5, so token 1 wins; rows 0 and 2 are untouched.
    got = s.sample(batch, [plain, pen, plain], [3, 3, 3], history=history([1], [[7, 0]], [1]))
    assert got == [0, 1, int(batch[2].argmax())]
    with pytest.raises(ValueError, match="history"):
        s.sample(batch[:1], [pen], [3])


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    s = Sampler(CPU, seed=0, eos_token_ids=(0,))
    x = logits_row()[None]  # greedy picks 0, then 1, then 2
    sp = SamplingParams(min_tokens=2, stop_token_ids=(1,))
    assert s.sample(x, [sp], [5], num_generated=[1]) == [2]  # 0 (EOS) and 1 (stop) masked
    assert s.sample(x, [sp], [6], num_generated=[2]) == [0]  # reached: EOS may come
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)  # EOS is no stop: not masked
    assert s.sample(x, [ignoring], [5], num_generated=[0]) == [0]
    hot = SamplingParams(temperature=1.0, seed=9, min_tokens=4, stop_token_ids=(1,))
    drawn = {s.sample(x, [hot], [i], num_generated=[0])[0] for i in range(200)}
    assert drawn and not drawn & {0, 1}


def test_no_feature_path_is_the_plain_argmax_and_race() -> None:
    x = torch.randn(4, 64)
    plain = [SamplingParams(), SamplingParams(temperature=0.7, seed=3)] * 2
    a = Sampler(CPU, seed=0).sample(x, plain, [1, 2, 3, 4])
    off = [SamplingParams(), SamplingParams(temperature=0.7, seed=3, min_p=0.0)] * 2
    b = Sampler(CPU, seed=0).sample(x, off, [1, 2, 3, 4], [0] * 4, history([], [], []))
    assert a == b and a[0] == int(x[0].argmax())


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
        dict(min_p=1.01),
        dict(min_tokens=20, max_tokens=10),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=-2.01),
        dict(frequency_penalty=2.01),
    ],
)
def test_bad_sampling_values_are_refused(kw) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)
