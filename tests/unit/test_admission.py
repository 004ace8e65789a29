"""Capacity-aware admission: the pure capacity view (fake clock) and the bounded queue.

A request is admitted only when a prefill instance can queue its uncached tokens and a decode
instance has KV room for prompt + max_tokens, counting what this entrypoint sent since the
instances' heartbeats; otherwise it waits, bounded, or is refused at once with a retry hint
from the measured drain rates. Nothing is left to the 60 s token timeout.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.common.errors import InvalidArgument, Overloaded, Unavailable
from libs.gateway.admission import MIN_RETRY_MS, Admission, Grant, parse_tenant_weights
from libs.gateway.capacity import (
    DECODE,
    PREFILL,
    Capacity,
    CapacityConfig,
    Load,
    Need,
    Rate,
    blocks,
)

BS = 128
MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def prefill(iid: str = "p1", queued: int = 0, total: int = 4096, draining: bool = False) -> Load:
    return Load(iid, PREFILL, MODEL, queued_tokens=queued, total_kv_blocks=total, draining=draining)


def decode(
    iid: str = "d1", free: int = 100, total: int = 100, address: str = "127.0.0.1:7001"
) -> Load:
    return Load(iid, DECODE, MODEL, address=address, free_kv_blocks=free, total_kv_blocks=total)


def agent_turn(uncached: int = 4096) -> Need:
    """~4K-token prompt, 96-token answer: 33 decode blocks of 128 tokens."""
    return Need(4096, uncached, 96)


def capacity(clock: Clock, queue: int = 65_536, *loads: Load) -> Capacity:
    cap = Capacity(CapacityConfig(block_size=BS, prefill_queue_tokens=queue), clock)
    for load in loads or (prefill(), decode()):
        cap.observe(load)
    return cap


# -- the capacity view ------------------------------------------------------------------------


def test_prefill_fits_within_its_queue_limit_and_an_idle_instance_takes_any_prompt() -> None:
    clock = Clock()
    cap = capacity(clock, 65_536, prefill(queued=60_000), decode(free=10_000, total=10_000))
    assert cap.fit(Need(5000, 5000, 1)).ok  # 65,000 queued: within the limit
    tight = cap.fit(Need(8000, 8000, 1))
    assert not tight.ok and tight.full == ("p1",) and "prefill queues are full" in tight.short
    assert cap.fit(Need(8000, 1000, 1)).ok  # only uncached tokens queue: the rest is cached
    cap.observe(prefill(queued=0))
    assert cap.fit(Need(100_000, 100_000, 1)).ok  # larger than the limit, but nothing queued


def test_a_measured_rate_turns_the_queue_limit_into_seconds_of_work() -> None:
    """The H100 agent run: prefill queues held ~59K tokens against a 65,536-token limit, so
    requests waited and were refused while the engine, at ~63K tokens/s, was idle most of the
    time. With its rate measured, the limit is 2 s of work there: 126K tokens."""
    clock = Clock()
    measured = Load(
        "p1", PREFILL, MODEL, queued_tokens=59_088, total_kv_blocks=4096, tokens_per_s=63_000
    )
    cap = capacity(clock, 65_536, measured, decode(free=10_000, total=10_000))
    assert cap.prefill_limit(measured) == 126_000
    assert cap.fit(Need(8000, 8000, 1)).ok  # 67K queued: ~1.07 s of work, admitted
    assert cap.fit(Need(66_000, 66_000, 1)).ok  # 125K: just under 2 s
    late = cap.fit(Need(67_000, 67_000, 1))  # 126,088 tokens: past 2 s of work, held
    assert not late.ok and late.full == ("p1",)
    assert "holds 59088 tokens = 0.94s at its measured 63000 tokens/s, limit 2s" in late.short
    # The same queue without a measured rate: the token limit holds the first one back.
    cap.observe(prefill(queued=59_088))
    unmeasured = cap.fit(Need(8000, 8000, 1))
    assert not unmeasured.ok and "59088 tokens, limit 65536" in unmeasured.short
    # A slow engine's 2 s are fewer tokens than the token limit: it holds sooner.
    slow = Load("p1", PREFILL, MODEL, queued_tokens=30_000, tokens_per_s=10_000)
    cap.observe(slow)
    assert cap.prefill_limit(slow) == 20_000 and not cap.fit(Need(100, 100, 1)).ok
    # 0 s: the token limit alone, rate or not.
    tokens_only = Capacity(CapacityConfig(block_size=BS, prefill_queue_seconds=0), clock)
    assert tokens_only.prefill_limit(measured) == 65_536


async def test_a_request_waits_only_past_the_instances_measured_seconds() -> None:
    clock = Clock()
    rate = 10_000.0
    cap = capacity(
        clock,
        65_536,
        Load("p1", PREFILL, MODEL, queued_tokens=15_000, tokens_per_s=rate),
        decode(free=10_000, total=10_000),
    )
    adm = admission(cap, admit_wait=5.0)
    first = await adm.acquire(Need(4000, 4000, 1), MODEL)  # 1.9 s of work with it: at once
    assert first.waited == 0
    waiter = asyncio.ensure_future(adm.acquire(Need(4000, 4000, 1), MODEL))
    await asyncio.sleep(0.02)
    assert not waiter.done() and adm.waiting == 1  # 2.3 s: waits
    cap.observe(Load("p1", PREFILL, MODEL, queued_tokens=2000, tokens_per_s=rate))
    adm.wake()
    assert (await asyncio.wait_for(waiter, 1)).ticket is not None
    # Before this entrypoint measured a drain rate, the retry hint comes from the instances'
    # own: 25K queued + the second request (one heartbeat since it was sent) + 1K, less 20K.
    cap.observe(Load("p1", PREFILL, MODEL, queued_tokens=25_000, tokens_per_s=rate))
    assert cap.drain_seconds(Need(1000, 1000, 1)) == pytest.approx(
        (25_000 + 4000 + 1000 - 20_000) / rate
    )


def test_decode_needs_blocks_for_prompt_plus_max_tokens() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=100))
    need = agent_turn()
    assert need.decode_blocks(BS) == 33
    tickets = [cap.reserve(need, cap.fit(need)) for _ in range(3)]  # 99 blocks reserved
    assert all(t.decode == "d1" for t in tickets)
    fit = cap.fit(need)
    assert not fit.ok and "no decode instance has 33 free KV blocks (most: 1)" in fit.short
    assert cap.fit(Need(100, 100, 28)).ok  # one block still fits
    cap.release(tickets[0])
    assert cap.fit(need).ok


def test_reservations_count_until_heartbeats_surely_show_them() -> None:
    """A burst between heartbeats must not overshoot: what was sent counts until the
    instance's second heartbeat after it (the first may predate the task's arrival)."""
    cap = capacity(Clock(), 10_000, prefill(queued=0), decode(free=1000, total=1000))
    need = Need(4000, 4000, 100)
    a = cap.reserve(need, cap.fit(need))
    b = cap.reserve(need, cap.fit(need))
    assert not cap.fit(need).ok  # 8,000 sent since the heartbeat: a third would make 12,000
    cap.observe(prefill(queued=8000))  # first heartbeat after: may or may not count them
    assert cap.prefill_load(prefill(queued=8000)) == 16_000  # counted twice, never zero times
    cap.observe(prefill(queued=8000))  # second: it does
    assert cap.prefill_load(prefill(queued=8000)) == 8000
    cap.saw(a, 0, 1)  # a's first token: its prefill is done, it queues nowhere any more
    cap.saw(b, 0, 1)
    cap.observe(prefill(queued=0))
    assert cap.fit(need).ok


def test_decode_reservation_is_whole_until_landed_then_only_what_it_may_grow_into() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=100))
    need = Need(1000, 1000, 1000)  # 16 blocks: 8 of prompt, 8 it may still grow into
    t = cap.reserve(need, cap.fit(need))
    for _ in range(3):  # heartbeats do not show it before its KV lands there
        cap.observe(decode(free=100))
    assert cap.decode_room(decode(free=100)) == 84
    cap.saw(t, 1, 2)  # the first decode token: the KV has landed
    cap.observe(decode(free=92))
    assert cap.decode_room(decode(free=92)) == 76  # one heartbeat may predate the landing
    cap.observe(decode(free=92))
    assert cap.decode_room(decode(free=92)) == 92 - (16 - blocks(1002, BS))
    cap.saw(t, 500, 600)  # grown to 1,600 tokens: 13 blocks held, 3 more at most
    assert cap.decode_room(decode(free=87)) == 87 - 3
    cap.release(t)
    assert cap.decode_room(decode(free=87)) == 87


def test_bind_moves_the_reservation_to_where_the_balancer_routed() -> None:
    cap = capacity(Clock(), 0, prefill(), decode("d1", free=50), decode("d2", free=40))
    need = Need(1000, 1000, 1000)
    t = cap.reserve(need, cap.fit(need))
    assert t.decode == "d1"  # most room
    cap.bind(t, "p1", "d2")
    assert cap.decode_room(decode("d1", free=50)) == 50
    assert cap.decode_room(decode("d2", free=40)) == 24


def test_dead_draining_and_addressless_instances_take_nothing() -> None:
    clock = Clock()
    cap = capacity(
        clock,
        0,
        prefill("p1"),
        prefill("p2", draining=True),
        decode("d1"),
        decode("d2", address=""),
    )
    assert [i.instance_id for i in cap.candidates(PREFILL, MODEL)] == ["p1"]
    assert [i.instance_id for i in cap.candidates(DECODE, MODEL)] == ["d1"]
    assert cap.candidates(DECODE, "other-model") == []
    clock.t += 3.5  # silent past dead_after
    fit = cap.fit(agent_turn(), MODEL)
    assert not fit.ok and fit.missing == PREFILL


def test_instances_that_report_no_kv_size_are_not_kv_gated() -> None:
    cap = capacity(Clock(), 0, prefill(total=0), decode(free=0, total=0))
    assert cap.fit(Need(10**6, 10**6, 10**5)).ok and cap.never_fits(Need(10**6, 1, 1)) is None


def test_a_request_larger_than_any_instance_never_fits() -> None:
    cap = capacity(Clock(), 0, prefill(total=64), decode("d1", total=100), decode("d2", total=40))
    assert cap.never_fits(Need(8000, 8000, 4000)) is None  # 94 blocks: d1 could hold it
    err = cap.never_fits(Need(8000, 8000, 5000))
    assert isinstance(err, InvalidArgument) and err.field == "sampling.max_tokens"
    assert "largest decode instance holds 100 (12800 tokens)" in str(err)
    err = cap.never_fits(Need(9000, 9000, 1))  # 71 prompt blocks: no prefill holds 64+
    assert isinstance(err, InvalidArgument) and err.field == "prompt_token_ids"
    empty = capacity(Clock(), 0, prefill())
    assert empty.never_fits(Need(100_000, 1, 10**6)) is None  # no decode known: one may come


def test_rate_over_a_window() -> None:
    r = Rate(10.0)
    assert r.per_second(0.0) is None
    r.add(0.0, 1000)
    assert r.per_second(0.5) == 1000  # at least 1 s of history is assumed
    r.add(4.0, 1000)
    assert r.per_second(4.0) == 500
    assert r.per_second(11.0) == 100  # the first sample left the window
    assert r.per_second(20.0) is None


def test_drain_seconds_follow_the_measured_rates() -> None:
    clock = Clock()
    cap = capacity(clock, 10_000, prefill(queued=9000), decode(free=1000, total=1000))
    need = Need(3000, 3000, 10)
    assert cap.drain_seconds(need) is None  # short on prefill, no rate measured yet
    for _ in range(4):  # 4 x 2,500 tokens prefilled over 2 s: 5,000 tokens/s
        t = cap.reserve(Need(2500, 2500, 1), cap.fit(Need(1, 1, 1)))
        cap.saw(t, 0, 1)
        cap.release(t)
        clock.t += 0.5
    assert cap.drain_seconds(need) == pytest.approx(2000 / 5000)
    ahead = [Need(5000, 5000, 1)]
    assert cap.drain_seconds(need, ahead) == pytest.approx(7000 / 5000)
    assert cap.drain_seconds(Need(500, 500, 1)) == 0.0  # fits now


# -- the queue --------------------------------------------------------------------------------


class Seen:
    def __init__(self) -> None:
        self.results: list[str] = []
        self.why: list[str] = []

    def on_admission(self, result: str, waited: float | None, waiting: int, why: str = "") -> None:
        self.results.append(result)
        if why:
            self.why.append(why)


def admission(
    cap: Capacity | None,
    *,
    max_inflight: int = 0,
    max_waiting: int = 8,
    admit_wait: float = 0.2,
    retry_after_ms: int = 500,
    observer: Seen | None = None,
    clock: Clock | None = None,
) -> Admission:
    return Admission(
        max_inflight,
        max_waiting,
        admit_wait,
        retry_after_ms,
        capacity=cap,
        observer=observer,
        clock=clock or time.monotonic,
    )


async def test_admits_while_it_fits_then_refuses_quickly_with_a_hint() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=100))
    seen = Seen()
    adm = admission(cap, max_waiting=2, observer=seen)
    grants = [await adm.acquire(agent_turn(), MODEL) for _ in range(3)]
    assert adm.running == 3 and all(g.ticket for g in grants)
    t0 = time.monotonic()
    waiters = [asyncio.ensure_future(adm.acquire(agent_turn(), MODEL)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as at_once:  # the queue is full: no waiting at all
        await adm.acquire(agent_turn(), MODEL)
    assert time.monotonic() - t0 < 0.1
    assert "no decode instance has 33 free KV blocks" in str(at_once.value)
    assert "its queue is full" in str(at_once.value)
    assert at_once.value.retry_after_ms == 500  # no drain measured yet: the configured hint
    for w in waiters:  # past admit_wait: refused, not left hanging
        with pytest.raises(Overloaded, match="none came free within"):
            await w
    assert time.monotonic() - t0 < 1.0
    assert seen.results.count("refused") == 3 and adm.waiting == 0
    assert seen.why == ["decode_kv", "behind"]  # what held each one that waited


async def test_a_waiting_request_is_counted_under_what_held_it() -> None:
    """The operator's view of why requests waited: the in-flight cap, or a full prefill queue."""
    seen = Seen()
    capped = admission(None, max_inflight=1, observer=seen)
    await capped.acquire(agent_turn(), MODEL)
    held = asyncio.ensure_future(capped.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0)
    queue = capacity(Clock(), 1000, prefill(queued=1000), decode(free=10_000, total=10_000))
    full = admission(queue, observer=seen)
    busy = asyncio.ensure_future(full.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0)
    assert seen.why == ["inflight", "prefill_queue"]
    for w in (held, busy):
        w.cancel()
    await asyncio.gather(held, busy, return_exceptions=True)


