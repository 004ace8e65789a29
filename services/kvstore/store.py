"""KV blocks as files, their metadata in Redis: the kvstore's storage logic, without gRPC.

A block is one engine-exported single-block KV frame, named by its chain digest
(``libs.common.hashchain``). Layout and visibility rules:

* data: ``<data_dir>/blocks/<hex[:2]>/<hex>``, written to a temporary file in the same
  directory, fsynced, renamed into place (atomic) and the directory fsynced;
* metadata: ``HSET ds:kv:<hex> size tenant class parent last_access created``, written only
  after every file of a ``Put`` is in place, by one Lua script (atomic: all blocks of a put
  become visible together, or none does). Redis metadata is what makes a block exist:
  ``Lookup`` and ``Get`` never serve a file without it, so a crash at any point leaves at
  worst an orphan file (invisible; collected by fsck, a later issue), never a half-written
  block that can be read;
* counters ``blocks``/``bytes`` live in the hash ``ds:kv:_stats``, updated by the same scripts
  that add or remove metadata, so concurrent puts of one block count it once.

No torch: frames are checked with ``libs.engine.kv.transfer.decode_frame`` (header only).
Erasure coding, checksums, TTLs and LRU eviction come later; this is the simplest honest form.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from libs.common.hashchain import DIGEST_SIZE
from libs.engine.kv.transfer import KVFormatError, decode_frame

log = logging.getLogger("kvstore.store")

KEY_PREFIX = "ds:kv:"
STATS_KEY = "ds:kv:_stats"  # not a 64-hex name, so it never collides with a block key
MAX_HASHES = 1 << 16  # per request: 8.4M tokens of 128-token blocks, far past any context

T = TypeVar("T")

# KEYS: the block keys, then STATS_KEY. ARGV: 5 per block (size, tenant, class, parent, now).
_COMMIT = """
local stored, added = 0, 0
for i = 1, #KEYS - 1 do
  local b = (i - 1) * 5
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSET', KEYS[i], 'last_access', ARGV[b + 5])
  else
    redis.call('HSET', KEYS[i], 'size', ARGV[b + 1], 'tenant', ARGV[b + 2], 'class', ARGV[b + 3],
               'parent', ARGV[b + 4], 'last_access', ARGV[b + 5], 'created', ARGV[b + 5])
    stored = stored + 1
    added = added + tonumber(ARGV[b + 1])
  end
