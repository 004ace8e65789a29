"""Prefill and decode handlers wired in one process (no NATS, no gRPC): the tokens a client
collects equal one engine's output, across the handoff, with and without the kvstore."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import pytest

from libs.common import subjects
from libs.common.hashchain import chain_hashes
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kv.peer import PeerUnavailable, host_id
from libs.engine.kv.transfer import PeerKV, decode_frame
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engine_loop import EngineLoop
from libs.serving.handoff import Holding
from libs.transport.inproc import InProcBus, InProcKVPusher, InProcSubscription, Msg
from services.decode.handlers import DecodeHandler
from services.prefill.handlers import Block, PrefillHandler

from ..event_positions import first_positions

BS = 16


def make(tiny_loaded, kv_mac_key: bytes | None = None) -> Engine:
    return Engine(
        EngineConfig(
            model="tiny",
            block_size=BS,
            num_kv_blocks=256,
            time_budget_s=None,
            kv_mac_key=kv_mac_key,
        ),
        loaded=tiny_loaded,
    )


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


def reference(tiny_loaded, p: list[int], sp: SamplingParams) -> list[int]:
    engine = make(tiny_loaded)
    engine.add_request("ref", p, sp)
    out = []
    while engine.has_unfinished():
        out += [ev.token_id for ev in engine.step()]
    return out


class Bus:
    """The library's in-process bus, read as the entrypoint reads it: TokenEvents by subject."""

    def __init__(self) -> None:
        self.bus = InProcBus()
        self.publish = self.bus.publish
        self.events: dict[str, list[control_pb2.TokenEvent]] = defaultdict(list)
        self.sub: InProcSubscription | None = None

    async def start(self) -> None:
        self.sub = await self.bus.subscribe(subjects.token_events(">"))

    def _record(self, msgs: list[Msg]) -> None:
        for msg in msgs:
            self.events[msg.subject].append(control_pb2.TokenEvent.FromString(msg.data))

    async def next(self, timeout: float = 30.0) -> None:
        """Wait for one more event."""
        assert self.sub is not None
        self._record([await self.sub.next_msg(timeout)])

    def settle(self) -> None:
        """Record every event published so far."""
        assert self.sub is not None
        self._record(self.sub.take_pending())

    async def wait_done(self, rid: str, timeout: float = 60.0) -> list[control_pb2.TokenEvent]:
        async def done() -> None:
            while not any(e.finished for e in self.events[subjects.token_events(rid)]):
                await self.next()

        await asyncio.wait_for(done(), timeout)
        return sorted(self.events[subjects.token_events(rid)], key=lambda e: e.index)


class MemoryKVStore:
    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.gets = 0

    async def get(self, hashes: list[bytes]) -> list[bytes]:
        self.gets += 1
        out = []
        for h in hashes:
            if h not in self.blocks:
                break
            out.append(self.blocks[h])
        return out

    async def put(self, blocks: list[Block], tenant: str, traffic_class: int) -> None:
        for digest, _, frame in blocks:
            self.blocks[digest] = frame


@pytest.fixture
async def stack(tiny_loaded):
    bus = Bus()
    await bus.start()
    ploop, dloop = EngineLoop(make(tiny_loaded), name="p"), EngineLoop(make(tiny_loaded), name="d")
    ploop.start()
    dloop.start()
    kv = MemoryKVStore()
    decode = DecodeHandler(
        dloop,
        bus.publish,
        instance_id="decode-0",
        model_name="m",
        address="inproc:0",
        block_size=BS,
        kvstore=kv,
    )
    pusher = InProcKVPusher()  # KVTransfer.Push to decode.accept
    pusher.register("inproc:0", decode)
    prefill = PrefillHandler(
        ploop,
        bus.publish,
        pusher,
        instance_id="prefill-0",
        model_name="m",
        block_size=BS,
        max_model_len=163840,
        kvstore=kv,
    )
    yield bus, prefill, decode, pusher, kv
    await ploop.close()
    await dloop.close()


def task(
    rid: str, p: list[int], sp: SamplingParams, cached_blocks: int = 0
) -> control_pb2.PrefillTask:
    return control_pb2.PrefillTask(
        request_id=rid,
        prompt_token_ids=p,
        sampling=sp.to_proto(),
        cached_blocks=cached_blocks,
        decode_instance="decode-0",
        decode_address="inproc:0",
        events_subject=subjects.token_events(rid),
    )


