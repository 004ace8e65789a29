"""``deepserve.v1.Generate``: validate, look up the cached prefix, route, relay token events.

The handler talks to the world through two small interfaces, :class:`Bus` (NATS in
production) and :class:`PrefixLookup` (the kvstore), so tests drive it with in-process fakes;
an attempt's calls upstream (salt, lookup, route, task, abort) are ``upstream.py``'s, who may
call and what it is billed ``callers.py``'s, token events and resends ``receive.py``'s.
Inner code raises the kinds of :mod:`libs.common.errors`; :meth:`Generate` maps them to a gRPC
status once (:func:`libs.common.grpc_errors.abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from opentelemetry import trace

from libs.common import grpc_errors, subjects
from libs.common.errors import (
    AlreadyExists,
    DeepserveError,
    Internal,
    Overloaded,
    Unavailable,
)
from libs.common.request_key import request_key
from libs.common.telemetry import extract_context, inject_traceparent, tracer
from libs.gateway.admission import Admission, Grant
from libs.gateway.capacity import Capacity, CapacityConfig, Need
from libs.gateway.policy import (
    Finish,
    Output,
    Ready,
    ReorderOverflow,
    RequestStream,
    Tokens,
    ValidRequest,
    joined,
    validate_request,
)
from libs.gateway.retry import (
    Action,
    AttemptFailed,
    Liveness,
    Progress,
    Watch,
    decide,
    exact_continuation,
)
from libs.proto.deepserve.v1 import (
    control_pb2,
    generate_pb2,
    generate_pb2_grpc,
)
from libs.transport.keycaps import KeyCaps

from .admission import AdmissionMetrics, load_from_status, need_of
from .callers import CallAccount, Callers
from .contracts import Bus as Bus
from .contracts import BusUnavailable as BusUnavailable
from .contracts import LookupFailed as LookupFailed
from .contracts import PrefixLookup as PrefixLookup
from .contracts import Resender as Resender
from .contracts import ResendFailed as ResendFailed
from .contracts import Subscription as Subscription
from .delivery import TaskSender
from .handler_config import HandlerConfig as HandlerConfig
from .handler_config import attempt_id, give_up, new_request_id, outcome_of, to_proto
from .ledger import Ledger
from .metrics import (
    INFLIGHT,
    REJECTED,
    REQUEST_SECONDS,
    REQUESTS,
    RETRIES,
    RETRY_AFTER,
    TOKENS,
    TTFT_SECONDS,
)
from .receive import EventReader, Refill
from .request_log import RequestRecord, log_request
from .request_metrics import RequestMetrics, RequestTimes, finished_reason
from .upstream import Upstream

log = logging.getLogger("entrypoint")
TRACER = tracer("entrypoint")


@dataclass
class _Admitted:
    """The grant a call holds across its attempts (released once, when the call ends), and
    the call's moments (request metrics: when it was admitted)."""

    times: RequestTimes
    grant: Grant | None = None


