"""The recipe tells the entrypoint which API key and protocol route a call serves (call metadata
beside its service credential), so the entrypoint's usage ledger -- the billing record -- names
them; the entrypoint believes that metadata from the service caller only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from libs.common.auth import KeyTable
from libs.common.grpc_auth import KEY_ID_METADATA, ROUTE_METADATA, OnBehalf
from libs.gateway.keylimits import key_id
from libs.gateway.policy import Limits
from libs.proto.deepserve.v1 import generate_pb2_grpc
from services.entrypoint.callers import CredentialInterceptor
from services.entrypoint.handler_config import HandlerConfig
from services.entrypoint.handlers import EntrypointHandlers
from services.entrypoint.ledger import MemoryLedger
from services.recipe.app import build_app
from services.recipe.backend import GrpcGenerateBackend
from services.recipe.encoding import PromptEncoder
from services.recipe.handlers import AppConfig, Metrics

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_entrypoint_handlers import SECRET, Aborted, FakeBus, FakeContext, FakeLookup, req

KEY = "sk-acme-key"
KEYS = {KEY: "acme"}
TOKEN = "svc"
NAMED = OnBehalf(key_id(KEY), "messages")


def _handlers(ledger: MemoryLedger, limits: Limits | None = None) -> EntrypointHandlers:
    cfg = HandlerConfig(
        limits=limits or Limits(model_name="tiny", vocab_size=1000, block_size=4),
        salt_secret=SECRET,
        api_keys=KEYS,
        service_token=TOKEN,
    )
    return EntrypointHandlers(cfg, FakeBus(), FakeLookup(), ledger=ledger)


async def _drain(h: EntrypointHandlers, rid: str, *metadata: tuple[str, str]) -> list[Any]:
    context = FakeContext(metadata=tuple(metadata))
    return [ev async for ev in h.Generate(req([1, 2, 3], tenant="acme", request_id=rid), context)]


async def test_the_service_callers_key_id_and_route_reach_the_usage_record() -> None:
    ledger = MemoryLedger()
    h = _handlers(ledger)
    service = ("authorization", f"Bearer {TOKEN}")
    await _drain(h, "named", service, *NAMED.metadata())
    await _drain(h, "plain", service)  # a service call that names nothing
    records = {r["request_id"]: r for r in ledger.records.values()}
    assert (records["named"]["key_id"], records["named"]["route"]) == (key_id(KEY), "messages")
    assert (records["plain"]["key_id"], records["plain"]["route"]) == ("", "service")


async def test_an_api_key_caller_cannot_name_another_key_or_route() -> None:
    ledger = MemoryLedger()
    h = _handlers(ledger)
    forged = OnBehalf("0123abcd", "chat_completions").metadata()
    await _drain(h, "forged", ("authorization", f"Bearer {KEY}"), *forged)
    (rec,) = ledger.records.values()
    assert (rec["key_id"], rec["route"], rec["tenant"]) == (key_id(KEY), "grpc", "acme")


@pytest.mark.parametrize(
    ("name", "value"), [(KEY_ID_METADATA, "sk-a-raw-key"), (ROUTE_METADATA, "Chat Completions!")]
)
async def test_malformed_metadata_is_invalid_argument_naming_it(name: str, value: str) -> None:
    h = _handlers(MemoryLedger())
    with pytest.raises(Aborted) as refused:
        await _drain(h, "bad", ("authorization", f"Bearer {TOKEN}"), (name, value))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert name in refused.value.details


def test_the_recipe_names_the_key_and_route_of_each_call() -> None:
    from starlette.testclient import TestClient

    encoder = PromptEncoder([MODEL], default_thinking=False)
    backend = FakeBackend(encoder)
    cfg = AppConfig(model_name=MODEL, default_max_tokens=8, keys=KeyTable(KEYS))
    client = strict_http(TestClient(build_app(cfg, encoder, backend, Metrics(CollectorRegistry()))))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}
    r = client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert backend.on_behalf == [OnBehalf(key_id(KEY), "chat_completions")] * 2


@pytest.fixture
async def grpc_entrypoint() -> AsyncIterator[tuple[str, MemoryLedger]]:
    ledger = MemoryLedger()
    h = _handlers(ledger, Limits(model_name=MODEL, vocab_size=129280, block_size=4))
    server = grpc.aio.server(interceptors=[CredentialInterceptor(h.callers)])
    generate_pb2_grpc.add_GenerateServicer_to_server(h, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", ledger
    finally:
        await server.stop(None)


async def test_an_http_request_is_billed_under_its_key_and_route_over_grpc(
    grpc_entrypoint: tuple[str, MemoryLedger],
) -> None:
    address, ledger = grpc_entrypoint
    encoder = PromptEncoder([MODEL], default_thinking=False)
    backend = GrpcGenerateBackend(address, service_token=TOKEN)
    cfg = AppConfig(model_name=MODEL, default_max_tokens=8, keys=KeyTable(KEYS))
    app = build_app(cfg, encoder, backend, Metrics(CollectorRegistry()))
    try:
        async with strict_http(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://recipe")
        ) as client:
            r = await client.post(
                "/v1/messages",
                json={
                    "model": MODEL,
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                headers={"x-api-key": KEY},
            )
        assert r.status_code == 200, r.text
    finally:
        await backend.close()
    (rec,) = ledger.records.values()
    assert (rec["tenant"], rec["key_id"], rec["route"]) == ("acme", key_id(KEY), "messages")
    assert rec["completion_tokens"] == 3 and rec["status"] == "ok"
