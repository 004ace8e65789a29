"""How token events reach the caller: one at a time as they come, and all at once where they
were already waiting (a caller or an entrypoint that fell behind catches up in one message
instead of one per token, with nothing lost, reordered or billed twice)."""

from __future__ import annotations

import asyncio

from libs.proto.deepserve.v1 import control_pb2

from .test_entrypoint_handlers import FakeBus, FakeContext, greedy_events, make, req


async def test_events_already_waiting_go_out_as_one_message_in_order() -> None:
    # out of order on the bus, all there before the first is read
    bus = FakeBus(lambda t: greedy_events(t, [7, 8, 9, 10], order=[3, 1, 2, 0]))
    events = [ev async for ev in make(bus).Generate(req([1, 2, 3], max_tokens=4), FakeContext())]
    assert [e.WhichOneof("event") for e in events] == ["ready", "tokens", "finish"]
    assert list(events[1].tokens.token_ids) == [7, 8, 9, 10]
    assert events[2].finish.usage.completion_tokens == 4


async def test_events_that_come_one_by_one_are_sent_one_by_one() -> None:
    """No waiting to fill a batch: each event is passed on as soon as it is read."""
    held: list[bytes] = []
    bus = FakeBus(lambda t: [])

    async def publish(subject: str, data: bytes) -> None:
        await FakeBus.publish(bus, subject, data)
        if subject.startswith("ds.prefill."):
            task = control_pb2.PrefillTask.FromString(data)
            held.extend(e.SerializeToString() for e in greedy_events(task, [7, 8, 9]))

    bus.publish = publish  # type: ignore[method-assign]
    stream = make(bus).Generate(req([1, 2, 3], max_tokens=3), FakeContext())
    out = []
    nxt = asyncio.ensure_future(stream.__anext__())
    while len(out) < 4:  # ready+first token, second, third, finish
        await asyncio.sleep(0.01)
        if not nxt.done() and held:
            (sub,) = bus.subs.values()
            sub.queue.put_nowait(held.pop(0))  # one event, then see what comes out
            await asyncio.sleep(0.01)
        if nxt.done():
            out.append(nxt.result())
            nxt = asyncio.ensure_future(stream.__anext__())
    nxt.cancel()
    kinds = [e.WhichOneof("event") for e in out]
    assert kinds == ["ready", "tokens", "tokens", "tokens"]
    assert [list(e.tokens.token_ids) for e in out[1:]] == [[7], [8], [9]]