async def test_a_heartbeat_that_frees_capacity_wakes_the_waiter() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=40))
    adm = admission(cap, admit_wait=5.0)
    first = await adm.acquire(agent_turn(), MODEL)
    waiter = asyncio.ensure_future(adm.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0.05)
    assert not waiter.done() and adm.waiting == 1
    cap.observe(decode(free=80))  # another entrypoint's requests finished
    adm.wake()
    grant = await asyncio.wait_for(waiter, 1)
    assert grant.ticket is not None and grant.waited > 0
    adm.release(first)
    adm.release(grant)
    assert adm.running == 0 and cap.tickets == 0


async def test_a_finished_request_wakes_the_waiter() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=40))
    adm = admission(cap, admit_wait=5.0)
    first = await adm.acquire(agent_turn(), MODEL)
    waiter = asyncio.ensure_future(adm.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0.02)
    adm.release(first)
    assert (await asyncio.wait_for(waiter, 1)).ticket is not None


async def test_the_retry_hint_comes_from_the_measured_drain_rate() -> None:
    clock = Clock()
    cap = capacity(clock, 0, prefill(), decode(free=70, total=100))
    adm = admission(cap, admit_wait=0.05, clock=clock)
    for _ in range(4):  # four requests of 33 blocks land and finish within 2 s: 66 blocks/s
        g = await adm.acquire(agent_turn(), MODEL)
        assert g.ticket is not None
        adm.saw(g, 1, 1)
        adm.release(g)
        clock.t += 0.5
    held = [await adm.acquire(agent_turn(), MODEL) for _ in range(2)]  # 4 blocks left
    with pytest.raises(Overloaded) as info:
        await adm.acquire(agent_turn(), MODEL)
    assert info.value.retry_after_ms == int(29 / 66 * 1000)  # 29 blocks short at 66/s
    assert f"retry after {info.value.retry_after_ms} ms" in str(info.value)
    for g in held:
        adm.release(g)


