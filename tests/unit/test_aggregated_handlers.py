"""An aggregated instance in one process: the prefill and decode handlers over ONE engine loop
(services/aggregated). A request routed to it for both roles keeps its KV where it was
computed: the tokens equal one engine's output, nothing is pushed, and the kvstore gets the
prompt's and the answer's blocks; the decode role still takes pushes from other prefills."""

from __future__ import annotations

import asyncio

import pytest

from libs.common import subjects
from libs.common.sampling import SamplingParams
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engine_loop import EngineLoop
from libs.transport.inproc import InProcKVPusher
from services.aggregated.main import BothRoles
from services.decode.handlers import DecodeHandler
from services.prefill.handlers import PrefillHandler
from tests.unit.test_prefill_decode_handlers import (
    BS,
    Bus,
    MemoryKVStore,
    make,
    prompt,
    reference,
)

from ..event_positions import first_positions

ME = "inproc:agg"


def task_to(rid: str, p: list[int], sp: SamplingParams, address: str) -> control_pb2.PrefillTask:
    return control_pb2.PrefillTask(
        request_id=rid,
        prompt_token_ids=p,
        sampling=sp.to_proto(),
        decode_instance="agg-0",
        decode_address=address,
        events_subject=subjects.token_events(rid),
    )


@pytest.fixture
async def agg(tiny_loaded):
    bus = Bus()
    await bus.start()
    loop = EngineLoop(make(tiny_loaded), name="agg")
    loop.start()
    kv = MemoryKVStore()
    decode = DecodeHandler(
        loop,
        bus.publish,
        instance_id="agg-0",
        model_name="m",
        address=ME,
        block_size=BS,
        kvstore=kv,
    )
    pusher = InProcKVPusher()
    pusher.register(ME, decode)  # a push to itself would work too: it must not happen
    prefill = PrefillHandler(
        loop,
        bus.publish,
        pusher,
        instance_id="agg-0",
        model_name="m",
        block_size=BS,
        max_model_len=163840,
        kvstore=kv,
        local=decode,
    )
    yield bus, BothRoles(prefill, decode), pusher, kv
    await loop.close()


async def _idle(both: BothRoles) -> None:
    for _ in range(200):
        if both.decode.num_active == 0 and both.prefill.num_active == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the aggregated instance never went idle")


async def test_a_request_for_both_roles_never_moves_its_kv(agg, tiny_loaded) -> None:
    bus, both, pusher, kv = agg
    cases = {
        "greedy": (prompt(37, 1), SamplingParams(max_tokens=8, ignore_eos=True)),
        "seeded": (
            prompt(20, 2),
            SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=8, ignore_eos=True),
        ),
    }
    for rid, (p, sp) in cases.items():
        both.prefill.submit(task_to(rid, p, sp, ME))
    for rid, (p, sp) in cases.items():
        events = await bus.wait_done(rid)
        assert [e.index for e in events] == first_positions(events)
        assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, p, sp)
        assert events[0].prompt_tokens == len(p) and events[-1].finish_reason == "length"
        assert not any(e.error for e in events)
    await _idle(both)
    assert pusher.pushed == 0  # no hand-over: the engine that prefilled decoded
    assert both.decode.loop.stats.free_kv_blocks == 256  # and let go of the KV at the end
    await both.decode.writes.drain(5.0)
    # greedy: 37 prompt + 7 computed answer tokens = 44 -> 2 full blocks; seeded: 27 -> 1
    assert len(kv.blocks) == 3


async def test_the_first_token_can_end_it(agg, tiny_loaded) -> None:
    bus, both, pusher, _ = agg
    p, sp = prompt(10, 3), SamplingParams(max_tokens=1, ignore_eos=True)
    both.prefill.submit(task_to("one", p, sp, ME))
    events = await bus.wait_done("one")
    assert len(events) == 1 and events[0].finish_reason == "length"
    assert list(events[0].token_ids) == reference(tiny_loaded, p, sp)
    await _idle(both)
    assert pusher.pushed == 0 and both.decode.loop.stats.free_kv_blocks == 256


async def test_its_decode_role_takes_another_prefills_push(agg, tiny_loaded) -> None:
    bus, both, _, _ = agg
    other = EngineLoop(make(tiny_loaded), name="p")
    other.start()
    pusher = InProcKVPusher()
    pusher.register(ME, both.decode)
    try:
        prefill = PrefillHandler(
            other,
            bus.publish,
            pusher,
            instance_id="prefill-9",
            model_name="m",
            block_size=BS,
            max_model_len=163840,
        )
        p, sp = prompt(40, 7), SamplingParams(max_tokens=6, ignore_eos=True)
        prefill.submit(task_to("pushed", p, sp, ME))
        events = await bus.wait_done("pushed")
        assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, p, sp)
        assert pusher.pushed == 1
    finally:
        await other.close()


async def test_an_abort_ends_a_local_request_quietly_and_frees_it(agg) -> None:
    bus, both, _, _ = agg
    rid = "long"
    both.prefill.submit(task_to(rid, prompt(30, 6), SamplingParams(max_tokens=10_000), ME))
    subject = subjects.token_events(rid)
    while len(bus.events[subject]) < 3:
        await bus.next()
    for status in (both.prefill.status(), both.decode.status()):  # one engine, both roles
        assert status.instance_id == "agg-0" and status.running == 1
    assert both.decode.status().address == ME
    await both.on_abort(control_pb2.Abort(request_id=rid, reason="client went away"))
    await _idle(both)
    bus.settle()
    n = len(bus.events[subject])
    await asyncio.sleep(0.1)
    bus.settle()
    assert len(bus.events[subject]) == n
    assert not any(e.finished or e.error for e in bus.events[subject])
    assert await both.decode.loop.call(lambda e: e.blocks.num_used) == 0


async def test_draining_refuses_new_tasks_on_both_roles(agg) -> None:
    bus, both, _, _ = agg
    both.draining = True
    assert both.prefill.draining and both.decode.draining
    both.prefill.submit(task_to("late", prompt(12, 5), SamplingParams(max_tokens=5), ME))
    events = await bus.wait_done("late")
    assert events[-1].error and events[-1].retryable and "draining" in events[-1].error
