"""The balancer's routing metrics: the reason the policy gives for each choice (the same choice
as before), the counter the handler keeps of them, and the scrape-time gauges of live instances
and of the work per prefill bucket."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from libs.proto.deepserve.v1 import control_pb2
from libs.routing.policy import (
    ANY_BUCKET,
    CACHE_HIT,
    LEAST_LOAD,
    LOAD_CAP,
    ONLY_CANDIDATE,
    RoutingPolicy,
)
from services.balancer.handlers import BalancerHandlers
from services.balancer.metrics import BalancerMetrics

from .test_balancer_policy import FakeClock, decode, prefill
from .test_balancer_routing import hashes, make, resident

K = 1024


def test_a_resident_prefix_that_beats_a_shorter_queue_is_a_cache_hit() -> None:
    hs = hashes(100)
    p = make(
        FakeClock(),
        prefill("p1", resident=resident(hs), queued_tokens=4000),
        prefill("p2"),
        decode("d1"),
        decode("d2"),
    )
    d = p.route(model="m", request_id="r", prompt_tokens=13000, block_hashes=hs)
    assert (d.prefill.instance_id, d.reason, d.decode_reason) == ("p1", CACHE_HIT, LEAST_LOAD)


def test_load_that_outweighs_the_cache_and_equal_caches_are_least_load() -> None:
    hs = hashes(10)
    p = make(
        FakeClock(),
        prefill("p1", resident=resident(hs), queued_tokens=8000),
        prefill("p2"),
        decode("d1"),
    )
    d = p.route(model="m", request_id="r", prompt_tokens=2000, block_hashes=hs)
    assert (d.prefill.instance_id, d.reason) == ("p2", LEAST_LOAD)
    assert d.decode_reason == ONLY_CANDIDATE
    hs = hashes(20)
    p = make(
        FakeClock(),
        prefill("p1", resident=resident(hs), queued_tokens=3000),
        prefill("p2", resident=resident(hs)),
        decode("d1"),
    )
    d = p.route(model="m", request_id="r", prompt_tokens=3000, block_hashes=hs)
    assert (d.prefill.instance_id, d.reason) == ("p2", LEAST_LOAD), "caches equal: load decided"


def test_one_instance_is_the_only_candidate() -> None:
    p = make(FakeClock(), prefill("p1"), decode("d1"))
    d = p.route(model="m", request_id="r", prompt_tokens=100)
    assert (d.reason, d.decode_reason) == (ONLY_CANDIDATE, ONLY_CANDIDATE)


def test_the_cap_moving_a_request_off_its_prefix_is_load_cap() -> None:
    hs = hashes(40)
    clock = FakeClock()
    # load_weight 0: only the cap can take the request off p0 (the price would do it too).
    p = make(
        clock, prefill("p0", resident=resident(hs)), prefill("p1"), decode("d1"), load_weight=0.0
    )
    for i in range(3):  # work routed to p0 only: far above the mean of the two
        p.route(model="m", request_id=f"w{i}", prompt_tokens=8000, exclude=["p1"])
    p.observe(prefill("p0", resident=resident(hs)))  # fresh heartbeats: no queue anywhere
    p.observe(prefill("p1"))
    d = p.route(model="m", request_id="r", prompt_tokens=6000, block_hashes=hs)
    assert (d.prefill.instance_id, d.reason) == ("p1", LOAD_CAP)
    uncapped = make(
        clock,
        prefill("p0", resident=resident(hs)),
        prefill("p1"),
        decode("d1"),
        load_weight=0.0,
        load_cap=float("inf"),
    )
    for i in range(3):
        uncapped.route(model="m", request_id=f"w{i}", prompt_tokens=8000, exclude=["p1"])
    uncapped.observe(prefill("p0", resident=resident(hs)))
    uncapped.observe(prefill("p1"))
    d = uncapped.route(model="m", request_id="r", prompt_tokens=6000, block_hashes=hs)
    assert (d.prefill.instance_id, d.reason) == ("p0", CACHE_HIT), "no cap: the prefix wins"


def _heartbeat(h: BalancerHandlers, name: str, role: int, **kw: object) -> None:
    status = control_pb2.InstanceStatus(instance_id=name, role=role, model="m", **kw)  # type: ignore[arg-type]
    h.on_heartbeat(status.SerializeToString())


def test_the_handler_counts_each_answered_route_by_role_and_reason() -> None:
    hs = hashes(20)
    metrics = BalancerMetrics(CollectorRegistry())
    h = BalancerHandlers(RoutingPolicy(clock=FakeClock()), metrics)

    def count(role: str, reason: str) -> float | None:
        labels = {"role": role, "reason": reason}
        return metrics.registry.get_sample_value(
            "deepserve:balancer_routing_decisions_total", labels
        )

    assert count("prefill", "cache_hit") == 0, "every series exported from the start"
    route = control_pb2.RouteRequest(request_id="r", model="m", prompt_tokens=2560, block_hashes=hs)
    h.on_route(route.SerializeToString())  # no instance yet: not a decision
    assert sum(count("prefill", r) or 0 for r in ("only_candidate", "least_load")) == 0
    _heartbeat(h, "p1", control_pb2.ROLE_PREFILL, queued_tokens=100)
    _heartbeat(h, "p2", control_pb2.ROLE_PREFILL, resident_prefixes=[x[:8] for x in hs])
    _heartbeat(h, "d1", control_pb2.ROLE_DECODE, address="h:1")
    reply = control_pb2.RouteDecision.FromString(h.on_route(route.SerializeToString()))
    assert reply.prefill_instance == "p2"
    assert count("prefill", "cache_hit") == 1 and count("decode", "only_candidate") == 1
    assert count("prefill", "least_load") == 0 and count("decode", "least_load") == 0


def test_scrape_reports_live_instances_and_the_work_per_bucket() -> None:
    clock = FakeClock()
    p = make(
        clock,
        prefill("p1", queued_tokens=500, running=1),
        prefill("p2", queued_tokens=70_000, waiting=2),
        decode("d1"),
    )
    registry = CollectorRegistry()
    BalancerMetrics(registry, p)

    def gauge(name: str, **labels: str) -> float | None:
        return registry.get_sample_value("deepserve:" + name, labels)

    assert gauge("balancer_live_instances", role="prefill") == 2
    assert gauge("balancer_live_instances", role="decode") == 1
    # Nothing routed yet: no assignment, both serve any bucket.
    assert gauge("balancer_bucket_instances", bucket=ANY_BUCKET) == 2
    assert gauge("balancer_bucket_queued_tokens", bucket=ANY_BUCKET) == 70_500
    assert gauge("balancer_bucket_requests", bucket=ANY_BUCKET) == 3
    assert gauge("balancer_bucket_instances", bucket="<16K") == 0
    assert p._assigned == {}, "a scrape computes no assignment"
    p.route(model="m", request_id="s", prompt_tokens=1000)
    p.route(model="m", request_id="l", prompt_tokens=100 * K)
    clock.now += p.rebalance_interval
    for inst in (
        prefill("p1", queued_tokens=500, running=1),
        prefill("p2", queued_tokens=70_000, waiting=2),
        decode("d1"),
    ):
        p.observe(inst)  # fresh heartbeats: nothing routed since
    assert p.assignment("m") == {"p1": 0, "p2": 2}, "demand in two buckets: one instance each"
    d = p.route(model="m", request_id="l2", prompt_tokens=100 * K)
    assert d.prefill.instance_id == "p2"
    assert gauge("balancer_bucket_instances", bucket="<16K") == 1
    assert gauge("balancer_bucket_queued_tokens", bucket="<16K") == 500
    assert gauge("balancer_bucket_requests", bucket="<16K") == 1
    assert gauge("balancer_bucket_instances", bucket="64K-256K") == 1
    assert gauge("balancer_bucket_queued_tokens", bucket="64K-256K") == 70_000 + 100 * K, (
        "the heartbeat's queue plus what this replica routed there since"
    )
    assert gauge("balancer_bucket_requests", bucket="64K-256K") == 3
    assert gauge("balancer_bucket_instances", bucket=ANY_BUCKET) == 0
    clock.now += 10  # every heartbeat is old: nobody is live
    assert gauge("balancer_live_instances", role="prefill") == 0
    assert gauge("balancer_bucket_instances", bucket="64K-256K") == 0