async def test_never_fits_is_invalid_argument_at_once_and_after_startup() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(total=20, free=20))
    adm = admission(cap)
    with pytest.raises(InvalidArgument):
        await adm.acquire(agent_turn(), MODEL)
    blind = Capacity(CapacityConfig(block_size=BS), Clock())  # nothing heard yet
    adm = admission(blind, admit_wait=2.0)
    waiter = asyncio.ensure_future(adm.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0.02)
    blind.observe(prefill())
    blind.observe(decode(total=20, free=20))
    adm.wake()
    with pytest.raises(InvalidArgument, match="can never run here"):
        await asyncio.wait_for(waiter, 1)
    assert adm.waiting == 0 and adm.running == 0


async def test_startup_waits_for_heartbeats_then_is_unavailable() -> None:
    clock = Clock()
    blind = Capacity(CapacityConfig(block_size=BS, dead_after=0.3), clock)
    adm = admission(blind, admit_wait=0.05)
    waiter = asyncio.ensure_future(adm.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0.1)  # past admit_wait, but every instance may not have beaten yet
    assert not waiter.done()
    blind.observe(prefill())
    blind.observe(decode())
    adm.wake()
    adm.release(await asyncio.wait_for(waiter, 1))
    clock.t += 10  # both went silent
    with pytest.raises(Unavailable, match="no live prefill instance"):
        await adm.acquire(agent_turn(), MODEL)