async def test_handoff_gives_the_engines_tokens(stack, tiny_loaded) -> None:
    bus, prefill, decode, _, _ = stack
    cases = {
        "greedy": (prompt(37, 1), SamplingParams(max_tokens=8, ignore_eos=True)),
        "seeded": (
            prompt(20, 2),
            SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=8, ignore_eos=True),
        ),
    }
    for rid, (p, sp) in cases.items():
        prefill.submit(task(rid, p, sp))
    for rid, (p, sp) in cases.items():
        events = await bus.wait_done(rid)
        assert [e.index for e in events] == first_positions(events)
        assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, p, sp)
        assert events[0].prompt_tokens == len(p) and events[-1].finish_reason == "length"
        assert not any(e.error for e in events)
    for _ in range(100):  # the tasks finish their bookkeeping (decode: copy out, free the KV)
        if decode.num_active == 0:
            break
        await asyncio.sleep(0.01)
    assert prefill.loop.stats.free_kv_blocks == 256  # prefill let go of the KV after the push
    assert decode.num_active == 0


async def test_max_tokens_one_finishes_at_prefill(stack, tiny_loaded) -> None:
    bus, prefill, _, pusher, _ = stack
    p, sp = prompt(10, 3), SamplingParams(max_tokens=1, ignore_eos=True)
    prefill.submit(task("one", p, sp))
    events = await bus.wait_done("one")
    assert len(events) == 1 and events[0].finish_reason == "length"
    assert list(events[0].token_ids) == reference(tiny_loaded, p, sp)
    assert pusher.pushed == 0


async def test_cached_prefix_from_kvstore_gives_the_same_tokens(stack, tiny_loaded) -> None:
    bus, prefill, _, _, kv = stack
    shared = prompt(50, 4)  # 3 full 16-token blocks
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    prefill.submit(task("warm", shared + [5, 6], sp))
    await bus.wait_done("warm")
    await asyncio.sleep(0.05)  # the block write runs in the background
    assert len(kv.blocks) == 3
    # A fresh prefill engine has no local prefix cache: the blocks can only come from the kvstore.
    ploop = EngineLoop(make(tiny_loaded), name="p2")
    ploop.start()
    try:
        cold = PrefillHandler(
            ploop,
            bus.publish,
            prefill.pusher,
            instance_id="prefill-1",
            model_name="m",
            block_size=BS,
            max_model_len=163840,
            kvstore=kv,
        )
        follow = shared + [7, 8, 9]
        cold.submit(task("hit", follow, sp, cached_blocks=3))
        events = await bus.wait_done("hit")
        assert kv.gets == 1
        assert events[0].cached_tokens == 48
        assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, follow, sp)
    finally:
        await ploop.close()


async def test_prefill_uses_its_own_cache_before_the_kvstore(stack, tiny_loaded) -> None:
    bus, prefill, _, _, kv = stack
    shared = prompt(50, 9)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    prefill.submit(task("first", shared + [5], sp))
    await bus.wait_done("first")
    await asyncio.sleep(0.05)
    assert len(kv.blocks) == 3
    follow = shared + [6, 7]
    prefill.submit(task("again", follow, sp, cached_blocks=3))
    events = await bus.wait_done("again")
    assert kv.gets == 0  # every cached block was still in the engine: nothing fetched
    assert events[0].cached_tokens == 48
    assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, follow, sp)


