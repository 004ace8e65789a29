"""The recipe's view of the entrypoint: a ``Generate`` stream it can cancel.

:class:`GenerateBackend` is the seam the app depends on; :class:`GrpcGenerateBackend` is the
real one (gRPC to the entrypoint) and tests pass a deterministic in-process fake. Failures
surface as the kinds of :mod:`libs.common.errors` (read from the gRPC status by
:func:`libs.common.grpc_errors.from_status`), mapped to HTTP once, in the app.

Every wait on the entrypoint is bounded: the first event of a call must come within
``first_event_timeout`` seconds and each later one within ``event_timeout`` of the one before
(``--first-event-timeout``, ``--event-timeout``), else the call is cancelled and
:class:`~libs.common.errors.DeadlineExceeded` raised (504). The entrypoint aborts a request
whose engines fall silent for its own ``--request-timeout`` (60 s) and sends that error, so the
recipe's deadlines, longer, only fire when the entrypoint itself is frozen or unreachable.

A request with several choices (``n``) is one call per choice: :class:`Calls` starts and
cancels them together, :func:`merged` reads their events as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.common.errors import DeadlineExceeded
from libs.common.grpc_auth import ANONYMOUS, OnBehalf, call_metadata
from libs.common.grpc_errors import from_status
from libs.common.ready_queue import ReadyQueue
from libs.proto.deepserve.v1 import generate_pb2, generate_pb2_grpc


class GenerateCall(Protocol):
    """One running ``Generate``: iterate its events; ``cancel()`` stops it (idempotent)."""

    def __aiter__(self) -> AsyncIterator[generate_pb2.GenerateEvent]: ...

    def cancel(self) -> None: ...


class GenerateBackend(Protocol):
    def generate(
        self,
        request: generate_pb2.GenerateRequest,
        traceparent: str = "",
        on_behalf: OnBehalf = ANONYMOUS,
    ) -> GenerateCall:
        """Start a request; errors (also at start) surface while iterating, as a
        :class:`~libs.common.errors.DeepserveError`. ``on_behalf``: the client's key id and
        the protocol route, which the entrypoint's usage record names."""
        ...

    async def check(self) -> tuple[bool, str]:
        """Whether the entrypoint can take requests now, and why not."""
        ...

    async def close(self) -> None: ...


