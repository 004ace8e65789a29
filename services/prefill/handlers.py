"""Prefill: compute a prompt and its first token, hand the KV to decode, keep new blocks.

:class:`PrefillHandler` holds the logic; the transports come in as small interfaces
(``publish`` for TokenEvents, a :class:`KVPusher` for decode, an optional :class:`KVStore`),
so tests wire it to a decode handler in the same process.

One task, in order:

1. cached prefix: of the ``cached_blocks`` leading blocks the entrypoint found in the kvstore,
   those still in this engine's own cache are used as they are; only the rest are fetched
   when loading them beats computing them (``kvstore_io.py``; any failure: compute them);
2. the engine computes the rest with ``max_tokens=1`` and keeps the KV (``hold_kv``);
3. TokenEvent index 0 with the first token (finished if it is EOS/stop, or max_tokens == 1);
4. hand-over (``handoff.py``): only the blocks decode lacks, by reference into this engine's
   KV pool when decode runs on this host, else as bytes; the engine's copy is released right
   after;
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
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from opentelemetry import trace

from libs.common import subjects
from libs.common.errors import DeepserveError, InstanceFailed, InvalidArgument, Unavailable
from libs.common.sampling import SamplingParams
from libs.common.telemetry import extract_context, inject_traceparent
from libs.engine.engine import InvalidRequest, KVFormatError, NoFreeBlocks
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.aborts import RecentAborts, RecentIds
from libs.serving.convert import error_event
from libs.serving.engine_loop import EngineLoop
from libs.serving.handoff import KVPusher
from libs.serving.instance import drain_tasks, instance_status
from libs.serving.request_stream import EngineFailed, EngineLoopClosed, NotAdded, RequestStream
from libs.transport.kvstore_client import Block, KVStore

from .handoff import HandOff, PushFailed
from .kvstore_io import PrefixStore
from .metrics import DUPLICATES, ERRORS, FORGED, LATENCY, REQUESTS

__all__ = [  # and what tests read from here: the KV frame type, the forged-block counter
    "Block",
    "FORGED",
    "LocalDecode",
    "PrefillHandler",
    "PushFailed",
    "TaskMessage",
]

log = logging.getLogger("prefill")

Publish = Callable[[str, bytes], Awaitable[None]]

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
        # same_host_handoff False: always bytes (tests, debugging)
        self.handoff = HandOff(loop, pusher, block_size, self.tracer, same_host_handoff)
        self.store = PrefixStore(loop, kvstore, block_size) if kvstore is not None else None
        self.local = local  # aggregated: this engine's own decode role
        self.draining = False
        self.aborted = RecentAborts()
        self.seen = RecentIds(TASK_MEMORY_S, TASK_MEMORY_MAX)  # task ids taken lately
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cut: dict[str, str] = {}  # request id -> why it was cancelled ("abort", "shutdown")

    @property
    def same_host_handoff(self) -> bool:
        """False: hand KV over as bytes even to a decode instance on this host."""
        return self.handoff.same_host

    @same_host_handoff.setter
    def same_host_handoff(self, value: bool) -> None:
        self.handoff.same_host = value

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
        if self.store is not None and not (local and reason is None):
            n_new = len(prompt) // self.block_size - in_store
            await self.store.write_back(task, n_new, in_store)
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
                await self.handoff.send(task, decode_task, prompt)
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
        blocks the kvstore holds already (new blocks from there on are worth storing).

        One engine command where the engine's own prefix cache has what the kvstore has (or
        loading would not pay): it checks that and adds the request at once. Otherwise the
        blocks it lacks are fetched, and the request added with them."""
        rid = task.request_id
        add = functools.partial(
            self.loop.add,
            rid,
            prompt,
            params,
            cache_salt=task.cache_salt,
            weight=task.tenant_weight or 1.0,
            hold_kv=hold_kv,
            prior_outputs=task.num_prior_outputs,
            arrival=arrived,
        )
        try:
            load = self.store.plan(task, prompt) if self.store is not None else None
            if load is None:
                return await add(), max(task.cached_blocks, 0)
            try:
                return await add(unless=load.worth_it), max(task.cached_blocks, 0)
            except NotAdded:  # the kvstore has blocks this engine lacks, worth loading
                pass
            cached = await load.store.fetch(task, load)
            if cached is not None:
                try:
                    return await add(kv=cached), task.cached_blocks
                except (KVFormatError, NoFreeBlocks) as exc:
                    ERRORS.labels("kv_import").inc()
                    log.warning("request %s: cached KV not usable (%s); computing it", rid, exc)
            return await add(), max(task.cached_blocks, 0)
        except InvalidRequest as exc:
            REQUESTS.labels("invalid").inc()
            await self._send(
                task.events_subject or subjects.token_events(rid),
                error_event(rid, InvalidArgument(f"prefill refused the request: {exc}")),
            )
            return None, 0

    async def _release(self, rid: str) -> None:
        try:
            await asyncio.shield(self.loop.call(lambda e: e.release(rid)))
        except (EngineLoopClosed, asyncio.CancelledError):
            pass  # _forget frees it (closing aborts everything anyway)

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
        if self.store is not None:
            await self.store.writes.drain(5.0)
