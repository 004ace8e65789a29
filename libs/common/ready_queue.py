"""A FIFO for one asyncio consumer that can see what is already there.

The token path's hops (decode's relay, the entrypoint's NATS subscription, the recipe's gRPC
call) each take what arrived while they were busy in one go. ``asyncio.Queue`` cannot peek,
and ``wait_for(queue.get(), t)`` makes a task per item; here an item that is already there
costs a ``popleft``, and only an empty queue waits (with a timer, never a task).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadyQueue(Generic[T]):
    """Items in arrival order; ``put`` from the consumer's event loop thread only."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._arrived = asyncio.Event()

    def put(self, item: T) -> None:
        self._items.append(item)
        self._arrived.set()

    async def get(self, timeout: float | None = None) -> T:
        """The first item, waiting for one if there is none; TimeoutError after ``timeout``
        seconds (None: no limit)."""
        while not self._items:
            self._arrived.clear()
            async with asyncio.timeout(timeout):
                await self._arrived.wait()
        return self._items.popleft()

    def peek(self) -> T:
        """The first item, left in place (IndexError when empty)."""
        return self._items[0]

    def take(self) -> T:
        """The first item, without waiting (IndexError when empty)."""
        return self._items.popleft()

    def take_all(self) -> list[T]:
        """Every item already here, without waiting."""
        out = list(self._items)
        self._items.clear()
        return out

    def __len__(self) -> int:
        return len(self._items)
