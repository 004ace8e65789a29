"""The internal APIs' service credential (libs/common/grpc_auth.py) over a real local gRPC server:
a call refused for its credential never has its body parsed, whatever the method's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from libs.common.grpc_auth import ServiceTokenInterceptor, call_metadata

TOKEN = "svc-token"


class Parses:
    """A deserializer that counts the bodies it parses (the method's real one would)."""

    def __init__(self) -> None:
        self.parsed: list[bytes] = []

    def __call__(self, data: bytes) -> bytes:
        self.parsed.append(data)
        return data


def _echo(x: bytes) -> bytes:
    return x


async def _server(parses: Parses) -> tuple[grpc.aio.Server, int]:
    async def uu(request: bytes, context: Any) -> bytes:
        return request

    async def us(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield request

    async def su(requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b"".join([r async for r in requests])

    async def ss(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r

    handlers = {
        "UU": grpc.unary_unary_rpc_method_handler(uu, parses, _echo),
        "US": grpc.unary_stream_rpc_method_handler(us, parses, _echo),
        "SU": grpc.stream_unary_rpc_method_handler(su, parses, _echo),
        "SS": grpc.stream_stream_rpc_method_handler(ss, parses, _echo),
    }
    server = grpc.aio.server(interceptors=[ServiceTokenInterceptor(TOKEN)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Svc", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _call(channel: grpc.aio.Channel, shape: str, metadata: Any) -> list[bytes]:
    body = b"\xff\xff not a protobuf"
    path = f"/t.Svc/{shape}"
    if shape == "UU":
        return [await channel.unary_unary(path)(body, metadata=metadata)]
    if shape == "US":
        return [r async for r in channel.unary_stream(path)(body, metadata=metadata)]
    if shape == "SU":
        return [await channel.stream_unary(path)(iter([body, body]), metadata=metadata)]
    return [r async for r in channel.stream_stream(path)(iter([body, body]), metadata=metadata)]


def _lost_the_race(exc: grpc.aio.AioRpcError) -> bool:
    """A streamed request's client still writing its second message when the server's refusal
    closed the stream: grpc reports its own failed write (INTERNAL, "execute_batch") instead of
    the server's status. The call is tried again; the server parsed nothing either way."""
    return exc.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (
        exc.debug_error_string() or ""
    )


@pytest.mark.parametrize("shape", ["UU", "US", "SU", "SS"])
async def test_a_call_refused_for_its_credential_is_never_parsed(shape: str) -> None:
    parses = Parses()
    server, port = await _server(parses)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for metadata in (None, call_metadata("not-the-token")):
                for _ in range(5):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await _call(channel, shape, metadata)
                    if not _lost_the_race(refused.value):
                        break
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "service credential" in (refused.value.details() or "")
            assert parses.parsed == []  # no refused body reached the method's deserializer
            served = await _call(channel, shape, call_metadata(TOKEN))
            assert served and parses.parsed  # with the token the method reads its body
    finally:
        await server.stop(None)
