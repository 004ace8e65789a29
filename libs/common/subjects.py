"""NATS subjects, defined once (listed in docs/architecture.md); every payload is a proto."""

from __future__ import annotations

PREFIX = "ds"
BALANCER_QUEUE = "balancer"  # queue group of the balancer replicas
ROUTE = f"{PREFIX}.balancer.route"  # RouteRequest -> RouteDecision (request/reply)
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"  # InstanceStatus
ABORT = f"{PREFIX}.abort"  # Abort, broadcast to every instance


def heartbeat(role: str, instance_id: str) -> str:
    return f"{PREFIX}.heartbeat.{role}.{instance_id}"


def prefill_task(instance_id: str) -> str:
    """PrefillTask for one prefill instance."""
    return f"{PREFIX}.prefill.{instance_id}.task"


def token_events(request_id: str) -> str:
    """TokenEvent stream of one request (published by prefill, then decode)."""
    return f"{PREFIX}.tokens.{request_id}"
