"""The token path's queue: first in, first out; an item already there is taken without
waiting; an empty queue waits for the next put, or raises TimeoutError after its bound."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.ready_queue import ReadyQueue


async def test_waits_for_a_put_then_gives_everything_in_order() -> None:
    q: ReadyQueue[int] = ReadyQueue()
    getter = asyncio.ensure_future(q.get(5.0))
    await asyncio.sleep(0.01)
    assert not getter.done()
    q.put(1)
    q.put(2)
    q.put(3)
    assert await getter == 1
    assert q.peek() == 2 and len(q) == 2
    assert q.take_all() == [2, 3] and len(q) == 0


async def test_an_empty_queue_times_out() -> None:
    q: ReadyQueue[int] = ReadyQueue()
    with pytest.raises(TimeoutError):
        await q.get(0.05)
    q.put(7)
    assert await q.get(0.05) == 7
