"""Background cache writes with a bound, so a slow kvstore never piles work on an instance.

Prefill and decode copy new blocks out of the engine and write them to the kvstore after the
request has moved on. Each pending write holds its blocks (device staging, then host bytes)
until the kvstore takes them, so under load they are bounded: at most ``max_bytes`` pending
and ``max_concurrent`` writes in flight; a write that would exceed the bound is not started
(:meth:`reserve` says no) -- a lost cache write only costs a future recompute, while an
unbounded backlog costs memory and the instance's CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class WriteBehind:
    def __init__(self, max_bytes: int = 1 << 30, max_concurrent: int = 2) -> None:
        if max_bytes <= 0 or max_concurrent <= 0:
            raise ValueError("max_bytes and max_concurrent must be positive")
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.dropped = 0  # writes refused by the bound
        self._slots = asyncio.Semaphore(max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()

    def reserve(self, nbytes: int) -> bool:
        """Take room for a write of ``nbytes``; False (and counted) when there is none."""
        if self.pending_bytes and self.pending_bytes + nbytes > self.max_bytes:
            self.dropped += 1
            return False
        self.pending_bytes += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        """Give back room taken by :meth:`reserve` for a write that will not start."""
        self.pending_bytes -= nbytes

    def start(self, write: Callable[[], Awaitable[None]], nbytes: int) -> None:
        """Run ``write`` (room for ``nbytes`` reserved) when a slot is free; its errors are
        its own to log."""

        async def run() -> None:
            try:
                async with self._slots:
                    await write()
            finally:
                self.pending_bytes -= nbytes

        t = asyncio.ensure_future(run())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def submit(
        self,
        nbytes: int,
        copy_out: Callable[[], Awaitable[T]],
        write: Callable[[T], Awaitable[None]],
    ) -> bool:
        """Reserve room for ``nbytes``, run ``copy_out`` now (what it copies may be freed once
        it returns), then ``write`` its result in the background. False, and nothing run,
        when there is no room."""
        if not self.reserve(nbytes):
            return False
        try:
            copied = await copy_out()
        except BaseException:
            self.unreserve(nbytes)
            raise
        self.start(lambda: write(copied), nbytes)
        return True

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
