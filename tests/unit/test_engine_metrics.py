"""Engine metrics of prefill/decode instances: the values follow the real engine (the fake
engine's scheduler, block manager and prefix cache are the real ones) as requests run and end,
through the engine loop and through the prefill -> decode handlers."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from libs.common import subjects
from libs.common.sampling import SamplingParams
from libs.engine.engine import EngineConfig
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engine_loop import EngineLoop
from libs.serving.engine_metrics import DECODE, PREFILL, EngineMetrics, StatsLine, log_stats
from libs.serving.fake_engine import FAKE_MODEL, build_fake_engine
from libs.transport.inproc import InProcBus, InProcKVPusher
from services.decode.handlers import DecodeHandler
from services.prefill.handlers import PrefillHandler

BS = 16
M = {"model_name": "m"}


def engine(
    num_kv_blocks: int = 64, step_s: float = 0.0, block_size: int = BS, max_running: int = 256
):
    return build_fake_engine(
        EngineConfig(
            model=FAKE_MODEL,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            time_budget_s=None,
            max_running=max_running,
        ),
        step_seconds=step_s,
        token_seconds=0.0,
    )


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


def value(reg: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    v = reg.get_sample_value(name, M if labels is None else labels)
    assert v is not None, f"{name} is not exported"
    return v


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


async def drain(stream) -> list[int]:
    return [ev.token_id async for ev in stream if ev.token_id is not None]


async def test_gauges_and_latencies_follow_one_request(reg: CollectorRegistry) -> None:
    metrics = EngineMetrics("m", "engine", reg)  # any other role: every series
    loop = EngineLoop(engine(step_s=0.05), metrics=metrics)
    loop.start()
    try:
        assert value(reg, "deepserve:num_requests_running") == 0
        assert value(reg, "deepserve:kv_cache_usage_perc") == 0
        p = prompt(40, 1)
        stream = await loop.add("r1", p, SamplingParams(max_tokens=5, ignore_eos=True))
        first = await stream.next()
        assert first is not None and first.token_id is not None
        # Mid-request (4 more steps of 50 ms to go): it runs and holds 3 of 64 blocks.
        assert value(reg, "deepserve:num_requests_running") == 1
        assert value(reg, "deepserve:num_requests_waiting") == 0
        assert value(reg, "deepserve:kv_cache_usage_perc") == pytest.approx(3 / 64)
        assert value(reg, "deepserve:time_to_first_token_seconds_count") == 1
        assert value(reg, "deepserve:time_to_first_token_seconds_sum") >= 0.05  # one step
        assert value(reg, "deepserve:prompt_tokens_total") == 40
        assert value(reg, "deepserve:e2e_request_latency_seconds_count") == 0
        rest = await drain(stream)
        assert len(rest) == 4
        assert value(reg, "deepserve:num_requests_running") == 0
        assert value(reg, "deepserve:kv_cache_usage_perc") == 0  # released (cached, free)
        assert value(reg, "deepserve:generation_tokens_total") == 5
        assert value(reg, "deepserve:inter_token_latency_seconds_count") == 4
        assert value(reg, "deepserve:inter_token_latency_seconds_sum") >= 0.15  # 4 steps of 50 ms
        assert value(reg, "deepserve:e2e_request_latency_seconds_count") == 1
        assert value(reg, "deepserve:e2e_request_latency_seconds_sum") >= 5 * 0.05
        steps = value(reg, "deepserve:engine_step_duration_seconds_count")
        assert steps == loop.engine.finished_steps == 5
        assert value(reg, "deepserve:engine_step_duration_seconds_sum") >= 5 * 0.05
        assert value(reg, "deepserve:engine_step_batch_size_sum") == 5  # one request per step
        assert value(reg, "deepserve:iteration_tokens_total_sum") == 40 + 4
    finally:
        await loop.close()
        metrics.unregister()
    assert reg.get_sample_value("deepserve:num_requests_running", M) is None


async def test_waiting_gauge_counts_requests_the_batch_has_no_room_for(
    reg: CollectorRegistry,
) -> None:
    loop = EngineLoop(engine(step_s=0.05, max_running=1), metrics=EngineMetrics("m", DECODE, reg))
    loop.start()
    try:
        sp = SamplingParams(max_tokens=4, ignore_eos=True)
        a = await loop.add("a", prompt(8, 1), sp)
        b = await loop.add("b", prompt(8, 2), sp)
        await a.next()
        await a.next()  # a step after b was added: b waits (one request runs at a time)
        assert value(reg, "deepserve:num_requests_running") == 1
        assert value(reg, "deepserve:num_requests_waiting") == 1
        await drain(a)
        await drain(b)
        assert value(reg, "deepserve:num_requests_waiting") == 0
        assert value(reg, "deepserve:e2e_request_latency_seconds_count") == 2
    finally:
        await loop.close()


async def test_an_aborted_request_is_not_a_finished_one(reg: CollectorRegistry) -> None:
    loop = EngineLoop(engine(step_s=0.02), metrics=EngineMetrics("m", DECODE, reg))
    loop.start()
    try:
        stream = await loop.add("r", prompt(8, 1), SamplingParams(max_tokens=50, ignore_eos=True))
        await stream.next()
        assert await loop.abort("r")
        await drain(stream)
        assert value(reg, "deepserve:e2e_request_latency_seconds_count") == 0
        assert value(reg, "deepserve:num_requests_running") == 0
    finally:
        await loop.close()


async def test_prefix_cache_counts_prompt_tokens_found_in_the_engine(
    reg: CollectorRegistry,
) -> None:
    loop = EngineLoop(engine(), metrics=EngineMetrics("m", PREFILL, reg))
    loop.start()
    try:
        p, sp = prompt(40, 3), SamplingParams(max_tokens=1, ignore_eos=True)
        await drain(await loop.add("cold", p, sp))
        assert value(reg, "deepserve:prefix_cache_queries_total") == 40
        assert value(reg, "deepserve:prefix_cache_hits_total") == 0
        await drain(await loop.add("warm", p, sp))  # 2 full blocks of 16 are cached now
        assert value(reg, "deepserve:prefix_cache_queries_total") == 80
        assert value(reg, "deepserve:prefix_cache_hits_total") == 32
        await drain(await loop.add("other", prompt(40, 4), sp))
        assert value(reg, "deepserve:prefix_cache_queries_total") == 120
        assert value(reg, "deepserve:prefix_cache_hits_total") == 32
    finally:
        await loop.close()


def test_imported_kv_counts_only_blocks_the_engine_held_itself() -> None:
    src, dst = engine(), engine()
    p = prompt(40, 5)
    src.add_request("a", p, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    while src.has_unfinished():
        src.step()
    frame = src.export_kv("a", include_partial=True)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    dst.add_request("x", p, sp, kv=frame)
    assert (dst.prefix_cache_queries, dst.prefix_cache_hits) == (40, 0)  # all transferred
    while dst.has_unfinished():
        dst.step()
    dst.add_request("y", p, sp, kv=frame)
    assert (dst.prefix_cache_queries, dst.prefix_cache_hits) == (80, 32)  # 2 blocks held here


def test_preemptions_are_the_schedulers(reg: CollectorRegistry) -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens growing to 16 cannot both fit.
    eng = engine(num_kv_blocks=6, block_size=4)
    metrics = EngineMetrics("m", DECODE, reg)
    loop = EngineLoop(eng, metrics=metrics)  # not started: read the snapshot it would publish
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.add_request("a", prompt(8, 1), sp)
    eng.add_request("b", prompt(8, 2), sp)
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.num_preemptions > 0
    loop.stats = loop._snapshot()
    assert value(reg, "deepserve:num_preemptions_total") == eng.scheduler.num_preemptions


def test_roles_export_their_own_latencies(reg: CollectorRegistry) -> None:
    names = lambda r: {m.name for m in r.collect()}  # noqa: E731
    EngineMetrics("m", PREFILL, reg)
    assert "deepserve:time_to_first_token_seconds" in names(reg)
    assert "deepserve:prompt_tokens" in names(reg)
    assert "deepserve:inter_token_latency_seconds" not in names(reg)
    other = CollectorRegistry()
    EngineMetrics("m", DECODE, other)
    assert "deepserve:inter_token_latency_seconds" in names(other)
    assert "deepserve:e2e_request_latency_seconds" in names(other)
    assert "deepserve:time_to_first_token_seconds" not in names(other)
    for r in (reg, other):
        for name in (
            "deepserve:num_requests_running",
            "deepserve:num_requests_waiting",
            "deepserve:kv_cache_usage_perc",
            "deepserve:num_preemptions",
            "deepserve:prefix_cache_queries",
            "deepserve:prefix_cache_hits",
            "deepserve:engine_step_duration_seconds",
            "deepserve:engine_step_batch_size",
            "deepserve:generation_tokens",
        ):
            assert name in names(r), name


async def test_prefill_and_decode_handlers_feed_their_metrics() -> None:
    preg, dreg = CollectorRegistry(), CollectorRegistry()
    bus = InProcBus()
    sub = await bus.subscribe(subjects.token_events(">"))
    ploop = EngineLoop(engine(step_s=0.01), name="p", metrics=EngineMetrics("m", PREFILL, preg))
    dloop = EngineLoop(engine(step_s=0.01), name="d", metrics=EngineMetrics("m", DECODE, dreg))
    ploop.start()
    dloop.start()
    try:
        decode = DecodeHandler(
            dloop, bus.publish, instance_id="d0", model_name="m", address="x:0", block_size=BS
        )
        pusher = InProcKVPusher()
        pusher.register("x:0", decode)
        prefill = PrefillHandler(
            ploop,
            bus.publish,
            pusher,
            instance_id="p0",
            model_name="m",
            block_size=BS,
            max_model_len=163840,
            same_host_handoff=False,
        )
        p = prompt(37, 6)
        prefill.submit(
            control_pb2.PrefillTask(
                request_id="r",
                prompt_token_ids=p,
                sampling=SamplingParams(max_tokens=6, ignore_eos=True).to_proto(),
                decode_instance="d0",
                decode_address="x:0",
                events_subject=subjects.token_events("r"),
            )
        )
        done = False
        while not done:
            ev = control_pb2.TokenEvent.FromString((await sub.next_msg(30)).data)
            assert not ev.error, ev.error
            done = ev.finished
        assert value(preg, "deepserve:time_to_first_token_seconds_count") == 1
        assert value(preg, "deepserve:prompt_tokens_total") == 37
        assert value(preg, "deepserve:generation_tokens_total") == 1
        assert value(preg, "deepserve:prefix_cache_queries_total") == 37
        assert value(dreg, "deepserve:generation_tokens_total") == 5  # 6 - prefill's first
        assert value(dreg, "deepserve:inter_token_latency_seconds_count") == 4
        assert value(dreg, "deepserve:e2e_request_latency_seconds_count") == 1
        assert value(dreg, "deepserve:prefix_cache_queries_total") == 38  # prompt + first token
    finally:
        await ploop.close()
        await dloop.close()


async def test_stats_line_reports_load_and_token_rates(
    reg: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = EngineMetrics("m", PREFILL, reg)
    loop = EngineLoop(engine(), metrics=metrics)
    loop.start()
    try:
        line = StatsLine(metrics)
        await drain(await loop.add("a", prompt(40, 7), SamplingParams(max_tokens=1)))
        text = line.line()
        assert "running=0 waiting=0 kv_usage=0.0%" in text
        rate = float(text.split("prompt_tokens/s=")[1].split()[0])
        assert rate > 0
        assert "generation_tokens/s=0.0" not in text
        assert "prompt_tokens/s=0.0 " in line.line()  # nothing since the previous line

        stop = asyncio.Event()
        log = logging.getLogger("test-stats")
        with caplog.at_level(logging.INFO, logger="test-stats"):
            task = asyncio.create_task(log_stats(metrics, 0.05, log, stop))
            await asyncio.sleep(0.18)
            stop.set()
            await task
        lines = [r.getMessage() for r in caplog.records if r.name == "test-stats"]
        assert 2 <= len(lines) <= 4 and all(m.startswith("engine stats: ") for m in lines)
    finally:
        await loop.close()


def test_a_second_engine_in_one_registry_is_refused_cleanly(reg: CollectorRegistry) -> None:
    first = EngineMetrics("m", PREFILL, reg)
    before = {m.name for m in reg.collect()}
    with pytest.raises(ValueError):
        EngineMetrics("m", PREFILL, reg)
    assert {m.name for m in reg.collect()} == before  # nothing half-registered
    first.unregister()
    EngineMetrics("m", PREFILL, reg)  # the names are free again


async def test_latencies_count_from_the_arrival_the_service_gives(reg: CollectorRegistry) -> None:
    import time

    loop = EngineLoop(engine(), metrics=EngineMetrics("m", "engine", reg))
    loop.start()
    try:
        arrived = time.monotonic() - 2.0  # e.g. a kvstore load before the engine saw it
        sp = SamplingParams(max_tokens=2, ignore_eos=True)
        await drain(await loop.add("r", prompt(8, 1), sp, arrival=arrived))
        assert 2.0 <= value(reg, "deepserve:time_to_first_token_seconds_sum") < 10
        assert 2.0 <= value(reg, "deepserve:e2e_request_latency_seconds_sum") < 10
    finally:
        await loop.close()


async def test_time_to_first_token_splits_into_intake_waiting_and_prefill(
    reg: CollectorRegistry,
) -> None:
    """Where a slow first token came from: the service's wait before the engine took the
    request (intake), the scheduler's queue (waiting), the prompt's own step (prefill); the
    three add up to the TTFT."""
    import time

    loop = EngineLoop(engine(step_s=0.05, max_running=1), metrics=EngineMetrics("m", PREFILL, reg))
    loop.start()
    try:
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        arrived = time.monotonic() - 0.5  # e.g. half a second of kvstore load before the add
        a = await loop.add("a", prompt(8, 1), sp)
        b = await loop.add("b", prompt(8, 2), sp, arrival=arrived)  # runs once a is done
        await drain(a)
        await drain(b)

        def total(part: str) -> float:
            return value(reg, f"deepserve:ttft_{part}_seconds_sum")

        parts = {p: total(p) for p in ("intake", "waiting", "prefill")}
        assert all(value(reg, f"deepserve:ttft_{p}_seconds_count") == 2 for p in parts)
        assert sum(parts.values()) == pytest.approx(
            value(reg, "deepserve:time_to_first_token_seconds_sum"), abs=1e-6
        )
        assert parts["intake"] >= 0.5  # b's: the time before the engine took it
        assert parts["waiting"] >= 5 * 0.05  # b waited behind a's six steps
        assert 2 * 0.05 <= parts["prefill"] < parts["waiting"]  # one step each
    finally:
        await loop.close()
