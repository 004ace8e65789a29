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

from . import index, scripts
from .ec import Codec
from .metrics import StoreMetrics
from .scripts import ANY_ATTEMPT, CHILDREN_KEY, KEY_PREFIX, LRU_KEY, STATS_KEY
from .shards import BlockUnreadable, ShardIO
from .targets import Target, new_attempt, shard_key

log = logging.getLogger("kvstore.store")

MAX_HASHES = 1 << 16  # per request: 8.4M tokens of 128-token blocks, far past any context
READ_AHEAD = 2  # blocks a Get reads ahead of the one it sends (2 x 9 MiB of memory per Get)
# Blocks of one Put being encoded and written at once: a Put holds at most this many blocks
# (plus the one gRPC is receiving), whatever its length -- 2 x 9 MiB for DeepSeek-V3 blocks.
PUT_IN_FLIGHT = 2
EVICT_BATCH = 1024  # blocks one eviction script removes before the shards are deleted

T = TypeVar("T")


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


@dataclass(frozen=True)
class _Written:
    """A block whose shards this put attempt wrote: everything the commit needs, not its bytes
    (a Put's memory must not grow with its length)."""

    hash: bytes
    parent: bytes
    size: int
    tenant: str
    traffic_class: str
    placement: list[str]  # the store's own target-name strings: no copy per block
    checksum: str

    def shards(self, attempt: str) -> list[tuple[str, str]]:
        hx = self.hash.hex()
        return [(t, shard_key(hx, i, attempt)) for i, t in enumerate(self.placement)]


@dataclass
class _PutState:
    attempt: str = field(default_factory=new_attempt)  # names this attempt's shards
    seen: set[bytes] = field(default_factory=set)
    written: list[_Written] = field(default_factory=list)  # shards in place, not committed
    repeated: int = 0  # blocks named twice in this put


def check_hash(h: bytes, what: str = "hash") -> None:
    if len(h) != DIGEST_SIZE:
        raise InvalidBlock(f"{what} must be a {DIGEST_SIZE}-byte chain digest, got {len(h)} bytes")


