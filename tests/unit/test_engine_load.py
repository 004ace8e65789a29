"""What an engine reports as its load: the tokens it will actually compute (resident prefixes
excluded) and the share of time it spends stepping (the real scheduler and block manager; the
fake engine's steps are sleeps)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from libs.common.request_key import request_key
from libs.common.sampling import SamplingParams
from libs.engine.engine import EngineConfig
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engine_loop import EngineLoop
from libs.serving.engine_metrics import PREFILL, EngineMetrics
from libs.serving.engine_stats import BusyMeter, ComputeRate, WaitingWork, engine_stats
from libs.serving.fake_engine import FAKE_MODEL, build_fake_engine
from libs.serving.instance import instance_status

BS = 16
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def engine(step_s: float = 0.0, num_kv_blocks: int = 64):
    return build_fake_engine(
        EngineConfig(
            model=FAKE_MODEL, block_size=BS, num_kv_blocks=num_kv_blocks, time_budget_s=None
        ),
        step_seconds=step_s,
        token_seconds=0.0,
    )


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


def test_a_waiting_request_counts_only_the_tokens_not_resident() -> None:
    eng = engine()
    shared = prompt(96, 1)  # 6 full blocks, computed once and left in the prefix cache
    eng.add_request("first", shared, ONE)
    while eng.has_unfinished():
        eng.step()
    assert engine_stats(eng).queued_tokens == 0
    eng.add_request("turn2", shared + prompt(20, 2), ONE)  # 96 resident + 20 new
    eng.add_request("fresh", prompt(40, 3), ONE)  # nothing resident
    work = WaitingWork()
    assert engine_stats(eng, work=work).queued_tokens == 20 + 40
    # What the engine then computes is what was reported.
    before = eng.prefix_cache_hits
    while eng.has_unfinished():
        eng.step()
    assert eng.prefix_cache_hits - before == 96
    assert engine_stats(eng, work=work).queued_tokens == 0


def test_the_resident_run_is_looked_up_once_per_waiting_request() -> None:
    eng = engine()
    shared = prompt(64, 1)
    eng.add_request("first", shared, ONE)
    while eng.has_unfinished():
        eng.step()
    eng.add_request("next", shared + prompt(10, 2), ONE)
    lookups = []
    real = eng.blocks.match_prefix
    eng.blocks.match_prefix = lambda h: lookups.append(len(h)) or real(h)  # type: ignore[method-assign]
    work = WaitingWork()
    for _ in range(5):  # stats are taken after every engine iteration
        assert engine_stats(eng, work=work).queued_tokens == 10
    assert lookups == [4]
    eng.blocks.match_prefix = real  # type: ignore[method-assign]
    while eng.has_unfinished():
        eng.step()
    assert engine_stats(eng, work=work).queued_tokens == 0
    assert work._resident == {}  # forgotten once it left the queue


def test_the_heartbeat_lists_held_requests_and_what_they_will_still_take() -> None:
    """What admission subtracts from the free blocks: each held request's growth to prompt +
    max_tokens beyond the blocks it holds, and which requests those figures cover."""
    eng = engine()
    eng.add_request("a", prompt(40, 1), SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("b", prompt(20, 2), SamplingParams(max_tokens=100, ignore_eos=True))
    stats = engine_stats(eng)  # nothing computed: all of prompt + max_tokens is promised
    assert stats.promised_kv_blocks == -(-70 // BS) + -(-120 // BS) == 5 + 8
    assert set(stats.held_requests) == {request_key("a"), request_key("b")}
    eng.step()  # both prompts computed, one token each
    stats = engine_stats(eng)
    held = {r.request_id: len(r.blocks) for r in eng.scheduler.running}
    assert stats.promised_kv_blocks == (5 - held["a"]) + (8 - held["b"])
    free_before = stats.free_kv_blocks
    while eng.has_unfinished():  # growing uses exactly what was promised, no more
        eng.step()
        now = engine_stats(eng)
        if eng.has_unfinished():
            assert now.free_kv_blocks - now.promised_kv_blocks >= (
                free_before - stats.promised_kv_blocks
            )
    stats = engine_stats(eng)
    assert stats.promised_kv_blocks == 0 and stats.held_requests == ()
    beat = instance_status(
        stats, instance_id="i", role=control_pb2.ROLE_DECODE, model="m", address="a:1",
        draining=False, block_size=BS,
    )  # fmt: skip
    assert beat.reports_held and list(beat.held_requests) == []


def test_busy_meter_windows_wall_time() -> None:
    now = [100.0]
    meter = BusyMeter(window=5.0, clock=lambda: now[0])
    now[0] = 110.0  # 10 s idle since start: nothing busy in the window
    assert meter.fraction() == 0.0
    for _ in range(10):  # 5 s of 0.4 s steps with 0.1 s gaps
        meter.begin()
        now[0] += 0.4
        meter.end()
        now[0] += 0.1
    assert abs(meter.fraction() - 0.8) < 1e-9
    meter.begin()  # a long step in progress counts up to now
    now[0] += 2.0
    assert abs(meter.fraction() - (2.0 + 3.0 * 0.8) / 5.0) < 1e-9
    meter.end(count=False)  # an idle EP poll, not a step
    now[0] += 5.0
    assert meter.fraction() == 0.0


def test_the_compute_rate_is_what_one_more_token_costs() -> None:
    """An aggregated engine's steps: 40 ms of host work each (an eager forward), plus 1 s per
    60K tokens. Small steps average ~10K tokens/s; a queued prompt costs at 60K/s."""
    rate = ComputeRate()
    assert rate.tokens_per_s() == 0.0  # nothing measured
    for n in (300, 500, 1200, 260, 3000, 700, 900, 2000, 400, 8192):
        rate.observe(n, 0.040 + n / 60_000)
    assert abs(rate.tokens_per_s() - 60_000) < 1.0
    steps = [(300, 0.045), (500, 0.048), (1200, 0.06), (260, 0.044), (3000, 0.09)]
    # Time that does not grow with tokens (noise): the plain average, never an absurd slope.
    flat = ComputeRate()
    for n, _ in steps * 2:
        flat.observe(n, 0.05)
    assert abs(flat.tokens_per_s() - sum(n for n, _ in steps) / 0.25) < 1e-6
    # Steps of one size (no spread to fit a slope over): the average of the big ones.
    same = ComputeRate()
    for n, s in steps[:1] * 10:
        same.observe(n, s)
    assert abs(same.tokens_per_s() - 300 / 0.045) < 1e-6
    # A slope that would claim more than 20x the average is held there.
    steep = ComputeRate()
    for n in (256, 4096) * 5:
        steep.observe(n, 1.0 + n * 1e-9)
    average = 5 * (256 + 4096) / (10.0 + 5 * (256 + 4096) * 1e-9)
    assert abs(steep.tokens_per_s() - 20 * average) < 1e-6


async def test_busy_fraction_of_an_engine_that_sleeps_through_its_steps() -> None:
    reg = CollectorRegistry()
    metrics = EngineMetrics("m", PREFILL, reg)
    loop = EngineLoop(engine(step_s=0.03, num_kv_blocks=256), metrics=metrics)
    loop.start()
    try:
        await asyncio.sleep(0.3)  # idle
        assert loop.stats.busy_fraction < 0.1
        many = SamplingParams(max_tokens=40, ignore_eos=True)
        streams = [await loop.add(f"r{i}", prompt(20, i), many) for i in range(2)]
        await asyncio.sleep(1.0)  # stepping all along (0.03 s sleeps back to back)
        busy = loop.stats.busy_fraction
        assert 0.6 < busy <= 1.0, busy  # ~1.0 s busy of the ~1.3 s since start
        scraped = reg.get_sample_value("deepserve:engine_busy_fraction", {"model_name": "m"})
        assert scraped is not None and scraped > 0.6
        beat = instance_status(
            loop.stats,
            instance_id="p1",
            role=control_pb2.ROLE_PREFILL,
            model="m",
            address="",
            draining=False,
            block_size=BS,
        )
        assert beat.busy_fraction > 0.6
        for s in streams:
            async for _ in s:
                pass
        t0 = time.monotonic()
        done = loop.stats.busy_fraction
        await asyncio.sleep(0.5)  # idle again: the fraction falls without another step
        assert loop.stats.busy_fraction < done - 0.05, (done, time.monotonic() - t0)
    finally:
        await loop.close()
