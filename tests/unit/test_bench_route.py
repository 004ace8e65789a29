"""The routing simulator: the balancer policy keeps more prefixes in GPU cache than round robin."""

from __future__ import annotations

import itertools

import pytest

from deepserve.bench import route


def test_traces_are_deterministic_and_sessions_share_prefixes() -> None:
    a, b = route.trace("agent", 3, 60), route.trace("agent", 3, 60)
    assert a == b and a != route.trace("agent", 4, 60)
    first, later = (
        a[0],
        [r for r in a if r.request_id.rsplit(".", 1)[0] == a[0].request_id.rsplit(".", 1)[0]],
    )
    assert len(later) > 1 and all(r.blocks[: len(first.blocks)] == first.blocks for r in later)
    assert all(y.tokens > x.tokens for x, y in itertools.pairwise(later))  # turns grow


def test_policy_beats_round_robin_and_oracle_is_at_least_as_good() -> None:
    r = route.run("agent", seed=1, duration_s=90)
    assert r["requests"] > 100
    assert r["hit_rate"] > r["round_robin_hit_rate"] + 0.1
    assert r["oracle_hit_rate"] >= r["hit_rate"]
    assert set(r["routers"]["policy"]["queueing"]) <= {"<16K", "16K-64K", "64K-256K", ">=256K"}
    assert r["max_mean_load"] >= 1.0


def test_mixed_trace_keeps_short_prompts_from_queueing_behind_long_ones() -> None:
    r = route.run("mixed", seed=2, duration_s=120)
    short = r["routers"]
    pol, rr = short["policy"]["queueing"]["<16K"], short["round_robin"]["queueing"]["<16K"]
    assert pol["p99_wait_s"] <= rr["p99_wait_s"]


def test_sweep_reports_hit_rate_against_balance_for_each_knob_value() -> None:
    knob, values = route.parse_sweep("load_cap=inf,1.05")
    r = route.run("agent", seed=1, duration_s=60, sweep=(knob, values))
    rows = r["sweep"]["rows"]
    assert [row["load_cap"] for row in rows] == [None, 1.05]  # inf (off) is written as null
    for row in rows:
        assert 0 < row["hit_ratio_to_oracle"] <= 1.0 + 1e-9
        assert (
            row["max_mean_load"] >= 1.0 and row["max_mean_load_60s"] >= row["max_mean_load"] - 1e-9
        )
    with pytest.raises(ValueError, match="KNOB"):
        route.parse_sweep("bucket_bounds=1,2")


def test_windowed_balance_sees_an_instance_taking_a_whole_burst() -> None:
    # Equal totals, but p0 did all of the first minute and p1 all of the second.
    spans = [[(0.0, 30.0)], [(60.0, 90.0)]]
    assert route.balance(spans, 1e9) == 1.0
    assert route.balance(spans, 60.0) == 2.0
