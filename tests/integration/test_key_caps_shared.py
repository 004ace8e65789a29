"""Per-key caps held in a real Redis (libs/transport/keycaps.py): two replicas share one cap, a
replica that dies gives its slots back when they expire, the token bucket is one, and a Redis
that cannot be reached falls back to the process's own limits instead of refusing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepserve import procs
from libs.gateway.keylimits import KeyLimit, KeyLimitPolicy, Refusal, Slot
from libs.transport.keycaps import KeyCaps, open_redis

KID = "0123abcd"


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = procs.free_port()
    proc = procs.start_redis(port, tmp_path / "redis", log=tmp_path / "redis.log")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        procs.stop(proc)


def _policy(concurrency: int, tokens_per_min: int = 0) -> KeyLimitPolicy:
    return KeyLimitPolicy(KeyLimit(concurrency, tokens_per_min))


async def _replicas(url: str, policy: KeyLimitPolicy, ttl: float = 30.0) -> list[KeyCaps]:
    out = []
    for _ in range(2):
        client = open_redis(url)
        for _ in range(100):  # the server may still be starting
            try:
                await client.ping()
                break
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.05)
        out.append(KeyCaps(policy, client, slot_ttl_s=ttl))
    return out


def test_two_replicas_share_one_cap_counting_generations(redis_url: str) -> None:
    async def go() -> None:
        a, b = await _replicas(redis_url, _policy(4))
        first = await a.enter(KID)
        assert isinstance(first, Slot) and first.shared
        assert await a.widen(first, 3) is None  # n=3 on replica a
        second = await b.enter(KID)  # the 4th generation, on replica b
        assert isinstance(second, Slot)
        refused = await b.enter(KID)  # a 5th: refused although b alone holds 1
        assert isinstance(refused, Refusal) and "limit is 4" in refused.message
        too_wide = await b.widen(second, 5)
        assert isinstance(too_wide, Refusal) and "lower n to at most 4" in too_wide.message
        await a.leave(first, None)
        assert await b.widen(second, 4) is None  # the 3 a gave back
        assert isinstance(await a.enter(KID), Refusal)
        await b.leave(second, None)
        await b.leave(second, None)  # idempotent: never gives back twice
        slots = [await a.enter(KID) for _ in range(4)]
        assert all(isinstance(s, Slot) for s in slots)
        assert isinstance(await b.enter(KID), Refusal)

    asyncio.run(go())


def test_a_dead_replicas_slots_expire_and_a_live_ones_do_not(redis_url: str) -> None:
    async def go() -> None:
        dead, live = await _replicas(redis_url, _policy(2), ttl=0.6)
        assert isinstance(await dead.enter(KID), Slot)  # never renewed nor left: killed
        kept = await live.enter(KID)
        assert isinstance(kept, Slot)
        assert isinstance(await live.enter(KID), Refusal)
        stop = asyncio.Event()
        renewing = asyncio.create_task(live.renew_forever(stop))
        await asyncio.sleep(1.0)  # past the dead replica's ttl, within the live one's renewals
        again = await live.enter(KID)
        assert isinstance(again, Slot), "the dead replica's slot should have expired"
        assert isinstance(await live.enter(KID), Refusal), "the renewed slot must still count"
        stop.set()
        await renewing

    asyncio.run(go())


def test_the_token_bucket_is_shared(redis_url: str) -> None:
    async def go() -> None:
        a, b = await _replicas(redis_url, _policy(0, tokens_per_min=600))
        sa, sb = await a.enter(KID), await b.enter(KID)
        assert isinstance(sa, Slot) and isinstance(sb, Slot)
        assert await a.reserve(sa, 500) is None
        refused = await b.reserve(sb, 200)  # 100 left in the one bucket
        assert isinstance(refused, Refusal) and refused.reason == "tokens"
        assert 1 <= refused.retry_after_s <= 11  # 100 tokens at 10/s
        await a.leave(sa, used=100)  # 400 unused given back
        assert await b.reserve(sb, 200) is None

    asyncio.run(go())


def test_redis_unreachable_falls_back_to_local_limits() -> None:
    async def go() -> None:
        port = procs.free_port()  # nothing listens there
        caps = KeyCaps(_policy(1), open_redis(f"redis://127.0.0.1:{port}/0"))
        slot = await caps.enter(KID)
        assert isinstance(slot, Slot) and not slot.shared
        assert isinstance(await caps.enter(KID), Refusal)  # the local cap still holds
        await caps.leave(slot, None)
        assert isinstance(await caps.enter(KID), Slot)

    asyncio.run(go())