async def test_first_come_first_served_a_big_request_is_not_overtaken() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=60, total=100))
    adm = admission(cap, admit_wait=5.0)
    first = await adm.acquire(agent_turn(), MODEL)  # 33 of 60 blocks
    big = asyncio.ensure_future(adm.acquire(Need(4096, 4096, 2000), MODEL))  # 48 blocks
    await asyncio.sleep(0.01)
    small = asyncio.ensure_future(adm.acquire(Need(100, 100, 10), MODEL))  # 1 block: fits now
    await asyncio.sleep(0.02)
    assert not small.done()  # waits behind the big one instead of starving it
    adm.release(first)
    g_big, g_small = await asyncio.wait_for(asyncio.gather(big, small), 1)
    assert g_big.ticket is not None and g_small.ticket is not None


async def test_max_inflight_is_still_a_cap_on_top_of_capacity() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=10_000, total=10_000))
    adm = admission(cap, max_inflight=2, max_waiting=0)
    held = [await adm.acquire(agent_turn(), MODEL) for _ in range(2)]
    with pytest.raises(Overloaded, match=r"2 requests in flight \(limit 2\)"):
        adm.refuse_if_full(agent_turn(), MODEL)
    with pytest.raises(Overloaded):
        await adm.acquire(agent_turn(), MODEL)
    adm.release(held[0])
    adm.release(held[1])
    adm.refuse_if_full(agent_turn(), MODEL)  # room again: no refusal


