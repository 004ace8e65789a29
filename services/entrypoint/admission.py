"""Admission at the service edge: heartbeats in as the policy's :class:`Load`, decisions out
as Prometheus metrics. The policy itself is ``libs/gateway/{capacity,admission}.py``."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from libs.gateway.capacity import BUSY_WINDOW_S, PREFILL, ROLES, Capacity, Load, Need
from libs.proto.deepserve.v1 import control_pb2
from libs.routing.heartbeat import role_of
from libs.routing.policy import resident_run

QUEUED_WHY = Counter(
    "deepserve_entrypoint_admission_queued_reasons_total",
    "requests that had to wait at admission, by what held them: behind (others waited ahead), "
    "inflight (--max-inflight), prefill_queue (every prefill queue full), decode_kv (no decode "
    "KV room), no_instance",
    ["why"],
)
ADMISSIONS = Counter(
    "deepserve_entrypoint_admission_total",
    "admission decisions: admitted (at once or after queueing), queued, refused (overloaded), "
    "unfit (larger than any instance), unavailable (no live instance)",
    ["result"],
)
ADMISSION_WAIT = Histogram(
    "deepserve_entrypoint_admission_wait_seconds",
    "time queued requests waited for capacity, by how the wait ended",
    ["result"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ADMISSION_WAITING = Gauge(
    "deepserve_entrypoint_admission_waiting", "requests waiting for capacity now"
)
ENGINE_BUSY = Gauge(
    "deepserve_entrypoint_engine_busy_fraction",
    "share of the last 1 s each live instance's engine spent stepping, from its latest "
    "heartbeat (instances silent past --instance-dead-after are dropped)",
    ["role", "instance"],
)
QUEUED_BUSY = Histogram(
    "deepserve_entrypoint_admission_queued_busy_fraction",
    "at each heartbeat whose busy window lies inside a wait at admission (requests have waited "
    "since before the window began): that instance's busy fraction, per role (a request should "
    "wait only while the engines are busy)",
    ["role"],
    buckets=(0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0),
)


def load_from_status(status: control_pb2.InstanceStatus) -> Load:
    """Admission's view of a heartbeat; ValueError if it names no role or instance."""
    role = role_of(status)
    return Load(
        instance_id=status.instance_id,
        role=role,
        model=status.model,
        address=status.address,
        queued_tokens=status.queued_tokens,
        free_kv_blocks=status.free_kv_blocks,
        total_kv_blocks=status.total_kv_blocks,
        draining=status.draining,
        tokens_per_s=status.compute_tokens_per_s,
        busy_fraction=status.busy_fraction,
        promised_kv_blocks=status.promised_kv_blocks,
        held=frozenset(status.held_requests) if status.reports_held else None,
    )


class AdmissionMetrics:
    """Admission decisions, and the busy fraction of the engines admitted to (from
    ``capacity``'s heartbeats), as Prometheus metrics."""

    def __init__(
        self, capacity: Capacity | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self._shown: set[tuple[str, str]] = set()  # (role, instance) series exported
        self._clock = clock
        self._waiting_since: float | None = None  # when requests began to wait, without a gap

    def on_admission(self, result: str, waited: float | None, waiting: int, why: str = "") -> None:
        ADMISSIONS.labels(result).inc()
        if why:
            QUEUED_WHY.labels(why).inc()
        if waited is not None:
            ADMISSION_WAIT.labels(result).observe(waited)
        ADMISSION_WAITING.set(waiting)
        if waiting <= 0:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = self._clock()

    def on_heartbeat(self, load: Load | None = None) -> None:
        """After a heartbeat (``load``) was observed: the busy gauges of the live instances,
        and, once requests have waited a whole busy window, how busy the engine that sent it
        was over that window. A heartbeat's busy fraction covers the second before it; one
        that arrives sooner after the wait began describes, in part, the engine before the
        burst that made requests wait, and is not a sample of the engine while they wait."""
        if self.capacity is None:
            return
        since = self._waiting_since
        if load is not None and since is not None and self._clock() - since >= BUSY_WINDOW_S:
            QUEUED_BUSY.labels(load.role).observe(load.busy_fraction)
        shown = set()
        for role in ROLES:
            for load in self.capacity.live(role):
                ENGINE_BUSY.labels(role, load.instance_id).set(load.busy_fraction)
                shown.add((role, load.instance_id))
        for key in self._shown - shown:
            ENGINE_BUSY.remove(*key)
        self._shown = shown


def need_of(
    capacity: Capacity | None,
    resident: Mapping[str, frozenset[bytes]],
    block_size: int,
    prompt: tuple[int, ...],
    hashes: list[bytes],
    cached_blocks: int,
    max_tokens: int,
) -> Need:
    """What a request takes: its uncached tokens are those neither the kvstore
    (``cached_blocks``) nor the best prefill instance's GPU cache (``resident``: each prefill
    instance's heartbeat summary) holds -- the balancer routes a prompt to the instance that
    has its prefix."""
    live = capacity.candidates(PREFILL) if capacity is not None else []
    best = max(
        (resident_run(resident[p.instance_id], hashes) for p in live if p.instance_id in resident),
        default=0,
    )
    cached = min(max(cached_blocks, best) * block_size, len(prompt))
    return Need(len(prompt), len(prompt) - cached, max_tokens)
