"""``bench serve``'s first-token times at the engine's prefill ceiling: what the trace's own
arrivals allow, beside what the stack measured."""

from __future__ import annotations

import pytest

from deepserve.bench.http_load import Result, summarize
from deepserve.bench.ttft_floor import ttfts_at_ceiling

ENGINE = {
    "prefill": [{"tokens": 16384, "tokens_per_s": 10_000.0}],
    "decode": [{"batch": 256, "tokens_per_s": 5_000.0}],
}


def test_a_burst_waits_for_the_prompts_sent_before_it() -> None:
    # Three 10K-token prompts sent together at 10K tok/s: 1, 2 and 3 s; one sent after the
    # engine has gone idle waits only for itself; one sent during the burst queues behind it.
    sent = [(100.0, 10_000), (100.0, 10_000), (100.0, 10_000), (110.0, 5_000), (101.0, 2_000)]
    assert ttfts_at_ceiling(sent, 10_000.0) == pytest.approx([1.0, 2.0, 3.0, 0.5, 2.2])


def test_cached_tokens_cost_nothing_and_bad_figures_are_refused() -> None:
    assert ttfts_at_ceiling([(0.0, 0), (0.0, 0)], 1.0) == [0.0, 0.0]
    with pytest.raises(ValueError, match="tokens_per_s"):
        ttfts_at_ceiling([(0.0, 1)], 0.0)
    with pytest.raises(ValueError, match="prompt tokens"):
        ttfts_at_ceiling([(0.0, -1)], 1.0)


def _sent(at: float, prompt: int, cached: int, ttft: float) -> Result:
    return Result(
        session=0,
        turn=0,
        ok=True,
        ttft_s=ttft,
        e2e_s=ttft + 0.1,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=2,
        itl_s=[0.1],
        sent_at=at,
    )


def test_the_summary_sets_the_floor_beside_the_measured_ttft() -> None:
    # Four requests sent together, 20K prompt tokens each of which 10K cached: the engine
    # alone would give them their first tokens after 1, 2, 3 and 4 s; the stack took 5 s each.
    results = [_sent(1e9, 20_000, 10_000, 5.0) for _ in range(4)]
    results.append(Result(session=1, turn=0, status="429", sent_at=1e9))  # never computed
    s = summarize(results, 10.0, price=(0.15, 0.003, 0.6), gpus=1, engine=ENGINE)
    floor = s["engine_ceiling"]["ttft_at_ceiling"]
    assert floor["mean_ms"] == pytest.approx(2_500.0)
    assert (floor["p50_ms"], floor["p99_ms"]) == (pytest.approx(3_000.0), pytest.approx(4_000.0))
    assert s["ttft"]["p50_ms"] == pytest.approx(5_000.0)


def test_records_without_send_times_give_no_floor() -> None:
    # Results from a client that did not stamp its sends (sent_at 0): no made-up figure.
    results = [_sent(0.0, 20_000, 0, 1.0)]
    s = summarize(results, 10.0, price=(0.15, 0.003, 0.6), gpus=1, engine=ENGINE)
    assert "ttft_at_ceiling" not in s["engine_ceiling"]
