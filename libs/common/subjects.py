"""NATS subjects, defined once (listed in docs/architecture.md); every payload is a proto."""

from __future__ import annotations

PREFIX = "ds"
BALANCER_QUEUE = "balancer"  # queue group of the balancer replicas
ROUTE = f"{PREFIX}.balancer.route"  # RouteRequest -> RouteDecision (request/reply)
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"  # InstanceStatus
ABORT = f"{PREFIX}.abort"  # Abort, broadcast to every instance
LOAD_ALL = f"{PREFIX}.load.>"  # LoadStatus of instances loading their model


def heartbeat(role: str, instance_id: str) -> str:
    return f"{PREFIX}.heartbeat.{role}.{instance_id}"


def load_status(role: str, instance_id: str) -> str:
    """LoadStatus of one instance while it loads its model (role: its service)."""
    return f"{PREFIX}.load.{role}.{instance_id}"


def prefill_task(instance_id: str) -> str:
    """PrefillTask for one prefill instance."""
    return f"{PREFIX}.prefill.{instance_id}.task"


def token_events(request_id: str) -> str:
    """TokenEvent stream of one request (published by prefill, then decode)."""
    return f"{PREFIX}.tokens.{request_id}"
