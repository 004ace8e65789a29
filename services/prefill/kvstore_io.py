"""Prefill's side of the kvstore: load a cached prefix instead of computing it, write the
prompt's new full blocks back.

Both are optimisations, never a request's failure: a prefix that is slower to load than to
compute (:class:`~libs.kvstore.policy.LoadOrCompute` at the measured rates), a failed Get or
a block whose MAC does not match is computed instead; a write the write-behind bound has no
room for, or that fails, is counted and dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from libs.common.hashchain import chain_hashes
from libs.engine.engine import Engine, KVFormatError, KVIntegrityError, PreparedKV
from libs.kvstore.policy import LoadOrCompute
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engine_loop import EngineLoop
from libs.serving.write_behind import WriteBehind
from libs.transport.kvstore_client import Block, KVStore, write_back

from .metrics import CACHED_BLOCKS, ERRORS, FORGED, OWN_BLOCKS, STORE_DROPPED, STORED_BLOCKS

log = logging.getLogger("prefill")


class PrefixStore:
    """The kvstore as one prefill engine uses it (``loop``'s engine, ``block_size`` tokens a
    block). Owns the load/compute rates it measures and the bounded background writes."""

    def __init__(self, loop: EngineLoop, kvstore: KVStore, block_size: int) -> None:
        self.loop, self.kvstore, self.block_size = loop, kvstore, block_size
        self.rates = LoadOrCompute()
        self.writes = WriteBehind()

    def plan(self, task: control_pb2.PrefillTask, prompt: list[int]) -> Load | None:
        """The kvstore's blocks of this prompt (None: it holds none that could be used)."""
        if task.cached_blocks <= 0:
            return None
        usable = min(task.cached_blocks, (len(prompt) - 1) // self.block_size)
        if usable <= 0:
            return None
        hashes = chain_hashes(prompt[: usable * self.block_size], self.block_size, task.cache_salt)
        stats = self.loop.stats
        if stats.tokens_per_s:
            self.rates.observe_compute(stats.tokens_per_s)
        return Load(self, hashes)

    async def fetch(self, task: control_pb2.PrefillTask, load: Load) -> PreparedKV | None:
        """The blocks ``load`` found worth loading, uploaded and ready to import (None: the
        kvstore failed or its bytes were unusable; the engine computes them)."""
        own, hashes = load.own, load.hashes
        t0 = time.perf_counter()
        try:
            frames = await self.kvstore.get(hashes[own:])
        except Exception as exc:  # noqa: BLE001 - the kvstore is an optimisation: compute instead
            ERRORS.labels("kvstore_get").inc()
            log.warning(
                "request %s: kvstore Get failed (%s); computing the prefix", task.request_id, exc
            )
            return None
        if not frames:
            return None
        self.rates.observe_load(sum(len(f) for f in frames), time.perf_counter() - t0)
        CACHED_BLOCKS.inc(len(frames))
        try:
            return await self.loop.prepare_kv(frames)
        except (KVFormatError, ValueError) as exc:
            if isinstance(exc, KVIntegrityError):
                FORGED.inc()  # a miss: the prefix is computed, the forged bytes never used
            ERRORS.labels("kv_import").inc()
            log.warning("request %s: kvstore blocks unusable (%s)", task.request_id, exc)
            return None

    async def write_back(self, task: control_pb2.PrefillTask, n_new: int, start: int) -> None:
        """Copy the prompt's new full blocks out of the engine (before the KV is released) and
        write them to the kvstore in the background, if the write-behind has room."""
        nbytes = max(n_new, 0) * self.loop.engine.spec.bytes_per_block
        rid = task.request_id
        if nbytes and not await self.writes.submit(
            nbytes,
            lambda: self.loop.export_blocks(rid, start),
            lambda finish: self._store(task, finish),
        ):
            STORE_DROPPED.inc()

    async def _store(
        self, task: control_pb2.PrefillTask, finish: Callable[[], list[Block]]
    ) -> None:
        n = await write_back(
            self.kvstore, finish, task.cache_salt, task.traffic_class, log, task.request_id
        )
        if n < 0:
            ERRORS.labels("kvstore_put").inc()
        else:
            STORED_BLOCKS.inc(n)


class Load:
    """A prompt's blocks in the kvstore (``hashes``), and how many leading ones the engine
    holds itself (``own``, once :meth:`worth_it` has run)."""

    def __init__(self, store: PrefixStore, hashes: list[bytes]) -> None:
        self.store, self.hashes, self.own = store, hashes, 0

    def worth_it(self, engine: Engine) -> bool:
        """On the engine thread: whether loading the blocks it lacks beats computing them
        (at the measured load and compute rates)."""
        self.own = engine.resident_blocks(self.hashes)
        OWN_BLOCKS.inc(self.own)
        bpb, bs = engine.spec.bytes_per_block, self.store.block_size
        return self.store.rates.worth_loading(len(self.hashes) - self.own, bpb, bs)
