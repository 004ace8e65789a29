"""``deepserve bench serve --metrics``: the engines' view of a run from their /metrics, as
differences of two scrapes plus gauge samples (the series a real EngineMetrics exports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from deepserve.bench.engine_view import Instance, parse, summary_lines, targets_from
from libs.engine.scheduler import TokenEvent
from libs.serving.engine_metrics import DECODE, PREFILL, EngineMetrics
from libs.serving.engine_stats import EngineStats


def _stats(running: int, free: int, queries: int, hits: int) -> EngineStats:
    return EngineStats(
        running=running,
        waiting=0,
        free_kv_blocks=free,
        total_kv_blocks=64,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
    )


def test_a_run_is_the_difference_of_two_scrapes_plus_samples() -> None:
    reg = CollectorRegistry()
    m = EngineMetrics(DECODE, "m", registry=reg)
    state = {"s": _stats(0, 64, 100, 40)}
    m.attach(lambda: state["s"])
    m.on_step(1, 0.02, 1, 1)  # before the run
    before = parse(generate_latest(reg).decode())
    m.on_add("r", 10, None)
    for step, secs in enumerate((0.010, 0.030), start=2):
        m.on_step(step, secs, 4, 4)
    m.on_events([TokenEvent("r", 5)])  # two steps' tokens: one inter-token interval
    m.on_events([TokenEvent("r", 6, finished=True, finish_reason="stop")])
    state["s"] = _stats(3, 48, 300, 140)
    mid = parse(generate_latest(reg).decode())
    after = parse(generate_latest(reg).decode())
    inst = Instance("decode-0", "http://x/metrics", before, after, [mid])
    r = inst.report()
    assert r["steps"] == 2 and r["step_ms"] == pytest.approx(20.0) and r["batch"] == 4
    assert r["prefix_hit_rate"] == pytest.approx(100 / 200)  # (140 - 40) / (300 - 100)
    assert r["running"] == {"mean": 3, "max": 3} and r["kv_usage"]["max"] == pytest.approx(0.25)
    assert r["generation_tokens"] == 2 and r["e2e_ms"] is not None and r["itl_ms"] is not None
    assert "decode-0" in summary_lines({"decode-0": r})[0]


def test_a_first_tokens_wait_is_reported_in_its_parts() -> None:
    import time

    reg = CollectorRegistry()
    m = EngineMetrics(PREFILL, "m", registry=reg)
    before = parse(generate_latest(reg).decode())
    now = time.monotonic()
    m.on_add("r", 10, now - 0.9)  # arrived 0.9 s ago; taken 0.6 s ago, first computed 0.2 s ago
    m.on_events([TokenEvent("r", 5, timing=(now - 0.6, now - 0.2))])
    after = parse(generate_latest(reg).decode())
    r = Instance("prefill-0", "http://x/metrics", before, after).report()
    parts = r["ttft_parts_ms"]
    assert parts["intake"] == pytest.approx(300, abs=5)
    assert parts["waiting"] == pytest.approx(400, abs=5)
    assert sum(parts.values()) == pytest.approx(r["ttft_ms"])
    assert "(intake 300 + waiting 400 + prefill 2" in summary_lines({"prefill-0": r})[0]


def test_targets_from_flags_and_a_stack_json(tmp_path: Path) -> None:
    assert targets_from("p=http://h:1/metrics,http://h:2/metrics") == {
        "p": "http://h:1/metrics",
        "engine-1": "http://h:2/metrics",
    }
    state = {
        "services": {
            "prefill-0": {"service": "prefill", "ops_port": 9001},
            "decode-0": {"service": "decode", "ops_port": 9002},
            "recipe": {"service": "recipe", "ops_port": 9003},
        }
    }
    (tmp_path / "stack.json").write_text(json.dumps(state))
    assert targets_from("", str(tmp_path / "stack.json")) == {
        "prefill-0": "http://127.0.0.1:9001/metrics",
        "decode-0": "http://127.0.0.1:9002/metrics",
    }
    with pytest.raises(ValueError, match="not an http"):
        targets_from("x=ftp://h/metrics")


def test_medians_of_a_first_tokens_wait_and_the_loop_lag() -> None:
    """A few slow first tokens (a wave of first turns) move the mean, not the median; the
    event loop's lag is read from the same page."""
    import time

    from prometheus_client import Histogram

    reg = CollectorRegistry()
    m = EngineMetrics(PREFILL, "m", registry=reg)
    lag = Histogram(
        "deepserve_event_loop_lag_seconds", "lag", registry=reg, buckets=(0.005, 0.05, 1.0)
    )
    lag.observe(0.001)
    before = parse(generate_latest(reg).decode())
    now = time.monotonic()
    for i, intake in enumerate((0.01, 0.02, 0.3, 0.3, 3.0)):
        m.on_add(f"r{i}", 10, now - intake - 0.1)
        m.on_events([TokenEvent(f"r{i}", 5, timing=(now - 0.1, now - 0.05))])
    for x in (0.002, 0.003, 0.2):
        lag.observe(x)
    r = Instance("prefill-0", "http://x/metrics", before, parse(generate_latest(reg).decode()))
    r = r.report()
    assert r["ttft_parts_ms"]["intake"] > 700  # the mean, pulled up by the one 3 s wait
    assert 250 <= r["ttft_parts_p50_ms"]["intake"] <= 500  # the median's bucket: 0.3 s
    assert 250 <= r["ttft_p50_ms"] <= 1000
    assert r["loop_lag_ms"] == pytest.approx(205 / 3)  # this run's three rounds, not before's
    assert r["loop_lag_over_50ms"] == pytest.approx(1 / 3)
