"""``deepserve.v1.Generate``: validate, look up the cached prefix, route, relay token events.

The handler talks to the world through two small interfaces, :class:`Bus` (NATS in
production) and :class:`PrefixLookup` (the kvstore), so tests drive it with in-process fakes.
Inner code raises the kinds of :mod:`libs.common.errors`; :meth:`Generate` maps them to a gRPC
status once (:func:`libs.common.grpc_errors.abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from google.protobuf.message import DecodeError
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from libs.common import grpc_errors, subjects
from libs.common.auth import KeyTable
from libs.common.errors import (
    AlreadyExists,
    DeadlineExceeded,
    DeepserveError,
    Internal,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from libs.common.grpc_auth import bearer, same_token
from libs.common.hashchain import chain_hashes, tenant_salt
from libs.common.sampling import TokenLogprob
from libs.common.telemetry import extract_context, inject_traceparent, tracer
from libs.gateway.admission import Admission, Grant
from libs.gateway.capacity import PREFILL, Capacity, CapacityConfig, Need
from libs.gateway.policy import (
    Chunk,
    Finish,
    Limits,
    Output,
    Ready,
    ReorderOverflow,
    RequestStream,
    Tokens,
    ValidRequest,
    lookup_prefix,
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
    common_pb2,
    control_pb2,
    generate_pb2,
    generate_pb2_grpc,
)
from libs.routing.policy import resident_run

from .admission import AdmissionMetrics, load_from_status
from .delivery import TaskSender, deliver
from .request_log import RequestRecord, log_request
from .request_metrics import RequestMetrics, RequestTimes, finished_reason

log = logging.getLogger("entrypoint")
TRACER = tracer("entrypoint")

REQUESTS = Counter("deepserve_entrypoint_requests_total", "Generate calls by outcome", ["outcome"])
INFLIGHT = Gauge("deepserve_entrypoint_inflight_requests", "Generate calls in progress")
REQUEST_SECONDS = Histogram(
    "deepserve_entrypoint_request_seconds",
    "Generate call duration",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
TTFT_SECONDS = Histogram(
    "deepserve_entrypoint_time_to_first_token_seconds",
    "From the call to the first token sent",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TOKENS = Counter("deepserve_entrypoint_tokens_total", "Tokens by kind", ["kind"])
RETRIES = Counter(
    "deepserve_entrypoint_retries_total",
    "failed attempts by what followed (fresh, continue, gave_up)",
    ["action"],
)
REJECTED = Counter(
    "deepserve_entrypoint_rejected_total",
    "requests refused with RESOURCE_EXHAUSTED (no capacity within --admit-wait, or queue full)",
)
RETRY_AFTER = Histogram(
    "deepserve_entrypoint_retry_after_seconds",
    "retry hints sent with RESOURCE_EXHAUSTED (from the measured drain rates)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
RESENT = Counter(
    "deepserve_entrypoint_resent_tokens_total",
    "tokens lost on the bus and sent again by decode instances (a NATS outage)",
)
TASK_COPIES = Counter(
    "deepserve_entrypoint_prefill_task_copies_total",
    "PrefillTasks sent again: not confirmed (a NATS outage, the instance not subscribed yet)",
)
LOOKUP_ERRORS = Counter(
    "deepserve_entrypoint_kvstore_lookup_errors_total",
    "kvstore lookups that failed (treated as a miss)",
)

# Route requests carry the leading chain digests for cache-aware routing; 256 blocks (32K
# tokens, 8 KiB) say where a prompt's prefix lives without shipping a 160K-token chain.
MAX_ROUTE_HASHES = 256
# Between two route requests answered "no instance" just after a NATS outage (heartbeats
# come every 1 s; the bus settles for 3 s).
ROUTE_RETRY_PAUSE_S = 0.25
# Hash long prompts off the event loop: 160K tokens take ~20 ms of SHA-256 and packing.
INLINE_HASH_TOKENS = 16384


class BusUnavailable(Unavailable):
    """A request on the bus found no responder, or none answered in time."""


class LookupFailed(Unavailable):
    """The kvstore could not answer (treated as a miss)."""


class ResendFailed(Unavailable):
    """The decode instance could not be asked for lost token events (asked again later)."""


class Subscription(Protocol):
    async def next(self, timeout: float) -> bytes:
        """The next payload; raises TimeoutError after ``timeout`` seconds without one."""

    async def close(self) -> None: ...


class Bus(Protocol):
    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        """The reply's payload; raises :class:`Unavailable` (or a subclass) if none comes."""

    async def publish(self, subject: str, data: bytes) -> None: ...

    async def subscribe(self, subject: str) -> Subscription:
        """A subscription that is live at the server when this returns."""