class EntrypointHandlers(generate_pb2_grpc.GenerateServicer):
    def __init__(
        self,
        config: HandlerConfig,
        bus: Bus,
        kv: PrefixLookup,
        liveness: Liveness | None = None,
        resender: Resender | None = None,
        tasks: TaskSender | None = None,
        caps: KeyCaps | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.config, self.liveness, self.resender = config, liveness, resender
        # the kvstore, the balancer and prefill, as one attempt calls them
        self.upstream = Upstream(config, bus, kv, tasks)
        self.reader = EventReader(config, resender)
        # an API key's limits (shared through Redis when caps holds a client) and usage records
        self.callers = Callers(config, caps or KeyCaps(config.key_limits))
        self.ledger = ledger
        self.draining = False
        self._active: set[str] = set()
        # prefill instance -> its heartbeat's resident-prefix summary (first bytes of digests)
        self._resident: dict[str, frozenset[bytes]] = {}
        self.capacity = (
            Capacity(
                CapacityConfig(
                    block_size=config.limits.block_size,
                    prefill_queue_tokens=config.prefill_queue_tokens,
                    prefill_queue_seconds=config.prefill_queue_seconds,
                    dead_after=config.instance_dead_after,
                )
            )
            if config.capacity_admission
            else None
        )
        self.admission_metrics = AdmissionMetrics(self.capacity)
        self.request_metrics = RequestMetrics(config.limits.model_name)
        self.admission = Admission(
            config.max_inflight,
            config.max_waiting,
            config.admit_wait,
            config.retry_after_ms,
            capacity=self.capacity,
            observer=self.admission_metrics,
            weights=config.tenant_weights,
        )
        self._background: set[asyncio.Task[None]] = set()

    def on_status(self, status: control_pb2.InstanceStatus) -> None:
        """A heartbeat (``ds.heartbeat.*``): refresh the routing view kept for when no balancer
        answers (``last_view.py``) and capacity, admit waiting requests it fits."""
        self.upstream.view.observe(status)
        if self.capacity is None:
            return
        try:
            load = load_from_status(status)
        except ValueError as exc:
            log.debug("ignoring a heartbeat: %s", exc)
            return
        self.capacity.observe(load)
        self.admission_metrics.on_heartbeat(load)
        if status.role == control_pb2.ROLE_PREFILL:
            self._resident[status.instance_id] = frozenset(status.resident_prefixes)
        self.admission.wake()

    @property
    def bus(self) -> Bus:
        return self.upstream.bus

    @bus.setter
    def bus(self, bus: Bus) -> None:
        self.upstream.bus = bus

    @property
    def inflight(self) -> int:
        return len(self._active)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateEvent]:
        started = time.monotonic()
        INFLIGHT.inc()
        outcome = "cancelled"  # stays so only if the client goes away (CancelledError)
        record = RequestRecord()
        times = RequestTimes(received=started)
        counted = False  # passed validation: a request of the model (request metrics)
        account: CallAccount | None = None
        try:
            caller = self.callers.authenticate(request, context)
            valid, rid = self._admit(caller.request)
            counted = True
            record.request_id = rid
            record.tenant_label = self.config.labels(valid.tenant)
            record.prompt_tokens = len(valid.prompt_token_ids)
            try:
                slot = await self.callers.admit(caller, valid)
                account = CallAccount(
                    self.ledger, self.callers.caps, caller, valid, rid, slot, self._spawn
                )
                self.admission.refuse_if_full(
                    self._need(valid.prompt_token_ids, [], 0, valid.sampling.max_tokens),
                    valid.model,
                    valid.tenant,
                )
                metadata = dict(context.invocation_metadata() or ())
                parent = extract_context(str(metadata.get("traceparent", "")))
                async with contextlib.aclosing(
                    self._generate(valid, rid, parent, started, record, times, account)
                ) as events:
                    async for event in events:
                        yield event
            finally:
                self._active.discard(rid)
            outcome = "ok"
        except DeepserveError as exc:  # the one place errors become a gRPC status
            outcome = outcome_of(exc)
            if isinstance(exc, Overloaded):
                REJECTED.inc()
                RETRY_AFTER.observe(exc.retry_after_ms / 1000)
            log.info("request failed (%s): %s", grpc_errors.status_code(exc).name, exc)
            await grpc_errors.abort(context, exc)
        except Exception:
            outcome = "error"
            log.exception("request failed")
            raise
        finally:
            if account is not None:
                account.end(outcome)
            INFLIGHT.dec()
            ended = time.monotonic()
            REQUESTS.labels(outcome).inc()
            REQUEST_SECONDS.observe(ended - started)
            if counted:
                reason = finished_reason(outcome, record.finish_reason)
                self.request_metrics.finished(times, reason, ended)
            log_request(log, record, outcome, ended - started)

    def _admit(self, request: generate_pb2.GenerateRequest) -> tuple[ValidRequest, str]:
        if self.draining:
            raise Unavailable("this entrypoint is shutting down; retry on another")
        valid = validate_request(request, self.config.limits)  # InvalidArgument, NotFound
        rid = valid.request_id or new_request_id()
        if rid in self._active:
            raise AlreadyExists(f"request_id {rid!r} is already in flight; use a new one")
        self._active.add(rid)
        return valid, rid

    async def _generate(
        self,
        valid: ValidRequest,
        rid: str,
        parent: Any,
        started: float,
        record: RequestRecord,
        times: RequestTimes,
        account: CallAccount,
    ) -> AsyncGenerator[generate_pb2.GenerateEvent, None]:
        span = TRACER.start_span(
            "entrypoint.generate",
            context=parent,
            attributes={
                "deepserve.request_id": rid,
                "deepserve.prompt_tokens": len(valid.prompt_token_ids),
            },
        )
        trace_id = span.get_span_context().trace_id
        record.trace_id = f"{trace_id:032x}" if trace_id else ""
        progress = Progress(valid.prompt_token_ids, valid.sampling.max_tokens)
        exact = exact_continuation(valid.sampling.temperature, valid.sampling.seed)
        admitted = _Admitted(times)
        try:
            for attempt in itertools.count(1):
                record.attempts = attempt
                try:
                    async with contextlib.aclosing(
                        self._attempt(valid, rid, span, progress, started, admitted)
                    ) as outputs:
                        async for out in outputs:
                            if isinstance(out, Ready):
                                await account.ready(out.prompt_tokens, out.cached_tokens)
                            if isinstance(out, Tokens):
                                # billed before it is sent (ledger.py: a write-ahead)
                                total = account.completion_tokens + len(out.token_ids)
                                await account.delivering(total)
                                now = time.monotonic()
                                if record.ttft_s is None:
                                    record.ttft_s = now - started
                                times.sent(len(out.token_ids), now)
                            if isinstance(out, Finish):
                                record.speculative = out.speculative
                                record.finish_reason = out.reason
                            yield to_proto(out, rid)
                    return
                except AttemptFailed as exc:
                    action = decide(
                        retryable=True,
                        attempt=attempt,
                        max_attempts=self.config.max_attempts,
                        tokens_sent=len(progress.sent),
                        exact=exact,
                    )
                    if action is Action.FAIL:
                        RETRIES.labels("gave_up").inc()
                        raise Unavailable(
                            give_up(rid, exc, attempt, len(progress.sent), exact)
                        ) from None
                    RETRIES.labels(action.value).inc()
                    progress.exclude(exc.instances)
                    log.warning(
                        "request %s: attempt %d failed (%s); retrying (%s, %d tokens sent, "
                        "excluding %s)",
                        rid,
                        attempt,
                        exc,
                        action.value,
                        len(progress.sent),
                        ", ".join(progress.excluded) or "none",
                    )
        finally:
            record.cached_tokens, record.completion_tokens = (
                progress.cached_tokens,
                len(progress.sent),
            )
            if admitted.grant is not None:
                self.admission.release(admitted.grant)
            span.end()

    def _need(
        self, prompt: tuple[int, ...], hashes: list[bytes], cached_blocks: int, max_tokens: int
    ) -> Need:
        return need_of(
            self.capacity, self._resident, self.config.limits.block_size,
            prompt, hashes, cached_blocks, max_tokens,
        )  # fmt: skip

    async def _admit_attempt(self, admitted: _Admitted, need: Need, tenant: str) -> Grant:
        """The first attempt waits its turn in ``tenant``'s queue (or is refused); a retry is
        already admitted and only moves its reservation to its new prompt. ``tenant``: the
        authenticated one (``Callers.authenticate``: the key's, or the service caller's)."""
        if admitted.grant is None:
            waited_from = time.monotonic()
            admitted.grant = await self.admission.acquire(
                need, self.config.limits.model_name, tenant
            )
            admitted.times.admit(waited_from, time.monotonic())
        else:
            self.admission.rebook(admitted.grant, need, self.config.limits.model_name)
        return admitted.grant

    async def _attempt(
        self,
        valid: ValidRequest,
        rid: str,
        span: Any,
        progress: Progress,
        started: float,
        admitted: _Admitted,
    ) -> AsyncGenerator[Output, None]:
        """One attempt on one prefill + decode pair; raises AttemptFailed if an instance fails."""
        sub: Subscription | None = None
        finished_upstream = False
        abort_reason = "cancelled"  # the client went away, or shutdown ran out of grace
        wire = attempt_id(rid)
        prompt = progress.attempt_prompt
        generated = 0  # tokens of this attempt seen so far
        try:
            up = self.upstream
            salt = up.salt(valid.tenant)
            hashes = await up.hashes(prompt, salt)
            cached_blocks = await up.lookup(wire, hashes)
            need = self._need(prompt, hashes, cached_blocks, progress.remaining)
            grant = await self._admit_attempt(admitted, need, valid.tenant)
            decision = await up.route(
                valid, wire, len(prompt), hashes, cached_blocks, progress.excluded, grant.avoid
            )
            self.admission.bind(
                grant, decision.prefill_instance, decision.decode_instance, request_key(wire)
            )
            span.add_event(
                "attempt",
                {
                    "deepserve.attempt_id": wire,
                    "deepserve.cached_blocks": cached_blocks,
                    "deepserve.prefill": decision.prefill_instance,
                    "deepserve.decode": decision.decode_instance,
                },
            )
            sub = await self.bus.subscribe(subjects.token_events(wire))  # before the task goes out
            with trace.use_span(span, end_on_exit=False):
                traceparent = inject_traceparent()
            task = control_pb2.PrefillTask(
                request_id=wire,
                prompt_token_ids=prompt,
                # The whole request's settings: a retry's prior outputs (the end of prompt)
                # count towards max_tokens and min_tokens, as in the uninterrupted run.
                sampling=valid.sampling.to_proto(),
                num_prior_outputs=progress.prior_outputs,
                cache_salt=salt,
                tenant_weight=self.admission.weight_of(valid.tenant),
                traffic_class=cast(Any, valid.traffic_class),
                cached_blocks=cached_blocks,
                decode_instance=decision.decode_instance,
                decode_address=decision.decode_address,
                events_subject=subjects.token_events(wire),
                traceparent=traceparent,
            )
            try:
                await up.send_task(decision.prefill_instance, task.SerializeToString())
            except AttemptFailed:
                abort_reason = "instance failed"
                raise
            stream = RequestStream(prompt_tokens=len(prompt), max_tokens=progress.remaining)
            watch = Watch(self.liveness, decision.prefill_instance, decision.decode_instance)
            refill = (
                Refill(decision.decode_address, self.resender.reconnects())
                if self.resender is not None and decision.decode_address
                else None
            )
            while not stream.done:
                outputs: list[Output] = []
                failure: Exception | None = None  # raised once what came before it is sent
                # Every event already here goes out as one: a client (or this loop) that fell
                # behind catches up in one message, not one per token.
                while not outputs or (sub.ready() and not stream.done):
                    try:
                        chunk = await self.reader.next_chunk(sub, wire, watch, stream, refill)
                        watch.saw(chunk.index + max(0, len(chunk.token_ids) - 1))
                        outputs += stream.push(chunk)
                    except AttemptFailed as exc:
                        abort_reason, failure = "instance failed", exc
                    except DeepserveError as exc:
                        abort_reason, failure = outcome_of(exc), exc
                    except ReorderOverflow as exc:
                        abort_reason, failure = "error", Internal(f"request {rid}: {exc}")
                    if failure is not None:
                        break
                    generated = max(generated, chunk.index + len(chunk.token_ids))  # resends
                    self.admission.saw(grant, chunk.index, generated)
                for out in joined(outputs):
                    shown = progress.translate(out)
                    if shown is None:
                        continue
                    if isinstance(shown, Tokens) and len(progress.sent) == len(shown.token_ids):
                        TTFT_SECONDS.observe(time.monotonic() - started)
                    yield shown
                if failure is not None:
                    raise failure
            finished_upstream = not stream.truncated
            abort_reason = "completion past max_tokens"
            TOKENS.labels("prompt").inc(len(progress.prompt))
            TOKENS.labels("cached").inc(progress.cached_tokens)
            TOKENS.labels("completion").inc(len(progress.sent))
        finally:
            if sub is not None:
                if not finished_upstream:
                    log.info("request %s: aborting upstream (%s)", wire, abort_reason)
                    self._spawn(self.upstream.abort(wire, abort_reason))
                await sub.close()

    def _spawn(self, coro: Any) -> None:
        # Not awaited inline: the caller may be a cancelled task, and the abort must still go out.
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_idle(self, timeout: float) -> None:
        """Shutdown: wait for handlers to finish (gRPC may return from ``stop`` while
        cancelled handlers still run their cleanup) and for pending aborts to go out."""
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._background:
            await asyncio.wait(set(self._background), timeout=max(0.1, deadline - time.monotonic()))
