"""The balancer's routing metrics, named as the engine's (``deepserve:`` prefix,
``libs/serving/engine_metrics.py``), on the ops port's ``/metrics`` beside the older
``deepserve_balancer_*`` series of ``handlers.py``. Where each value comes from:

* counter ``deepserve:balancer_routing_decisions_total{role, reason}``: one per answered
  route request and role, with the reason the policy gives for its choice
  (``libs.routing.policy``: prefill ``only_candidate`` / ``load_cap`` / ``cache_hit`` /
  ``least_load``; decode ``only_candidate`` / ``least_load``);
* gauges read from the policy's table at scrape time (the scrape runs on the event loop that
  feeds the policy, so it sees one consistent table): ``deepserve:balancer_live_instances
  {role}`` (heartbeat within the timeout, draining ones included), and per prefill bucket
  (``<16K`` ... ``>=256K``; ``any``: instances no assignment has placed yet)
  ``deepserve:balancer_bucket_instances``, ``deepserve:balancer_bucket_queued_tokens`` (prompt
  tokens queued on the bucket's instances as of their last heartbeat plus those this replica
  routed there since) and ``deepserve:balancer_bucket_requests`` (running + waiting, likewise);
  ``deepserve:balancer_prefill_bucket{instance, bucket}`` (1 per live prefill instance: the
  bucket the latest assignment placed it in, ``any`` before one has; read by the recipe's
  ``/status`` page, ``services/recipe/status.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.routing.policy import (
    DECODE,
    DECODE_REASONS,
    PREFILL,
    PREFILL_REASONS,
    ROLES,
    Decision,
    RoutingPolicy,
)

PREFIX = "deepserve:"


class BalancerMetrics:
    """The routing counter, and (``policy`` given) the scrape-time gauges over that policy.
    ``registry``: where they are registered (None: a private one, for tests)."""

    def __init__(
        self, registry: CollectorRegistry | None = None, policy: RoutingPolicy | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions = Counter(
            PREFIX + "balancer_routing_decisions",
            "Route decisions by role and the reason the policy chose the instance",
            ["role", "reason"],
            registry=self.registry,
        )
        for role, reasons in ((PREFILL, PREFILL_REASONS), (DECODE, DECODE_REASONS)):
            for reason in reasons:  # every series exported (at 0) from the start
                self.decisions.labels(role, reason)
        self.collector: PolicyCollector | None = None
        if policy is not None:
            self.collector = PolicyCollector(policy)
            self.registry.register(self.collector)

    def on_decision(self, decision: Decision) -> None:
        self.decisions.labels(PREFILL, decision.reason).inc()
        self.decisions.labels(DECODE, decision.decode_reason).inc()


class PolicyCollector(Collector):
    """Live instances by role and the work per prefill bucket, from the policy's table."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = GaugeMetricFamily(
            PREFIX + "balancer_live_instances",
            "Instances with a heartbeat within the timeout (draining ones included)",
            labels=["role"],
        )
        for role in ROLES:
            live.add_metric([role], len(self.policy.live(role)))
        families = {
            "instances": GaugeMetricFamily(
                PREFIX + "balancer_bucket_instances",
                "Live prefill instances serving the bucket",
                labels=["bucket"],
            ),
            "queued_tokens": GaugeMetricFamily(
                PREFIX + "balancer_bucket_queued_tokens",
                "Prompt tokens queued on the bucket's prefill instances (last heartbeat + "
                "routed since)",
                labels=["bucket"],
            ),
            "requests": GaugeMetricFamily(
                PREFIX + "balancer_bucket_requests",
                "Requests running or waiting on the bucket's prefill instances (last "
                "heartbeat + routed since)",
                labels=["bucket"],
            ),
        }
        for bucket, load in self.policy.bucket_load().items():
            for field, family in families.items():
                family.add_metric([bucket], getattr(load, field))
        placed = GaugeMetricFamily(
            PREFIX + "balancer_prefill_bucket",
            "1 per live prefill instance, labelled with the length bucket it serves (any: not "
            "placed yet)",
            labels=["instance", "bucket"],
        )
        for instance_id, bucket in self.policy.placed_buckets().items():
            placed.add_metric([instance_id, bucket], 1.0)
        yield live
        yield from families.values()
        yield placed
