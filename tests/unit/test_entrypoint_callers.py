"""gRPC Generate: an API key's limits hold there as on HTTP (the service caller -- the recipe,
which enforces them itself -- is not capped twice), a refusal names the limit, a call whose
credential is bad is refused before its body is parsed, and usage is written as the client
receives tokens (a failover billed once)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from libs.gateway.keylimits import KeyLimit, KeyLimitPolicy
from libs.proto.deepserve.v1 import control_pb2
from services.entrypoint.callers import CredentialInterceptor
from services.entrypoint.handler_config import HandlerConfig
from services.entrypoint.handlers import EntrypointHandlers
from services.entrypoint.ledger import MemoryLedger

from .test_entrypoint_handlers import (
    LIMITS,
    SECRET,
    Aborted,
    FakeBus,
    FakeContext,
    FakeLookup,
    greedy_events,
    req,
)

KEYS = {"sk-a": "acme"}
KEY = FakeContext(metadata=(("authorization", "Bearer sk-a"),))
SERVICE = FakeContext(metadata=(("authorization", "Bearer svc"),))


def handlers(bus: FakeBus, ledger: MemoryLedger | None = None, **limit: int) -> EntrypointHandlers:
    cfg = HandlerConfig(
        limits=LIMITS,
        salt_secret=SECRET,
        api_keys=KEYS,
        service_token="svc",
        key_limits=KeyLimitPolicy(KeyLimit(**limit)),
    )
    return EntrypointHandlers(cfg, bus, FakeLookup(), ledger=ledger)


async def _drain(h: EntrypointHandlers, r: Any, ctx: FakeContext) -> list[Any]:
    return [ev async for ev in h.Generate(r, ctx)]


async def test_an_api_keys_cap_holds_on_generate_and_names_the_limit() -> None:
    bus = FakeBus(lambda t: [])  # no events: the first call stays in flight
    h = handlers(bus, concurrency=1)
    first = asyncio.create_task(_drain(h, req([1, 2, 3]), KEY))
    await asyncio.sleep(0.05)
    with pytest.raises(Aborted) as refused:
        await _drain(h, req([1, 2, 3]), KEY)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit is 1 generations in flight" in refused.value.details
    # the recipe's own calls (service credential) are capped by the recipe, not here again
    bus.prefill = lambda t: greedy_events(t, [7])
    served = await _drain(h, req([1, 2, 3], tenant="acme"), SERVICE)
    assert served[-1].WhichOneof("event") == "finish"
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0)  # the slot goes back in a task of its own
    bus.prefill = lambda t: greedy_events(t, [7])
    again = await _drain(h, req([1, 2, 3]), KEY)
    assert again[-1].WhichOneof("event") == "finish"


async def test_a_keys_token_rate_holds_on_generate() -> None:
    h = handlers(FakeBus(), concurrency=0, tokens_per_min=20)
    await _drain(h, req([1, 2, 3], max_tokens=3), KEY)  # reserves 6, uses 6
    with pytest.raises(Aborted) as refused:
        await _drain(h, req(list(range(1, 11)), max_tokens=10), KEY)  # 20 > 14 left
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "20 tokens per minute" in refused.value.details


async def test_usage_is_recorded_per_request_id_as_delivered() -> None:
    ledger = MemoryLedger()
    h = handlers(FakeBus(), ledger)
    await _drain(h, req([1, 2, 3], request_id="r1"), KEY)
    (rec,) = ledger.records.values()
    assert (rec["tenant"], rec["route"], rec["status"]) == ("acme", "grpc", "ok")
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["calls"]) == (3, 3, 1)
    assert rec["key_id"] and rec["key_id"] != "sk-a"
    # the same request id again (a client's retry): one record, billed once
    await _drain(h, req([1, 2, 3], request_id="r1"), KEY)
    (rec,) = ledger.records.values()
    assert (rec["completion_tokens"], rec["calls"]) == (3, 2)


async def test_a_client_gone_mid_stream_is_billed_what_it_received() -> None:
    ledger = MemoryLedger()
    h = handlers(FakeBus(lambda t: greedy_events(t, [7, 8, 9, 10, 11])), ledger)
    stream = h.Generate(req([1, 2, 3], max_tokens=5, request_id="r2"), KEY)
    got = [await stream.__anext__() for _ in range(2)]  # ready + tokens, then it leaves
    assert [e.WhichOneof("event") for e in got] == ["ready", "tokens"]
    received = len(got[1].tokens.token_ids)  # every event already waiting, as one
    await stream.aclose()
    (rec,) = ledger.records.values()
    assert rec["completion_tokens"] == received and rec["status"] != "open"


async def test_a_refused_request_has_no_usage_record() -> None:
    ledger = MemoryLedger()
    h = handlers(FakeBus(lambda t: []), ledger, concurrency=1)
    first = asyncio.create_task(_drain(h, req([1, 2, 3]), KEY))
    await asyncio.sleep(0.05)
    with pytest.raises(Aborted):
        await _drain(h, req([1, 2, 3], request_id="refused"), KEY)
    assert not any(r["request_id"] == "refused" for r in ledger.records.values())
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


class Details:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = "/deepserve.v1.Generate/Generate"
        self.invocation_metadata = metadata


async def test_a_bad_credential_is_refused_before_the_body_is_parsed() -> None:
    h = handlers(FakeBus())
    interceptor = CredentialInterceptor(h.callers)
    real = grpc.unary_stream_rpc_method_handler(
        h.Generate, request_deserializer=control_pb2.PrefillTask.FromString
    )

    async def continuation(details: Any) -> Any:
        return real

    for metadata in ((), (("authorization", "Bearer sk-nope"),)):
        got = await interceptor.intercept_service(continuation, Details(metadata))
        assert got is not real
        assert got.request_deserializer(b"\xff\xff not a protobuf") is None  # never parsed
        with pytest.raises(Aborted) as refused:
            async for _ in got.unary_stream(None, FakeContext()):
                pass
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    for metadata in ((("authorization", "Bearer sk-a"),), (("authorization", "Bearer svc"),)):
        assert await interceptor.intercept_service(continuation, Details(metadata)) is real


async def test_an_unknown_traffic_class_is_refused_naming_the_field() -> None:
    h = handlers(FakeBus())
    with pytest.raises(Aborted) as refused:
        await _drain(h, req([1, 2, 3], traffic_class=99), KEY)  # type: ignore[arg-type]
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "traffic_class" in refused.value.details and "99" in refused.value.details
    assert "TRAFFIC_CLASS_AGENT" in refused.value.details
    served = await _drain(h, req([1, 2, 3], traffic_class=2), KEY)
    assert served[-1].WhichOneof("event") == "finish"
