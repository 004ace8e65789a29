"""One request's events on the asyncio side of an :class:`~.engine_loop.EngineLoop`: the engine
thread puts them (through ``call_soon_threadsafe``, in engine order), the service reads them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from libs.common.ready_queue import ReadyQueue
from libs.engine.scheduler import TokenEvent


class NotAdded(Exception):
    """:meth:`~.engine_loop.EngineLoop.add`'s ``unless`` said True: the request was not added."""


class EngineLoopClosed(RuntimeError):
    """The engine loop is stopped (or never started); no more work is taken."""


class EngineFailed(RuntimeError):
    """The engine raised while stepping; every request in flight at the time fails with this."""


class RequestStream:
    """The events of one request, in engine order; iteration ends after the finishing event.

    ``async for ev in stream`` yields :class:`TokenEvent` s; an abort ends the stream with an
    event whose ``finish_reason`` is ``"abort"`` and ``token_id`` is None. If the engine fails,
    iteration raises :class:`EngineFailed`.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._items: ReadyQueue[TokenEvent | BaseException] = ReadyQueue()
        self.finished = False
        # What add_request returned: an event to wait on before a KV pool reference's owner
        # may reuse the blocks it lent (None: nothing to wait for).
        self.imported: Any = None

    def _put(self, item: TokenEvent | BaseException) -> None:
        self._items.put(item)

    async def next(self) -> TokenEvent | None:
        """The next event, or None once the stream has ended."""
        if self.finished and not self._items:
            return None
        item = await self._items.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def ready_tokens(self) -> list[TokenEvent]:
        """The token events already here, taken without waiting, up to and including a
        finishing one; an abort or a failure stays for :meth:`next` (a relay that fell behind
        the engine sends these in one message)."""
        out: list[TokenEvent] = []
        while not self.finished and self._items:
            head = self._items.peek()
            if isinstance(head, BaseException) or head.token_id is None:
                break
            self._items.take()
            out.append(head)
            self.finished = head.finished
        return out

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[TokenEvent]:
        while (ev := await self.next()) is not None:
            yield ev