class Resender(Protocol):
    """Token events lost on the bus, back from the decode instance (gRPC in production).

    Token events are core NATS: those published while NATS is down, or before this
    entrypoint's subscription is back on a restarted server, are gone. The decode instance
    keeps what it published (``libs/serving/replay.py``) and sends it again on request.
    """

    def reconnects(self) -> int:
        """How many times the bus connection came back so far (it only grows)."""

    async def settle(self) -> None:
        """Wait until the server has this entrypoint's subscriptions again after a
        reconnection; raises :class:`ResendFailed` if it cannot tell yet."""

    async def resend(
        self, address: str, request_id: str, from_index: int
    ) -> list[control_pb2.TokenEvent] | None:
        """The events of ``request_id`` from ``from_index`` on, from the decode instance at
        ``address``; None if it does not know the request; raises :class:`ResendFailed`."""


@dataclass
class _Refill:
    """One attempt's watch for lost token events: after a bus reconnection, or when a gap
    in the indices outlives ``liveness_poll``, the decode instance is asked for the events
    from the first missing position (at most once per ``liveness_poll``)."""

    address: str
    reconnects: int  # bus reconnections already accounted for
    gap_since: float | None = None
    asked_at: float = float("-inf")
    queued: list[control_pb2.TokenEvent] = field(default_factory=list)