class _GrpcCall:
    """One ``Generate`` call. Its events are read ahead by a task of their own, so the events
    that came while the consumer was busy (formatting and sending the last ones) are taken
    together, runs of tokens joined into one event (:func:`joined_events`): a client stream
    that falls behind catches up in one SSE chunk, not one per token."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, address: str, first_timeout: float, timeout: float
    ) -> None:
        self._call, self._address = call, address
        self._first_timeout, self._timeout = first_timeout, timeout
        # what the read-ahead got: events, then None (the end) or the error the call ended with
        self._got: ReadyQueue[generate_pb2.GenerateEvent | BaseException | None] = ReadyQueue()

    async def _read_ahead(self) -> None:
        try:
            while True:
                event = await self._call.read()
                if event is grpc.aio.EOF:
                    self._got.put(None)
                    return
                assert isinstance(event, generate_pb2.GenerateEvent)
                self._got.put(event)
        except grpc.aio.AioRpcError as exc:
            self._got.put(from_status(exc.code(), exc.details() or "", exc.trailing_metadata()))
        except asyncio.CancelledError:
            self._got.put(None)  # the call was cancelled: its events end here
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self._got.put(exc)

    async def __aiter__(self) -> AsyncIterator[generate_pb2.GenerateEvent]:
        wait, which = self._first_timeout, "--first-event-timeout"
        reader = asyncio.get_running_loop().create_task(self._read_ahead())
        try:
            while True:
                try:
                    first = await self._got.get(wait)
                except TimeoutError:
                    self._call.cancel()
                    raise DeadlineExceeded(
                        f"the entrypoint at {self._address} sent nothing for {wait:g} s ({which})"
                    ) from None
                got = [first, *self._got.take_all()]
                events = [e for e in got if isinstance(e, generate_pb2.GenerateEvent)]
                for event in joined_events(events):
                    yield event
                end = got[-1]  # the read-ahead puts nothing after the end
                if isinstance(end, BaseException):
                    raise end
                if end is None:
                    return
                wait, which = self._timeout, "--event-timeout"
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    def cancel(self) -> None:
        self._call.cancel()


def joined_events(events: list[generate_pb2.GenerateEvent]) -> list[generate_pb2.GenerateEvent]:
    """``events`` with each run of adjacent ``tokens`` events made one (ids and logprobs in
    order); ``ready`` and ``finish`` stay as they are."""
    out: list[generate_pb2.GenerateEvent] = []
    for ev in events:
        if ev.WhichOneof("event") == "tokens" and out and out[-1].WhichOneof("event") == "tokens":
            out[-1].tokens.token_ids.extend(ev.tokens.token_ids)
            out[-1].tokens.logprobs.extend(ev.tokens.logprobs)
        else:
            out.append(ev)
    return out


class GrpcGenerateBackend:
    def __init__(
        self,
        address: str,
        max_message_bytes: int = 64 << 20,
        first_event_timeout: float = 120.0,
        event_timeout: float = 120.0,
        service_token: str = "",
    ) -> None:
        self.address = address
        # The recipe authenticated the client (its API key -> tenant); to the entrypoint it
        # presents the service credential, which lets it name that tenant in the request.
        self._md = call_metadata(service_token)
        self.first_event_timeout, self.event_timeout = first_event_timeout, event_timeout
        self.channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self.stub = generate_pb2_grpc.GenerateStub(self.channel)  # type: ignore[no-untyped-call]
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(
        self,
        request: generate_pb2.GenerateRequest,
        traceparent: str = "",
        on_behalf: OnBehalf = ANONYMOUS,
    ) -> GenerateCall:
        # with the service credential the entrypoint believes the key id and route we name
        metadata = self._md + on_behalf.metadata()
        metadata += (("traceparent", traceparent),) if traceparent else ()
        call = self.stub.Generate(request, metadata=metadata or None)
        return _GrpcCall(call, self.address, self.first_event_timeout, self.event_timeout)

    async def check(self) -> tuple[bool, str]:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return True, f"entrypoint at {self.address} answers (no health service)"
            return (
                False,
                f"entrypoint at {self.address} unreachable: {exc.code().name} {exc.details()}",
            )
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return False, f"entrypoint at {self.address} is {state}"
        return True, f"entrypoint at {self.address} serving"

    async def close(self) -> None:
        await self.channel.close()


class Calls:
    """The backend calls of a request's choices, started by ``start(choice)`` and cancelled
    together."""

    def __init__(self, start: Callable[[int], GenerateCall]) -> None:
        self._start = start
        self.calls: list[GenerateCall] = []
        self.events: list[AsyncIterator[generate_pb2.GenerateEvent]] = []

    def start(self, index: int) -> AsyncIterator[generate_pb2.GenerateEvent]:
        call = self._start(index)
        self.calls.append(call)
        self.events.append(aiter(call))
        return self.events[-1]

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


async def merged(
    events: list[AsyncIterator[generate_pb2.GenerateEvent]], live: Callable[[int], bool]
) -> AsyncGenerator[tuple[int, generate_pb2.GenerateEvent], None]:
    """(choice, event) from every choice's call as they come, reading a choice only while
    ``live(choice)``; one read in flight per call, so a finished choice is read no further."""
    if len(events) == 1:  # the common case: no tasks
        if live(0):
            async for ev in events[0]:
                yield 0, ev
                if not live(0):
                    return
        return
    reads: dict[asyncio.Future[generate_pb2.GenerateEvent], int] = {
        asyncio.ensure_future(anext(e)): i for i, e in enumerate(events) if live(i)
    }
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=lambda r: reads[r]):
                i = reads.pop(read)
                try:
                    ev = read.result()
                except StopAsyncIteration:
                    continue
                yield i, ev
                if live(i):
                    reads[asyncio.ensure_future(anext(events[i]))] = i
    finally:
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