async def test_a_cancelled_waiter_leaves_the_queue_and_a_granted_one_is_released() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=40))
    adm = admission(cap, admit_wait=5.0)
    first = await adm.acquire(agent_turn(), MODEL)
    waiter = asyncio.ensure_future(adm.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.waiting == 0
    waiter = asyncio.ensure_future(adm.acquire(agent_turn(), MODEL))
    await asyncio.sleep(0.01)
    adm.release(first)  # grants the waiter ...
    waiter.cancel()  # ... whose client goes away before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.running == 0 and cap.tickets == 0


async def test_a_retry_is_rebooked_at_once_even_when_full() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=40))
    adm = admission(cap)
    grant = await adm.acquire(agent_turn(), MODEL)
    cap.observe(decode(free=0))  # everything else filled up meanwhile
    adm.rebook(grant, Need(4100, 4100, 92), MODEL)
    assert grant.ticket is not None and grant.ticket.need.prompt_tokens == 4100
    assert grant.avoid == () and cap.tickets == 1 and adm.running == 1
    adm.release(grant)
    assert cap.tickets == 0


async def test_without_capacity_it_is_the_plain_inflight_cap() -> None:
    adm = admission(None, max_inflight=1, max_waiting=1, admit_wait=0.05, retry_after_ms=250)
    held = await adm.acquire(agent_turn())
    with pytest.raises(Overloaded) as info:
        await adm.acquire(agent_turn())
    assert info.value.retry_after_ms == 250 and "1 requests in flight (limit 1)" in str(info.value)
    adm.release(held)
    adm.release(await adm.acquire(agent_turn()))
    assert adm.retry_after(agent_turn()) >= MIN_RETRY_MS


