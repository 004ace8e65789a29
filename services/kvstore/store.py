"""KV blocks erasure-coded over storage targets, their metadata in Redis: the kvstore's storage
logic, without gRPC.

A block is one engine-exported single-block KV frame, named by its chain digest
(``libs.common.hashchain``); the header is validated, the rest is opaque. Layout and rules:

* data: RS(10, 2) shards (``ec.py``), one per target, on 12 distinct targets chosen by
  rendezvous hashing (``libs.kvstore.policy.place``); shard ``i`` is ``<hex[:2]>/<hex>.<i>`` on
  its target, written by temp file + fsync + rename (directories) or one PUT (S3);
* metadata: ``HSET ds:kv:<hex> size tenant class parent last_access created targets checksum``,
  written only after every shard of every block of a ``Put`` is in place, by one Lua script
  (atomic: all blocks of a put become visible together, or none does), together with the
  block's entry in the LRU index ``ds:kv:_lru`` (score: last use). Metadata is what makes a
  block exist: a crash at any moment leaves at worst orphan shards (invisible; ``fsck``
  collects them), never a block that can be half read;
* counters ``blocks``/``bytes`` live in ``ds:kv:_stats``, updated by the same scripts that add
  or remove metadata, so concurrent puts of one block (several kvstore processes) count it once.

Reads use the 10 data shards when they are healthy and rebuild from any 10 when up to 2 are
down or fail their CRC; a rebuilt block is checked against its SHA-256 before it is returned.
No torch: frames are checked with ``libs.engine.kv.transfer.decode_frame`` (header only).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from libs.common.errors import InvalidArgument, Unavailable
from libs.common.hashchain import DIGEST_SIZE
from libs.engine.kv.transfer import KVFormatError, decode_frame
from libs.kvstore.policy import BlockInfo, Reclaim, Retention, place, plan_reclaim

from .ec import Codec
from .shards import BlockUnreadable, ShardIO, ShardScan
from .targets import Target, shard_key

log = logging.getLogger("kvstore.store")

KEY_PREFIX = "ds:kv:"
STATS_KEY = "ds:kv:_stats"  # not a 64-hex name, so it never collides with a block key
LRU_KEY = "ds:kv:_lru"
MAX_HASHES = 1 << 16  # per request: 8.4M tokens of 128-token blocks, far past any context
READ_AHEAD = 2  # blocks a Get reads ahead of the one it sends (2 x 9 MiB of memory per Get)

T = TypeVar("T")

# KEYS: block keys, STATS_KEY, LRU_KEY. ARGV: 7 per block (size, tenant, class, parent, now,
# targets, checksum).
_COMMIT = """
local n = #KEYS - 2
local stored, added = 0, 0
for i = 1, n do
  local b = (i - 1) * 7
  local hex = string.sub(KEYS[i], 7)
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSET', KEYS[i], 'last_access', ARGV[b + 5])
  else
    redis.call('HSET', KEYS[i], 'size', ARGV[b + 1], 'tenant', ARGV[b + 2], 'class', ARGV[b + 3],
               'parent', ARGV[b + 4], 'last_access', ARGV[b + 5], 'created', ARGV[b + 5],
               'targets', ARGV[b + 6], 'checksum', ARGV[b + 7])
    stored = stored + 1
    added = added + tonumber(ARGV[b + 1])
  end
  redis.call('ZADD', KEYS[n + 2], ARGV[b + 5], hex)
end
if stored > 0 then
  redis.call('HINCRBY', KEYS[n + 1], 'blocks', stored)
  redis.call('HINCRBY', KEYS[n + 1], 'bytes', added)
end
return stored
"""

# KEYS: block keys, STATS_KEY, LRU_KEY. Returns the targets of each block that existed ("" if not).
_DELETE = """
local n = #KEYS - 2
local deleted, removed, out = 0, 0, {}
for i = 1, n do
  local v = redis.call('HMGET', KEYS[i], 'size', 'targets')
  out[i] = ''
  if v[1] then
    redis.call('DEL', KEYS[i])
    deleted = deleted + 1
    removed = removed + tonumber(v[1])
    out[i] = v[2] or ''
  end
  redis.call('ZREM', KEYS[n + 2], string.sub(KEYS[i], 7))
end
if deleted > 0 then
  redis.call('HINCRBY', KEYS[n + 1], 'blocks', -deleted)
  redis.call('HINCRBY', KEYS[n + 1], 'bytes', -removed)
end
return out
"""

# KEYS: block keys, LRU_KEY. ARGV[1]: now. Refresh last use of the blocks that still exist.
_TOUCH = """
local n = #KEYS - 1
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSET', KEYS[i], 'last_access', ARGV[1])
    redis.call('ZADD', KEYS[n + 1], ARGV[1], string.sub(KEYS[i], 7))
  end