async def _two_turns(bus: Bus, prefill: PrefillHandler, tiny_loaded) -> tuple[list[int], list]:
    """Turn one (50 tokens: 3 full blocks) then turn two extending it to 80 tokens."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    turn1 = prompt(50, 7)
    prefill.submit(task("turn1", turn1, sp))
    await bus.wait_done("turn1")
    turn2 = turn1 + prompt(30, 8)
    prefill.submit(task("turn2", turn2, sp))
    events = await bus.wait_done("turn2")
    assert not any(e.error for e in events)
    assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, turn2, sp)
    return turn2, events


async def test_next_turn_sends_decode_only_the_blocks_it_lacks(stack, tiny_loaded) -> None:
    """Decode kept turn one's blocks; turn two moves the other two blocks, by reference into
    prefill's pool (same host), and the tokens are the engine's."""
    bus, prefill, _, pusher, _ = stack
    await _two_turns(bus, prefill, tiny_loaded)
    sent = pusher.sent[-1]
    assert isinstance(sent, PeerKV)
    assert sent.first_block == 3 and len(sent.block_ids) == 2 and sent.num_tokens == 80


async def test_next_turn_as_bytes_sends_only_the_missing_blocks(stack, tiny_loaded) -> None:
    bus, prefill, _, pusher, _ = stack
    prefill.same_host_handoff = False
    await _two_turns(bus, prefill, tiny_loaded)
    frame = pusher.sent[-1]
    assert isinstance(frame, bytes)
    header, _ = decode_frame(frame)
    assert header.first_block == 3 and header.num_blocks == 2


async def test_handoff_resends_when_decode_lost_what_it_claimed(stack, tiny_loaded) -> None:
    """Decode evicted the blocks between Match and Push: it says what it has, prefill sends
    again from there; a pool decode cannot map is sent again as bytes."""
    bus, prefill, decode, pusher, _ = stack

    class Forgetful:
        async def match(self, block_hashes: list[bytes]) -> Holding:
            return Holding(len(block_hashes), host_id())  # claims it all, holds nothing

        async def accept(self, t: control_pb2.DecodeTask, kv: Any, tp: str = "") -> Any:
            return await decode.accept(t, kv, tp)

    pusher.register("inproc:0", Forgetful())
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    p = prompt(40, 10)
    prefill.submit(task("lost", p, sp))
    events = await bus.wait_done("lost")
    assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, p, sp)
    assert pusher.pushed == 2 and isinstance(pusher.sent[-1], PeerKV)
    assert pusher.sent[-1].first_block == 0

    def unmappable(handle: bytes) -> Any:
        raise PeerUnavailable("not from here")

    decode.loop.engine.cache.open_peer = unmappable
    decode.loop.engine._peer_pools.clear()
    p = prompt(40, 11)
    prefill.submit(task("far", p, sp))
    events = await bus.wait_done("far")
    assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, p, sp)
    assert isinstance(pusher.sent[-1], bytes)


async def test_decode_writes_the_answers_blocks_for_the_next_turn(stack, tiny_loaded) -> None:
    """The blocks decode completed (prompt tail + answer) reach the kvstore, and a prefill
    that never saw the conversation continues it from them with the engine's tokens."""
    bus, prefill, decode, _, kv = stack
    p = prompt(40, 12)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    prefill.submit(task("t1", p, sp))
    events = await bus.wait_done("t1")
    answer = [t for e in events for t in e.token_ids]
    for _ in range(100):
        await asyncio.sleep(0.02)
        if not decode.writes.busy:
            break
    convo = p + answer  # 70 tokens; the last one was sampled, never computed
    names = chain_hashes(convo[:64], BS)
    assert all(h in kv.blocks for h in names)  # 2 from prefill, 2 from decode
    turn2 = convo + prompt(10, 13)
    ploop = EngineLoop(make(tiny_loaded), name="p3")
    ploop.start()
    try:
        fresh = PrefillHandler(
            ploop,
            bus.publish,
            prefill.pusher,
            instance_id="prefill-2",
            model_name="m",
            block_size=BS,
            max_model_len=163840,
            kvstore=kv,
        )
        sp2 = SamplingParams(max_tokens=4, ignore_eos=True)
        fresh.submit(task("t2", turn2, sp2, cached_blocks=4))
        events = await bus.wait_done("t2")
        assert events[0].cached_tokens == 64
        assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, turn2, sp2)
    finally:
        await ploop.close()


async def test_a_forged_kvstore_block_is_a_miss_never_a_prefix(tiny_loaded) -> None:
    """Blocks signed by the serving tier's key load; a block altered in the kvstore fails its
    MAC, is counted, and the prefix is computed instead: the tokens are the engine's."""
    from services.prefill import handlers as prefill_handlers

    key = b"serving-tier"
    bus = Bus()
    await bus.start()
    kv = MemoryKVStore()
    loops = [EngineLoop(make(tiny_loaded, key), name=f"k{i}") for i in range(3)]
    for lp in loops:
        lp.start()
    try:
        decode = DecodeHandler(
            loops[2],
            bus.publish,
            instance_id="d",
            model_name="m",
            address="inproc:0",
            block_size=BS,
        )
        pusher = InProcKVPusher()
        pusher.register("inproc:0", decode)

        def prefill(loop: EngineLoop) -> PrefillHandler:
            return PrefillHandler(
                loop,
                bus.publish,
                pusher,
                instance_id="p",
                model_name="m",
                block_size=BS,
                max_model_len=163840,
                kvstore=kv,
            )

        shared = prompt(50, 14)
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        prefill(loops[0]).submit(task("warm", shared + [5], sp))
        await bus.wait_done("warm")
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(kv.blocks) == 3:
                break
        digest = chain_hashes(shared[:32], BS)[1]
        forged = bytearray(kv.blocks[digest])
        forged[-5] ^= 0xFF
        kv.blocks[digest] = bytes(forged)
        before = prefill_handlers.FORGED._value.get()
        follow = shared + [7, 8]
        prefill(loops[1]).submit(task("hit", follow, sp, cached_blocks=3))
        events = await bus.wait_done("hit")
        assert prefill_handlers.FORGED._value.get() == before + 1
        assert events[0].cached_tokens == 0  # nothing imported: computed from scratch
        assert [t for e in events for t in e.token_ids] == reference(tiny_loaded, follow, sp)
    finally:
        for lp in loops:
            await lp.close()


