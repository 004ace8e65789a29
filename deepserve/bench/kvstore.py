"""``deepserve bench kvstore``: the erasure-coded store against plain files on the same disk.

One run, one scratch directory, the same bytes: ``--blocks`` synthetic engine frames of
``--block-bytes`` each (default 9 MiB, one DeepSeek-V3 128-token block) are

* written and read as plain sequential files, one per block, fsynced (``raw_*``: the disk's
  own limit for this access pattern);
* put into and got from the kvstore (RS(10,2) shards on 12 directories of that disk, metadata
  in a redis-server started on a free port), then got again with 2 of the 12 targets down;
* put into and got from 12 SeaweedFS buckets through boto3 (``s3_*``; a local ``weed`` on free
  ports, so this measures the S3 path, not a network).

Before every read phase the files' pages are dropped from the page cache (fsync, then
``posix_fadvise(DONTNEED)``, file by file: nothing system-wide), so reads come from the disk.
The store runs in this process (no gRPC hop): the figures are the storage path itself.
Lookup latency is one ``Lookup`` of a 2,048-hash chain whose every block is present (the
worst case: the script walks the whole chain), ``--lookups`` times.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from deepserve.procs import free_port, start_redis, start_seaweedfs, stop
from libs.engine.kv.transfer import KVHeader, encode_frame
from libs.kvstore.policy import Retention
from services.kvstore.ec import Codec, tune_allocator
from services.kvstore.scripts import LRU_KEY
from services.kvstore.store import BlockPut, BlockStore
from services.kvstore.targets import MARKER, DirTarget, open_targets

PUT_BATCH = 4  # blocks per Put, as prefill writes a request's new blocks


def make_blocks(n: int, size: int, seed: int) -> list[BlockPut]:
    out, parent = [], b""
    payload = os.urandom(size)
    for i in range(n):
        h = hashlib.sha256(parent + f"{seed}/{i}".encode()).digest()
        header = KVHeader("bench", "layout", 128, "bf16", size, (i + 1) * 128, i, (h.hex(),))
        # Same random bytes per block, but the first 8 differ: nothing is deduplicated anyway.
        out.append(BlockPut(h, parent, encode_frame(header, i.to_bytes(8, "little") + payload[8:])))
        parent = h
    return out


def drop_cache(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_phase(blocks: list[BlockPut], root: Path) -> tuple[float, float]:
    root.mkdir(parents=True)
    total = sum(len(b.data) for b in blocks)
    t0 = time.perf_counter()
    for i, b in enumerate(blocks):
        with open(root / f"{i:05d}", "wb") as f:
            f.write(b.data)
            f.flush()
            os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    drop_cache(root)
    t0 = time.perf_counter()
    got = sum(len((root / f"{i:05d}").read_bytes()) for i in range(len(blocks)))
    read_s = time.perf_counter() - t0
    assert got == total
    return total / write_s / 1e9, total / read_s / 1e9


async def store_phase(store: BlockStore, blocks: list[BlockPut]) -> tuple[float, float]:
    total = sum(len(b.data) for b in blocks)
    t0 = time.perf_counter()
    for i in range(0, len(blocks), PUT_BATCH):
        await store.put(blocks[i : i + PUT_BATCH])
    put_s = time.perf_counter() - t0
    return total / put_s / 1e9, await get_gbps(store, blocks)


async def get_gbps(store: BlockStore, blocks: list[BlockPut]) -> float:
    for t in store.targets:
        if isinstance(t, DirTarget) and t.root.exists():
            drop_cache(t.root)
    # Each block is compared with what was put as it arrives, then dropped (a memcmp, ~1 ms per
    # 9 MiB, inside the timing): keeping all of them, as a server streaming them never does,
    # put every block on never-touched memory, ~2,300 page faults (2-5 ms of kernel time) each.
    n, got = 0, 0
    t0 = time.perf_counter()
    for i in range(0, len(blocks), PUT_BATCH):
        async for h, data in store.get([b.hash for b in blocks[i : i + PUT_BATCH]]):
            if n >= len(blocks) or h != blocks[n].hash or data != blocks[n].data:
                raise RuntimeError(f"get returned other bytes than were put (block {n})")
            n, got = n + 1, got + len(data)
    seconds = time.perf_counter() - t0
    if n != len(blocks):
        raise RuntimeError(f"the gets stopped after {n} of {len(blocks)} blocks")
    return got / seconds / 1e9


async def lookup_phase(store: BlockStore, count: int, chain: int) -> tuple[float, float]:
    """Metadata and LRU index entries for a ``chain``-long chain, as a Put's commit writes them
    (no shards: Lookup never reads them), then timed Lookups."""
    hashes, parent = [], b""
    pipe = store.redis.pipeline(transaction=False)
    now = store.clock()
    for i in range(chain):
        h = hashlib.sha256(parent + f"lookup/{i}".encode()).digest()
        pipe.hset(
            store.key(h),
            mapping={"size": 1, "class": "chat", "parent": parent.hex(), "last_access": now},
        )
        pipe.zadd(LRU_KEY, {h.hex(): now})
        hashes.append(h)
        parent = h
    await pipe.execute()
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        n = await store.lookup(hashes)
        times.append((time.perf_counter() - t0) * 1e3)
        assert n == chain
    await store.redis.delete(*[store.key(h) for h in hashes])
    await store.redis.zrem(LRU_KEY, *[h.hex() for h in hashes])
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]


def encode_gbps(codec: Codec, blocks: list[BlockPut]) -> float:
    t0 = time.perf_counter()
    for b in blocks[:8]:
        codec.encode(b.data)
    return sum(len(b.data) for b in blocks[:8]) / (time.perf_counter() - t0) / 1e9


async def run(args: argparse.Namespace, scratch: Path, redis_port: int) -> dict[str, Any]:
    blocks = make_blocks(args.blocks, args.block_bytes, 1)
    raw_w, raw_r = raw_phase(blocks, scratch / "raw")
    shutil.rmtree(scratch / "raw")
    r = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/0")
    codec = Codec()
    dirs = [scratch / "targets" / f"t{i:02d}" for i in range(12)]
    store = BlockStore(r, [DirTarget(d) for d in dirs], codec, Retention())
    store.prepare()
    res: dict[str, Any] = {"ec_backend": codec.backend, "encode_gbps": encode_gbps(codec, blocks)}
    res["put_gbps"], res["get_gbps"] = await store_phase(store, blocks)
    for d in dirs[:2]:  # two targets down: every block that has a data shard there rebuilds
        (d / MARKER).rename(d / (MARKER + ".down"))
    res["degraded_get_gbps"] = await get_gbps(store, blocks)
    for d in dirs[:2]:
        (d / (MARKER + ".down")).rename(d / MARKER)
    res["lookup_p50_ms"], res["lookup_p99_ms"] = await lookup_phase(store, args.lookups, args.chain)
    store.close()
    shutil.rmtree(scratch / "targets")
    if args.s3_blocks:
        await r.flushdb()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "deepserve-bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "deepserve-bench")
        weed, endpoint = start_seaweedfs(scratch / "weed", scratch / "weed.log")
        try:
            s3 = BlockStore(
                r, open_targets([f"s3://bench-{i:02d}" for i in range(12)], endpoint), codec
            )
            await asyncio.to_thread(s3.prepare)
            res["s3_put_gbps"], res["s3_get_gbps"] = await store_phase(s3, blocks[: args.s3_blocks])
            s3.close()
        finally:
            stop(weed, timeout=3)
    await r.flushdb()
    await r.aclose()
    res["raw_write_gbps"], res["raw_read_gbps"] = raw_w, raw_r
    res["get_of_raw_read"] = res["get_gbps"] / raw_r
    return res


def main(args: argparse.Namespace) -> int:
    tune_allocator()  # as the service does at startup
    scratch = Path(tempfile.mkdtemp(prefix="ds-bench-kv-", dir=args.dir or None))
    redis_port = free_port()
    redis_proc = start_redis(redis_port, scratch / "redis")
    try:
        res = asyncio.run(run(args, scratch, redis_port))
    finally:
        stop(redis_proc)
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "bench": "kvstore",
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "blocks": args.blocks,
        "block_bytes": args.block_bytes,
        "s3_blocks": args.s3_blocks,
        "lookup_chain": args.chain,
        "lookups": args.lookups,
        **res,
    }
    for k, v in result.items():
        print(f"{k:>18}: {v:.3f}" if isinstance(v, float) else f"{k:>18}: {v}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
