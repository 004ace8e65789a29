"""The engine thread: requests served through it see exactly what the engine alone produces."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig, InvalidRequest
from libs.serving.engine_loop import BACKGROUND_PER_ITERATION, EngineLoop
from libs.serving.request_stream import EngineFailed, EngineLoopClosed, NotAdded, RequestStream

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)


def make(tiny_loaded) -> Engine:
    return Engine(
        EngineConfig(model="tiny", block_size=16, num_kv_blocks=256, time_budget_s=None),
        loaded=tiny_loaded,
    )


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


REQS = {
    "a": (prompt(5, 1), GREEDY),
    "b": (prompt(40, 2), SEEDED),
    "c": (prompt(21, 3), GREEDY),
}


def direct(tiny_loaded) -> dict[str, list[int]]:
    engine = make(tiny_loaded)
    out: dict[str, list[int]] = {rid: [] for rid in REQS}
    for rid, (p, sp) in REQS.items():
        engine.add_request(rid, p, sp)
    while engine.has_unfinished():
        for ev in engine.step():
            out[ev.request_id].append(ev.token_id)
    return out


async def collect(stream: RequestStream) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async for ev in stream:
        if ev.token_id is not None:
            tokens.append(ev.token_id)
        reason = ev.finish_reason
    return tokens, reason


async def test_concurrent_requests_match_the_engine_alone(tiny_loaded) -> None:
    want = direct(tiny_loaded)
    loop = EngineLoop(make(tiny_loaded))
    loop.start()
    try:

        async def one(rid: str) -> tuple[list[int], str | None]:
            p, sp = REQS[rid]
            return await collect(await loop.add(rid, p, sp))

        results = await asyncio.gather(*(one(rid) for rid in REQS))
        for rid, (tokens, reason) in zip(REQS, results):
            assert tokens == want[rid], f"request {rid} changed when served through the loop"
            assert reason == "length"
        assert loop.num_streams == 0
        assert loop.stats.free_kv_blocks == loop.stats.total_kv_blocks == 256
        assert loop.stats.running == loop.stats.waiting == 0
    finally:
        await loop.close()


async def test_abort_midway_ends_the_stream_and_frees_blocks(tiny_loaded) -> None:
    loop = EngineLoop(make(tiny_loaded))
    loop.start()
    try:
        stream = await loop.add(
            "long", prompt(50, 4), SamplingParams(max_tokens=10_000, ignore_eos=True)
        )
        first = await stream.next()
        assert first is not None and first.token_id is not None and not first.finished
        used = await loop.call(lambda e: e.blocks.num_used)
        assert used >= 4  # 50 prompt tokens in 16-token blocks
        assert await loop.abort("long") is True
        _, reason = await collect(stream)
        assert reason == "abort"
        assert await loop.call(lambda e: (e.blocks.num_used, e.has_unfinished())) == (0, False)
        assert await loop.abort("long") is False  # already gone
    finally:
        await loop.close()


async def test_held_kv_is_exported_between_steps_and_released(tiny_loaded) -> None:
    loop = EngineLoop(make(tiny_loaded))
    loop.start()
    try:
        p = prompt(37, 5)
        stream = await loop.add("h", p, SamplingParams(max_tokens=1), hold_kv=True)
        tokens, _ = await collect(stream)
        assert len(tokens) == 1
        frame = await loop.call(lambda e: e.export_kv("h", include_partial=True))
        assert frame[:4] == b"DSKV"
        assert await loop.call(lambda e: e.blocks.num_used) == 3  # held: 37 tokens -> 3 blocks
        await loop.call(lambda e: e.release("h"))
        assert await loop.call(lambda e: e.blocks.num_used) == 0
    finally:
        await loop.close()


async def test_errors_reach_the_caller_and_close_ends_open_streams(tiny_loaded) -> None:
    loop = EngineLoop(make(tiny_loaded))
    loop.start()
    with pytest.raises(InvalidRequest):
        await loop.add("bad", [], GREEDY)
    assert loop.num_streams == 0
    with pytest.raises(KeyError):
        await loop.call(lambda e: e.export_kv("nope"))
    stream = await loop.add(
        "open", prompt(8, 6), SamplingParams(max_tokens=10_000, ignore_eos=True)
    )
    await stream.next()
    await loop.close()
    _, reason = await collect(stream)
    assert reason == "abort"
    with pytest.raises(EngineLoopClosed):
        await loop.call(lambda e: None)


async def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(tiny_loaded) -> None:
    engine = make(tiny_loaded)
    real_step = engine.step

    def broken() -> list:
        raise RuntimeError("device lost")

    engine.step = broken  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    loop.start()
    try:
        stream = await loop.add("doomed", prompt(9, 7), GREEDY)
        with pytest.raises(EngineFailed, match="device lost"):
            await stream.next()
        assert await loop.call(lambda e: (e.has_unfinished(), e.blocks.num_used)) == (False, 0)
        engine.step = real_step  # type: ignore[method-assign]
        p, sp = REQS["a"]
        tokens, _ = await collect(await loop.add("after", p, sp))
        assert tokens == direct(tiny_loaded)["a"]
    finally:
        await loop.close()


async def test_an_add_cancelled_after_the_engine_took_it_leaves_nothing_behind(tiny_loaded) -> None:
    import threading
    import time

    engine = make(tiny_loaded)
    took_it = threading.Event()
    original = engine.add_request

    def slow_add(*args, **kwargs):  # the engine thread is busy right after taking the request
        original(*args, **kwargs)
        took_it.set()
        time.sleep(0.3)

    engine.add_request = slow_add  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    loop.start()
    try:
        task = asyncio.create_task(
            loop.add("r", prompt(30, 9), SamplingParams(max_tokens=500, ignore_eos=True))
        )
        await asyncio.to_thread(took_it.wait, 5)
        task.cancel()  # e.g. the gRPC Push that carried it was cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)
        left = await loop.call(lambda e: (list(e.scheduler.requests), e.blocks.num_used))
        assert left == ([], 0)
    finally:
        await loop.close()


async def test_a_wave_of_background_copies_does_not_hold_a_clients_command(tiny_loaded) -> None:
    # When a turn ends for many sessions at once, each finished request's blocks are copied out
    # for the kvstore (background commands) just as the sessions' next turns arrive: those
    # admissions must not wait for every copy, and the copies keep their own order.
    loop = EngineLoop(make(tiny_loaded))
    loop.start()
    try:
        steady = SamplingParams(max_tokens=400, ignore_eos=True)  # busy until aborted
        busy = await loop.add("long", prompt(30, 9), steady)
        order: list[int] = []

        def copy(i: int) -> None:
            time.sleep(0.02)  # a copy's host work
            order.append(i)

        copies = [
            asyncio.ensure_future(loop.call(lambda e, i=i: copy(i), background=True))
            for i in range(40)
        ]
        await asyncio.sleep(0)  # every copy is queued first
        ran_before = await loop.call(lambda e: len(order))
        assert ran_before <= 2 * BACKGROUND_PER_ITERATION  # not all 40 (0.8 s) before it
        await asyncio.gather(*copies)
        assert order == list(range(40))
        await loop.abort("long")
        await collect(busy)
    finally:
        await loop.close()


async def test_an_add_the_engines_own_check_refuses_leaves_nothing_and_can_come_again(
    tiny_loaded,
) -> None:
    """``add(unless=...)``: one command asks the engine first (the prefill service: does the
    engine's own prefix cache hold what the kvstore would send?) and adds only if not; a
    refused add leaves no request and no stream, and the same id can be added right after."""
    import threading

    from prometheus_client import CollectorRegistry

    from libs.serving.engine_metrics import PREFILL, EngineMetrics

    metrics = EngineMetrics("m", PREFILL, CollectorRegistry())
    loop = EngineLoop(make(tiny_loaded), metrics=metrics)
    loop.start()
    asked: list[str] = []

    def check(answer: bool):
        def unless(engine: Engine) -> bool:
            asked.append(threading.current_thread().name)
            assert engine.scheduler.requests == {}  # in the same command, before any add
            return answer

        return unless

    try:
        p, sp = REQS["a"]
        with pytest.raises(NotAdded):
            await loop.add("a", p, sp, unless=check(True))
        assert loop.num_streams == 0 and metrics._timings == {}  # nothing left to time
        assert await loop.call(lambda e: list(e.scheduler.requests)) == []
        stream = await loop.add("a", p, sp, unless=check(False))
        assert await collect(stream) == (direct(tiny_loaded)["a"], "length")
        assert len(asked) == 2 and threading.current_thread().name not in asked
    finally:
        await loop.close()
