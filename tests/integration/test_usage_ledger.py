"""The entrypoint's usage ledger on a real Redis (services/entrypoint/ledger.py): tokens are in
Redis before they are sent, a record whose entrypoint died is closed by another's sweep with
every token it delivered, and a request id seen twice is one record billed once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepserve import procs
from libs.transport.keycaps import open_redis
from services.entrypoint.ledger import Opened, RedisLedger


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = procs.free_port()
    proc = procs.start_redis(port, tmp_path / "redis", log=tmp_path / "redis.log")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        procs.stop(proc)


async def _client(url: str) -> object:
    client = open_redis(url)
    for _ in range(100):
        try:
            await client.ping()
            return client
        except Exception:  # noqa: BLE001 - still starting
            await asyncio.sleep(0.05)
    raise AssertionError("redis did not start")


def _opened(rid: str) -> Opened:
    return Opened(rid, "acme", "0123abcd", "tiny", "grpc", prompt_tokens=10, cached_tokens=4)


async def _record(client: object, name: str) -> dict[str, str]:
    raw = await client.hgetall(name)  # type: ignore[attr-defined]
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_delivered_tokens_survive_a_dead_entrypoint(redis_url: str) -> None:
    async def go() -> None:
        client = await _client(redis_url)
        dead = RedisLedger(client, "ep-dead", lease_s=0.3)
        name = await dead.open(_opened("r1"))
        for n in (1, 2, 3):
            await dead.delivered(name, n)
        # ep-dead is killed here: never closes, never renews
        live = RedisLedger(client, "ep-live", lease_s=0.3)
        assert await live.maintain() == 0  # within the lease: still open
        await asyncio.sleep(0.4)
        assert await live.maintain() == 1
        rec = await _record(client, name)
        assert (rec["status"], rec["completion_tokens"], rec["prompt_tokens"]) == (
            "interrupted",
            "3",
            "10",
        )
        entries = await client.xrange(live.stream)  # type: ignore[attr-defined]
        assert [e[1][b"record"].decode() for e in entries] == [name]

    asyncio.run(go())


def test_a_request_id_seen_twice_is_billed_once(redis_url: str) -> None:
    async def go() -> None:
        client = await _client(redis_url)
        ledger = RedisLedger(client, "ep")
        name = await ledger.open(_opened("r2"))
        await ledger.delivered(name, 5)
        ledger.close(name, "cancelled", 5)
        await ledger.flush(5.0)
        again = await ledger.open(_opened("r2"))  # the client retries under the same id
        assert again == name
        await ledger.delivered(name, 2)  # the retry's count never lowers the record
        ledger.close(name, "ok", 4)
        await ledger.flush(5.0)
        rec = await _record(client, name)
        assert (rec["status"], rec["completion_tokens"], rec["calls"]) == ("ok", "5", "2")
        assert 0 < await client.ttl(name) <= 7 * 86400  # type: ignore[attr-defined]
        # another tenant's request under the same id is another record
        other = await ledger.open(Opened("r2", "globex", "", "tiny", "service", 1, 0))
        assert other != name

    asyncio.run(go())


def test_concurrent_streams_share_one_write_and_each_is_in_redis_before_it_returns(
    redis_url: str,
) -> None:
    """Group commit: 64 streams' tokens delivered at once are one script call, and when each
    ``delivered`` returns its count is in Redis; a record that is gone is not brought back."""

    async def go() -> None:
        client = await _client(redis_url)
        ledger = RedisLedger(client, "ep")
        names = [await ledger.open(_opened(f"g{i}")) for i in range(64)]

        async def calls() -> int:
            stats = await client.info("commandstats")  # type: ignore[attr-defined]
            return sum(
                v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
            )

        async def deliver(name: str, n: int) -> None:
            await ledger.delivered(name, n)
            assert (await _record(client, name))["completion_tokens"] == str(n)

        before = await calls()
        await asyncio.gather(*(deliver(n, i + 1) for i, n in enumerate(names)))
        assert await calls() - before <= 2  # one for all 64 (a script load may add one)
        gone = "ds:{usage}:rec:none:never-opened"
        await ledger.delivered(gone, 3)
        assert not await client.exists(gone)  # type: ignore[attr-defined]

    asyncio.run(go())
