"""Erasure-coded kvstore on real Redis, real directories and a real S3 (SeaweedFS): targets going
down, flipped bytes, crashes in the middle of puts, retention over simulated days, and two
kvstore processes sharing one store. Blocks are synthetic engine frames (no torch needed)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from deepserve.procs import free_port, start_redis, start_seaweedfs, stop, wait_port
from libs.engine.kv.transfer import KVHeader, encode_frame
from libs.kvstore.policy import DAY_S, Retention
from libs.proto.deepserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.ec import Codec
from services.kvstore.fsck import fsck
from services.kvstore.store import BlockPut, BlockStore, StoreUnavailable
from services.kvstore.targets import DirTarget, open_targets, shard_key

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 64 * 1024 + 7  # odd on purpose: shards need padding


def make_chain(seed: int, n: int, size: int = BLOCK_BYTES) -> list[BlockPut]:
    """n consecutive full blocks of one chain, as the engine exports them (header + bytes)."""
    rng = random.Random(seed)
    out, parent = [], b""
    for i in range(n):
        h = hashlib.sha256(parent + f"{seed}/{i}".encode()).digest()
        header = KVHeader("synthetic", "layout", 128, "bf16", size, (i + 1) * 128, i, (h.hex(),))
        out.append(BlockPut(h, parent, encode_frame(header, rng.randbytes(size))))
        parent = h
    return out


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield port
    finally:
        stop(proc)


@pytest.fixture
async def env(
    tmp_path: Path, redis_port: int
) -> AsyncIterator[tuple[BlockStore, list[Path], Clock]]:
    db = int(hashlib.sha256(str(tmp_path).encode()).hexdigest(), 16) % 15 + 1
    r = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/{db}")
    await r.flushdb()
    dirs = [tmp_path / f"ssd{i:02d}" for i in range(12)]
    clock = Clock()
    store = BlockStore(
        r,
        [DirTarget(d) for d in dirs],
        Codec(),
        Retention({"chat": 7 * DAY_S, "agent": 3 * DAY_S}),
        clock,
    )
    store.prepare()
    try:
        yield store, dirs, clock
    finally:
        store.close()
        await r.aclose()


async def get_all(store: BlockStore, blocks: list[BlockPut]) -> list[bytes]:
    return [data async for _, data in store.get([b.hash for b in blocks])]


def take_down(d: Path) -> Path:
    """A target disappears (disk pulled, server gone): the directory moves away."""
    gone = d.with_name(d.name + ".gone")
    d.rename(gone)
    return gone


def shard_path(dirs: list[Path], store_meta: dict[bytes, bytes], h: bytes, i: int) -> Path:
    target = json.loads(store_meta[b"targets"])[i]
    return Path(target) / shard_key(h.hex(), i, store_meta[b"attempt"].decode())


async def test_two_targets_down_every_block_reads_three_down_is_a_clear_error(env) -> None:
    store, dirs, _ = env
    blocks = make_chain(1, 6)
    assert (await store.put(blocks)).stored == 6
    want = [b.data for b in blocks]
    gone = [take_down(dirs[3]), take_down(dirs[8])]
    assert await get_all(store, blocks) == want, "2 of 12 targets down: every block readable"
    gone.append(take_down(dirs[0]))
    with pytest.raises(StoreUnavailable, match=r"only 9 of 12 shards readable.*targets down"):
        await get_all(store, blocks)
    assert await store.lookup([b.hash for b in blocks]) == 6, "targets down: nothing is deleted"
    for g in gone:
        g.rename(g.with_name(g.name.removesuffix(".gone")))
    assert await get_all(store, blocks) == want


async def test_flipped_byte_is_detected_repaired_and_fsck_finds_the_rest(env) -> None:
    store, dirs, _ = env
    blocks = make_chain(2, 3)
    await store.put(blocks)
    meta = await store.redis.hgetall(store.key(blocks[1].hash))
    p = shard_path(dirs, meta, blocks[1].hash, 2)  # a data shard
    good = p.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 3] ^= 0x10
    p.write_bytes(bytes(bad))
    assert await get_all(store, blocks) == [b.data for b in blocks], "never wrong bytes"
    assert p.read_bytes() == good, "the read rewrote the damaged shard"

    meta2 = await store.redis.hgetall(store.key(blocks[2].hash))
    q = shard_path(dirs, meta2, blocks[2].hash, 11)  # a parity shard: reads never touch it
    q.write_bytes(q.read_bytes()[:-1] + bytes([q.read_bytes()[-1] ^ 1]))
    meta0 = await store.redis.hgetall(store.key(blocks[0].hash))
    shard_path(dirs, meta0, blocks[0].hash, 5).unlink()
    report = await fsck(store, repair=False, grace_s=0)
    assert len(report.damaged_shards) == 2 and not report.clean
    report = await fsck(store, repair=True, grace_s=0)
    assert report.repaired_shards == 2 and report.clean
    assert (await fsck(store, grace_s=0)).clean
    take_down(dirs[0]), take_down(dirs[1])  # repaired parity now carries the block
    assert await get_all(store, blocks) == [b.data for b in blocks]


async def test_fsck_removes_orphans_and_lost_blocks(env) -> None:
    store, dirs, _ = env
    blocks = make_chain(3, 3)
    await store.put(blocks[:2])
    placement = [str(d) for d in dirs]
    await asyncio.to_thread(
        store.io.write, blocks[2].hash.hex(), blocks[2].data, placement, "crashed"
    )
    (dirs[4] / "ab").mkdir(exist_ok=True)
    (dirs[4] / "ab" / ".x.tmp").write_bytes(b"half a shard")  # crash inside a shard write
    meta = await store.redis.hgetall(store.key(blocks[1].hash))
    for i in range(3):
        shard_path(dirs, meta, blocks[1].hash, i).unlink()
    report = await fsck(store, grace_s=0)
    assert len(report.orphans) == 13 and report.lost_blocks == [blocks[1].hash.hex()]
    assert await store.lookup([b.hash for b in blocks]) == 2, (
        "fsck without --repair changes nothing"
    )
    report = await fsck(store, repair=True, grace_s=0)
    assert report.clean and report.removed_orphans == 13
    assert await store.lookup([b.hash for b in blocks]) == 1
    assert (await fsck(store, grace_s=0)).clean
    assert (await fsck(store, grace_s=3600)).clean


async def test_ttl_by_traffic_class_and_unreachable_tails(env) -> None:
    store, _, clock = env
    chat, agent = make_chain(4, 3), make_chain(5, 3)
    await store.put(chat)
    await store.put([BlockPut(b.hash, b.parent, b.data, "t", "agent") for b in agent])
    clock.t += 2.9 * DAY_S
    assert await get_all(store, chat[:1]) == [chat[0].data]  # only the prefix is used again
    clock.t += 0.2 * DAY_S  # agent: 3.1 days since last use
    assert await store.lookup([b.hash for b in agent]) == 0, "an expired block is not promised"
    plan = await store.sweep()
    assert set(plan.expired) == {b.hash.hex() for b in agent}
    clock.t += 4.0 * DAY_S  # chat tail: 7.1 days; chat prefix: 4.2 days
    plan = await store.sweep()
    assert set(plan.expired) == {b.hash.hex() for b in chat[1:]}
    assert await store.lookup([b.hash for b in chat]) == 1
    await store.put(chat[1:])
    await store.delete([chat[0].hash])  # a parent gone: its tail is unreachable and reclaimed
    plan = await store.sweep()
    assert set(plan.unreachable) == {b.hash.hex() for b in chat[1:]}
    assert await store.stats() == (0, 0)
    assert not [p for p in (Path(t.name) for t in store.targets) for p in p.rglob("*.0*")]


async def test_capacity_evicts_least_recently_used_tails_first(env) -> None:
    store, _, clock = env
    size = len(make_chain(6, 1)[0].data)
    store.retention = Retention(capacity_bytes=7 * size)
    old, new = make_chain(6, 4), make_chain(7, 4)
    await store.put(old)
    clock.t += 10
    await store.put(new)  # 8 blocks > 7: the put itself sweeps

    def hashes(bs: list[BlockPut]) -> list[bytes]:
        return [b.hash for b in bs]

    assert await store.lookup(hashes(old)) == 3, "the old chain lost its tail, not its prefix"
    assert await store.lookup(hashes(new)) == 4
    assert (await store.stats())[0] == 7


async def commands(store: BlockStore) -> dict[str, int]:
    """Calls per command on the server so far (INFO commandstats)."""
    info = await store.redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


async def test_lookup_is_one_round_trip_for_2048_hashes(env) -> None:
    store, _, _ = env
    blocks = make_chain(8, 4, size=256)
    await store.put(blocks)
    chain = [b.hash for b in blocks] + [
        hashlib.sha256(str(i).encode()).digest() for i in range(2044)
    ]
    before = await commands(store)
    assert await store.lookup(chain) == 4
    after = await commands(store)
    ran = {c: n - before.get(c, 0) for c, n in after.items() if n != before.get(c, 0)}
    assert ran == {"zmscore": 1, "info": 1}, ran  # the INFO above is the only other command


async def test_lookup_past_a_long_prefix_and_is_not_a_use(env) -> None:
    """Lookup asks about the whole chain at once: a gap deep in it still stops the count, and a
    Lookup leaves last use (TTL, LRU) alone; only put and get refresh it."""
    store, _, clock = env
    from services.kvstore.scripts import LRU_KEY

    blocks = make_chain(9, 2, size=256)
    await store.put(blocks)
    extra = [hashlib.sha256(b"chunk/%d" % i).digest() for i in range(600)]
    pipe = store.redis.pipeline(transaction=False)
    for h in extra:
        pipe.hset(store.key(h), mapping={"size": 1, "class": "chat", "last_access": clock.t})
        pipe.zadd(LRU_KEY, {h.hex(): clock.t})
    await pipe.execute()
    chain = [b.hash for b in blocks] + extra
    assert await store.lookup(chain) == len(chain)
    gap = 263
    assert await store.lookup(chain[:gap] + [bytes(32)] + chain[gap:]) == gap
    assert await store.lookup(chain + chain[:3]) == len(chain) + 3, "a repeated hash is counted"
    before = await store.redis.hget(store.key(blocks[0].hash), "last_access")
    clock.t += 100
    assert await store.lookup(chain[:2]) == 2
    assert await store.redis.hget(store.key(blocks[0].hash), "last_access") == before
    assert await get_all(store, blocks) == [b.data for b in blocks]
    assert float(await store.redis.hget(store.key(blocks[0].hash), "last_access")) == clock.t


async def test_lookup_checks_old_blocks_by_their_own_class(env) -> None:
    """Blocks older than the shortest TTL (agent: 3 days) are decided by their own class: a
    chat block 4 days old still counts, an agent block that old stops the count, and so does a
    block whose metadata lost its class (or went away) while its index entry stayed."""
    store, _, clock = env
    chain = make_chain(10, 5, size=256)
    classes = ["chat", "chat", "agent", "chat", "chat"]
    for b, cls in zip(chain, classes):
        await store.put([BlockPut(b.hash, b.parent, b.data, "t", cls)])
    hashes = [b.hash for b in chain]
    clock.t += 2 * DAY_S
    assert await store.lookup(hashes) == 5, "nothing is older than the shortest TTL yet"
    clock.t += 2 * DAY_S  # 4 days: past agent's 3, within chat's 7
    assert await store.lookup(hashes) == 2, "the agent block expired: the count stops there"
    assert await store.lookup(hashes[:2]) == 2
    assert await store.lookup(hashes[3:]) == 2, "old chat blocks after it still count"
    await store.redis.hdel(store.key(hashes[4]), "class")
    assert await store.lookup(hashes[3:]) == 1, "a block without a class is not promised"
    clock.t += 3.5 * DAY_S  # 7.5 days: every chat block expired too
    assert await store.lookup(hashes) == 0


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "deepserve-test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "deepserve-test")
    tmp = tmp_path_factory.mktemp("seaweed")
    proc, endpoint = start_seaweedfs(tmp / "data", tmp / "weed.log")
    try:
        yield endpoint
    finally:
        stop(proc, timeout=3)


async def test_s3_targets_on_seaweedfs(seaweed: str, redis_port: int) -> None:
    r = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/0")
    await r.flushdb()
    targets = open_targets([f"s3://kv-ec-{i:02d}" for i in range(12)], seaweed)
    store = BlockStore(r, targets)
    try:
        await asyncio.to_thread(store.prepare)
        blocks = make_chain(9, 3)
        assert (await store.put(blocks)).stored == 3
        assert await get_all(store, blocks) == [b.data for b in blocks]
        client, bucket = targets[0].client, targets[0].bucket  # type: ignore[attr-defined]
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert len(keys) == 3
        client.delete_object(Bucket=bucket, Key=keys[0])  # a lost object
        assert await get_all(store, blocks) == [b.data for b in blocks]
        assert (await fsck(store, repair=True, grace_s=0)).clean  # rebuilt by the read or here
        assert (await fsck(store, grace_s=0)).clean
        assert await store.delete([b.hash for b in blocks]) == 3
        assert not client.list_objects_v2(Bucket=bucket).get("Contents")
    finally:
        store.close()
        await r.aclose()


# -- the service as processes ------------------------------------------------------------------
def start_service(
    data_dir: Path, redis_port: int, log: Path, *extra: str
) -> tuple[subprocess.Popen[bytes], grpc.Channel]:
    port = free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.kvstore",
                "--grpc-port",
                str(port),
                "--redis-url",
                f"redis://127.0.0.1:{redis_port}/0",
                "--data-dir",
                str(data_dir),
                "--drain-seconds",
                "1",
                *extra,
            ],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_port("127.0.0.1", port, 30, proc)
    opts = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ]
    return proc, grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)


def to_msgs(blocks: list[BlockPut]) -> list[kvstore_pb2.PutBlock]:
    return [
        kvstore_pb2.PutBlock(
            hash=b.hash,
            parent_hash=b.parent,
            data=b.data,
            traffic_class=common_pb2.TRAFFIC_CLASS_CHAT,
        )
        for b in blocks
    ]


def fsck_cli(data_dir: Path, redis_port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "deepserve.cli",
            "kvstore",
            "fsck",
            "--redis-url",
            f"redis://127.0.0.1:{redis_port}/0",
            "--data-dir",
            str(data_dir),
            "--grace",
            "0",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_kill_9_during_puts_leaves_whole_blocks_or_nothing(tmp_path: Path) -> None:
    redis_port = free_port()
    redis_proc = start_redis(redis_port, tmp_path / "redis")
    data = tmp_path / "data"
    rounds = [[make_chain(100 * r + g, 4, size=256 * 1024) for g in range(30)] for r in range(3)]
    groups = [g for r in rounds for g in r]
    rng = random.Random(7)
    try:
        for todo in rounds:  # a fresh stream each round, killed part way
            proc, channel = start_service(data, redis_port, tmp_path / "kv.log")
            stub = kvstore_pb2_grpc.KVStoreStub(channel)

            # Killed once a random number of its puts have returned, with the rest still to
            # stream (a timed kill can come after the whole round on a fast machine).
            target, reached = rng.randint(3, 20), threading.Event()

            def stream(
                stub: kvstore_pb2_grpc.KVStoreStub = stub,
                todo: list[list[BlockPut]] = todo,
                target: int = target,
                reached: threading.Event = reached,
            ) -> None:
                for i, g in enumerate(todo, 1):
                    try:
                        stub.Put(iter(to_msgs(g)), timeout=10)
                    except grpc.RpcError:
                        return
                    if i == target:
                        reached.set()

            t = threading.Thread(target=stream)
            t.start()
            assert reached.wait(30), "the kvstore took none of a round's first puts"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            t.join(20)
            channel.close()
        proc, channel = start_service(data, redis_port, tmp_path / "kv.log")
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        visible = 0
        for g in groups:
            n = stub.Lookup(
                kvstore_pb2.LookupRequest(hashes=[b.hash for b in g]), timeout=10
            ).num_present
            assert n in (0, len(g)), "a put's blocks become visible together or not at all"
            if n:
                visible += 1
                got = [b.data for b in stub.Get(kvstore_pb2.GetRequest(hashes=[b.hash for b in g]))]
                assert got == [b.data for b in g], "a visible block reads back exactly as put"
        assert 0 < visible < len(groups), "the kills landed part way through the streams"
        stop(proc)
        channel.close()
        repaired = fsck_cli(data, redis_port, "--repair", "--json")
        assert repaired.returncode == 0, repaired.stdout + repaired.stderr
        report = json.loads(repaired.stdout)
        assert not report["lost_blocks"] and not report["damaged_shards"], report
        clean = fsck_cli(data, redis_port, "--json")
        assert clean.returncode == 0 and json.loads(clean.stdout)["clean"], clean.stdout
        assert json.loads(clean.stdout)["blocks"] == 4 * visible
    finally:
        stop(redis_proc)


def test_two_processes_serve_one_store(tmp_path: Path) -> None:
    redis_port = free_port()
    redis_proc = start_redis(redis_port, tmp_path / "redis")
    a, ca = start_service(tmp_path / "data", redis_port, tmp_path / "a.log")
    b, cb = start_service(tmp_path / "data", redis_port, tmp_path / "b.log")
    try:
        sa, sb = kvstore_pb2_grpc.KVStoreStub(ca), kvstore_pb2_grpc.KVStoreStub(cb)
        blocks = make_chain(11, 3)
        hashes = [x.hash for x in blocks]
        assert sa.Put(iter(to_msgs(blocks)), timeout=30).stored == 3
        assert sb.Put(iter(to_msgs(blocks)), timeout=30).skipped == 3
        assert [x.data for x in sb.Get(kvstore_pb2.GetRequest(hashes=hashes))] == [
            x.data for x in blocks
        ]
        assert sb.Delete(kvstore_pb2.DeleteRequest(hashes=hashes[2:]), timeout=10).deleted == 1
        assert sa.Lookup(kvstore_pb2.LookupRequest(hashes=hashes), timeout=10).num_present == 2
        assert sa.Stats(kvstore_pb2.StatsRequest(), timeout=10).blocks == 2
    finally:
        ca.close(), cb.close()
        stop(a), stop(b), stop(redis_proc)
