"""Balancer routing policy: liveness, buckets, cache locality, load, ties, replicas, exclude."""

from __future__ import annotations

from collections import Counter

import pytest

from libs.proto.deepserve.v1 import control_pb2
from libs.routing.policy import DECODE, PREFILL, Instance, NoInstance, RoutingPolicy
from services.balancer.handlers import BalancerHandlers


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prefill(name: str, model: str = "m", **kw: object) -> Instance:
    return Instance(instance_id=name, role=PREFILL, model=model, **kw)  # type: ignore[arg-type]


def decode(name: str, model: str = "m", **kw: object) -> Instance:
    kw.setdefault("address", f"{name}.local:9000")
    return Instance(instance_id=name, role=DECODE, model=model, **kw)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def policy(clock: FakeClock) -> RoutingPolicy:
    p = RoutingPolicy(heartbeat_timeout=3.0, clock=clock)
    for inst in (prefill("p1"), prefill("p2"), decode("d1"), decode("d2")):
        p.observe(inst)
    return p


def picks(policy: RoutingPolicy, n: int, **kw: object) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        d = policy.route(request_id=f"r{i}", **kw)  # type: ignore[arg-type]
        out.append((d.prefill.instance_id, d.decode.instance_id))
    return out


def test_equal_instances_alternate_between_heartbeats(policy: RoutingPolicy) -> None:
    # Same heartbeat figures: what this policy routed since counts as load, so a burst
    # spreads instead of piling onto one instance; the hash of the request id breaks ties.
    got = picks(policy, 6, model="m")
    pre, dec = [p for p, _ in got], [d for _, d in got]
    assert Counter(pre) == {"p1": 3, "p2": 3} and Counter(dec) == {"d1": 3, "d2": 3}
    # Never ahead by more than one: each consecutive pair covers both instances.
    assert all(set(pre[i : i + 2]) == {"p1", "p2"} for i in range(0, 6, 2)), pre
    assert all(set(dec[i : i + 2]) == {"d1", "d2"} for i in range(0, 6, 2)), dec


def test_ties_spread_evenly_over_many_instances(clock: FakeClock) -> None:
    policy = RoutingPolicy(heartbeat_timeout=3.0, clock=clock)
    for i in range(5):
        policy.observe(prefill(f"p{i}"))
    for i in range(3):
        policy.observe(decode(f"d{i}"))
    got = picks(policy, 30, model="m")
    assert Counter(p for p, _ in got) == {f"p{i}": 6 for i in range(5)}
    assert Counter(d for _, d in got) == {f"d{i}": 10 for i in range(3)}


def test_decision_carries_the_decode_address(policy: RoutingPolicy) -> None:
    d = policy.route(model="m")
    assert d.decode.address == f"{d.decode.instance_id}.local:9000"


def test_dead_instance_is_dropped_after_the_timeout(
    policy: RoutingPolicy, clock: FakeClock
) -> None:
    clock.now += 2.0
    policy.observe(prefill("p1"))  # p1 and both decodes keep heartbeating; p2 goes quiet
    policy.observe(decode("d1"))
    policy.observe(decode("d2"))
    clock.now += 0.9  # p2 last seen 2.9 s ago: still alive
    assert {p for p, _ in picks(policy, 4, model="m")} == {"p1", "p2"}
    clock.now += 0.2  # 3.1 s: dead
    assert {p for p, _ in picks(policy, 4, model="m")} == {"p1"}
    assert [i.instance_id for i in policy.prune()] == ["p2"]
    assert [i.instance_id for i in policy.live(PREFILL)] == ["p1"]


def test_instance_that_heartbeats_again_comes_back(policy: RoutingPolicy, clock: FakeClock) -> None:
    clock.now += 10
    policy.prune()
    with pytest.raises(NoInstance):
        policy.route(model="m")
    policy.observe(prefill("p2"))
    policy.observe(decode("d1"))
    d = policy.route(model="m")
    assert (d.prefill.instance_id, d.decode.instance_id) == ("p2", "d1")


def test_draining_instance_is_skipped(policy: RoutingPolicy) -> None:
    policy.observe(prefill("p1", draining=True))
    policy.observe(decode("d2", draining=True))
    assert set(picks(policy, 4, model="m")) == {("p2", "d1")}


def test_exclude_is_honoured(policy: RoutingPolicy) -> None:
    assert set(picks(policy, 4, model="m", exclude=["p1", "d1"])) == {("p2", "d2")}


def test_excluding_every_instance_is_an_error(policy: RoutingPolicy) -> None:
    with pytest.raises(NoInstance, match="prefill.*2 excluded"):
        policy.route(model="m", exclude=["p1", "p2"])


