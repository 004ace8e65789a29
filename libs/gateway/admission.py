"""Backpressure: at most ``max_inflight`` Generate calls run; up to ``max_waiting`` more wait
up to ``admit_wait`` seconds for a slot; the rest are refused at once with RESOURCE_EXHAUSTED
and a retry hint, so a burst never becomes an unbounded queue inside the entrypoint."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from libs.common.errors import Overloaded


class Admission:
    def __init__(
        self, max_inflight: int, max_waiting: int, admit_wait: float, retry_after_ms: int
    ) -> None:
        self.max_inflight, self.max_waiting = max_inflight, max_waiting  # max_inflight 0: no limit
        self.admit_wait, self.retry_after_ms = admit_wait, retry_after_ms
        self.running = 0
        self.waiting = 0
        self._freed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body; raises :class:`Overloaded` if none comes in time."""
        if self.max_inflight and self.running >= self.max_inflight:
            if self.waiting >= self.max_waiting:
                self._refuse("its queue is full")
            self.waiting += 1
            try:
                async with self._freed:
                    await asyncio.wait_for(
                        self._freed.wait_for(lambda: self.running < self.max_inflight),
                        self.admit_wait,
                    )
            except TimeoutError:
                self._refuse(f"no slot came free within {self.admit_wait:g}s")
            finally:
                self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if self.max_inflight:
                # Not awaited here: the caller may be a cancelled task. The condition's lock
                # is only held across non-blocking code, so this runs almost at once.
                asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    def _refuse(self, why: str) -> None:
        ms = self.retry_after_ms
        raise Overloaded(
            f"entrypoint overloaded: {self.running} requests in flight (limit "
            f"{self.max_inflight}) and {why}; retry after {ms} ms",
            ms,
        )
