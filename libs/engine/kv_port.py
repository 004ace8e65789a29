"""A request's KV in and out of an engine: signed frames (``kv/transfer.py``) or a peer's blocks.

:class:`KVPort` is the :class:`~libs.engine.engine.Engine`'s side of moving KV: it parses,
checks and stages frames (any thread), imports them into fresh blocks for a request (engine
thread), exports a request's blocks as frames in two halves (the copy started on the engine
thread, the frame built on any), and names a request's blocks for an engine in another process
on this host (:class:`~libs.engine.kv.transfer.PeerKV`). It owns no block: the engine's
:class:`~libs.engine.kv.block_manager.BlockManager` decides who holds one and the scheduler
admits an imported request; the port only checks names and moves bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from libs.common.hashchain import chain_hashes

from .kv.block_manager import BlockManager, NoFreeBlocks
from .kv.layout import CacheSpec
from .kv.transfer import (
    KVFormatError,
    KVHeader,
    PeerKV,
    check_compatible,
    decode_frame,
    encode_frame,
    verify,
)
from .parts import KVBlockStore
from .scheduler import Request, Scheduler


class MissingPrefix(KVFormatError):
    """KV that starts past block 0 whose leading blocks this engine no longer holds.

    ``have``: how many leading blocks it does hold; a sender retries from there.
    """

    def __init__(self, message: str, have: int) -> None:
        super().__init__(message)
        self.have = have


@dataclass(frozen=True)
class PreparedKV:
    """KV frames parsed and uploaded off the engine thread (:meth:`Engine.prepare_kv`).

    Covers blocks ``first_block ..`` of a request: ``num_tokens`` tokens counted from 0.
    """

    first_block: int
    num_tokens: int
    block_hashes: tuple[str, ...]  # hex chain digests, one per block held
    staged: Any  # the cache's staged upload


KVInput = bytes | Sequence[bytes] | PreparedKV | PeerKV


class KVPort:
    """Frames in and out of ``cache`` for the requests of ``scheduler`` (module doc).

    ``model_id`` and ``spec`` name what the frames hold (a frame of another model or layout
    is refused); ``mac_key`` signs exported frames and is required on imported ones (None:
    neither signed nor checked)."""

    def __init__(
        self,
        model_id: str,
        spec: CacheSpec,
        cache: KVBlockStore,
        blocks: BlockManager,
        scheduler: Scheduler,
        mac_key: bytes | None,
    ) -> None:
        self.model_id = model_id
        self.spec = spec
        self.cache = cache
        self.blocks = blocks
        self.scheduler = scheduler
        self.mac_key = mac_key
        self.peer_pools: dict[bytes, Any] = {}  # share handle -> another engine's pool, mapped

    # -- in -------------------------------------------------------------------------------------
    def prepare(self, frames: Sequence[bytes | bytearray | memoryview]) -> PreparedKV:
        """Parse, check and upload KV frames; touches no engine state (any thread)."""
        headers: list[KVHeader] = []
        payloads: list[memoryview] = []
        for data in frames:
            header, payload = decode_frame(bytes(data) if isinstance(data, bytearray) else data)
            check_compatible(header, self.spec)
            verify(self.mac_key, header, payload)
            if headers:
                expected = headers[-1].first_block + headers[-1].num_blocks
                if header.first_block != expected:
                    raise KVFormatError(
                        f"KV frames are not contiguous: block {header.first_block} "
                        f"follows block {expected - 1}"
                    )
            headers.append(header)
            payloads.append(payload)
        if not headers:
            raise KVFormatError("no KV frames given")
        return PreparedKV(
            headers[0].first_block,
            headers[-1].num_tokens,
            tuple(h for header in headers for h in header.block_hashes),
            self.cache.stage(payloads),
        )

    def import_into(self, req: Request, src: PreparedKV | PeerKV) -> tuple[Any, int]:
        """Import ``src`` for ``req`` and admit it: (what :meth:`Engine.add_request` returns,
        tokens of it this engine's own cache already held)."""
        bs = self.spec.block_size
        covered = src.num_tokens
        if covered > len(req.token_ids):
            raise KVFormatError(f"KV covers {covered} tokens, the request has {len(req.token_ids)}")
        want = [
            h.hex()
            for h in chain_hashes(req.token_ids[:covered], bs, req.cache_salt, include_partial=True)
        ]
        first = src.first_block
        if list(src.block_hashes) != want[first:] or first < 0:
            raise KVFormatError("KV does not belong to these tokens (chain hash mismatch)")
        usable = min(covered, len(req.token_ids) - 1)  # the last token is computed to sample
        n_blocks = -(-usable // bs)
        n_full = usable // bs
        names = chain_hashes(req.token_ids[: n_full * bs], bs, req.cache_salt)
        hits = self.blocks.match_prefix(names)
        if len(hits) < first:
            raise MissingPrefix(
                f"KV starts at block {first} but this engine holds only the first "
                f"{len(hits)} blocks of the prompt",
                len(hits),
            )
        fresh_needed = n_blocks - len(hits)
        # Cached hits that sit in the free queue stop being free once acquired.
        available = self.blocks.num_free - sum(1 for b in hits if self.blocks.ref_count(b) == 0)
        if fresh_needed > available:
            raise NoFreeBlocks(
                f"importing {n_blocks} blocks needs {fresh_needed} free, {available} available"
            )
        self.blocks.acquire(hits)
        fresh: list[int] = []
        done = None
        try:
            fresh = self.blocks.allocate(fresh_needed)
            start = len(hits) - first  # index in the source of the first block we lack
            if isinstance(src, PeerKV):
                pool = self._peer_pool(src.pool)
                done = self.cache.copy_from_peer(
                    pool, src.block_ids[start : start + len(fresh)], fresh
                )
            else:
                self.cache.write_staged(fresh, src.staged, start)
        except BaseException:
            self.blocks.release(hits + fresh)
            raise
        self.scheduler.admit_imported(req, hits + fresh, names, len(hits), usable)
        return done, len(hits) * bs

    def _peer_pool(self, handle: bytes) -> Any:
        pool = self.peer_pools.get(handle)
        if pool is None:
            pool = self.peer_pools[handle] = self.cache.open_peer(handle)
        return pool

    # -- out ------------------------------------------------------------------------------------
    def held(self, request_id: str) -> Request:
        """A request this engine holds: running, waiting, or finished and kept (``hold_kv``)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} (finished requests need hold_kv=True)")
        return req

    def export_async(
        self, request_id: str, include_partial: bool = False, start_block: int = 0
    ) -> Callable[[], bytes]:
        """One frame of the request's computed KV from block ``start_block`` on (its full
        blocks, plus the tail if ``include_partial``), in two halves: this call (engine
        thread) starts copying the blocks out; the function it returns (any thread) waits for
        them and builds the frame. The blocks may be released or reused once this returns."""
        req = self.held(request_id)
        bs = self.spec.block_size
        covered = req.num_computed if include_partial else (req.num_computed // bs) * bs
        start, blocks, names = self._span(req, covered, start_block)
        header = KVHeader(
            self.model_id,
            self.spec.layout_hash(),
            bs,
            self.spec.dtype,
            self.spec.bytes_per_block,
            covered,
            start,
            names,
        )
        pending = self.cache.gather_async(blocks)
        key = self.mac_key
        return lambda: encode_frame(header, pending.result(), key)

    def export_blocks_async(
        self, request_id: str, start_block: int = 0
    ) -> Callable[[], list[tuple[bytes, bytes, bytes]]]:
        """The request's full blocks from ``start_block`` on, one single-block frame each, in
        two halves like :meth:`export_async`: (chain digest, parent digest or b"", frame) per
        block, the kvstore's unit. Frames for blocks ``0..k`` import together as one prefix."""
        req = self.held(request_id)
        bs = self.spec.block_size
        hashes = req.full_block_hashes(bs, req.num_computed)
        start = min(max(start_block, 0), len(hashes))
        pending = self.cache.gather_async(req.blocks[start : len(hashes)])
        key = self.mac_key
        model_id, layout, bpb, dtype = (
            self.model_id,
            self.spec.layout_hash(),
            self.spec.bytes_per_block,
            self.spec.dtype,
        )

        def finish() -> list[tuple[bytes, bytes, bytes]]:
            raw = pending.result()
            out = []
            for i in range(start, len(hashes)):
                header = KVHeader(
                    model_id, layout, bs, dtype, bpb, (i + 1) * bs, i, (hashes[i].hex(),)
                )
                k = i - start
                frame = encode_frame(header, raw[k * bpb : (k + 1) * bpb], key)
                out.append((hashes[i], hashes[i - 1] if i else b"", frame))
            return out

        return finish

    def peer(self, request_id: str, start_block: int = 0) -> PeerKV | None:
        """The request's computed KV (tail included) from ``start_block`` on, as blocks of this
        cache's shared pool, for an engine in another process on this host; None when the pool
        cannot be shared. The caller keeps the request (``hold_kv``) until the importer is done
        with the blocks."""
        handle = self.cache.share()
        if handle is None:
            return None
        req = self.held(request_id)
        start, blocks, names = self._span(req, req.num_computed, start_block)
        return PeerKV(handle, tuple(blocks), start, req.num_computed, names)

    def _span(
        self, req: Request, covered: int, start_block: int
    ) -> tuple[int, list[int], tuple[str, ...]]:
        """The blocks holding tokens ``0..covered`` (a partial tail included) from
        ``start_block`` on: (first block, their ids, their hex chain digests)."""
        hashes = chain_hashes(
            req.token_ids[:covered], self.spec.block_size, req.cache_salt, include_partial=True
        )
        start = min(max(start_block, 0), len(hashes))
        return start, req.blocks[start : len(hashes)], tuple(h.hex() for h in hashes[start:])