def test_no_instance_is_an_error_naming_the_role() -> None:
    policy = RoutingPolicy(clock=FakeClock())
    with pytest.raises(NoInstance, match="no live prefill instance for model 'm'"):
        policy.route(model="m")
    policy.observe(prefill("p1"))
    with pytest.raises(NoInstance, match="no live decode instance"):
        policy.route(model="m")


def test_only_instances_of_the_requested_model(policy: RoutingPolicy) -> None:
    policy.observe(prefill("p9", model="other"))
    policy.observe(decode("d9", model="other"))
    assert set(picks(policy, 6, model="other")) == {("p9", "d9")}
    assert {p for p, _ in picks(policy, 6, model="m")} == {"p1", "p2"}
    with pytest.raises(NoInstance):
        policy.route(model="missing")


def test_decode_without_address_is_not_routable(clock: FakeClock) -> None:
    policy = RoutingPolicy(clock=clock)
    policy.observe(prefill("p1"))
    policy.observe(decode("d1", address=""))
    with pytest.raises(NoInstance):
        policy.route(model="m")


def test_a_joining_instance_takes_its_share(policy: RoutingPolicy) -> None:
    picks(policy, 2, model="m")
    policy.observe(prefill("p0"))  # fresh, nothing routed to it yet: it is the least loaded
    assert policy.route(model="m", request_id="x").prefill.instance_id == "p0"


def test_a_failed_route_changes_nothing(policy: RoutingPolicy, clock: FakeClock) -> None:
    twin = RoutingPolicy(heartbeat_timeout=3.0, clock=clock)
    for inst in (prefill("p1"), prefill("p2"), decode("d1"), decode("d2")):
        twin.observe(inst)
    with pytest.raises(NoInstance):
        policy.route(model="m", exclude=["d1", "d2"], request_id="a")
    assert picks(policy, 4, model="m") == picks(twin, 4, model="m")


def test_bad_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        RoutingPolicy(heartbeat_timeout=0)


def test_handlers_answer_route_requests_from_heartbeats(clock: FakeClock) -> None:
    h = BalancerHandlers(RoutingPolicy(clock=clock))
    route = control_pb2.RouteRequest(request_id="r", model="m").SerializeToString()
    assert "no live prefill" in control_pb2.RouteDecision.FromString(h.on_route(route)).error
    for name, role, addr in (
        ("p1", control_pb2.ROLE_PREFILL, ""),
        ("d1", control_pb2.ROLE_DECODE, "h:1"),
    ):
        h.on_heartbeat(
            control_pb2.InstanceStatus(
                instance_id=name, role=role, model="m", address=addr
            ).SerializeToString()
        )
    h.on_heartbeat(b"\xff not a proto")  # ignored, not fatal
    h.on_heartbeat(control_pb2.InstanceStatus(instance_id="x").SerializeToString())  # no role
    d = control_pb2.RouteDecision.FromString(h.on_route(route))
    assert (d.prefill_instance, d.decode_instance, d.decode_address, d.error) == (
        "p1",
        "d1",
        "h:1",
        "",
    )
    assert control_pb2.RouteDecision.FromString(h.on_route(b"\xff\xff")).error


def test_an_aggregated_instance_decodes_what_it_prefilled(clock: FakeClock) -> None:
    """Two aggregated instances (each heartbeats as prefill and decode under one id) and a
    decode-only one with more room: a request always stays on the engine that prefills it."""
    from libs.routing.policy import SAME_ENGINE

    p = RoutingPolicy(heartbeat_timeout=3.0, clock=clock)
    for name in ("a1", "a2"):
        p.observe(prefill(name))
        p.observe(decode(name, free_kv_blocks=10, total_kv_blocks=100))
    p.observe(decode("d-idle", free_kv_blocks=100, total_kv_blocks=100))
    seen = set()
    for i in range(20):
        d = p.route("m", request_id=f"r{i}", prompt_tokens=200)
        assert d.decode.instance_id == d.prefill.instance_id
        assert d.decode_reason == SAME_ENGINE
        seen.add(d.prefill.instance_id)
    assert seen == {"a1", "a2"}  # both engines take work
    # Excluded after a failure, the aggregated instance is left out of both roles.
    d = p.route("m", exclude=["a1"], request_id="retry", prompt_tokens=200)
    assert "a1" not in (d.prefill.instance_id, d.decode.instance_id)
    # A prefill-only instance's requests still go to the decode with the most room.
    p.observe(prefill("p-only"))
    d = p.route("m", exclude=["a1", "a2"], request_id="r", prompt_tokens=200)
    assert (d.prefill.instance_id, d.decode.instance_id) == ("p-only", "d-idle")