class PrefixLookup(Protocol):
    async def lookup(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` the kvstore holds; raises LookupFailed."""


@dataclass(frozen=True)
class HandlerConfig:
    limits: Limits = field(default_factory=Limits)
    route_timeout: float = 2.0
    request_timeout: float = 60.0  # longest silence between two token events
    # A PrefillTask copy's wait for the instance's confirmation (delivery.py): a round trip
    # on a healthy bus; past it, a copy the server handed to a subscriber counts as arrived.
    task_ack_timeout: float = 1.0
    # Admission (libs/gateway/admission.py): a request starts when fewer than max_inflight
    # run (0 = no cap) and, with capacity_admission, some prefill instance can queue its
    # uncached tokens within prefill_queue_seconds of work at its measured rate (within
    # prefill_queue_tokens, 0 = no limit, until it has measured one) and some decode instance has
    # KV blocks for prompt + max_tokens, as heartbeats (fed to on_status) and this
    # entrypoint's own reservations say. Otherwise up to max_waiting requests wait up to
    # admit_wait seconds, queued per tenant (the authenticated one) and admitted by weighted fair
    # queuing over tenants by uncached prompt tokens (tenant_weights; others weigh 1); the rest
    # get RESOURCE_EXHAUSTED at once with a retry hint from the measured drain rates
    # (retry_after_ms until one is measured; gRPC trailing metadata "retry-after-ms"). Off by
    # default here, so a handler with no heartbeat feed (tests, embedders) admits by
    # max_inflight alone; the service turns it on (--capacity-admission).
    max_inflight: int = 256
    max_waiting: int = 256
    admit_wait: float = 1.0
    retry_after_ms: int = 500
    capacity_admission: bool = False
    prefill_queue_tokens: int = 65_536
    prefill_queue_seconds: float = 2.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    # Failures: attempts per request; an instance whose heartbeat (every 1 s) is silent longer
    # than instance_dead_after counts as dead, checked every liveness_poll seconds of silence,
    # so a kill -9 is noticed within instance_dead_after + liveness_poll (3.5 s by default).
    max_attempts: int = 3
    instance_dead_after: float = 3.0
    liveness_poll: float = 0.5
    # The secret of the tenants' cache salts (libs/common/hashchain.py: tenant_salt): every
    # entrypoint of a deployment needs the same one. Empty: a random one for this process
    # (cached prefixes then do not survive its restart nor match another entrypoint's).
    salt_secret: bytes = field(default=b"", repr=False)
    # Who may call Generate (docs/security.md): with api_keys, a caller presents one of them
    # (its tenant then comes from the key, whatever the request says) or the service token
    # (internal front ends such as the recipe, which authenticated the client; the request's
    # tenant is trusted); with only a service token, that token; with neither, anyone.
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    service_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        for name in ("max_inflight", "max_waiting", "retry_after_ms", "prefill_queue_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.prefill_queue_seconds >= 0:
            raise ValueError(
                f"prefill_queue_seconds must be >= 0, got {self.prefill_queue_seconds}"
            )
        if self.admit_wait < 0:
            raise ValueError(f"admit_wait must be >= 0 seconds, got {self.admit_wait}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("instance_dead_after", "liveness_poll", "task_ack_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.route_timeout > 0:
            raise ValueError(f"route_timeout must be > 0 seconds, got {self.route_timeout}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")


def outcome_of(exc: DeepserveError) -> str:
    """The requests metric's ``outcome`` label for a call that ended with ``exc``."""
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, DeadlineExceeded):
        return "timeout"
    if exc.retryable:
        return "unavailable"
    return "error" if isinstance(exc, Internal) else "invalid"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def attempt_id(request_id: str) -> str:
    """The id one attempt at a request carries upstream (subjects, tasks, aborts).

    Unique per attempt, so instances that remember an earlier attempt's abort never mistake
    a client's retry under the same request id for it.
    """
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def to_proto(out: Output, request_id: str) -> generate_pb2.GenerateEvent:
    if isinstance(out, Ready):
        return generate_pb2.GenerateEvent(
            ready=generate_pb2.Ready(
                request_id=request_id,
                prompt_tokens=out.prompt_tokens,
                cached_tokens=out.cached_tokens,
            )
        )
    if isinstance(out, Tokens):
        return generate_pb2.GenerateEvent(
            tokens=generate_pb2.Tokens(
                token_ids=out.token_ids, logprobs=[lp.to_proto() for lp in out.logprobs]
            )
        )
    assert isinstance(out, Finish)
    usage = common_pb2.Usage(
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        completion_tokens=out.completion_tokens,
    )
    return generate_pb2.GenerateEvent(finish=generate_pb2.Finish(reason=out.reason, usage=usage))


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
    ) -> None:
        self.config, self.bus, self.kv, self.liveness = config, bus, kv, liveness
        self.resender = resender
        self.tasks = tasks  # None: tasks are published once (an in-process bus loses none)
        self.draining = False
        self._active: set[str] = set()
        self._salt_secret = config.salt_secret or secrets.token_bytes(32)
        if not config.salt_secret:
            log.warning(
                "no --cache-salt-secret: tenants' cache names use a random secret of this "
                "process (cached prefixes will not survive a restart or match other entrypoints)"
            )
        self._salts: dict[str, bytes] = {}
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
        """A heartbeat (``ds.heartbeat.*``): refresh capacity, admit waiting requests it fits."""
        if self.capacity is None:
            return
        try:
            load = load_from_status(status)
        except ValueError as exc:
            log.debug("ignoring a heartbeat: %s", exc)
            return
        self.capacity.observe(load)
        self.admission_metrics.on_heartbeat()
        if status.role == control_pb2.ROLE_PREFILL:
            self._resident[status.instance_id] = frozenset(status.resident_prefixes)
        self.admission.wake()

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
        try:
            request = self._authenticate(request, context)
            valid, rid = self._admit(request)
            counted = True
            record.request_id, record.tenant = rid, valid.tenant
            record.prompt_tokens = len(valid.prompt_token_ids)
            try:
                self.admission.refuse_if_full(
                    self._need(valid.prompt_token_ids, [], 0, valid.sampling.max_tokens),
                    valid.model,
                    valid.tenant,
                )
                metadata = dict(context.invocation_metadata() or ())
                parent = extract_context(str(metadata.get("traceparent", "")))
                async with contextlib.aclosing(
                    self._generate(valid, rid, parent, started, record, times)
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
            INFLIGHT.dec()
            ended = time.monotonic()
            REQUESTS.labels(outcome).inc()
            REQUEST_SECONDS.observe(ended - started)
            if counted:
                reason = finished_reason(outcome, record.finish_reason)
                self.request_metrics.finished(times, reason, ended)
            log_request(log, record, outcome, ended - started)

    def _authenticate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> generate_pb2.GenerateRequest:
        """The request as this caller may send it: its tenant is the key's when a key was
        presented; raises Unauthenticated for a caller without a credential it needs."""
        cfg = self.config
        if not cfg.api_keys and not cfg.service_token:
            return request  # open (local use): said at start
        presented = bearer(context.invocation_metadata() or ())
        if same_token(presented, cfg.service_token):
            return request
        if cfg.api_keys and presented is not None:
            tenant = KeyTable(cfg.api_keys).tenant_of(presented)
            if tenant is not None:
                if request.tenant == tenant:
                    return request
                out = generate_pb2.GenerateRequest()
                out.CopyFrom(request)
                out.tenant = tenant
                return out
        raise Unauthenticated(
            "Generate needs a credential: authorization: Bearer <API key>"
            + (" or the service token" if cfg.service_token else "")
            + ("" if presented is None else " (the one presented is not valid)")
        )

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
                            if isinstance(out, Tokens):
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
                            self._give_up(rid, exc, attempt, len(progress.sent), exact)
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

    @staticmethod
    def _give_up(rid: str, exc: AttemptFailed, attempt: int, sent: int, exact: bool) -> str:
        if sent and not exact:
            why = (
                f"{sent} tokens were already sent and unseeded sampling cannot be continued "
                "exactly: a resumed attempt keeps the grammar, penalties and stop state, but its "
                "draws would not be the ones the failed instance would have made (set a seed "
                "for exact failover)"
            )
        else:
            why = f"after {attempt} attempt{'s' if attempt > 1 else ''}"
        return f"request {rid} failed: {exc} ({why}); retry"

    def _need(
        self, prompt: tuple[int, ...], hashes: list[bytes], cached_blocks: int, max_tokens: int
    ) -> Need:
        """What the request takes: its uncached tokens are those neither the kvstore nor the
        best prefill instance's GPU cache (its heartbeat's resident summary) holds -- the
        balancer routes a prompt to the instance that has its prefix."""
        live = self.capacity.candidates(PREFILL) if self.capacity is not None else []
        best = max(
            (
                resident_run(self._resident[p.instance_id], hashes)
                for p in live
                if p.instance_id in self._resident
            ),
            default=0,
        )
        cached = min(max(cached_blocks, best) * self.config.limits.block_size, len(prompt))
        return Need(len(prompt), len(prompt) - cached, max_tokens)

    async def _admit_attempt(self, admitted: _Admitted, need: Need, tenant: str) -> Grant:
        """The first attempt waits its turn in ``tenant``'s queue (or is refused); a retry is
        already admitted and only moves its reservation to its new prompt. ``tenant``: the
        authenticated one (``_authenticate``: the key's, or the service caller's)."""
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
            salt = self._salt(valid.tenant)
            hashes = await self._hashes(prompt, salt)
            cached_blocks = await self._lookup(wire, hashes)
            need = self._need(prompt, hashes, cached_blocks, progress.remaining)
            grant = await self._admit_attempt(admitted, need, valid.tenant)
            decision = await self._route(
                valid, wire, len(prompt), hashes, cached_blocks, progress.excluded, grant.avoid
            )
            self.admission.bind(grant, decision.prefill_instance, decision.decode_instance)
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
                traffic_class=cast(Any, valid.traffic_class),
                cached_blocks=cached_blocks,
                decode_instance=decision.decode_instance,
                decode_address=decision.decode_address,
                events_subject=subjects.token_events(wire),
                traceparent=traceparent,
            )
            try:
                await self._send_task(decision.prefill_instance, task.SerializeToString())
            except AttemptFailed:
                abort_reason = "instance failed"
                raise
            stream = RequestStream(prompt_tokens=len(prompt), max_tokens=progress.remaining)
            watch = Watch(self.liveness, decision.prefill_instance, decision.decode_instance)
            refill = (
                _Refill(decision.decode_address, self.resender.reconnects())
                if self.resender is not None and decision.decode_address
                else None
            )
            while not stream.done:
                try:
                    chunk = await self._next_chunk(sub, wire, watch, stream, refill)
                    watch.saw(chunk.index + max(0, len(chunk.token_ids) - 1))
                    outputs = stream.push(chunk)
                except AttemptFailed:
                    abort_reason = "instance failed"
                    raise
                except DeepserveError as exc:
                    abort_reason = outcome_of(exc)
                    raise
                except ReorderOverflow as exc:
                    abort_reason = "error"
                    raise Internal(f"request {rid}: {exc}") from None
                generated = max(generated, chunk.index + len(chunk.token_ids))  # resends overlap
                self.admission.saw(grant, chunk.index, generated)
                for out in outputs:
                    shown = progress.translate(out)
                    if shown is None:
                        continue
                    if isinstance(shown, Tokens) and len(progress.sent) == len(shown.token_ids):
                        TTFT_SECONDS.observe(time.monotonic() - started)
                    yield shown
            finished_upstream = not stream.truncated
            abort_reason = "completion past max_tokens"
            TOKENS.labels("prompt").inc(len(progress.prompt))
            TOKENS.labels("cached").inc(progress.cached_tokens)
            TOKENS.labels("completion").inc(len(progress.sent))
        finally:
            if sub is not None:
                if not finished_upstream:
                    log.info("request %s: aborting upstream (%s)", wire, abort_reason)
                    self._spawn(self._abort_upstream(wire, abort_reason))
                await sub.close()

    def _salt(self, tenant: str) -> bytes:
        """The tenant's cache salt: a keyed hash, never the tenant's name."""
        salt = self._salts.get(tenant)
        if salt is None:
            if len(self._salts) >= 65_536:
                self._salts.clear()
            salt = self._salts[tenant] = tenant_salt(self._salt_secret, tenant)
        return salt

    async def _hashes(self, prompt: tuple[int, ...], salt: bytes) -> list[bytes]:
        size = self.config.limits.block_size
        prefix = prompt[: lookup_prefix(len(prompt), size)]
        if len(prefix) <= INLINE_HASH_TOKENS:
            return chain_hashes(prefix, size, salt=salt)
        return await asyncio.to_thread(chain_hashes, prefix, size, salt)

    async def _lookup(self, rid: str, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        try:
            return await self.kv.lookup(hashes)
        except LookupFailed:
            LOOKUP_ERRORS.inc()
            return 0

    async def _route(
        self,
        valid: ValidRequest,
        rid: str,
        prompt_tokens: int,
        hashes: list[bytes],
        cached_blocks: int,
        exclude: list[str],
        avoid: tuple[str, ...] = (),
    ) -> control_pb2.RouteDecision:
        """Ask a balancer; ``avoid`` (instances admission found full) is excluded too, unless
        the balancer then finds nothing (its view of the instances may differ from ours)."""
        req = control_pb2.RouteRequest(
            request_id=rid,
            model=valid.model,
            prompt_tokens=prompt_tokens,
            cached_blocks=cached_blocks,
            block_hashes=hashes[:MAX_ROUTE_HASHES],
            exclude=[*exclude, *(i for i in avoid if i not in exclude)],
        )
        decision = await self._ask_balancer(req)
        if (decision.error or not decision.prefill_instance) and len(req.exclude) > len(exclude):
            del req.exclude[:]
            req.exclude.extend(exclude)
            decision = await self._ask_balancer(req)
        while (decision.error or not decision.prefill_instance) and self._bus_settling():
            # Just after a NATS outage the balancer has not heard the instances again yet
            # (heartbeats every 1 s): ask again while the bus settles (a few seconds).
            await asyncio.sleep(ROUTE_RETRY_PAUSE_S)
            decision = await self._ask_balancer(req)
        if decision.error or not decision.prefill_instance:
            raise Unavailable(
                f"no instance can take the request: {decision.error or 'empty decision'}"
            )
        return decision

    def _bus_settling(self) -> bool:
        return self.tasks is not None and self.tasks.settling()

    async def _ask_balancer(self, req: control_pb2.RouteRequest) -> control_pb2.RouteDecision:
        try:
            reply = await self.bus.request(
                subjects.ROUTE, req.SerializeToString(), self.config.route_timeout
            )
        except Unavailable as exc:
            raise Unavailable(f"no balancer answered ({exc}); retry in a few seconds") from None
        try:
            decision = cast(control_pb2.RouteDecision, control_pb2.RouteDecision.FromString(reply))
        except DecodeError:
            raise Internal("the balancer sent an unreadable reply") from None
        return decision

    async def _send_task(self, instance: str, data: bytes) -> None:
        """The PrefillTask to ``instance``: until it confirms a copy where the bus can tell
        (``delivery.py``: a task sent during a NATS outage or just after it would be lost);
        raises AttemptFailed if nothing takes the instance's tasks for instance_dead_after."""
        subject = subjects.prefill_task(instance)
        if self.tasks is None:
            await self.bus.publish(subject, data)
            return
        _, copies = await deliver(
            self.tasks,
            subject,
            data,
            instance=instance,
            ack_timeout=self.config.task_ack_timeout,
            gone_after=self.config.instance_dead_after,
        )
        TASK_COPIES.inc(copies - 1)

    async def _next_chunk(
        self,
        sub: Subscription,
        rid: str,
        watch: Watch,
        stream: RequestStream,
        refill: _Refill | None,
    ) -> Chunk:
        timeout = self.config.request_timeout
        silent_since = time.monotonic()
        while True:
            if refill is not None:
                if not refill.queued and self._refill_due(refill, stream):
                    await self._refill(refill, rid, stream)
                if refill.queued:
                    return self._chunk(refill.queued.pop(0), rid, watch)
            waited = time.monotonic() - silent_since
            if waited >= timeout:
                raise DeadlineExceeded(
                    f"request {rid}: no token for {timeout:g}s from the serving instances; aborted"
                )
            try:
                data = await sub.next(min(timeout - waited, self.config.liveness_poll))
            except TimeoutError:
                dead = watch.dead(self.config.instance_dead_after)
                if dead:
                    raise AttemptFailed(
                        f"instance {dead} stopped heartbeating "
                        f"(silent > {self.config.instance_dead_after:g}s)",
                        (dead,),
                    ) from None
                continue
            try:
                ev = control_pb2.TokenEvent.FromString(data)
            except DecodeError:
                log.warning("request %s: unreadable token event ignored", rid)
                continue
            return self._chunk(ev, rid, watch)

    @staticmethod
    def _chunk(ev: control_pb2.TokenEvent, rid: str, watch: Watch) -> Chunk:
        if ev.error:
            if ev.retryable:
                raise AttemptFailed(ev.error, watch.blamed(ev.index))
            raise Internal(f"request {rid} failed: {ev.error}")
        return Chunk(
            ev.index,
            tuple(ev.token_ids),
            ev.finished,
            ev.finish_reason,
            ev.prompt_tokens,
            ev.cached_tokens,
            tuple(TokenLogprob.from_proto(lp) for lp in ev.logprobs),
            (ev.speculative.drafted, ev.speculative.verified, ev.speculative.accepted)
            if ev.HasField("speculative")
            else (),
        )

    def _refill_due(self, refill: _Refill, stream: RequestStream) -> bool:
        """Whether to ask the decode instance for lost events now: the bus reconnected since
        we last asked, or a gap in the indices has lasted ``liveness_poll`` (events from one
        publisher arrive in order; prefill's and decode's may cross, but not for that long)."""
        assert self.resender is not None
        now, poll = time.monotonic(), self.config.liveness_poll
        if not stream.buffer.pending:
            refill.gap_since = None
        elif refill.gap_since is None:
            refill.gap_since = now
        if now - refill.asked_at < poll:
            return False
        gap = refill.gap_since is not None and now - refill.gap_since >= poll
        return gap or self.resender.reconnects() > refill.reconnects

    async def _refill(self, refill: _Refill, rid: str, stream: RequestStream) -> None:
        """Ask the decode instance for the events from the first position not yet released;
        what it sends joins the stream like any event (overlaps are cut off). A failed ask is
        repeated after ``liveness_poll``; the usual deadlines still apply."""
        assert self.resender is not None
        refill.asked_at = time.monotonic()
        reconnects = self.resender.reconnects()
        start = stream.buffer.next_index
        try:
            await self.resender.settle()
            events = await self.resender.resend(refill.address, rid, start)
        except ResendFailed as exc:
            log.info("request %s: cannot ask for lost token events yet (%s)", rid, exc)
            return
        refill.reconnects = reconnects
        if events is None:
            return  # not handed over to decode yet: what prefill sends still comes
        got = sum(len(ev.token_ids) for ev in events)
        lost = stream.buffer.missing(start + got)
        RESENT.inc(lost)
        log.warning(
            "request %s: asked decode for token events from position %d after %s: %d came, "
            "%d of them not received here",
            rid,
            start,
            "a gap" if stream.buffer.pending else "a NATS reconnection",
            got,
            lost,
        )
        refill.queued.extend(events)

    async def _abort_upstream(self, rid: str, reason: str) -> None:
        try:
            await self.bus.publish(
                subjects.ABORT, control_pb2.Abort(request_id=rid, reason=reason).SerializeToString()
            )
        except Exception as exc:  # noqa: BLE001 - best effort; instances also time requests out
            log.warning("request %s: could not publish abort: %s", rid, exc)

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
