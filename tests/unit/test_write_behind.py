"""The write-behind bound: room is reserved before a write starts, given back when it ends,
and a write past the bound is refused (counted) instead of queued."""

from __future__ import annotations

import asyncio

import pytest

from libs.serving.write_behind import WriteBehind


async def test_writes_past_the_bound_are_refused_until_room_comes_back() -> None:
    wb = WriteBehind(max_bytes=100, max_concurrent=1)
    gate = asyncio.Event()
    done: list[str] = []

    def write(name: str):  # noqa: ANN202
        async def run() -> None:
            await gate.wait()
            done.append(name)

        return run

    assert wb.reserve(60)
    wb.start(write("a"), 60)
    assert wb.reserve(40)
    wb.start(write("b"), 40)  # waits for the one slot
    assert not wb.reserve(1) and wb.dropped == 1
    assert wb.pending_bytes == 100 and wb.busy
    gate.set()
    await wb.drain(5.0)
    assert done == ["a", "b"] and wb.pending_bytes == 0 and not wb.busy
    assert wb.reserve(100)  # room is back
    wb.unreserve(100)
    assert wb.pending_bytes == 0


async def test_a_failing_write_gives_its_room_back() -> None:
    wb = WriteBehind(max_bytes=10)

    async def boom() -> None:
        raise OSError("kvstore gone")

    assert wb.reserve(10)
    wb.start(boom, 10)
    await wb.drain(5.0)
    assert wb.pending_bytes == 0


def test_one_write_larger_than_the_bound_still_runs_alone() -> None:
    wb = WriteBehind(max_bytes=10)
    assert wb.reserve(50)  # nothing pending: a big write is not starved forever
    assert not wb.reserve(1)
    with pytest.raises(ValueError):
        WriteBehind(max_bytes=0)


async def test_submit_copies_now_writes_later_and_refuses_without_room() -> None:
    wb = WriteBehind(max_bytes=100, max_concurrent=1)
    order: list[str] = []

    async def copy() -> str:
        order.append("copied")
        return "blocks"

    async def write(what: str) -> None:
        order.append(f"wrote {what}")

    assert await wb.submit(80, copy, write)
    assert order == ["copied"]  # the copy is done when submit returns; the write comes later
    calls: list[str] = []

    async def never() -> str:
        calls.append("copy")
        return ""

    assert not await wb.submit(50, never, write) and calls == [] and wb.dropped == 1
    await wb.drain(5.0)
    assert order == ["copied", "wrote blocks"] and wb.pending_bytes == 0

    async def broken() -> str:
        raise OSError("engine gone")

    with pytest.raises(OSError):
        await wb.submit(60, broken, write)
    assert wb.pending_bytes == 0  # a failed copy gives its room back