def check_hashes(hashes: Sequence[bytes]) -> None:
    if len(hashes) > MAX_HASHES:
        raise InvalidBlock(f"hashes holds {len(hashes)} digests; at most {MAX_HASHES} per request")
    if any(n != DIGEST_SIZE for n in set(map(len, hashes))):  # one C pass; names the culprit
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
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.metrics = metrics or StoreMetrics()  # counted where it happens (``metrics.py``)
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
        self._commit = redis.register_script(scripts.COMMIT)
        self._delete = redis.register_script(scripts.DELETE)
        self._evict = redis.register_script(scripts.EVICT)
        self._touch_script = redis.register_script(scripts.TOUCH)

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
        """How many leading hashes of a chain are stored and unexpired: one native ``ZMSCORE``
        of the LRU index (``index.py``) whatever the chain's length, stopping at the first block
        missing; only blocks last used longer ago than the shortest TTL (days: rarely) cost a
        second round trip, for their traffic class, and the count stops at the first expired.

        Read-only: a Lookup is not a *use* of a block. A block's last use (what its TTL and the
        LRU eviction count from) is refreshed by a ``put`` naming it and by every ``get`` that
        returns it, i.e. when its bytes are written or read, not when they are only asked about.
        """
        check_hashes(hashes)
        if not hashes:
            return 0
        now = self.clock()
        packed = index.pack_zmscore(LRU_KEY, hashes)
        scores = await self._redis(index.execute_packed(self.redis, packed))
        n, old = index.leading(scores, now, min(self.retention.ttls.values()))
        if not old:
            return n
        pipe = self.redis.pipeline(transaction=False)
        for i in old:
            pipe.hget(self.key(hashes[i]), "class")
        classes = await self._redis(pipe.execute())
        for i, cls in zip(old, classes):  # a block deleted since (no class) stops the count too
            if cls is None or self.retention.expired(_text(cls), float(scores[i]), now):
                return i
        return n

    # -- put -----------------------------------------------------------------------------------
    async def put(self, blocks: AsyncIterator[BlockPut] | Sequence[BlockPut]) -> PutResult:
        """Store blocks; all of them become visible together at the end, or none does.

        Each block is validated and written as it arrives, at most ``PUT_IN_FLIGHT`` at a time,
        and only its metadata is kept until the commit: memory is bounded whatever the stream's
        length. :class:`InvalidBlock` aborts the whole put and removes the shards it wrote.
        Blocks already present are skipped (their last use is refreshed). Shards are named by
        this put's attempt id, so a concurrent put of the same block (other bytes, other
        process) never overwrites them: the first commit wins, the loser removes its own. A
        target that is down fails the put (``TargetDown``, retry later).
        """
        state = _PutState()
        pending: set[asyncio.Task[None]] = set()
        try:
            async for block in _each(blocks):
                validate_block(block)
                if block.hash in state.seen:
                    state.repeated += 1
                    continue
                state.seen.add(block.hash)
                while len(pending) >= PUT_IN_FLIGHT:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        t.result()
                pending.add(asyncio.create_task(self._put_one(block, state)))
            if pending:
                await asyncio.gather(*pending)
                pending.clear()
            stored, used = await self._commit_blocks(state) if state.written else (0, 0)
        except BaseException:
            if pending:  # let writes in flight finish, so discard sees every shard they wrote
                await asyncio.gather(*pending, return_exceptions=True)
            await self._discard(state)
            raise
        total = len(state.seen) + state.repeated
        if stored and self.retention.capacity_bytes and used > self.retention.capacity_bytes:
            await self.evict()
        return PutResult(stored, total - stored)

    async def _put_one(self, block: BlockPut, state: _PutState) -> None:
        if (await self.present([block.hash]))[0]:
            await self._touch([block.hash])
            return
        placement = place(block.hash, self.target_names, self.codec.n)
        checksum = await asyncio.to_thread(
            self._write_shards, block.hash.hex(), block.data, placement, state.attempt
        )
        state.written.append(
            _Written(
                block.hash,
                block.parent,
                len(block.data),
                block.tenant,
                block.traffic_class,
                placement,
                checksum,
            )
        )

    def _write_shards(self, hx: str, data: bytes, placement: list[str], attempt: str) -> str:
        self.io.write(hx, data, placement, attempt)
        return hashlib.sha256(data).hexdigest()

    async def _commit_blocks(self, state: _PutState) -> tuple[int, int]:
        """Write the metadata of every block this put wrote (one script); remove the shards of
        blocks another put committed first. Returns (blocks stored, store bytes after)."""
        now = self.clock()
        keys = [self.key(w.hash) for w in state.written] + [STATS_KEY, LRU_KEY, CHILDREN_KEY]
        args: list[Any] = []
        for w in state.written:
            args += [
                w.size,
                w.tenant,
                w.traffic_class,
                w.parent.hex(),
                now,
                json.dumps(w.placement),
                w.checksum,
                state.attempt,
            ]
        out = await self._redis(self._commit(keys=keys, args=args))
        flags, used = [int(x) for x in out[:-1]], int(out[-1])
        lost = [
            p for w, won in zip(state.written, flags) if not won for p in w.shards(state.attempt)
        ]
        state.written = []
        if lost:
            await asyncio.to_thread(self.io.remove, lost)
        return sum(flags), used

    async def _discard(self, state: _PutState) -> None:
        """Remove the shards of a failed put, unless its commit did land (Redis answered after
        the client gave up): metadata naming this attempt keeps its shards."""
        if not state.written:
            return
        pipe = self.redis.pipeline(transaction=False)
        for w in state.written:
            pipe.hget(self.key(w.hash), "attempt")
        try:
            attempts = await self._redis(pipe.execute())
        except StoreUnavailable:
            log.warning(
                "failed put: Redis is down, leaving %d blocks of orphan shards (collected after "
                "the grace period)",
                len(state.written),
            )
            return
        mine = state.attempt.encode()
        pairs = [
            p for w, a in zip(state.written, attempts) if a != mine for p in w.shards(state.attempt)
        ]
        await asyncio.to_thread(self.io.remove, pairs)

    # -- get -----------------------------------------------------------------------------------
    async def get(self, hashes: Sequence[bytes]) -> AsyncIterator[tuple[bytes, bytes]]:
        """Yield (hash, frame) for the leading stored blocks, in order; stop at the first missing.

        Up to ``m`` shards may be down or damaged (missing, failing their CRC, a broken fragment
        header, or wrong bytes behind a valid CRC: any ``k`` shards that reproduce the block's
        SHA-256 serve it); damaged ones are rewritten on the way. A block that lost more than
        ``m`` shards on healthy targets is gone: its metadata is removed so ``lookup`` stops
        promising it, and the stream stops there. When targets are *down*,
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
            pipe.hmget(self.key(h), ["targets", "checksum", "attempt"])
        metas = await self._redis(pipe.execute())
        blocks: list[tuple[bytes, list[str], str, str]] = []
        for h, (targets, checksum, attempt) in zip(leading, metas):
            if targets is None:  # deleted since the lookup
                break
            blocks.append((h, json.loads(targets), checksum.decode(), (attempt or b"").decode()))
        # Read ahead: block i+1's shards are read and decoded in a worker thread while block i
        # goes out, so disk waits overlap with CRC/decode/SHA-256 work and with the stream.
        reads = [self._read_task(*b) for b in blocks[:READ_AHEAD]]
        try:
            for i, (h, placement, _, attempt) in enumerate(blocks):
                task = reads[i]
                if i + READ_AHEAD < len(blocks):
                    reads.append(self._read_task(*blocks[i + READ_AHEAD]))
                try:
                    data, bad, degraded = await task
                except BlockUnreadable as exc:
                    if not exc.damaged:
                        raise StoreUnavailable(str(exc)) from None
                    log.error("%s; dropping it", exc)
                    self.metrics.lost_blocks.inc(await self._remove([h], [attempt]))
                    return
                if not _frame_named(data, h):
                    log.error("block %s decodes to a frame of another name; dropping it", h.hex())
                    self.metrics.lost_blocks.inc(await self._remove([h], [attempt]))
                    return
                if degraded:
                    self.metrics.degraded_reads.inc()
                if bad:
                    try:
                        n = await asyncio.to_thread(
                            self.io.repair, h.hex(), placement, data, bad, attempt
                        )
                        self.metrics.repaired_shards.labels("get").inc(n)
                    except (OSError, RuntimeError) as exc:
                        log.warning(
                            "block %s: repair failed (%s); fsck --repair retries", h.hex(), exc
                        )
                yield h, data
        finally:
            for t in reads:
                t.cancel()

    def _read_task(
        self, h: bytes, placement: list[str], checksum: str, attempt: str
    ) -> asyncio.Future[tuple[bytes, list[int], bool]]:
        """The block's bytes, its shards to rewrite, and whether it was degraded: served from
        fewer than all of its data shards (one was down, damaged, or outvoted)."""

        def read() -> tuple[bytes, list[int], bool]:
            data, scan = self.io.read(h.hex(), placement, checksum, attempt)
            # Every data shard not down and not bad was read and used: degraded is either.
            return data, scan.bad, bool(scan.bad or scan.down)

        task = asyncio.ensure_future(asyncio.to_thread(read))
        task.add_done_callback(_retrieve)  # a read-ahead nobody awaits must not warn
        return task

    async def _touch(self, hashes: Sequence[bytes]) -> None:
        """Refresh last use; a block deleted meanwhile is not brought back as a bare key."""
        args: list[float | str] = [self.clock(), b"".join(hashes).hex()]
        await self._redis(self._touch_script(keys=[LRU_KEY], args=args))

    # -- delete / stats / retention --------------------------------------------------------------
    async def delete(self, hashes: Sequence[bytes]) -> int:
        """Remove blocks: metadata first (invisible at once), then shards.

        Returns how many existed."""
        check_hashes(hashes)
        unique = list(dict.fromkeys(hashes))
        if not unique:
            return 0
        return await self._remove(unique, [ANY_ATTEMPT] * len(unique))

    async def _remove(self, hashes: Sequence[bytes], attempts: Sequence[str]) -> int:
        """Delete metadata of ``hashes`` still naming ``attempts`` (ANY_ATTEMPT: any), then the
        shards of what was deleted. Returns how many were deleted."""
        keys = [self.key(h) for h in hashes] + [STATS_KEY, LRU_KEY, CHILDREN_KEY]
        out = await self._redis(self._delete(keys=keys, args=list(attempts)))
        gone = [(h.hex(), t, a) for h, (t, a) in zip(hashes, out) if t]
        await self._remove_shards(gone)
        return len(gone)

    async def _remove_shards(self, blocks: Sequence[tuple[str, bytes, bytes]]) -> None:
        """Shards of deleted blocks: (hex, targets JSON, attempt) each."""
        pairs = [
            (t, shard_key(hx, i, bytes(attempt).decode()))
            for hx, targets, attempt in blocks
            for i, t in enumerate(json.loads(targets))
        ]
        if pairs:
            await asyncio.to_thread(self.io.remove, pairs)

    async def evict(self) -> int:
        """Evict least recently used chain tails until the bytes fit the capacity (Lua over the
        LRU index: the work is proportional to what is evicted, not to the store's size).
        Returns how many blocks were evicted."""
        cap, n = self.retention.capacity_bytes, 0
        while cap:
            keys = [STATS_KEY, LRU_KEY, CHILDREN_KEY]
            out = await self._redis(self._evict(keys=keys, args=[cap, EVICT_BATCH]))
            await self._remove_shards([(bytes(hx).decode(), t, a) for hx, t, a in out])
            n += len(out)
            self.metrics.evictions.labels("capacity").inc(len(out))
            if len(out) < EVICT_BATCH:
                break
        if n:
            log.info("capacity: evicted %d least recently used chain tails", n)
        return n

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
        for reason, hexes in (
            ("ttl", plan.expired),
            ("unreachable", plan.unreachable),
            ("capacity", plan.evicted),
        ):
            doomed = [bytes.fromhex(h) for h in hexes]
            for i in range(0, len(doomed), 1024):  # counted as deleted here: exact, not planned
                gone = await self.delete(doomed[i : i + 1024])
                self.metrics.evictions.labels(reason).inc(gone)
        if plan.all:
            log.info(
                "retention: %d expired, %d unreachable, %d evicted",
                len(plan.expired),
                len(plan.unreachable),
                len(plan.evicted),
            )
        return plan

    async def ping(self) -> None:
        await self._redis(self.redis.ping())


async def _each(blocks: AsyncIterator[BlockPut] | Sequence[BlockPut]) -> AsyncIterator[BlockPut]:
    if isinstance(blocks, Sequence):
        for b in blocks:
            yield b
    else:
        async for b in blocks:
            yield b


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _frame_named(data: bytes, h: bytes) -> bool:
    try:
        header, _ = decode_frame(data)
    except KVFormatError:
        return False
    return header.chain_hash == h.hex()
