"""The entrypoint handler's frozen config, and the small pure helpers around a call: the outcome
label of an error, request and attempt ids, and a policy output as a ``GenerateEvent``."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.common.errors import DeadlineExceeded, DeepserveError, Internal, Overloaded
from libs.common.tenant_label import UNSALTED, TenantLabels
from libs.gateway.keylimits import KeyLimitPolicy
from libs.gateway.policy import Finish, Limits, Output, Ready, Tokens
from libs.proto.deepserve.v1 import common_pb2, generate_pb2


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
    # The limits of a key presented here (callers.py; the recipe's flags, the same state when
    # both share --redis-url).
    key_limits: KeyLimitPolicy = field(default_factory=KeyLimitPolicy)
    # What the request line calls a tenant (--tenant-label-secret; the recipe's labels).
    labels: TenantLabels = UNSALTED

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


def give_up(rid: str, exc: Exception, attempt: int, sent: int, exact: bool) -> str:
    """Why a call failed for good after ``attempt`` attempts with ``sent`` tokens sent."""
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