end
if stored > 0 then
  redis.call('HINCRBY', KEYS[#KEYS], 'blocks', stored)
  redis.call('HINCRBY', KEYS[#KEYS], 'bytes', added)
end
return stored
"""

# KEYS: the block keys, then STATS_KEY. Returns how many existed (and are now gone).
_DELETE = """
local deleted, removed = 0, 0
for i = 1, #KEYS - 1 do
  local size = redis.call('HGET', KEYS[i], 'size')
  if size then
    redis.call('DEL', KEYS[i])
    deleted = deleted + 1
    removed = removed + tonumber(size)
  end
end
if deleted > 0 then
  redis.call('HINCRBY', KEYS[#KEYS], 'blocks', -deleted)
  redis.call('HINCRBY', KEYS[#KEYS], 'bytes', -removed)
end
return deleted
"""

# KEYS: block keys. ARGV[1]: now. Refresh last use of the blocks that still exist.
_TOUCH = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSET', KEYS[i], 'last_access', ARGV[1])
  end
end
return 0
"""


class InvalidBlock(ValueError):
    """The caller sent something that is not a storable block (fix the request; nothing stored)."""


class StoreUnavailable(RuntimeError):
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
    written: list[Path] = field(default_factory=list)  # files this put created, not yet committed
    commit: list[BlockPut] = field(default_factory=list)
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
    """Raise :class:`InvalidBlock` unless ``block.data`` is one full-block frame named ``block.hash``."""
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
        raise InvalidBlock(f"hash {block.hash.hex()} does not match the frame's block digest "
                           f"{header.chain_hash}")
    if header.num_tokens != (header.first_block + 1) * header.block_size:
        raise InvalidBlock("the frame covers a partial block; only full blocks are stored")
    if (header.first_block == 0) != (not block.parent):
        raise InvalidBlock(f"parent_hash must be empty exactly for a chain's first block "
                           f"(this frame is block {header.first_block})")


class BlockStore:
    """Blocks by chain digest. Safe for many concurrent calls on one event loop.

    Contract: a block is visible (``lookup``/``get``) only once its metadata exists, and its
    metadata is written only after its file is complete and renamed into place.
    """

    def __init__(self, redis: aioredis.Redis, data_dir: Path,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.data_dir = Path(data_dir)
        self.blocks_dir = self.data_dir / "blocks"
        self.clock = clock
        self._commit = redis.register_script(_COMMIT)
        self._delete = redis.register_script(_DELETE)
        self._touch_script = redis.register_script(_TOUCH)

    def prepare(self) -> None:
        """Create the data directory (blocking; call once at startup)."""
        self.blocks_dir.mkdir(parents=True, exist_ok=True)

    # -- names ---------------------------------------------------------------------------------
    @staticmethod
    def key(h: bytes) -> str:
        return KEY_PREFIX + h.hex()

    def path(self, h: bytes) -> Path:
        hx = h.hex()
        return self.blocks_dir / hx[:2] / hx

    async def _redis(self, op: Awaitable[T]) -> T:
        try:
            return await op
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"Redis does not answer ({type(exc).__name__}: {exc}); "
                                   "retry when it is back") from None

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
        """How many leading hashes of a chain are stored (metadata only; one round trip)."""
        check_hashes(hashes)
        n = 0
        for ok in await self.present(hashes):
            if not ok:
                break
            n += 1
        return n

    # -- put -----------------------------------------------------------------------------------
    async def put(self, blocks: AsyncIterator[BlockPut] | Sequence[BlockPut]) -> PutResult:
        """Store blocks; all of them become visible together at the end, or none does.

        Each block is validated as it arrives (:class:`InvalidBlock` aborts the whole put and
        removes the files it wrote). Blocks already present are skipped (their last use is
        refreshed).
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
        path = self.path(block.hash)
        await asyncio.to_thread(_write_atomic, path, block.data)
        state.written.append(path)
        state.commit.append(block)

    async def _commit_blocks(self, blocks: list[BlockPut]) -> int:
        now = self._now()
        keys = [self.key(b.hash) for b in blocks] + [STATS_KEY]
        args: list[Any] = []
        for b in blocks:
            args += [len(b.data), b.tenant, b.traffic_class, b.parent.hex(), now]
        return int(await self._redis(self._commit(keys=keys, args=args)))

    async def _discard(self, paths: list[Path]) -> None:
        """Remove files of a failed put, unless another put has since made them visible."""
        if not paths:
            return
        try:
            visible = await self.present([bytes.fromhex(p.name) for p in paths])
        except StoreUnavailable:
            log.warning("failed put: Redis is down, leaving %d unreferenced files", len(paths))
            return
        orphans = [p for p, v in zip(paths, visible) if not v]
        await asyncio.to_thread(_unlink_all, orphans)

    # -- get -----------------------------------------------------------------------------------
    async def get(self, hashes: Sequence[bytes]) -> AsyncIterator[tuple[bytes, bytes]]:
        """Yield (hash, frame) for the leading stored blocks, in order; stop at the first missing.

        A block whose file is gone or damaged (metadata without a readable frame of that name)
        counts as missing: its metadata is removed so ``lookup`` stops promising it.
        """
        check_hashes(hashes)
        leading = []
        for h, ok in zip(hashes, await self.present(hashes)):
            if not ok:
                break
            leading.append(h)
        if leading:
            await self._touch(leading)
        for h in leading:
            data = await asyncio.to_thread(_read, self.path(h))
            if data is None or not _frame_named(data, h):
                log.error("block %s has metadata but no readable frame; dropping it", h.hex())
                await self.delete([h])
                return
            yield h, data

    async def _touch(self, hashes: Sequence[bytes]) -> None:
        """Refresh last use; a block deleted meanwhile is not brought back as a bare key."""
        await self._redis(self._touch_script(keys=[self.key(h) for h in hashes], args=[self._now()]))

    # -- delete / stats ------------------------------------------------------------------------
    async def delete(self, hashes: Sequence[bytes]) -> int:
        """Remove blocks: metadata first (invisible at once), then files. Returns how many existed."""
        check_hashes(hashes)
        unique = list(dict.fromkeys(hashes))
        if not unique:
            return 0
        keys = [self.key(h) for h in unique] + [STATS_KEY]
        deleted = int(await self._redis(self._delete(keys=keys, args=[])))
        await asyncio.to_thread(_unlink_all, [self.path(h) for h in unique])
        return deleted

    async def stats(self) -> tuple[int, int]:
        """(blocks, bytes) stored."""
        blocks, size = await self._redis(self.redis.hmget(STATS_KEY, ["blocks", "bytes"]))
        return int(blocks or 0), int(size or 0)

    async def ping(self) -> None:
        await self._redis(self.redis.ping())

    def _now(self) -> str:
        return f"{self.clock():.3f}"


# -- blocking file helpers (run in a worker thread) ---------------------------------------------
def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut before metadata is written
    finally:
        os.close(dir_fd)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _frame_named(data: bytes, h: bytes) -> bool:
    try:
        header, _ = decode_frame(data)
    except KVFormatError:
        return False
    return header.chain_hash == h.hex()
