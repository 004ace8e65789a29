"""The balancer's message handlers: heartbeats in, route requests answered.

Bytes in, bytes out; no NATS here, so tests call these directly. ``main.py`` wires them to
``ds.heartbeat.>`` and ``ds.balancer.route`` (queue group ``balancer``).
"""

from __future__ import annotations

import logging
from typing import cast

from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge, Histogram

from libs.proto.deepserve.v1 import control_pb2
from libs.routing.heartbeat import decision_message, instance_from_status, route
from libs.routing.policy import DECODE, PREFILL, NoInstance, RoutingPolicy

from .metrics import BalancerMetrics

log = logging.getLogger("balancer")

HEARTBEATS = Counter("deepserve_balancer_heartbeats_total", "Heartbeats received", ["role"])
BAD_MESSAGES = Counter(
    "deepserve_balancer_bad_messages_total", "Messages that failed to parse", ["subject"]
)
ROUTES = Counter("deepserve_balancer_routes_total", "Route requests answered", ["result"])
ROUTE_SECONDS = Histogram(
    "deepserve_balancer_route_seconds",
    "Time to answer a route request",
    buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
)
RESIDENT_BLOCKS = Histogram(
    "deepserve_balancer_resident_blocks",
    "Leading blocks of a routed request resident on the chosen prefill",
    buckets=(0, 1, 4, 16, 64, 256),
)
LIVE = Gauge("deepserve_balancer_live_instances", "Instances with a recent heartbeat", ["role"])


def _reply(decision: control_pb2.RouteDecision) -> bytes:
    return cast(bytes, decision.SerializeToString())


class BalancerHandlers:
    def __init__(self, policy: RoutingPolicy, metrics: BalancerMetrics | None = None) -> None:
        self.policy = policy
        self.metrics = metrics or BalancerMetrics()  # ``deepserve:`` series (``metrics.py``)

    def on_heartbeat(self, data: bytes) -> None:
        try:
            status = control_pb2.InstanceStatus.FromString(data)
            instance = instance_from_status(status)
        except (DecodeError, ValueError) as exc:
            BAD_MESSAGES.labels("heartbeat").inc()
            log.warning("ignoring a heartbeat: %s", exc)
            return
        if not self.policy.is_live(instance.role, instance.instance_id):
            log.info(
                "%s instance %s is up (model %r, address %r)",
                instance.role,
                instance.instance_id,
                instance.model,
                instance.address,
            )
        self.policy.observe(instance)
        HEARTBEATS.labels(instance.role).inc()

    def on_route(self, data: bytes) -> bytes:
        """A serialized RouteDecision for a serialized RouteRequest (``error`` set on failure)."""
        with ROUTE_SECONDS.time():
            try:
                req = control_pb2.RouteRequest.FromString(data)
            except DecodeError as exc:
                BAD_MESSAGES.labels("route").inc()
                ROUTES.labels("bad_request").inc()
                return _reply(control_pb2.RouteDecision(error=f"unreadable RouteRequest: {exc}"))
            try:
                decision = route(self.policy, req)
            except NoInstance as exc:
                ROUTES.labels("no_instance").inc()
                log.warning("request %s: %s", req.request_id, exc)
                return _reply(control_pb2.RouteDecision(error=str(exc)))
            ROUTES.labels("ok").inc()
            self.metrics.on_decision(decision)
            RESIDENT_BLOCKS.observe(decision.resident_blocks)
            return _reply(decision_message(decision))

    def prune(self) -> None:
        """Forget dead instances and refresh the live gauge (called about once a second)."""
        for inst in self.policy.prune():
            log.warning(
                "%s instance %s sent no heartbeat for %.1fs: dropped",
                inst.role,
                inst.instance_id,
                self.policy.heartbeat_timeout,
            )
        for role in (PREFILL, DECODE):
            LIVE.labels(role).set(len(self.policy.live(role)))