# -- fair by tenant ---------------------------------------------------------------------------


async def _queue(adm: Admission, tenant: str, need: Need) -> asyncio.Task[Grant]:
    task = asyncio.ensure_future(adm.acquire(need, MODEL, tenant))
    await asyncio.sleep(0)  # it joins its queue now: arrival order is call order
    return task


async def _release_in_turn(
    adm: Admission, tasks: list[tuple[str, asyncio.Task[Grant]]], running: Grant, count: int
) -> list[str]:
    """With one slot (max_inflight 1): release the running request ``count`` times and say
    whose request each release admitted."""
    order = []
    for _ in range(count):
        adm.release(running)
        await asyncio.sleep(0)
        admitted = [(n, t) for n, t in tasks if t.done() and not t.result().released]
        assert len(admitted) == 1
        order.append(admitted[0][0])
        running = admitted[0][1].result()
    adm.release(running)
    return order


async def test_another_tenants_short_request_passes_a_burst_of_long_ones() -> None:
    """Measured before: a 6-token request waited 59 s behind a 30,000-token prompt in one FIFO.
    Now tenant A's burst is tagged one request after another, and B's short one is next as
    soon as it fits."""
    cap = capacity(Clock(), 0, prefill(), decode(free=33, total=100))
    adm = admission(cap, admit_wait=5.0)
    a1 = await adm.acquire(agent_turn(), MODEL, "a")  # 33 blocks: the decode is full
    longs = [await _queue(adm, "a", agent_turn()) for _ in range(3)]
    short = await _queue(adm, "b", Need(6, 6, 10))  # 1 block
    assert adm.waiting == 4 and adm.waiting_of("a") == 3 and not short.done()
    adm.release(a1)  # 33 blocks free: B's short one first, then A's next (32 left: not yet)
    await asyncio.sleep(0)
    assert short.done() and short.result().ticket is not None
    assert not any(t.done() for t in longs) and adm.waiting == 3
    adm.release(short.result())
    await asyncio.sleep(0)
    assert longs[0].done() and not longs[1].done()  # A's own stay in order
    adm.release(longs[0].result())
    for t in longs:
        t.cancel()
    await asyncio.gather(*longs, return_exceptions=True)
    assert adm.running == 0 and adm.waiting == 0 and cap.tickets == 0


async def test_a_short_request_of_an_idle_tenant_is_admitted_at_once_past_a_waiting_burst() -> None:
    cap = capacity(Clock(), 0, prefill(), decode(free=40, total=100))
    adm = admission(cap, admit_wait=5.0)
    a1 = await adm.acquire(agent_turn(), MODEL, "a")  # 7 blocks left
    waiting = await _queue(adm, "a", agent_turn())
    b = await asyncio.wait_for(adm.acquire(Need(6, 6, 10), MODEL, "b"), 0.5)  # fits: at once
    assert b.waited == 0 and not waiting.done()
    # The same short request of tenant A queues behind A's own long one (FIFO per tenant).
    mine = await _queue(adm, "a", Need(6, 6, 10))
    assert not mine.done()
    for g in (a1, b):
        adm.release(g)
    g1, g2 = await asyncio.wait_for(asyncio.gather(waiting, mine), 1)
    adm.release(g1)
    adm.release(g2)
    assert cap.tickets == 0


async def test_weights_split_admissions_in_proportion() -> None:
    adm = Admission(1, 64, 5.0, 500, weights={"a": 2, "b": 1})
    first = await adm.acquire(Need(1000, 1000, 10), MODEL, "x")
    tasks = []
    for _ in range(6):
        for tenant in ("a", "b"):
            tasks.append((tenant, await _queue(adm, tenant, Need(1000, 1000, 10))))
    order = await _release_in_turn(adm, tasks, first, 9)
    assert order.count("a") == 6 and order.count("b") == 3, order
    for _, t in tasks:
        t.cancel()
    await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
    assert adm.running == 0 and adm.waiting == 0


