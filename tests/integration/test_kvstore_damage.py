"""kvstore correctness under damage and races (issue 13, item 6), on real Redis and real
directories: shards that lie behind a valid CRC, damaged erasure-code headers, concurrent puts
of one block name with different bytes, the memory of a long Put, the cost of eviction at the
capacity limit, and orphan shards after Redis loses its data (the service as a process)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import random
import struct
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from deepserve.procs import free_port, start_redis, stop
from libs.kvstore.policy import Retention
from libs.proto.deepserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.ec import Codec
from services.kvstore.fsck import fsck
from services.kvstore.scripts import CHILDREN_KEY, LRU_KEY, STATS_KEY
from services.kvstore.store import BlockPut, BlockStore
from services.kvstore.targets import DirTarget, shard_key

from .test_kvstore_ec import Clock, make_chain, start_service, to_msgs

FRAGMENT_HEADER = 80  # liberasurecode's fragment header, after our 8-byte "DSS1" + CRC
SHARD_HEAD = 8


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield port
    finally:
        stop(proc)


def new_store(r: aioredis.Redis, dirs: list[Path], clock: Clock) -> BlockStore:
    store = BlockStore(r, [DirTarget(d) for d in dirs], Codec(), Retention(), clock)
    store.prepare()
    return store


@pytest.fixture
async def env(
    tmp_path: Path, redis_port: int
) -> AsyncIterator[tuple[BlockStore, list[Path], Clock]]:
    r = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/0")
    await r.flushdb()
    dirs = [tmp_path / f"ssd{i:02d}" for i in range(12)]
    clock = Clock()
    store = new_store(r, dirs, clock)
    try:
        yield store, dirs, clock
    finally:
        store.close()
        await r.aclose()


async def shard_file(store: BlockStore, h: bytes, i: int) -> Path:
    meta = await store.redis.hgetall(store.key(h))
    target = json.loads(meta[b"targets"])[i]
    return Path(target) / shard_key(h.hex(), i, meta[b"attempt"].decode())


def rewrite_behind_the_crc(p: Path, offset: int) -> bytes:
    """Flip a byte of the fragment at ``offset`` and recompute the shard's CRC: the damage only
    the block's SHA-256 (or pyeclib's header check) can see. Returns the original bytes."""
    good = p.read_bytes()
    frag = bytearray(good[SHARD_HEAD:])
    frag[offset] ^= 0x5A
    p.write_bytes(struct.pack("<4sI", b"DSS1", zlib.crc32(bytes(frag))) + bytes(frag))
    return good


async def get_all(store: BlockStore, blocks: list[BlockPut]) -> list[bytes]:
    return [data async for _, data in store.get([b.hash for b in blocks])]


async def test_a_wrong_shard_behind_a_valid_crc_is_outvoted_and_rewritten(env) -> None:
    store, _, _ = env
    blocks = make_chain(21, 3)
    await store.put(blocks)
    before = await store.stats()
    p = await shard_file(store, blocks[1].hash, 4)  # a data shard: every Get decodes it
    good = rewrite_behind_the_crc(p, FRAGMENT_HEADER + 1000)
    assert await get_all(store, blocks) == [b.data for b in blocks], "11 good shards remain"
    assert await store.stats() == before, "the block must not be deleted"
    assert p.read_bytes() == good, "the wrong shard is rewritten"

    q = await shard_file(store, blocks[2].hash, 11)  # parity: only fsck reads it
    good_q = rewrite_behind_the_crc(q, FRAGMENT_HEADER + 5)
    report = await fsck(store, grace_s=0)
    assert report.damaged_shards == [f"{blocks[2].hash.hex()}.11@{q.parent.parent}"]
    assert not report.lost_blocks and not report.clean
    report = await fsck(store, repair=True, grace_s=0)
    assert report.repaired_shards == 1 and report.clean and q.read_bytes() == good_q
    assert (await fsck(store, grace_s=0)).clean


async def test_a_damaged_fragment_header_is_one_damaged_shard_and_fsck_repairs_it(env) -> None:
    store, _, _ = env
    blocks = make_chain(22, 3)
    await store.put(blocks)
    p = await shard_file(store, blocks[0].hash, 2)
    good = rewrite_behind_the_crc(p, 20)  # inside pyeclib's header (its size fields)
    assert await get_all(store, blocks) == [b.data for b in blocks]
    assert p.read_bytes() == good, "the Get rewrote the shard"

    damaged = [await shard_file(store, blocks[i].hash, i + 3) for i in range(3)]
    originals = [rewrite_behind_the_crc(q, 8 + 7 * i) for i, q in enumerate(damaged)]
    report = await fsck(store, grace_s=0)  # used to crash in pyeclib's decode
    assert len(report.damaged_shards) == 3 and not report.lost_blocks and not report.clean
    report = await fsck(store, repair=True, grace_s=0)
    assert report.repaired_shards == 3 and report.clean
    assert [q.read_bytes() for q in damaged] == originals
    assert await get_all(store, blocks) == [b.data for b in blocks]


def variant(b: BlockPut, seed: int) -> BlockPut:
    """The same block name, other bytes (as a buggy or racing writer could send)."""
    data = bytearray(b.data)
    rng = random.Random(seed)
    for _ in range(64):
        data[len(data) - 1 - rng.randrange(len(data) // 2)] ^= 0xFF
    return BlockPut(b.hash, b.parent, bytes(data))


async def test_concurrent_puts_of_one_name_with_different_bytes_never_mix_shards(
    env, tmp_path: Path, redis_port: int
) -> None:
    store, dirs, clock = env
    other_redis = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/0")
    other = new_store(other_redis, dirs, clock)  # a second kvstore process on the same store
    try:
        firsts = [make_chain(1000 + i, 1)[0] for i in range(30)]  # 30 independent blocks
        pairs = [(b, variant(b, i)) for i, b in enumerate(firsts)]
        for a, b in pairs:
            ra, rb = await asyncio.gather(store.put([a]), other.put([b]))
            assert ra.stored + rb.stored == 1 and ra.skipped + rb.skipped == 1
        got = {h: data async for h, data in store.get([a.hash for a, _ in pairs])}
        assert len(got) == 30, "every block reads back"
        for a, b in pairs:
            assert got[a.hash] in (a.data, b.data), "the bytes of one put, never a mixture"
            stored = await store.redis.hget(store.key(a.hash), "checksum")
            assert hashlib.sha256(got[a.hash]).hexdigest().encode() == stored
        files = [f for d in dirs for f in d.rglob("*.*") if f.name[0] != "."]
        assert len(files) == 30 * 12, "the losers' shards are removed"
        assert (await fsck(store, grace_s=0)).clean
    finally:
        other.close()
        await other_redis.aclose()


async def test_a_put_of_120_blocks_holds_a_bounded_number_of_them(env) -> None:
    store, _, _ = env
    size = 64 * 1024

    async def firsts(seed: int, n: int) -> AsyncIterator[BlockPut]:
        for i in range(n):  # made as they are sent, as gRPC delivers them
            yield make_chain(seed + i, 1, size=size)[0]

    peaks = {}
    for n in (30, 120):
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            result = await store.put(firsts(1000 * n, n))
            peaks[n] = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert result.stored == n
    # Bounded in-flight: a few blocks (data, frame, shards: ~4x a block each) whatever the
    # stream's length, plus ~1 KB of metadata per block until the commit. Keeping every block
    # until the commit holds n x size: +5.9 MB from 30 to 120 blocks.
    assert peaks[120] < 20 * size, f"120 blocks peaked at {peaks[120] / size:.1f} blocks"
    assert peaks[120] - peaks[30] < 3 * size, f"memory grows with the stream: {peaks}"


async def fill(store: BlockStore, n: int, clock: Clock, size: int) -> None:
    """``n`` blocks' metadata (chains of 4), older than anything put later; no shards (their
    deletes are no-ops), so the store can be large and the test fast."""
    batch: list[bytes] = []
    args: list[object] = []
    for c in range(n // 4):
        parent = b""
        for i in range(4):
            h = hashlib.sha256(f"fill/{c}/{i}".encode()).digest()
            batch.append(h)
            t = clock.t - 1000 + c * 0.01
            args += [size, "", "chat", parent.hex(), t, json.dumps(store.target_names), "x", "f"]
            parent = h
        if len(batch) >= 400:
            await flush(store, batch, args)
    if batch:
        await flush(store, batch, args)


async def flush(store: BlockStore, batch: list[bytes], args: list[object]) -> None:
    keys = [store.key(h) for h in batch] + [STATS_KEY, LRU_KEY, CHILDREN_KEY]
    await store._commit(keys=keys, args=args)
    batch.clear(), args.clear()


async def redis_calls(r: aioredis.Redis) -> int:
    info = await r.info("commandstats")
    return sum(int(v["calls"]) for v in info.values())


async def test_eviction_at_capacity_costs_what_it_evicts_not_the_store_size(env) -> None:
    store, _, clock = env
    new = make_chain(31, 4, size=64)
    size = len(new[0].data)  # filled blocks as large as the new ones: 4 in, 4 out
    calls = {}
    for n in (500, 5000):
        await store.redis.flushdb()
        await fill(store, n, clock, size)
        store.retention = Retention(capacity_bytes=n * size)
        await store.redis.config_resetstat()
        assert (await store.put(new)).stored == 4
        calls[n] = await redis_calls(store.redis)
        assert await store.stats() == (n, n * size)
        assert await store.lookup([b.hash for b in new]) == 4, "the new chain stays"
        oldest = [hashlib.sha256(f"fill/0/{i}".encode()).digest() for i in range(4)]
        assert await store.lookup(oldest) == 0, "the least recently used chain went, tail first"
        second = [hashlib.sha256(f"fill/1/{i}".encode()).digest() for i in range(4)]
        assert await store.lookup(second) == 4
    # Redis commands (scripts' inner calls included) of one put at the limit: the same work for
    # a store 10x larger (the old sweep read every block's metadata: 10x the calls).
    assert calls[5000] <= calls[500] * 1.2 + 10, calls


def test_the_service_collects_orphan_shards_after_redis_loses_its_data(tmp_path: Path) -> None:
    redis_port = free_port()
    redis_proc = start_redis(redis_port, tmp_path / "redis")
    data = tmp_path / "data"
    proc, channel = start_service(
        data, redis_port, tmp_path / "kv.log", "--orphan-interval", "0.3", "--orphan-grace", "1"
    )
    try:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        lost, kept = make_chain(41, 3, size=4096), make_chain(42, 2, size=4096)
        assert stub.Put(iter(to_msgs(lost)), timeout=30).stored == 3
        redis.Redis(port=redis_port).flushall()  # Redis loses its data: 36 orphan shards

        def shards(blocks: list[BlockPut]) -> list[Path]:
            return [p for b in blocks for p in data.glob(f"targets/t*/*/{b.hash.hex()}.*")]

        assert len(shards(lost)) == 36
        assert stub.Put(iter(to_msgs(kept)), timeout=30).stored == 2
        deadline = time.monotonic() + 15
        while shards(lost) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not shards(lost), "orphan shards are collected after the grace period"
        time.sleep(1.5)  # past the grace: the live blocks' shards are older than it now
        assert len(shards(kept)) == 24, "shards that metadata names are never collected"
        got = stub.Get(kvstore_pb2.GetRequest(hashes=[b.hash for b in kept]), timeout=30)
        assert [b.data for b in got] == [b.data for b in kept]
    finally:
        channel.close()
        stop(proc)
        stop(redis_proc)
