"""Admission at the service edge: heartbeats in as the policy's :class:`Load`, decisions out
as Prometheus metrics. The policy itself is ``libs/gateway/{capacity,admission}.py``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from libs.gateway.capacity import DECODE, PREFILL, Load
from libs.proto.deepserve.v1 import control_pb2

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

_ROLE_NAMES = {control_pb2.ROLE_PREFILL: PREFILL, control_pb2.ROLE_DECODE: DECODE}


def load_from_status(status: control_pb2.InstanceStatus) -> Load:
    """Admission's view of a heartbeat; ValueError if it names no role or instance."""
    role = _ROLE_NAMES.get(status.role)
    if role is None:
        raise ValueError(f"heartbeat of {status.instance_id!r} has no role")
    return Load(
        instance_id=status.instance_id,
        role=role,
        model=status.model,
        address=status.address,
        queued_tokens=status.queued_tokens,
        free_kv_blocks=status.free_kv_blocks,
        total_kv_blocks=status.total_kv_blocks,
        draining=status.draining,
    )


class AdmissionMetrics:
    """Admission decisions as Prometheus metrics."""

    def on_admission(self, result: str, waited: float | None, waiting: int) -> None:
        ADMISSIONS.labels(result).inc()
        if waited is not None:
            ADMISSION_WAIT.labels(result).observe(waited)
        ADMISSION_WAITING.set(waiting)
