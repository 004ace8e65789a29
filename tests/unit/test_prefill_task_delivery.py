"""A PrefillTask survives a NATS outage: the entrypoint sends it until a copy is confirmed
(``services/entrypoint/delivery.py``), the prefill instance confirms every copy and serves
one (``PrefillHandler.on_message``). No NATS here: scripted senders and messages."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

from libs.common import subjects
from libs.gateway.retry import AttemptFailed
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.aborts import RecentIds
from services.entrypoint.delivery import Delivery, deliver
from services.entrypoint.handlers import EntrypointHandlers, HandlerConfig
from services.prefill.handlers import PrefillHandler

from .test_entrypoint_handlers import LIMITS, FakeBus, FakeLookup, collect, req

SUBJECT = subjects.prefill_task("p1")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


class ScriptedSender:
    """Answers each copy with the next outcome; ``on_arrival`` sees the copies that arrive."""

    def __init__(self, outcomes: Iterable[Delivery], bus: FakeBus | None = None) -> None:
        self.outcomes = list(outcomes)
        self.bus = bus
        self.sent: list[tuple[str, bytes, float]] = []
        self.reconnected = 0
        self.settle = False
        self.reconnect_after: int | None = None  # copy after which the bus "reconnects"

    def reconnects(self) -> int:
        return self.reconnected

    def settling(self) -> bool:
        return self.settle

    async def send(self, subject: str, data: bytes, timeout: float) -> Delivery:
        self.sent.append((subject, data, timeout))
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if self.reconnect_after is not None and len(self.sent) == self.reconnect_after:
            self.reconnected += 1
        if outcome in (Delivery.ACKED, Delivery.UNANSWERED) and self.bus is not None:
            await self.bus.publish(subject, data)  # the instance got this copy
        return outcome


async def run(sender: ScriptedSender, clock: Clock, gone_after: float = 2.0) -> Any:
    return await deliver(
        sender,
        SUBJECT,
        b"task",
        instance="p1",
        ack_timeout=1.0,
        gone_after=gone_after,
        clock=clock,
        sleep=clock.sleep,
    )


# -- the entrypoint's side ---------------------------------------------------------------------


async def test_a_confirmed_task_goes_out_once() -> None:
    sender, clock = ScriptedSender([Delivery.ACKED]), Clock()
    assert await run(sender, clock) == (Delivery.ACKED, 1)
    assert sender.sent == [(SUBJECT, b"task", 1.0)] and clock.now == 0


async def test_a_task_nobody_takes_yet_is_sent_again_until_confirmed() -> None:
    # Just after a restart the prefill instance has not subscribed again: the server says
    # "no responders" at once, and the copies go out every 0.1 s until one is confirmed.
    sender, clock = ScriptedSender([Delivery.NOBODY] * 5 + [Delivery.ACKED]), Clock()
    assert await run(sender, clock) == (Delivery.ACKED, 6)
    assert clock.now == pytest.approx(0.5)


async def test_a_copy_cut_off_is_sent_again_at_once() -> None:
    sender, clock = ScriptedSender([Delivery.CUT_OFF, Delivery.CUT_OFF, Delivery.ACKED]), Clock()
    assert await run(sender, clock) == (Delivery.ACKED, 3)


async def test_a_copy_handed_to_a_subscriber_that_does_not_confirm_arrived() -> None:
    # An instance from before confirmations: the server had a subscriber (else "no
    # responders"), so the task is there; sending it again would only duplicate it.
    sender, clock = ScriptedSender([Delivery.UNANSWERED]), Clock()
    assert await run(sender, clock) == (Delivery.UNANSWERED, 1)


async def test_nobody_subscribed_for_gone_after_fails_the_attempt_over() -> None:
    sender, clock = ScriptedSender([Delivery.NOBODY]), Clock()
    with pytest.raises(AttemptFailed) as info:
        await run(sender, clock, gone_after=2.0)
    assert info.value.instances == ("p1",) and "takes no tasks" in str(info.value)
    assert clock.now == pytest.approx(2.0) and len(sender.sent) == 21


async def test_the_gone_clock_restarts_when_the_bus_reconnects_or_a_copy_is_cut_off() -> None:
    # 1.5 s of "nobody", then the bus reconnects: the instances get a fresh 2 s to come back.
    sender, clock = ScriptedSender([Delivery.NOBODY] * 30 + [Delivery.ACKED]), Clock()
    sender.reconnect_after = 16
    assert await run(sender, clock, gone_after=2.0) == (Delivery.ACKED, 31)
    cut = ScriptedSender([Delivery.NOBODY] * 15 + [Delivery.CUT_OFF] + [Delivery.NOBODY] * 15)
    cut.outcomes.append(Delivery.ACKED)
    assert await run(cut, Clock(), gone_after=2.0) == (Delivery.ACKED, 32)


def make(bus: FakeBus, sender: ScriptedSender, **cfg: Any) -> EntrypointHandlers:
    config = HandlerConfig(limits=LIMITS, salt_secret=b"s", **cfg)
    return EntrypointHandlers(config, bus, FakeLookup(), tasks=sender)


async def test_generate_completes_when_the_first_copies_find_nobody() -> None:
    bus = FakeBus()
    sender = ScriptedSender([Delivery.NOBODY, Delivery.NOBODY, Delivery.ACKED], bus)
    events = await collect(make(bus, sender), req([1, 2, 3], request_id="r1"))
    assert [t for e in events if e.HasField("tokens") for t in e.tokens.token_ids] == [7, 8, 9]
    assert len(sender.sent) == 3 and len({data for _, data, _ in sender.sent}) == 1
    (task,) = bus.tasks()  # one copy arrived: the request ran once, under one upstream id
    assert task.request_id.startswith("r1-") and not bus.aborts()


async def test_generate_retries_elsewhere_when_the_instance_takes_no_tasks() -> None:
    bus = FakeBus()
    sender = ScriptedSender([Delivery.NOBODY])
    h = make(bus, sender, instance_dead_after=0.2, max_attempts=2)
    with pytest.raises(Exception, match="takes no tasks") as info:
        await collect(h, req([1, 2, 3], request_id="r2"))
    assert "UNAVAILABLE" in str(info.value)
    await h.wait_idle(1.0)  # aborts go out in the background
    # two attempts, each under its own upstream id, the second excluding p1; both aborted
    first, second = bus.routes
    assert first.request_id != second.request_id and list(second.exclude) == ["p1"]
    assert {a.request_id for a in bus.aborts()} == {first.request_id, second.request_id}


async def test_route_is_asked_again_while_the_bus_settles_after_an_outage() -> None:
    # Just after NATS is back the balancer has not heard the instances again: "no instance"
    # is asked again while the bus settles, not passed to the client.
    bus = FakeBus()
    good = bus.decision
    bus.decision = control_pb2.RouteDecision(error="no live prefill instance (0 live)")
    sender = ScriptedSender([Delivery.ACKED], bus)
    sender.settle = True

    async def heard_again() -> None:
        while len(bus.routes) < 2:
            await asyncio.sleep(0.01)
        bus.decision = good

    helper = asyncio.create_task(heard_again())
    events = await collect(make(bus, sender), req([1, 2, 3]))
    await helper
    assert events[-1].HasField("finish") and len(bus.routes) >= 3


# -- the prefill instance's side ---------------------------------------------------------------


class Msg:
    def __init__(self, data: bytes, reply: str = "_INBOX.1") -> None:
        self.data, self.reply = data, reply
        self.responses: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.responses.append(data)


def task(rid: str) -> bytes:
    return control_pb2.PrefillTask(request_id=rid, prompt_token_ids=[1, 2]).SerializeToString()


@pytest.fixture
def prefill() -> tuple[PrefillHandler, list[str], asyncio.Event]:
    """A prefill handler whose tasks run until ``release`` is set; ``served`` lists them."""
    h = PrefillHandler(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        instance_id="p1",
        model_name="m",
        block_size=4,
        max_model_len=64,
    )
    served: list[str] = []
    release = asyncio.Event()

    async def handle(t: control_pb2.PrefillTask) -> None:
        served.append(t.request_id)
        await release.wait()

    h.handle = handle  # type: ignore[method-assign]
    return h, served, release


async def test_every_copy_is_confirmed_and_one_is_served(
    prefill: tuple[PrefillHandler, list[str], asyncio.Event],
) -> None:
    h, served, release = prefill
    first, copy = Msg(task("a-1")), Msg(task("a-1"))
    await h.on_message(first)
    await h.on_message(copy)  # in flight
    await asyncio.sleep(0)
    assert first.responses == [b""] and copy.responses == [b""] and served == ["a-1"]
    release.set()
    await asyncio.sleep(0.01)
    assert h.num_active == 0
    late = Msg(task("a-1"))  # out of a client's buffer after the task finished
    await h.on_message(late)
    await asyncio.sleep(0.01)
    assert late.responses == [b""] and served == ["a-1"]
    other = Msg(task("b-1"))  # a retry has a new upstream id: served
    await h.on_message(other)
    await asyncio.sleep(0.01)
    assert served == ["a-1", "b-1"]


async def test_a_task_without_reply_subject_is_served_unconfirmed(
    prefill: tuple[PrefillHandler, list[str], asyncio.Event],
) -> None:
    h, served, release = prefill
    release.set()
    await h.on_message(Msg(task("c-1"), reply=""))  # an entrypoint from before confirmations
    await asyncio.sleep(0.01)
    assert served == ["c-1"]


async def test_an_unreadable_task_is_neither_served_nor_confirmed(
    prefill: tuple[PrefillHandler, list[str], asyncio.Event],
) -> None:
    h, served, _ = prefill
    bad = Msg(b"\xff\xff not a proto")
    await h.on_message(bad)
    assert bad.responses == [] and served == []


def test_recent_ids_forget_after_ttl_and_past_max_size() -> None:
    clock = Clock()
    ids = RecentIds(ttl_s=10.0, max_size=3, clock=clock)
    for rid in ("a", "b", "c", "d"):
        ids.add(rid)
    assert "a" not in ids and all(r in ids for r in "bcd") and len(ids) == 3
    clock.now = 10.5
    ids.add("e")
    assert "b" not in ids and "e" in ids and len(ids) == 1
