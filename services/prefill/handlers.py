"""Prefill: compute a prompt and its first token, hand the KV to decode, keep new blocks.

:class:`PrefillHandler` holds the logic; the transports come in as small interfaces
(``publish`` for TokenEvents, a :class:`KVPusher` for decode, an optional :class:`KVStore`),
so tests wire it to a decode handler in the same process.

One task, in order:

1. cached prefix: of the ``cached_blocks`` leading blocks the entrypoint found in the kvstore,
   those still in this engine's own cache are used as they are; only the rest are fetched
   (when loading them beats computing them at the measured rates), uploaded off the engine
   thread and imported (any failure: compute them -- the cache is an optimisation);
2. the engine computes the rest with ``max_tokens=1`` and keeps the KV (``hold_kv``);
3. TokenEvent index 0 with the first token (finished if it is EOS/stop, or max_tokens == 1);
4. hand-over (:mod:`libs.serving.handoff`): ask the decode instance which leading blocks it
   holds (a session's previous turn usually left them there) and send only the rest -- as
   references into this engine's KV pool when decode runs on this host (it copies them
   device to device; the blocks stay held until it answers), else as a frame of bytes built
   off the engine thread; the engine's copy is released right after;
5. new full blocks go to the kvstore in the background (failures are logged, not fatal).

A retry after tokens reached the client (``PrefillTask.num_prior_outputs``: the last N prompt
tokens are the completion sent so far) is the same request resumed, not a new one: the engine
takes those N tokens as output (``prior_outputs``: the grammar is advanced past them, the
penalties count them, min_tokens and max_tokens count the whole completion), and the DecodeTask
keeps the true prompt length, so decode treats them the same way.

A task comes off the bus through :meth:`PrefillHandler.on_message`, which confirms receipt
when the sender asks for it (a reply subject: the entrypoint sends a task again until one
copy is confirmed, ``services/entrypoint/delivery.py``); copies of a task already in flight
or seen in the last ``TASK_MEMORY_S`` are confirmed and otherwise ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from libs.common import subjects
from libs.common.errors import DeepserveError, InstanceFailed, InvalidArgument, Unavailable
from libs.common.hashchain import chain_hashes
from libs.common.sampling import SamplingParams
from libs.common.telemetry import extract_context, inject_traceparent
from libs.engine.engine import (
    InvalidRequest,
    KVFormatError,
    KVIntegrityError,
    NoFreeBlocks,
    PreparedKV,
)
from libs.engine.kv.peer import host_id
from libs.engine.kv.transfer import PeerKV
from libs.kvstore.policy import LoadOrCompute
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.aborts import RecentAborts, RecentIds
from libs.serving.convert import error_event
from libs.serving.engine_loop import EngineFailed, EngineLoop, EngineLoopClosed, RequestStream
from libs.serving.handoff import KVPusher, KVResend
from libs.serving.instance import drain_tasks, instance_status
from libs.serving.write_behind import WriteBehind
from libs.transport.kvstore_client import Block, KVStore, write_back

log = logging.getLogger("prefill")

Publish = Callable[[str, bytes], Awaitable[None]]

REQUESTS = Counter("deepserve_prefill_requests_total", "prefill tasks by outcome", ["outcome"])
ERRORS = Counter("deepserve_prefill_errors_total", "prefill failures by stage", ["stage"])
LATENCY = Histogram(
    "deepserve_prefill_seconds",
    "task received -> KV handed to decode",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CACHED_BLOCKS = Counter(
    "deepserve_prefill_kvstore_blocks_loaded_total", "prefix blocks loaded from the kvstore"
)
STORED_BLOCKS = Counter("deepserve_prefill_kvstore_blocks_put_total", "blocks sent to the kvstore")
FORGED = Counter(
    "deepserve_prefill_kv_integrity_failures_total",
    "kvstore blocks whose MAC did not match (forged or altered): treated as a miss",
)
OWN_BLOCKS = Counter(
    "deepserve_prefill_resident_blocks_total",
    "cached prefix blocks found in this engine's own cache (not fetched)",
)
HANDOFF_BLOCKS = Counter(
    "deepserve_prefill_handoff_blocks_total",
    "prompt blocks at hand-over by how they reached decode",
    ["how"],  # held (decode had them), peer (pool reference), bytes (a frame)
)
STORE_DROPPED = Counter(
    "deepserve_prefill_kvstore_writes_dropped_total",
    "kvstore writes not started: the write-behind bound was reached",
)
RESENDS = Counter("deepserve_prefill_handoff_resends_total", "hand-overs sent again", ["why"])
DUPLICATES = Counter(
    "deepserve_prefill_duplicate_tasks_total",
    "copies of a PrefillTask already in flight or seen lately (sent again after a NATS outage)",
)
MAX_SENDS = 3  # a hand-over tries at most: peer refs, bytes, bytes from block 0
# Copies of a task come while the entrypoint waits for a confirmation (each copy waits 1 s,
# the whole at most --nats-wait + --instance-dead-after, ~13 s) or out of a client's buffer
# right after a reconnection: a minute of ids covers them (100K ids: ~15 MB at most).
TASK_MEMORY_S = 60.0
TASK_MEMORY_MAX = 100_000


class TaskMessage(Protocol):
    """A PrefillTask off the bus (``nats.aio.msg.Msg`` or the in-process twin's)."""

    @property
    def data(self) -> bytes: ...

    @property
    def reply(self) -> str: ...

    async def respond(self, data: bytes) -> None: ...


class LocalDecode(Protocol):
    """The decode role of an aggregated instance (same engine): where a request whose decode
    target is this instance goes on after its first token, with no hand-over."""

    @property
    def address(self) -> str: ...

    async def continue_here(
        self, task: control_pb2.DecodeTask, stream: RequestStream, store_from_block: int
    ) -> None: ...


class PushFailed(InstanceFailed):
    """The decode instance did not take the KV (unreachable, refused, timed out)."""


class PrefillHandler:
    def __init__(
        self,
        loop: EngineLoop,
        publish: Publish,
        pusher: KVPusher,
        *,
        instance_id: str,
        model_name: str,
        block_size: int,
        max_model_len: int,
        kvstore: KVStore | None = None,
        tracer: trace.Tracer | None = None,
        same_host_handoff: bool = True,
        local: LocalDecode | None = None,
    ) -> None:
        self.loop = loop
        self.publish = publish
        self.pusher = pusher
        self.kvstore = kvstore
        self.instance_id = instance_id
        self.model_name = model_name
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.tracer = tracer or trace.get_tracer("prefill")
        self.same_host_handoff = same_host_handoff  # False: always bytes (tests, debugging)
        self.local = local  # aggregated: this engine's own decode role
        self.rates = LoadOrCompute()
        self.draining = False
        self.aborted = RecentAborts()
        self.seen = RecentIds(TASK_MEMORY_S, TASK_MEMORY_MAX)  # task ids taken lately
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cut: dict[str, str] = {}  # request id -> why it was cancelled ("abort", "shutdown")
        self.writes = WriteBehind()

    # -- entry points -------------------------------------------------------------------------
    async def on_message(self, msg: TaskMessage) -> None:
        """A PrefillTask off the bus: start it (a copy of one taken lately is ignored), then
        confirm receipt (an empty reply) if the sender asked for it -- before any prefill
        work, and after the task is registered, so any later copy is recognised."""
        try:
            task = control_pb2.PrefillTask.FromString(msg.data)
        except Exception as exc:  # noqa: BLE001 - not ours to answer: we cannot even read the request id
            log.warning("unreadable PrefillTask dropped: %s", exc)
            return
        self.submit(task)  # its own task: the subscription keeps taking messages
        if msg.reply:
            try:
                await msg.respond(b"")
            except Exception as exc:  # noqa: BLE001 - the sender sends the task again
                log.info("request %s: could not confirm the task: %r", task.request_id, exc)

    def submit(self, task: control_pb2.PrefillTask) -> asyncio.Task[None] | None:
        """Start serving ``task`` in its own asyncio task (None if it is refused outright, or
        is a copy of a task in flight or taken within ``TASK_MEMORY_S``)."""
        rid = task.request_id
        if rid in self._tasks or rid in self.seen:
            DUPLICATES.inc()
            state = "in flight" if rid in self._tasks else "taken lately"
            log.info("copy of PrefillTask %s ignored (%s)", rid, state)
            return None
        self.seen.add(rid)
        t = asyncio.create_task(self.handle(task), name=f"prefill-{rid}")
        self._tasks[rid] = t

        def forget(_: asyncio.Task[None]) -> None:
            if self._tasks.get(rid) is t:
                del self._tasks[rid]

        t.add_done_callback(forget)
        return t

    async def handle(self, task: control_pb2.PrefillTask) -> None:
        rid = task.request_id
        subject = task.events_subject or subjects.token_events(rid)
        if self.draining:
            REQUESTS.labels("refused").inc()
            await self._send(
                subject,
                error_event(
                    rid,
                    Unavailable(
                        f"prefill instance {self.instance_id} is draining; "
                        "retry on another instance"
                    ),
                ),
            )
            return
        if rid in self.aborted:
            return
        with self.tracer.start_as_current_span(
            "prefill", context=extract_context(task.traceparent)
        ) as span:
            span.set_attribute("deepserve.request_id", rid)
            span.set_attribute("deepserve.prompt_tokens", len(task.prompt_token_ids))
            try:
                await self._serve(task, subject)
            except asyncio.CancelledError:
                reason = self._cut.pop(rid, "shutdown")
                REQUESTS.labels(reason).inc()
                if reason != "abort":
                    await self._send(
                        subject,
                        error_event(
                            rid,
                            InstanceFailed(
                                f"prefill instance {self.instance_id} stopped ({reason}) before "
                                "the KV was handed over"
                            ),
                        ),
                    )
            except (EngineFailed, EngineLoopClosed) as exc:
                ERRORS.labels("engine").inc()
                await self._send(
                    subject, error_event(rid, InstanceFailed(f"prefill engine failed: {exc}"))
                )
            except Exception as exc:  # a bug: fail this request visibly, keep serving others
                ERRORS.labels("internal").inc()
                log.exception("request %s failed", rid)
                # Retryable: another instance may well serve it.
                await self._send(
                    subject, error_event(rid, InstanceFailed(f"prefill failed: {exc!r}"))
                )
            finally:
                await self._forget(rid)

    async def on_abort(self, abort: control_pb2.Abort) -> None:
        rid = abort.request_id
        self.aborted.add(rid)
        t = self._tasks.get(rid)
        if t is not None and not t.done():
            self._cut[rid] = "abort"
            t.cancel()

    # -- the task -----------------------------------------------------------------------------
    async def _serve(self, task: control_pb2.PrefillTask, subject: str) -> None:
        rid, prompt = task.request_id, list(task.prompt_token_ids)
        prior = task.num_prior_outputs  # outputs an earlier attempt sent (the end of prompt)
        t0 = time.perf_counter()
        arrived = time.monotonic()  # the engine metrics' TTFT counts kvstore loads too
        try:
            params = SamplingParams.from_proto(task.sampling)
            self._check(task, params)
        except InvalidArgument as exc:
            REQUESTS.labels("invalid").inc()
            await self._send(subject, error_event(rid, exc))
            return
        local = self.local is not None and task.decode_address == self.local.address
        # The engine counts max_tokens and min_tokens from its own outputs: the prior ones are
        # part of its prompt.
        rest = dataclasses.replace(
            params,
            max_tokens=params.max_tokens - prior,
            min_tokens=max(0, params.min_tokens - prior),
        )
        if local:  # this engine decodes it too: the whole request, its KV never moves
            stream, in_store = await self._add(
                task, prompt, rest, arrived, hold_kv=self.kvstore is not None
            )
        else:
            # Only the first token here; min_tokens >= 1 keeps it from being EOS (decode does
            # the rest).
            first_only = dataclasses.replace(rest, max_tokens=1, min_tokens=min(rest.min_tokens, 1))
            stream, in_store = await self._add(task, prompt, first_only, arrived)
        if stream is None:
            return
        ev = await stream.next()
        if ev is None or ev.token_id is None:  # aborted inside the engine: the loop is closing
            raise asyncio.CancelledError
        first = ev.token_id
        if local:
            reason = (ev.finish_reason or "stop") if ev.finished else None
        else:
            reason = self._first_token_reason(ev.finish_reason, rest.max_tokens, len(prompt))
        await self._send(
            subject,
            control_pb2.TokenEvent(
                request_id=rid,
                index=0,
                token_ids=[first],
                finished=reason is not None,
                finish_reason=reason or "",
                prompt_tokens=len(prompt) - prior,
                cached_tokens=ev.num_cached_tokens,
                logprobs=[ev.logprobs.to_proto()] if ev.logprobs is not None else [],
            ),
        )
        if self.kvstore is not None and not (local and reason is None):
            await self._write_back(task, len(prompt) // self.block_size - in_store, in_store)
        if reason is not None:
            REQUESTS.labels("finished").inc()
            return  # (a local request held for the write-back is freed by _forget)
        decode_task = control_pb2.DecodeTask(
            request_id=rid,
            token_ids=prompt + [first],
            num_prompt_tokens=len(prompt) - prior,  # the rest are outputs: decode's prior ones
            sampling=task.sampling,
            cache_salt=task.cache_salt,
            events_subject=subject,
            cached_tokens=ev.num_cached_tokens,
            traceparent=inject_traceparent(),
            traffic_class=task.traffic_class,
        )
        if ev.logprobs is not None:
            decode_task.first_logprobs.CopyFrom(ev.logprobs.to_proto())
        if local:
            assert self.local is not None
            REQUESTS.labels("decoding_here").inc()
            LATENCY.observe(time.perf_counter() - t0)
            try:
                await self.local.continue_here(decode_task, stream, in_store)
            except DeepserveError as exc:  # decode's checks refuse what they refuse of a push
                await self._send(subject, error_event(rid, exc, index=1))
            return
        try:
            if self.loop.engine.speculative is not None:  # drafts for decode's first step
                drafts = await self.loop.call(lambda e: e.take_drafts(rid))
                if drafts is not None:
                    decode_task.draft_token_ids.extend(drafts[0])
                    decode_task.draft_confidences.extend(drafts[1])
            with self.tracer.start_as_current_span("prefill.handoff"):
                await self._hand_over(task, decode_task, prompt)
        except InstanceFailed as exc:
            ERRORS.labels("push").inc()
            REQUESTS.labels("push_failed").inc()
            log.warning("request %s: %s", rid, exc)
            await self._send(subject, error_event(rid, exc, index=1))
            return
        finally:
            await self._release(rid)
        REQUESTS.labels("handed_over").inc()
        LATENCY.observe(time.perf_counter() - t0)

    def _check(self, task: control_pb2.PrefillTask, params: SamplingParams) -> None:
        if not task.request_id:
            raise InvalidArgument("PrefillTask.request_id must not be empty")
        if not task.prompt_token_ids:
            raise InvalidArgument("PrefillTask.prompt_token_ids must not be empty")
        prior = task.num_prior_outputs
        if not 0 <= prior < len(task.prompt_token_ids):
            raise InvalidArgument(
                f"PrefillTask.num_prior_outputs must lie in [0, {len(task.prompt_token_ids)}) "
                f"(the prompt must keep a token of its own), got {prior}"
            )
        if prior >= params.max_tokens:
            raise InvalidArgument(
                f"PrefillTask.num_prior_outputs ({prior}) leaves nothing to generate: "
                f"sampling.max_tokens ({params.max_tokens}) counts the whole completion"
            )
        if not task.decode_address:
            raise InvalidArgument(
                "PrefillTask.decode_address must name the decode instance (host:port)"
            )

    def _first_token_reason(
        self, engine_reason: str | None, max_tokens: int, prompt_len: int
    ) -> str | None:
        """Why the request ends at its first token, or None if decode continues it."""
        if engine_reason == "stop":
            return "stop"
        if max_tokens == 1 or prompt_len + 1 >= self.max_model_len:
            return "length"
        return None

    async def _add(
        self,
        task: control_pb2.PrefillTask,
        prompt: list[int],
        params: SamplingParams,
        arrived: float | None = None,
        hold_kv: bool = True,
    ) -> tuple[RequestStream | None, int]:
        """Queue the prompt (with cached KV if any); returns its stream and how many leading
        blocks the kvstore holds already (new blocks from there on are worth storing)."""
        rid = task.request_id
        salt = task.cache_salt
        try:
            cached = await self._load_cached(task, prompt)
            if cached is not None:
                try:
                    stream = await self.loop.add(
                        rid,
                        prompt,
                        params,
                        cache_salt=salt,
                        kv=cached,
                        hold_kv=hold_kv,
                        prior_outputs=task.num_prior_outputs,
                        arrival=arrived,
                    )
                    return stream, task.cached_blocks
                except (KVFormatError, NoFreeBlocks) as exc:
                    ERRORS.labels("kv_import").inc()
                    log.warning("request %s: cached KV not usable (%s); computing it", rid, exc)
            stream = await self.loop.add(
                rid,
                prompt,
                params,
                cache_salt=salt,
                hold_kv=hold_kv,
                prior_outputs=task.num_prior_outputs,
                arrival=arrived,
            )
            return stream, max(task.cached_blocks, 0)
        except InvalidRequest as exc:
            REQUESTS.labels("invalid").inc()
            await self._send(
                task.events_subject or subjects.token_events(rid),
                error_event(rid, InvalidArgument(f"prefill refused the request: {exc}")),
            )
            return None, 0

    async def _load_cached(
        self, task: control_pb2.PrefillTask, prompt: list[int]
    ) -> PreparedKV | None:
        """The kvstore's blocks of this prompt that this engine lacks, uploaded and ready to
        import (None: nothing worth loading -- the engine's own prefix cache does the rest)."""
        if self.kvstore is None or task.cached_blocks <= 0:
            return None
        usable = min(task.cached_blocks, (len(prompt) - 1) // self.block_size)
        if usable <= 0:
            return None
        hashes = chain_hashes(prompt[: usable * self.block_size], self.block_size, task.cache_salt)
        own = await self.loop.call(lambda e: e.resident_blocks(hashes))
        OWN_BLOCKS.inc(own)
        stats = self.loop.stats
        if stats.tokens_per_s:
            self.rates.observe_compute(stats.tokens_per_s)
        bpb = self.loop.engine.spec.bytes_per_block
        if not self.rates.worth_loading(usable - own, bpb, self.block_size):
            return None
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

    async def _hand_over(
        self, task: control_pb2.PrefillTask, decode_task: control_pb2.DecodeTask, prompt: list[int]
    ) -> None:
        """Send decode the blocks it lacks, by reference on this host, else as bytes."""
        rid, address, bs = task.request_id, task.decode_address, self.block_size
        full = chain_hashes(prompt[: (len(prompt) // bs) * bs], bs, task.cache_salt)
        have, same_host = 0, False
        if full:
            try:
                held = await self.pusher.match(address, full)
                have = max(0, min(held.blocks, len(full)))
                same_host = self.same_host_handoff and held.host == host_id()
            except InstanceFailed as exc:  # the push says what is wrong, or works
                log.info("request %s: Match on %s failed (%s); sending every block", rid, exc)
        total = -(-len(prompt) // bs)
        for _ in range(MAX_SENDS):
            kv = await self._kv_from(rid, have, same_host)
            try:
                await self.pusher.push(address, decode_task, kv)
            except KVResend as exc:
                if exc.send_bytes:
                    same_host = False
                    RESENDS.labels("send_bytes").inc()
                if exc.have_blocks is not None:
                    have = max(0, min(have, exc.have_blocks))
                    RESENDS.labels("missing_prefix").inc()
                continue
            HANDOFF_BLOCKS.labels("held").inc(have)
            HANDOFF_BLOCKS.labels("peer" if isinstance(kv, PeerKV) else "bytes").inc(total - have)
            return
        raise PushFailed(f"decode {address} refused the KV {MAX_SENDS} times; see its log")

    async def _kv_from(self, rid: str, start: int, same_host: bool) -> bytes | PeerKV:
        if same_host:
            ref = await self.loop.call(lambda e: e.peer_kv(rid, start))
            if ref is not None:
                return ref
        finish = await self.loop.call(
            lambda e: e.export_kv_async(rid, include_partial=True, start_block=start)
        )
        with self.tracer.start_as_current_span("prefill.export_kv"):
            return await asyncio.to_thread(finish)

    async def _release(self, rid: str) -> None:
        try:
            await asyncio.shield(self.loop.call(lambda e: e.release(rid)))
        except (EngineLoopClosed, asyncio.CancelledError):
            pass  # _forget frees it (closing aborts everything anyway)

    async def _write_back(self, task: control_pb2.PrefillTask, n_new: int, start: int) -> None:
        """Copy the prompt's new full blocks out of the engine (before the KV is released) and
        write them to the kvstore in the background, if the write-behind has room."""
        nbytes = max(n_new, 0) * self.loop.engine.spec.bytes_per_block
        rid = task.request_id
        if nbytes and not await self.writes.submit(
            nbytes,
            lambda: self.loop.call(lambda e: e.export_blocks_async(rid, start)),
            lambda finish: self._store(task, finish),
        ):
            STORE_DROPPED.inc()

    async def _store(
        self, task: control_pb2.PrefillTask, finish: Callable[[], list[Block]]
    ) -> None:
        assert self.kvstore is not None
        n = await write_back(
            self.kvstore, finish, task.cache_salt, task.traffic_class, log, task.request_id
        )
        if n < 0:
            ERRORS.labels("kvstore_put").inc()
        else:
            STORED_BLOCKS.inc(n)

    # -- helpers ------------------------------------------------------------------------------
    async def _forget(self, rid: str) -> None:
        """Make sure the engine holds nothing for ``rid`` (abort frees held KV too)."""
        try:
            await asyncio.shield(self.loop.abort(rid))
        except (EngineLoopClosed, asyncio.CancelledError):
            pass

    async def _send(self, subject: str, msg: control_pb2.TokenEvent) -> None:
        try:
            await self.publish(subject, msg.SerializeToString())
        except Exception as exc:  # noqa: BLE001 - the entrypoint's timeout covers a lost event
            log.warning("publishing %s for %s failed: %s", subject, msg.request_id, exc)

    @property
    def num_active(self) -> int:
        return len(self._tasks)

    def status(self) -> control_pb2.InstanceStatus:
        return instance_status(
            self.loop.stats,
            instance_id=self.instance_id,
            role=control_pb2.ROLE_PREFILL,
            model=self.model_name,
            address="",
            draining=self.draining,
            block_size=self.block_size,
        )

    async def drain(self, timeout_s: float) -> None:
        """Take nothing new; finish tasks for up to ``timeout_s``; cut the rest; flush cache
        writes."""
        self.draining = True
        await drain_tasks(list(self._tasks.values()), timeout_s, "prefill tasks", log)
        await self.writes.drain(5.0)
