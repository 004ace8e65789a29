"""The recipe's access log (issue 38 item 7): one line per HTTP request with its status, its
latency, the hashed tenant and the trace id -- refusals included -- and uvicorn's own lines in
JSON when JSON logging is asked."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.common.auth import KeyTable
from libs.common.grpc_auth import ANONYMOUS, OnBehalf
from libs.common.logs import formatter
from libs.common.tenant_label import UNSALTED
from libs.proto.deepserve.v1 import generate_pb2
from services.recipe.access_log import access_log
from services.recipe.encoding import PromptEncoder
from services.recipe.server import build_server, run_server, stop_server

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend, FakeCall
from .test_recipe import make_app

KEYS = {"sk-acme-secret": "acme"}
ACME = UNSALTED("acme")  # no --tenant-label-secret in these apps
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class TracingBackend(FakeBackend):
    """Remembers the traceparent each backend call carried."""

    def __init__(self, encoder: PromptEncoder) -> None:
        super().__init__(encoder)
        self.traceparents: list[str] = []

    def generate(
        self,
        request: generate_pb2.GenerateRequest,
        traceparent: str = "",
        on_behalf: OnBehalf = ANONYMOUS,
    ) -> FakeCall:
        self.traceparents.append(traceparent)
        return super().generate(request, traceparent, on_behalf)


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL], default_thinking=False)


@pytest.fixture
def backend(encoder: PromptEncoder) -> TracingBackend:
    return TracingBackend(encoder)


@pytest.fixture
def client(encoder: PromptEncoder, backend: TracingBackend) -> TestClient:
    app = make_app(encoder, backend, keys=KEYS, registry=CollectorRegistry())
    return strict_http(TestClient(access_log(app, KeyTable(KEYS)), raise_server_exceptions=False))


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "recipe.access"]


def test_one_line_per_request_with_status_tenant_and_latency(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="recipe.access")
    auth = {"authorization": "Bearer sk-acme-secret"}
    assert client.post("/v1/chat/completions", json=chat(), headers=auth).status_code == 200
    r = client.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer no"})
    assert r.status_code == 401
    assert (
        client.post("/v1/chat/completions", json={"model": MODEL}, headers=auth).status_code == 400
    )
    got = lines(caplog)
    assert [r.fields["status"] for r in got] == [200, 401, 400]  # type: ignore[attr-defined]
    assert [r.fields["tenant_hash"] for r in got] == [ACME, "-", ACME]  # type: ignore[attr-defined]
    for record in got:
        fields = record.fields  # type: ignore[attr-defined]
        assert fields["method"] == "POST" and fields["path"] == "/v1/chat/completions"
        assert fields["latency_s"] > 0 and len(fields["trace_id"]) == 32
        text = record.getMessage()
        assert f"POST /v1/chat/completions {fields['status']} " in text
        assert "sk-acme-secret" not in text and "acme " not in text
    assert got[0].fields["request_id"]  # type: ignore[attr-defined]  # the response named it


def test_a_stream_is_logged_when_it_ends(
    client: TestClient, backend: TracingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="recipe.access")
    auth = {"authorization": "Bearer sk-acme-secret"}
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=auth) as r:
        assert r.status_code == 200
        assert not lines(caplog)  # headers sent, the body still streaming: not yet
        body = r.read()
    assert b"[DONE]" in body
    (record,) = lines(caplog)
    assert record.fields["status"] == 200  # type: ignore[attr-defined]


def test_the_trace_id_is_the_callers_and_the_backend_call_joins_it(
    client: TestClient, backend: TracingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="recipe.access")
    headers = {
        "authorization": "Bearer sk-acme-secret",
        "traceparent": f"00-{CALLER_TRACE}-00f067aa0ba902b7-01",
    }
    assert client.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 200
    client.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer x"})
    first, second = lines(caplog)
    assert first.fields["trace_id"] == CALLER_TRACE  # type: ignore[attr-defined]
    assert backend.traceparents[0].split("-")[1] == CALLER_TRACE
    # No traceparent: a trace of its own, still named in the line.
    assert second.fields["trace_id"] not in ("0" * 32, CALLER_TRACE)  # type: ignore[attr-defined]


def test_json_format_carries_the_fields(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="recipe.access")
    client.get("/v1/models", headers={"x-api-key": "sk-acme-secret"})
    (record,) = lines(caplog)
    out = json.loads(formatter("json", "recipe").format(record))
    assert out["logger"] == "recipe.access" and out["service"] == "recipe"
    assert out["status"] == 200 and out["tenant_hash"] == ACME and out["path"] == "/v1/models"


async def test_uvicorn_lines_follow_the_json_format(
    encoder: PromptEncoder, backend: TracingBackend
) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter("json", "recipe"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        app = access_log(make_app(encoder, backend, registry=CollectorRegistry()), KeyTable())
        server = build_server(
            app,
            "127.0.0.1",
            0,
            log_level="INFO",
            drain_seconds=1,
            keep_alive_timeout=5,
            header_timeout=5,
        )
        task = asyncio.create_task(run_server(server))
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.02)
        assert server.started
        await stop_server(server, task, 1, logging.getLogger("test"))
    finally:
        root.removeHandler(handler)
    out = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is JSON
    uvicorn_lines = [o for o in out if o["logger"].startswith("uvicorn")]
    assert any("Uvicorn running on" in o["msg"] for o in uvicorn_lines), out
    assert all(o["service"] == "recipe" for o in uvicorn_lines)
