"""``deepserve bench serve --url``: the figures it derives from per-request records."""

from __future__ import annotations

import argparse

import pytest

from deepserve.bench import http_load
from deepserve.bench.http_load import Result, TraceShape, summarize

ENGINE = {
    "preset": "v2-lite",
    "device_name": "H200",
    "prefill": [
        {"tokens": 4096, "tokens_per_s": 70_000.0},
        {"tokens": 16384, "tokens_per_s": 64_000.0},
    ],
    "decode": [{"batch": 64, "tokens_per_s": 5_000.0}, {"batch": 256, "tokens_per_s": 16_000.0}],
}


def _result(turn: int, prompt: int, cached: int, out: int, allowed: int) -> Result:
    return Result(
        session=0,
        turn=turn,
        ok=True,
        ttft_s=0.1,
        e2e_s=0.1 + 0.01 * (out - 1),
        itl_s=[0.01] * (out - 1),
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=out,
        allowed_cached_tokens=allowed,
    )


def test_revenue_hit_rates_and_engine_ceiling() -> None:
    results = [
        _result(0, 1000, 0, 100, 0),
        _result(1, 2000, 896, 100, 896),
        Result(session=1, turn=0, status="429"),
        Result(session=2, turn=0, status="503"),
    ]
    s = summarize(results, 10.0, price=(0.15, 0.003, 0.60), gpus=2, engine=ENGINE)
    assert (s["requests"], s["ok"], s["rate_limited_429"], s["errors"]) == (4, 2, 1, 1)
    assert s["cache_hit_rate"] == pytest.approx(896 / 3000)
    assert s["hit_rate_vs_allowed"] == pytest.approx(1.0)
    assert s["tpot"]["p50_ms"] == pytest.approx(10.0)
    dollars = (2104 * 0.15 + 896 * 0.003 + 200 * 0.60) / 1e6
    assert s["revenue_per_gpu_hour"] == pytest.approx(dollars / 10 * 3600 / 2)
    ceiling = s["engine_ceiling"]
    # Prefill at the step nearest 16K tokens, decode at the largest batch; cached input free.
    assert (ceiling["prefill_tokens_per_s"], ceiling["decode_tokens_per_s"]) == (64_000, 16_000)
    gpu_seconds = 2104 / 64_000 + 200 / 16_000
    assert ceiling["revenue_per_gpu_hour"] == pytest.approx(dollars / gpu_seconds * 3600)
    assert ceiling["stack_over_ceiling"] == pytest.approx(
        s["revenue_per_gpu_hour"] / ceiling["revenue_per_gpu_hour"]
    )


def test_sessions_are_deterministic_and_shaped() -> None:
    shape = TraceShape(
        turns=4, system_words=10, context_words=30, user_words=5, max_tokens=8, systems=2
    )
    a = http_load.make_sessions(shape, 5, seed=3)
    b = http_load.make_sessions(shape, 5, seed=3)
    assert [(s.system, s.context, s.users) for s in a] == [
        (s.system, s.context, s.users) for s in b
    ]
    assert len({s.system for s in a}) <= 2
    assert all(len(s.users) == 4 and len(s.context.split()) == 30 for s in a)


def test_bad_flags_are_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", dest="json_out", default=None)
    http_load.add_arguments(parser)
    args = parser.parse_args(["--url", "http://127.0.0.1:9/v1", "--price", "1,2"])
    assert http_load.run(args) == 2
    assert "--price takes three" in capsys.readouterr().out
    args = parser.parse_args(["--url", "http://127.0.0.1:9/v1", "--client-processes", "-1"])
    assert http_load.run(args) == 2
    assert "--client-processes must be >= 0" in capsys.readouterr().out


def test_client_processes_follow_the_load_and_flag_a_busy_client() -> None:
    """One client process per 32 concurrent sessions (2 sessions/s open loop), never more
    than half the cores; a process busy most of the run is flagged in the report."""
    import os

    from deepserve.bench import http_procs

    half = max(1, (os.cpu_count() or 2) // 2)
    assert http_procs.auto_processes(32, 0.0) == 1
    assert http_procs.auto_processes(128, 0.0) == min(4, half)
    assert http_procs.auto_processes(1, 9.0) == min(5, half)
    report = http_procs.client_report(2, [9.0, 3.0], 10.0)
    assert report["busy"] == [0.9, 0.3] and report["throttled"]
    assert not http_procs.client_report(1, [3.0], 10.0)["throttled"]


def test_no_turn_starts_after_the_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--duration``: sessions stop at the deadline (a turn in flight finishes and counts)
    instead of the whole trace running past the caller's time limit."""
    import asyncio
    import time

    calls: list[float] = []

    async def fake_request(client, model, session, turn, max_tokens, timeout):  # noqa: ANN001
        calls.append(time.perf_counter())
        await asyncio.sleep(0.05)
        res = _result(turn, 100, 0, 2, 0)
        return res, "ok"

    class Bar:
        def update(self, n: int) -> None: ...

    monkeypatch.setattr(http_load, "one_request", fake_request)
    shape = http_load.TRACES["chat"]
    sessions = http_load.make_sessions(shape, 2, seed=1)
    results: list[Result] = []
    deadline = time.perf_counter() + 0.08  # room for two turns of 0.05 s, not three
    asyncio.run(http_load.play(None, "m", sessions[0], shape, 1.0, results, Bar(), deadline))
    assert len(results) == 2 and shape.turns > 2
    asyncio.run(http_load.play(None, "m", sessions[1], shape, 1.0, results, Bar(), 0.0))
    assert len(results) == 2  # past its deadline: no turn at all