end
return 0
"""

# KEYS: a chain's block keys. ARGV: now, default TTL, then class/TTL pairs. Returns how many
# leading blocks exist and have not expired: the whole Lookup in one round trip.
_LOOKUP = """
local now, ttl = tonumber(ARGV[1]), {}
for j = 3, #ARGV, 2 do ttl[ARGV[j]] = tonumber(ARGV[j + 1]) end
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 'class', 'last_access')
  if not v[2] then return i - 1 end
  local t = ttl[v[1]] or tonumber(ARGV[2])
  if now - tonumber(v[2]) >= t then return i - 1 end
end
return #KEYS
"""


class InvalidBlock(InvalidArgument):
    """The caller sent something that is not a storable block (fix the request; nothing stored)."""


class StoreUnavailable(Unavailable, RuntimeError):
    """Redis does not answer; the store cannot say what it holds (retry later)."""


@dataclass(frozen=True)
class BlockPut:
    """One block to store: its chain digest, its parent's (b"" for a chain's first block)."""

    hash: bytes
    parent: bytes
    data: bytes
    tenant: str = ""
    traffic_class: str = "chat"


@dataclass(frozen=True)
class PutResult:
    stored: int
    skipped: int  # already present (or repeated within the same put)


@dataclass
class _PutState:
    seen: set[bytes] = field(default_factory=set)
    written: list[tuple[bytes, list[tuple[str, str]]]] = field(default_factory=list)  # uncommitted
    commit: list[tuple[BlockPut, list[str], str]] = field(default_factory=list)  # placement, sha256
    skipped: int = 0


def check_hash(h: bytes, what: str = "hash") -> None:
    if len(h) != DIGEST_SIZE:
        raise InvalidBlock(f"{what} must be a {DIGEST_SIZE}-byte chain digest, got {len(h)} bytes")


def check_hashes(hashes: Sequence[bytes]) -> None:
    if len(hashes) > MAX_HASHES:
        raise InvalidBlock(f"hashes holds {len(hashes)} digests; at most {MAX_HASHES} per request")
    for i, h in enumerate(hashes):
        check_hash(h, f"hashes[{i}]")


def validate_block(block: BlockPut) -> None:
    """Raise :class:`InvalidBlock` unless ``block.data`` is one full-block frame named
    ``block.hash``."""
    check_hash(block.hash)
    if block.parent:
        check_hash(block.parent, "parent_hash")
    try:
        header, _ = decode_frame(block.data)
    except KVFormatError as exc:
        raise InvalidBlock(f"data is not a KV frame: {exc}") from None
    if header.num_blocks != 1:
        raise InvalidBlock(f"data must hold exactly one block, the frame holds {header.num_blocks}")
    if header.chain_hash != block.hash.hex():
        raise InvalidBlock(
            f"hash {block.hash.hex()} does not match the frame's block digest {header.chain_hash}"
        )
    if header.num_tokens != (header.first_block + 1) * header.block_size:
        raise InvalidBlock("the frame covers a partial block; only full blocks are stored")
    if (header.first_block == 0) != (not block.parent):
        raise InvalidBlock(
            f"parent_hash must be empty exactly for a chain's first block "
            f"(this frame is block {header.first_block})"
        )


class BlockStore:
    """Blocks by chain digest. Safe for many concurrent calls on one event loop, and for several
    processes sharing the same targets and Redis (every cross-block decision is a Lua script).

    Contract: a block is visible (``lookup``/``get``) only once its metadata exists, and its
    metadata is written only after all its shards are complete on their targets.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        targets: list[Target],
        codec: Codec | None = None,
        retention: Retention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.codec = codec or Codec()
        self.target_names = [t.name for t in targets]
        if len(set(self.target_names)) < self.codec.n:
            raise ValueError(
                f"{self.codec.k}+{self.codec.m} erasure coding needs {self.codec.n} "
                f"distinct storage targets, {len(set(self.target_names))} given"
            )
        self.targets = targets
        self.io = ShardIO(targets, self.codec)
        self.retention = retention or Retention()
        self.clock = clock
        self._commit = redis.register_script(_COMMIT)
        self._delete = redis.register_script(_DELETE)
        self._touch_script = redis.register_script(_TOUCH)
        self._lookup = redis.register_script(_LOOKUP)
        self._ttl_args: list[Any] = [self.retention.ttl(self.retention.default_class)]
        for cls, ttl in self.retention.ttls.items():
            self._ttl_args += [cls, ttl]

    def prepare(self) -> None:
        """Create the targets (directories, buckets) that do not exist yet (blocking; once)."""
        for t in self.targets:
            t.prepare()

    def close(self) -> None:
        self.io.close()

    @staticmethod
    def key(h: bytes) -> str:
        return KEY_PREFIX + h.hex()

    async def _redis(self, op: Awaitable[T]) -> T:
        try:
            return await op
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(
                f"Redis does not answer ({type(exc).__name__}: {exc}); retry when it is back"
            ) from None

    # -- lookup --------------------------------------------------------------------------------
    async def present(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which of ``hashes`` have metadata: one pipelined Redis round trip."""
        if not hashes:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(self.key(h))
        found = await self._redis(pipe.execute())
        return [bool(x) for x in found]

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading hashes of a chain are stored and unexpired: metadata only, one Redis
        round trip (a Lua script) whatever the chain's length."""
        check_hashes(hashes)
        if not hashes:
            return 0
        keys = [self.key(h) for h in hashes]
        return int(await self._redis(self._lookup(keys=keys, args=[self.clock(), *self._ttl_args])))

    # -- put -----------------------------------------------------------------------------------
    async def put(self, blocks: AsyncIterator[BlockPut] | Sequence[BlockPut]) -> PutResult:
        """Store blocks; all of them become visible together at the end, or none does.

        Each block is validated as it arrives (:class:`InvalidBlock` aborts the whole put and
        removes the shards it wrote). Blocks already present are skipped (their last use is
        refreshed). A target that is down fails the put (``TargetDown``, retry later).
        """
        state = _PutState()
        try:
            if isinstance(blocks, Sequence):
                for block in blocks:
                    await self._put_one(block, state)
            else:
                async for block in blocks:
                    await self._put_one(block, state)
            stored = await self._commit_blocks(state.commit) if state.commit else 0
        except BaseException:
            await self._discard(state.written)
            raise
        total = len(state.commit) + state.skipped
        if stored and self.retention.capacity_bytes:
            _, used = await self.stats()
            if used > self.retention.capacity_bytes:
                await self.sweep()
        return PutResult(stored, total - stored)

    async def _put_one(self, block: BlockPut, state: _PutState) -> None:
        validate_block(block)
        if block.hash in state.seen:
            state.skipped += 1
            return
        state.seen.add(block.hash)
        if (await self.present([block.hash]))[0]:
            state.skipped += 1
            await self._touch([block.hash])
            return
        hx = block.hash.hex()
        placement = place(block.hash, self.target_names, self.codec.n)
        written = await asyncio.to_thread(self.io.write, hx, block.data, placement)
        state.written.append((block.hash, written))
        checksum = await asyncio.to_thread(lambda: hashlib.sha256(block.data).hexdigest())
        state.commit.append((block, placement, checksum))

    async def _commit_blocks(self, blocks: list[tuple[BlockPut, list[str], str]]) -> int:
        now = self.clock()
        keys = [self.key(b.hash) for b, _, _ in blocks] + [STATS_KEY, LRU_KEY]
        args: list[Any] = []
        for b, placement, checksum in blocks:
            args += [
                len(b.data),
                b.tenant,
                b.traffic_class,
                b.parent.hex(),
                now,
                json.dumps(placement),
                checksum,
            ]
        return int(await self._redis(self._commit(keys=keys, args=args)))

    async def _discard(self, written: list[tuple[bytes, list[tuple[str, str]]]]) -> None:
        """Remove shards of a failed put, unless another put has since made the block visible."""
        if not written:
            return
        try:
            visible = await self.present([h for h, _ in written])
        except StoreUnavailable:
            log.warning(
                "failed put: Redis is down, leaving %d blocks of orphan shards (fsck)", len(written)
            )
            return
        pairs = [p for (_, ps), v in zip(written, visible) if not v for p in ps]
        await asyncio.to_thread(self.io.remove, pairs)

    # -- get -----------------------------------------------------------------------------------
    async def get(self, hashes: Sequence[bytes]) -> AsyncIterator[tuple[bytes, bytes]]:
        """Yield (hash, frame) for the leading stored blocks, in order; stop at the first missing.

        Up to ``m`` shards may be down or damaged; damaged ones are rewritten on the way. A block
        that lost more than ``m`` shards on healthy targets is gone: its metadata is removed so
        ``lookup`` stops promising it, and the stream stops there. When targets are *down*,
        :class:`BlockUnreadable` (a :class:`StoreUnavailable`) is raised instead: nothing is
        deleted, and no wrong bytes are ever yielded.
        """
        check_hashes(hashes)
        leading = hashes[: await self.lookup(hashes)] if hashes else []
        if not leading:
            return
        await self._touch(leading)
        pipe = self.redis.pipeline(transaction=False)
        for h in leading:
            pipe.hmget(self.key(h), ["targets", "checksum"])
        metas = await self._redis(pipe.execute())
        blocks: list[tuple[bytes, list[str], str]] = []
        for h, (targets, checksum) in zip(leading, metas):
            if targets is None:  # deleted since the lookup
                break
            blocks.append((h, json.loads(targets), checksum.decode()))
        # Read ahead: block i+1's shards are read and decoded in a worker thread while block i
        # goes out, so disk waits overlap with CRC/decode/SHA-256 work and with the stream.
        reads = [self._read_task(h, p, c) for h, p, c in blocks[:READ_AHEAD]]
        try:
            for i, (h, placement, _) in enumerate(blocks):
                task = reads[i]
                if i + READ_AHEAD < len(blocks):
                    reads.append(self._read_task(*blocks[i + READ_AHEAD]))
                try:
                    data, scan = await task
                except BlockUnreadable as exc:
                    if not exc.damaged:
                        raise StoreUnavailable(str(exc)) from None
                    log.error("%s; dropping it", exc)
                    await self.delete([h])
                    return
                if not _frame_named(data, h):
                    log.error("block %s decodes to a frame of another name; dropping it", h.hex())
                    await self.delete([h])
                    return
                if scan.bad:
                    try:
                        await asyncio.to_thread(self.io.repair, h.hex(), placement, scan)
                    except (OSError, RuntimeError) as exc:
                        log.warning(
                            "block %s: repair failed (%s); fsck --repair retries", h.hex(), exc
                        )
                yield h, data
        finally:
            for t in reads:
                t.cancel()

    def _read_task(
        self, h: bytes, placement: list[str], checksum: str
    ) -> asyncio.Future[tuple[bytes, ShardScan]]:
        task = asyncio.ensure_future(asyncio.to_thread(self.io.read, h.hex(), placement, checksum))
        task.add_done_callback(_retrieve)  # a read-ahead nobody awaits must not warn
        return task

    async def _touch(self, hashes: Sequence[bytes]) -> None:
        """Refresh last use; a block deleted meanwhile is not brought back as a bare key."""
        keys = [self.key(h) for h in hashes] + [LRU_KEY]
        await self._redis(self._touch_script(keys=keys, args=[self.clock()]))

    # -- delete / stats / retention --------------------------------------------------------------
    async def delete(self, hashes: Sequence[bytes]) -> int:
        """Remove blocks: metadata first (invisible at once), then shards.

        Returns how many existed."""
        check_hashes(hashes)
        unique = list(dict.fromkeys(hashes))
        if not unique:
            return 0
        keys = [self.key(h) for h in unique] + [STATS_KEY, LRU_KEY]
        placements = await self._redis(self._delete(keys=keys, args=[]))
        pairs = []
        for h, targets in zip(unique, placements):
            if targets:
                pairs += [(t, shard_key(h.hex(), i)) for i, t in enumerate(json.loads(targets))]
        if pairs:
            await asyncio.to_thread(self.io.remove, pairs)
        return sum(1 for t in placements if t)

    async def stats(self) -> tuple[int, int]:
        """(blocks, bytes) stored; bytes are block bytes (shards take (k+m)/k of that on disk)."""
        blocks, size = await self._redis(self.redis.hmget(STATS_KEY, ["blocks", "bytes"]))
        return int(blocks or 0), int(size or 0)

    async def block_hexes(self) -> list[str]:
        """Hex digests of every stored block (the LRU index)."""
        members: list[Any] = list(await self._redis(self.redis.zrange(LRU_KEY, 0, -1)))
        return [bytes(m).decode() for m in members]

    async def blocks(self) -> list[BlockInfo]:
        """Every stored block, as retention sees it (two Redis round trips)."""
        hexes = await self.block_hexes()
        pipe = self.redis.pipeline(transaction=False)
        for hx in hexes:
            pipe.hmget(KEY_PREFIX + hx, ["parent", "size", "class", "last_access"])
        out = []
        for hx, (parent, size, cls, last) in zip(hexes, await self._redis(pipe.execute())):
            if size is not None:
                out.append(
                    BlockInfo(
                        hx,
                        (parent or b"").decode(),
                        int(size),
                        (cls or b"chat").decode(),
                        float(last or 0),
                    )
                )
        return out

    async def sweep(self) -> Reclaim:
        """Apply retention now: remove expired, unreachable and (over capacity) LRU-tail blocks."""
        plan = plan_reclaim(await self.blocks(), self.retention, self.clock())
        doomed = [bytes.fromhex(h) for h in plan.all]
        for i in range(0, len(doomed), 1024):
            await self.delete(doomed[i : i + 1024])
        if doomed:
            log.info(
                "retention: %d expired, %d unreachable, %d evicted",
                len(plan.expired),
                len(plan.unreachable),
                len(plan.evicted),
            )
        return plan

    async def ping(self) -> None:
        await self._redis(self.redis.ping())


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()


def _frame_named(data: bytes, h: bytes) -> bool:
    try:
        header, _ = decode_frame(data)
    except KVFormatError:
        return False
    return header.chain_hash == h.hex()
