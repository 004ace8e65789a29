"""While no balancer answers, the entrypoint routes on the instances it heard (last_view.py):
requests are served, not refused, for as long as heartbeats say who is alive, and routing goes
back to the balancer as soon as one answers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import REGISTRY

from libs.proto.deepserve.v1 import control_pb2
from services.entrypoint.handlers import BusUnavailable, EntrypointHandlers
from services.entrypoint.last_view import LastView

from .test_entrypoint_handlers import Aborted, FakeBus, collect, make, req


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def local_routes() -> float:
    return REGISTRY.get_sample_value("deepserve_entrypoint_local_routes_total") or 0.0


def heard(h: EntrypointHandlers, *, decode: str = "d1") -> None:
    """Heartbeats of prefill p1 and a decode instance, as the NATS feed delivers them."""
    h.on_status(control_pb2.InstanceStatus(instance_id="p1", role=control_pb2.ROLE_PREFILL))
    h.on_status(
        control_pb2.InstanceStatus(
            instance_id=decode,
            role=control_pb2.ROLE_DECODE,
            address="127.0.0.1:7009",
            free_kv_blocks=100,
            total_kv_blocks=100,
        )
    )


def with_view(
    bus: FakeBus, clock: Clock | None = None, probe_every: float = 0.0
) -> EntrypointHandlers:
    h = make(bus)
    h.upstream.view = LastView(3.0, probe_every=probe_every, clock=clock or Clock())
    return h


async def test_a_request_is_routed_on_the_heard_instances_while_no_balancer_answers() -> None:
    bus = FakeBus()
    bus.balancer_up = False
    h = with_view(bus)
    heard(h)
    before = local_routes()
    events = await collect(h, req([1, 2, 3]))
    tokens = [t for e in events if e.WhichOneof("event") == "tokens" for t in e.tokens.token_ids]
    assert tokens == [7, 8, 9]
    (task,) = bus.tasks()
    assert (task.decode_instance, task.decode_address) == ("d1", "127.0.0.1:7009")
    assert h.upstream.view.away and local_routes() == before + 1


async def test_a_view_older_than_the_dead_time_routes_nothing() -> None:
    """Staleness is bounded: instances silent for instance_dead_after are never chosen."""
    bus, clock = FakeBus(), Clock()
    bus.balancer_up = False
    h = with_view(bus, clock)
    heard(h)
    clock.now += 3.5
    with pytest.raises(Aborted) as info:
        await collect(h, req([1, 2]))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no balancer" in info.value.details
    assert not bus.tasks()


async def test_a_balancers_answer_wins_over_the_view() -> None:
    bus = FakeBus()
    bus.decision = control_pb2.RouteDecision(error="no live decode instance (0 live)")
    h = with_view(bus)
    heard(h)
    with pytest.raises(Aborted) as info:
        await collect(h, req([1, 2]))
    assert "no live decode instance" in info.value.details and not h.upstream.view.away


async def test_routing_goes_back_to_the_balancer_once_it_answers() -> None:
    bus = FakeBus()
    bus.balancer_up = False
    h = with_view(bus)
    heard(h, decode="d2")  # the view would pick d2; the balancer says d1
    await collect(h, req([1, 2]))
    assert bus.tasks()[-1].decode_instance == "d2" and h.upstream.view.away
    bus.balancer_up = True
    await collect(h, req([1, 3]))  # routed on the view; its probe finds the balancer back
    await asyncio.sleep(0)
    assert not h.upstream.view.away and len(bus.routes) == 1
    await collect(h, req([1, 4]))
    assert bus.tasks()[-1].decode_instance == "d1" and len(bus.routes) == 2


class HungBus(FakeBus):
    """A balancer that takes the route request and never answers (SIGSTOP)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        self.asked += 1
        await asyncio.sleep(timeout)
        raise BusUnavailable(f"no answer on {subject} within {timeout:.1f}s")


async def test_a_hung_balancer_costs_one_request_its_timeout_not_every_one() -> None:
    bus = HungBus()
    h = make(bus, route_timeout=0.2)
    h.upstream.view = LastView(3.0, probe_every=60.0)
    heard(h)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await collect(h, req([1, 2]))
    first = loop.time() - t0
    t0 = loop.time()
    for k in range(5):
        await collect(h, req([1, 3 + k]))
    rest = loop.time() - t0
    assert first >= 0.2 and rest < 0.5, (first, rest)  # 5 x 0.2 s if each waited
    assert bus.asked == 1 and len(bus.tasks()) == 6


async def test_an_excluded_instance_is_not_chosen_by_the_view() -> None:
    view = LastView(3.0, clock=Clock())
    for iid, role in (("p1", control_pb2.ROLE_PREFILL), ("p2", control_pb2.ROLE_PREFILL)):
        view.observe(control_pb2.InstanceStatus(instance_id=iid, role=role))
    view.observe(
        control_pb2.InstanceStatus(instance_id="d1", role=control_pb2.ROLE_DECODE, address="a:1")
    )
    got = view.route(control_pb2.RouteRequest(request_id="r", exclude=["p1"], prompt_tokens=9))
    assert got is not None and got.prefill_instance == "p2"
    none = view.route(control_pb2.RouteRequest(request_id="r", exclude=["p1", "p2"]))
    assert none is None
