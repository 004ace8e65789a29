"""The recipe's Generate calls over real gRPC (a scripted entrypoint in threads): events that
arrived while the recipe was busy come out together, tokens joined, in order; events that come
one by one go out one by one; tokens before an error are delivered before it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from libs.common.errors import Unavailable
from libs.proto.deepserve.v1 import generate_pb2, generate_pb2_grpc
from services.recipe.backend import GrpcGenerateBackend

from .recipe_fakes import generate_server


def tokens(*ids: int) -> generate_pb2.GenerateEvent:
    return generate_pb2.GenerateEvent(tokens=generate_pb2.Tokens(token_ids=list(ids)))


class Scripted(generate_pb2_grpc.GenerateServicer):
    """Ready, five single-token events ``gap`` seconds apart, then finish (or an error)."""

    gap = 0.0
    fail = False

    def Generate(self, request: Any, context: Any) -> Iterator[generate_pb2.GenerateEvent]:
        yield generate_pb2.GenerateEvent(ready=generate_pb2.Ready(request_id="r", prompt_tokens=3))
        for t in range(5):
            time.sleep(self.gap)
            yield tokens(10 + t)
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode instance lost")
        yield generate_pb2.GenerateEvent(finish=generate_pb2.Finish(reason="length"))


@pytest.fixture
def served() -> Iterator[tuple[Scripted, str]]:
    servicer = Scripted()
    with generate_server(servicer) as address:
        yield servicer, address


async def _events(address: str, pause: float) -> list[tuple[str, list[int]]]:
    backend = GrpcGenerateBackend(address)
    out: list[tuple[str, list[int]]] = []
    try:
        async for ev in backend.generate(generate_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3])):
            kind = ev.WhichOneof("event")
            out.append((kind, list(ev.tokens.token_ids) if kind == "tokens" else []))
            await asyncio.sleep(pause)  # formatting and sending this one
    finally:
        await backend.close()
    return out


async def test_events_that_arrived_meanwhile_are_joined_in_order(served) -> None:
    _, address = served
    got = await _events(address, pause=0.5)  # everything arrives during the first pause
    assert got == [("ready", []), ("tokens", [10, 11, 12, 13, 14]), ("finish", [])]


async def test_events_that_come_one_by_one_go_out_one_by_one(served) -> None:
    servicer, address = served
    servicer.gap = 0.1
    got = await _events(address, pause=0.0)
    assert [ids for kind, ids in got if kind == "tokens"] == [[10], [11], [12], [13], [14]]


async def test_tokens_before_an_error_are_delivered_first(served) -> None:
    servicer, address = served
    servicer.fail = True
    backend = GrpcGenerateBackend(address)
    seen: list[int] = []
    try:
        with pytest.raises(Unavailable, match="decode instance lost"):
            async for ev in backend.generate(generate_pb2.GenerateRequest(prompt_token_ids=[1])):
                seen += list(ev.tokens.token_ids)
                await asyncio.sleep(0.3)
    finally:
        await backend.close()
    assert seen == [10, 11, 12, 13, 14]