async def test_refused_push_is_a_retryable_error(stack) -> None:
    bus, prefill, decode, _, _ = stack
    decode.draining = True
    prefill.submit(task("refused", prompt(12, 5), SamplingParams(max_tokens=5, ignore_eos=True)))
    events = await bus.wait_done("refused")
    assert events[-1].error and events[-1].retryable
    assert "draining" in events[-1].error


async def test_abort_stops_decode_and_frees_its_blocks(stack) -> None:
    bus, prefill, decode, _, _ = stack
    rid = "long"
    prefill.submit(task(rid, prompt(30, 6), SamplingParams(max_tokens=10_000, ignore_eos=True)))
    subject = subjects.token_events(rid)
    while len(bus.events[subject]) < 3:
        await bus.next()
    busy = decode.status()
    assert busy.running == 1 and busy.free_kv_blocks < busy.total_kv_blocks == 256
    assert busy.role == control_pb2.ROLE_DECODE and busy.address == "inproc:0"
    abort = control_pb2.Abort(request_id=rid, reason="client went away")
    await prefill.on_abort(abort)
    await decode.on_abort(abort)
    for _ in range(100):
        if decode.num_active == 0:
            break
        await asyncio.sleep(0.02)
    assert decode.num_active == 0
    bus.settle()
    n = len(bus.events[subject])
    await asyncio.sleep(0.1)
    bus.settle()
    assert len(bus.events[subject]) == n  # nothing after the abort settled
    assert not any(e.finished for e in bus.events[subject])  # client aborts get no answer
    assert await decode.loop.call(lambda e: e.blocks.num_used) == 0
    # A push that arrives after its abort is refused.
    late = control_pb2.DecodeTask(
        request_id=rid,
        token_ids=[1, 2, 3],
        num_prompt_tokens=2,
        sampling=SamplingParams(max_tokens=5).to_proto(),
    )
    reply = await decode.accept(late, b"")
    assert not reply.accepted and "aborted" in reply.error


async def test_a_relay_behind_the_engine_sends_the_waiting_tokens_as_one_event(stack) -> None:
    """Tokens the engine made while the relay was busy go out in one TokenEvent (positions in
    order); an abort behind them is not swallowed, and a resend still starts anywhere."""
    from libs.engine.step_plan import TokenEvent
    from libs.proto.deepserve.v1 import kv_transfer_pb2
    from libs.serving.request_stream import RequestStream

    bus, _, decode, _, _ = stack
    relay = DecodeHandler(
        decode.loop,
        bus.publish,
        instance_id="decode-1",
        model_name="m",
        address="inproc:1",
        block_size=BS,
    )

    def decode_task(rid: str) -> control_pb2.DecodeTask:
        return control_pb2.DecodeTask(
            request_id=rid,
            token_ids=[1, 2, 3, 4],
            num_prompt_tokens=3,
            sampling=SamplingParams(max_tokens=9).to_proto(),
            events_subject=subjects.token_events(rid),
        )

    late = RequestStream("late")
    for i, t in enumerate([5, 6, 7, 8]):
        late._put(
            TokenEvent("late", t, finished=i == 3, finish_reason="length" if i == 3 else None)
        )
    await relay.continue_here(decode_task("late"), late, 0)
    events = await bus.wait_done("late")
    assert [(e.index, list(e.token_ids), e.finish_reason) for e in events] == [
        (1, [5, 6, 7, 8], "length")
    ]
    again = relay.resend(kv_transfer_pb2.ResendRequest(request_id="late", from_index=3))
    assert [(e.index, list(e.token_ids)) for e in again.events] == [(3, [7, 8])]

    cut = RequestStream("cut")
    for t in (5, 6):
        cut._put(TokenEvent("cut", t))
    cut._put(TokenEvent("cut", None, finished=True, finish_reason="abort"))
    await relay.continue_here(decode_task("cut"), cut, 0)  # an abort nobody asked for: an error
    await bus.next()
    await bus.next()
    got = sorted(bus.events[subjects.token_events("cut")], key=lambda e: e.index)
    assert [list(e.token_ids) for e in got] == [[5, 6], []] and got[-1].error
