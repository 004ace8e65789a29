"""Admission counts each request once: by this entrypoint until an instance's heartbeat lists
it among the requests its engine holds, by the engine's own figures from then on.

Before heartbeats listed held requests, a request was counted by both for about two
heartbeats (never zero times); at 256 agent sessions on an H100 (code 2a0598f) that held back
requests while the engine's KV stood at 0.54 on average.
"""

from __future__ import annotations

from libs.common.request_key import request_key
from libs.gateway.capacity import DECODE, PREFILL, Capacity, CapacityConfig, Load, Need

BS = 128
NEED = Need(1000, 1000, 1000)  # 16 KV blocks in all: 8 of prompt, 8 it may grow into


def prefill(queued: int = 0, held: frozenset[int] | None = frozenset()) -> Load:
    return Load("p1", PREFILL, queued_tokens=queued, total_kv_blocks=1000, held=held)


def decode(free: int = 100, promised: int = 0, held: frozenset[int] | None = frozenset()) -> Load:
    return Load(
        "d1", DECODE, address="d1:1", free_kv_blocks=free, total_kv_blocks=100,
        promised_kv_blocks=promised, held=held,
    )  # fmt: skip


def capacity(*loads: Load) -> Capacity:
    cap = Capacity(CapacityConfig(block_size=BS, prefill_queue_tokens=4000), lambda: 100.0)
    for load in loads:
        cap.observe(load)
    return cap


def sent(cap: Capacity, request_id: str):
    ticket = cap.reserve(NEED, cap.fit(NEED))
    cap.bind(ticket, "p1", "d1", request_key(request_id))
    return ticket


def test_a_listed_request_is_counted_once_from_the_first_heartbeat_that_lists_it() -> None:
    cap = capacity(prefill(), decode())
    sent(cap, "a")
    sent(cap, "b")
    assert cap.decode_room(decode()) == 100 - 32
    assert cap.prefill_load(prefill()) == 2000
    # The engine took both: 8 prompt blocks each held, 8 each promised, 2000 tokens queued.
    both = frozenset({request_key("a"), request_key("b")})
    cap.observe(prefill(queued=2000, held=both))
    cap.observe(decode(free=84, promised=16, held=both))
    assert cap.decode_room(decode(free=84, promised=16, held=both)) == 84 - 16
    assert cap.prefill_load(prefill(queued=2000, held=both)) == 2000
    # Counted by both, the room would read 84 - 32 = 52 and the prefill queue 4000 (full).
    sent(cap, "c")  # not listed yet: all of it counts here
    assert cap.decode_room(decode(free=84, promised=16, held=both)) == 84 - 16 - 16


def test_an_older_engine_that_lists_nothing_is_counted_for_two_heartbeats() -> None:
    cap = capacity(prefill(held=None), decode(held=None))
    sent(cap, "a")
    cap.observe(decode(free=92, held=None))
    assert cap.decode_room(decode(free=92, held=None)) == 92 - 16  # may predate its arrival


def test_a_request_that_left_the_prefill_engine_counts_until_its_first_token() -> None:
    key = frozenset({request_key("a")})
    cap = capacity(prefill(), decode())
    t = sent(cap, "a")
    cap.observe(prefill(queued=1000, held=key))
    assert cap.prefill_load(prefill(queued=1000, held=key)) == 1000
    cap.observe(prefill())  # its prefill is done, the first token not here yet
    assert cap.prefill_load(prefill()) == 1000
    cap.saw(t, 0, 1)
    assert cap.prefill_load(prefill()) == 0


def test_room_is_what_no_request_of_the_engine_has_a_claim_on() -> None:
    cap = capacity(prefill(), decode(free=40, promised=30))
    fit = cap.fit(NEED)
    assert not fit.ok and "no decode instance has 16 free KV blocks (most: 10)" in fit.short
    cap.observe(decode(free=40, promised=24))
    assert cap.fit(NEED).ok
