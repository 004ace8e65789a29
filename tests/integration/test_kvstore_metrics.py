"""The kvstore's state metrics on real Redis and real directories: a degraded read, a repair (by
a get and by fsck), a lost block, evictions by capacity, TTL and unreachable parents, the store's
size read from Redis at scrape time and a target that goes down, each seen in the scrape."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest

from deepserve.procs import free_port, start_redis, stop
from libs.kvstore.policy import DAY_S, Retention
from libs.proto.deepserve.v1 import kvstore_pb2_grpc
from services.kvstore.ec import Codec
from services.kvstore.fsck import fsck
from services.kvstore.metrics import RedisStats, StoreCollector, StoreMetrics, TargetHealth
from services.kvstore.store import BlockPut, BlockStore
from services.kvstore.targets import DirTarget

from .test_kvstore_ec import Clock, make_chain, shard_path, start_service, take_down, to_msgs


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield port
    finally:
        stop(proc)


class Env:
    def __init__(self, store: BlockStore, dirs: list[Path], clock: Clock, url: str) -> None:
        self.store, self.dirs, self.clock, self.url = store, dirs, clock, url
        self.registry = store.metrics.registry

    def value(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels)
        assert v is not None, f"{name}{labels} is not exported"
        return v

    async def get_all(self, blocks: list[BlockPut]) -> list[bytes]:
        return [data async for _, data in self.store.get([b.hash for b in blocks])]

    async def meta(self, h: bytes) -> dict[bytes, bytes]:
        meta: Any = await self.store.redis.hgetall(self.store.key(h))
        return dict(meta)


@pytest.fixture
async def env(tmp_path: Path, redis_port: int) -> AsyncIterator[Env]:
    db = int(hashlib.sha256(str(tmp_path).encode()).hexdigest(), 16) % 15 + 1
    url = f"redis://127.0.0.1:{redis_port}/{db}"
    r = aioredis.from_url(url)
    await r.flushdb()
    dirs = [tmp_path / f"ssd{i:02d}" for i in range(12)]
    clock = Clock()
    store = BlockStore(
        r,
        [DirTarget(d) for d in dirs],
        Codec(),
        Retention({"chat": 7 * DAY_S, "agent": 3 * DAY_S}),
        clock,
        StoreMetrics(CollectorRegistry()),
    )
    store.prepare()
    try:
        yield Env(store, dirs, clock, url)
    finally:
        store.close()
        await r.aclose()


async def test_a_damaged_data_shard_is_a_degraded_read_and_one_repair(env: Env) -> None:
    blocks = make_chain(11, 3)
    await env.store.put(blocks)
    assert await env.get_all(blocks) == [b.data for b in blocks]
    assert env.value("deepserve:kvstore_degraded_reads_total") == 0, "healthy reads are not"
    p = shard_path(env.dirs, await env.meta(blocks[1].hash), blocks[1].hash, 4)
    good = p.read_bytes()
    p.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert await env.get_all(blocks) == [b.data for b in blocks]
    assert env.value("deepserve:kvstore_degraded_reads_total") == 1
    assert env.value("deepserve:kvstore_repaired_shards_total", source="get") == 1
    assert p.read_bytes() == good, "the counted repair is the rewrite that happened"
    await env.get_all(blocks)
    assert env.value("deepserve:kvstore_degraded_reads_total") == 1, "repaired: whole again"


async def test_a_target_down_degrades_the_blocks_with_a_data_shard_there(env: Env) -> None:
    blocks = make_chain(12, 6)
    await env.store.put(blocks)
    down = str(env.dirs[5])
    with_data_there = 0
    for b in blocks:
        placement = json.loads((await env.meta(b.hash))[b"targets"])
        with_data_there += placement.index(down) < env.store.codec.k
    take_down(env.dirs[5])
    assert await env.get_all(blocks) == [b.data for b in blocks]
    assert with_data_there > 0
    assert env.value("deepserve:kvstore_degraded_reads_total") == with_data_there
    assert env.value("deepserve:kvstore_repaired_shards_total", source="get") == 0, (
        "a target that is down is not damage: nothing rewritten"
    )


async def test_fsck_repairs_and_lost_blocks_are_counted(env: Env) -> None:
    blocks = make_chain(13, 3)
    await env.store.put(blocks)
    q = shard_path(env.dirs, await env.meta(blocks[0].hash), blocks[0].hash, 11)  # parity
    q.unlink()
    report = await fsck(env.store, repair=True, grace_s=3600)
    assert report.repaired_shards == 1
    assert env.value("deepserve:kvstore_repaired_shards_total", source="fsck") == 1
    assert env.value("deepserve:kvstore_degraded_reads_total") == 0
    meta = await env.meta(blocks[2].hash)
    for i in range(3):  # 9 of 12 left on healthy targets: the block is gone
        shard_path(env.dirs, meta, blocks[2].hash, i).unlink()
    assert len(await env.get_all(blocks)) == 2
    assert env.value("deepserve:kvstore_lost_blocks_total") == 1


async def test_evictions_by_capacity_ttl_and_unreachable(env: Env) -> None:
    store = env.store
    size = len(make_chain(14, 1)[0].data)
    store.retention = Retention(store.retention.ttls, capacity_bytes=5 * size)
    await store.put(make_chain(14, 4))
    env.clock.t += 10
    await store.put(make_chain(15, 3))  # 7 blocks > 5: the put evicts 2 tails
    assert (await store.stats())[0] == 5
    assert env.value("deepserve:kvstore_evictions_total", reason="capacity") == 2
    store.retention = Retention(store.retention.ttls)
    agent = make_chain(16, 2)
    await store.put([BlockPut(b.hash, b.parent, b.data, "t", "agent") for b in agent])
    env.clock.t += 3.1 * DAY_S
    await store.sweep()
    assert env.value("deepserve:kvstore_evictions_total", reason="ttl") == 2
    chain = make_chain(17, 3)
    await store.put(chain)
    await store.delete([chain[0].hash])  # deleted on request: not an eviction
    await store.sweep()
    assert env.value("deepserve:kvstore_evictions_total", reason="unreachable") == 2
    assert env.value("deepserve:kvstore_evictions_total", reason="ttl") == 2
    assert env.value("deepserve:kvstore_evictions_total", reason="capacity") == 2


async def test_scrape_reads_the_store_size_from_redis_and_each_targets_health(
    env: Env,
) -> None:
    registry = CollectorRegistry()
    health = TargetHealth(env.store.targets)
    stats = RedisStats(env.url)
    registry.register(StoreCollector(stats, health, 10**9))
    await env.store.put(make_chain(18, 4))
    blocks, size = await env.store.stats()
    assert blocks == 4
    assert registry.get_sample_value("deepserve:kvstore_stored_blocks") == blocks
    assert registry.get_sample_value("deepserve:kvstore_stored_bytes") == size
    await env.store.delete([make_chain(18, 4)[3].hash])
    assert registry.get_sample_value("deepserve:kvstore_stored_blocks") == 3, "read at scrape"
    await health.check()
    name = str(env.dirs[7])
    assert registry.get_sample_value("deepserve:kvstore_target_up", {"target": name}) == 1
    take_down(env.dirs[7])
    await health.check()
    assert registry.get_sample_value("deepserve:kvstore_target_up", {"target": name}) == 0
    up = [
        registry.get_sample_value("deepserve:kvstore_target_up", {"target": str(d)})
        for d in env.dirs
    ]
    assert sum(v == 1 for v in up) == 11
    stats.close()
    dead = RedisStats(f"redis://127.0.0.1:{free_port()}/0")
    registry2 = CollectorRegistry()
    registry2.register(StoreCollector(dead, health, 0))
    assert registry2.get_sample_value("deepserve:kvstore_stored_blocks") is None, (
        "Redis down: no value, not a stale one"
    )
    text = generate_latest(registry2).decode()
    assert f'deepserve:kvstore_target_up{{target="{name}"}} 0.0' in text
    dead.close()


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("deepserve:kvstore_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_the_service_exports_the_store_metrics_on_its_ops_port(
    tmp_path: Path, redis_port: int
) -> None:
    sync_redis.Redis(port=redis_port, db=0).flushdb()
    http_port = free_port()
    data = tmp_path / "data"
    proc, channel = start_service(
        data, redis_port, tmp_path / "kv.log", "--http-port", str(http_port)
    )
    try:
        blocks = make_chain(19, 3)
        stub = kvstore_pb2_grpc.KVStoreStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.Put(iter(to_msgs(blocks)), timeout=30)
        assert reply.stored == 3
        m = _scrape(http_port)
        assert m["deepserve:kvstore_stored_blocks"] == 3
        assert m["deepserve:kvstore_stored_bytes"] == sum(len(b.data) for b in blocks)
        up = {k: v for k, v in m.items() if k.startswith("deepserve:kvstore_target_up{")}
        assert len(up) == 12 and set(up.values()) == {1.0}, up
        assert m['deepserve:kvstore_evictions_total{reason="capacity"}'] == 0
        assert m["deepserve:kvstore_degraded_reads_total"] == 0
    finally:
        channel.close()
        stop(proc)