async def test_equal_weights_split_admitted_tokens_not_requests() -> None:
    """Work is uncached prompt tokens: a tenant of 1,000-token prompts gets one admitted for
    every four of another tenant's 250-token prompts."""
    adm = Admission(1, 64, 5.0, 500)
    first = await adm.acquire(Need(1, 1, 1), MODEL, "x")
    tasks = [("big", await _queue(adm, "big", Need(1000, 1000, 10))) for _ in range(3)]
    tasks += [("small", await _queue(adm, "small", Need(250, 250, 10))) for _ in range(12)]
    order = await _release_in_turn(adm, tasks, first, 10)
    assert order.count("big") == 2 and order.count("small") == 8, order
    for _, t in tasks:
        t.cancel()
    await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)


async def test_a_single_tenant_keeps_fifo_order() -> None:
    adm = Admission(1, 64, 5.0, 500)
    first = await adm.acquire(Need(10, 10, 1), MODEL, "a")
    sizes = [5000, 10, 3000, 1, 200]
    tasks = [(str(n), await _queue(adm, "a", Need(n, n, 1))) for n in sizes]
    assert await _release_in_turn(adm, tasks, first, len(sizes)) == [str(n) for n in sizes]


async def test_a_long_request_is_not_starved_by_another_tenants_stream_of_short_ones() -> None:
    adm = Admission(1, 512, 5.0, 500)
    first = await adm.acquire(Need(10, 10, 1), MODEL, "b")
    tasks = [("a", await _queue(adm, "a", Need(1000, 1000, 1)))]
    tasks += [("b", await _queue(adm, "b", Need(10, 10, 1))) for _ in range(300)]
    order = await _release_in_turn(adm, tasks, first, 150)
    assert order.index("a") <= 100, order.index("a")  # after ~1,000 tokens of B's
    for _, t in tasks:
        t.cancel()
    await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)


async def test_a_full_queue_makes_room_for_a_tenant_holding_less_of_it() -> None:
    seen = Seen()
    adm = Admission(1, 3, 5.0, 500, observer=seen)
    first = await adm.acquire(Need(10, 10, 1), MODEL, "a")
    burst = [await _queue(adm, "a", Need(10, 10, 1)) for _ in range(3)]
    with pytest.raises(Overloaded, match="its queue is full"):
        adm.refuse_if_full(Need(10, 10, 1), MODEL, "a")  # its own burst: refused at once
    with pytest.raises(Overloaded, match="its queue is full"):
        await adm.acquire(Need(10, 10, 1), MODEL, "a")
    adm.refuse_if_full(Need(10, 10, 1), MODEL, "b")  # B may join: A holds all of it
    b = await _queue(adm, "b", Need(10, 10, 1))
    await asyncio.sleep(0)
    assert burst[2].done() and not b.done() and adm.waiting == 3  # A's newest gave way
    with pytest.raises(Overloaded, match="took its place"):
        await burst[2]
    # 2 of A's against 1 of B's: a second B would hold as much as A; refused itself.
    with pytest.raises(Overloaded, match="its queue is full"):
        await adm.acquire(Need(10, 10, 1), MODEL, "b")
    order = await _release_in_turn(adm, [("a", burst[0]), ("a", burst[1]), ("b", b)], first, 3)
    assert sorted(order) == ["a", "a", "b"] and adm.running == 0


def test_tenant_weights_parse_and_name_a_wrong_entry() -> None:
    assert parse_tenant_weights(" a=2, b=0.5 ,") == {"a": 2.0, "b": 0.5}
    assert parse_tenant_weights("") == {}
    for bad in ("a", "a=0", "a=-1", "a=x", "=2", "a=inf"):
        with pytest.raises(ValueError, match="--tenant-weights entry"):
            parse_tenant_weights(bad)
    with pytest.raises(ValueError, match="weight must be > 0"):
        Admission(1, 1, 1.0, 500, weights={"a": 0})
