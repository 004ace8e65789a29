"""recipe under hostile input (issue 13): prompts that cannot fit, encoding that would hold the
event loop, JSON nested 50,000 deep, idle and half-sent connections, a frozen entrypoint, and
nothing private on the public port.

Loopback only: a real uvicorn for the connection timeouts, a fake gRPC entrypoint that never
answers, and one recipe process for the ops port.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.proto.deepserve.v1 import generate_pb2, generate_pb2_grpc
from services.recipe.app import build_app
from services.recipe.backend import GrpcGenerateBackend
from services.recipe.encoding import PromptEncoder
from services.recipe.handlers import AppConfig, Metrics, tenant_label
from services.recipe.server import build_server, run_server, stop_server

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend, generate_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


def app_of(encoder: Any, backend: Any, **cfg: Any) -> Any:
    cfg.setdefault("max_body_bytes", 64 << 20)
    return build_app(
        AppConfig(model_name=MODEL, default_max_tokens=16, **cfg),
        encoder,
        backend,
        Metrics(CollectorRegistry()),
    )


def chat(text: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def messages(text: str = "hi") -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}


# -- 1. a prompt that cannot fit is refused before it is tokenized --------------------------------
ADVERSARIAL = {
    "spaces": " " * 5000,
    "dots": "." * 5000,
    "dashes": "-" * 5000,
    "single bytes": "".join(chr(i) for i in range(1, 256)) * 20,
    "emoji": "🎉😀🚀" * 1000,
    "cjk": "世界你好中文" * 1000,
    "digits": "1234567890" * 500,
    "mixed": ("a\n\t .,;\u00e9\u0301ß" * 500),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_chars_per_token_bound_holds_on_adversarial_text(encoder: PromptEncoder, name: str) -> None:
    text = ADVERSARIAL[name]
    ids = encoder.plain.encode(text, add_special_tokens=False).ids
    assert encoder.chars_per_token is not None
    assert len(text) <= encoder.chars_per_token * len(ids), (name, len(text) / len(ids))


def test_bound_never_refuses_a_prompt_that_fits(encoder: PromptEncoder) -> None:
    # Runs of spaces are the vocabulary's densest text (128 per token): such a prompt that fits
    # exactly must not be refused by the character bound.
    backend = FakeBackend(encoder)
    client = strict_http(TestClient(app_of(encoder, backend, max_context=200)))
    r = client.post("/v1/chat/completions", json=chat("x" + " " * 127 * 100 + "x"))
    assert r.status_code == 200, r.text
    assert len(backend.requests[-1].prompt_token_ids) < 200


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(
    encoder: PromptEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenized: list[int] = []
    real = PromptEncoder.encode_rendered

    def spy(self: PromptEncoder, r: Any, parallel: bool | None = None, **kw: Any) -> list[int]:
        tokenized.append(len(r.prompt))
        return real(self, r, parallel, **kw)

    monkeypatch.setattr(PromptEncoder, "encode_rendered", spy)
    backend = FakeBackend(encoder)
    client = strict_http(
        TestClient(app_of(encoder, backend, max_context=1000), raise_server_exceptions=False)
    )
    long = "word " * 30_000  # 150,000 characters: at least 1,172 tokens
    for path, body, shape in (
        ("/v1/chat/completions", chat(long), "openai"),
        ("/v1/messages", messages(long), "anthropic"),
        ("/v1/messages/count_tokens", messages(long), "anthropic"),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        if shape == "openai":
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded"
            message = err["message"]
        else:
            assert r.json()["error"]["type"] == "invalid_request_error"
            message = r.json()["error"]["message"]
        assert "--max-context" in message and "1000" in message
    assert tokenized == [] and backend.requests == []
    assert client.post("/v1/chat/completions", json=chat("short")).status_code == 200
    assert len(tokenized) == 1


# -- 2. encoding never holds the event loop --------------------------------------------------------
class SlowEncoder:
    """The real encoder, but converting a request blocks its thread until released (as a large
    body does for seconds), and say so when it starts."""

    def __init__(self, inner: PromptEncoder) -> None:
        self.inner = inner
        self.started, self.release = threading.Event(), threading.Event()
        self.armed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def options(self) -> Any:
        if self.armed:
            self.armed = False
            self.started.set()
            self.release.wait(10)
        return self.inner.options


async def test_healthz_answers_while_a_request_is_encoded(encoder: PromptEncoder) -> None:
    slow = SlowEncoder(encoder)
    app = app_of(slow, FakeBackend(encoder))
    async with strict_http(
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    ) as http:
        big = asyncio.create_task(http.post("/v1/chat/completions", json=chat()))
        while not slow.started.is_set():  # the request is inside the encoder now
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        health = await http.get("/healthz")
        waited = time.monotonic() - t0
        slow.release.set()
        assert health.status_code == 200
        assert waited < 1.0, f"/healthz took {waited:.1f} s while a request was encoded"
        assert (await big).status_code == 200


async def test_full_encode_pool_is_429_in_the_protocols_shape(encoder: PromptEncoder) -> None:
    slow = SlowEncoder(encoder)
    app = app_of(slow, FakeBackend(encoder), encode_threads=1, encode_queue_bytes=1)
    async with strict_http(
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    ) as http:
        first = asyncio.create_task(http.post("/v1/chat/completions", json=chat()))
        while not slow.started.is_set():
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/chat/completions", json=chat())
        anthropic = await http.post("/v1/messages", json=messages())
        slow.release.set()
        assert (await first).status_code == 200
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "--encode-threads 1" in refused.json()["error"]["message"]
    assert anthropic.status_code == 429
    assert anthropic.json()["error"]["type"] == "rate_limit_error"


# -- 3. deep JSON is a 400 -------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [900, 50_000])
def test_deeply_nested_json_is_400_not_500(encoder: PromptEncoder, depth: int) -> None:
    client = strict_http(
        TestClient(app_of(encoder, FakeBackend(encoder)), raise_server_exceptions=False)
    )
    bare = "[" * depth + "]" * depth
    inside = json.dumps(chat()).replace('"hi"', bare)
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        for body in (bare, inside):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, depth, r.text[:200])
            if path == "/v1/messages":
                assert r.json()["type"] == "error"
            else:
                assert r.json()["error"]["type"] == "invalid_request_error"


# -- 4. idle, half-sent and trickled connections are closed ----------------------------------------
@pytest.fixture
async def live(encoder: PromptEncoder) -> Any:
    import logging

    app = app_of(encoder, FakeBackend(encoder), body_timeout=0.5)
    server = build_server(
        app,
        "127.0.0.1",
        0,
        log_level="warning",
        drain_seconds=1,
        keep_alive_timeout=0.5,
        header_timeout=0.5,
    )
    task = asyncio.create_task(run_server(server))
    while not server.started:
        assert not task.done()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield port
    await stop_server(server, task, 1, logging.getLogger("test"))


async def _closed_within(port: int, send: bytes, seconds: float = 5.0) -> bytes:
    """What the server sends before it closes the connection; fails if it is still open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(send)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), seconds)  # b"..." once closed
    finally:
        writer.close()


@pytest.mark.parametrize(
    "send",
    [
        b"",  # connects and says nothing
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",  # half a head
    ],
    ids=["idle", "half-head"],
)
async def test_connection_without_a_request_head_is_closed(live: int, send: bytes) -> None:
    assert await _closed_within(live, send) == b""


async def test_trickled_body_gets_408_and_the_connection_closes(live: int) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": '
    )
    got = await _closed_within(live, head)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"request_timeout" in got


async def test_keep_alive_connection_is_closed_when_idle(live: int) -> None:
    got = await _closed_within(live, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200")


# -- 5. a frozen entrypoint is a 504 ---------------------------------------------------------------
class FrozenEntrypoint(generate_pb2_grpc.GenerateServicer):
    """Accepts Generate and never answers (``ready_first``: sends Ready, then nothing)."""

    def __init__(self) -> None:
        self.ready_first = False
        self.release = threading.Event()

    def Generate(self, request: Any, context: Any) -> Iterator[generate_pb2.GenerateEvent]:
        if self.ready_first:
            yield generate_pb2.GenerateEvent(
                ready=generate_pb2.Ready(request_id=request.request_id, prompt_tokens=3)
            )
        self.release.wait(30)


@pytest.fixture
def frozen() -> Iterator[tuple[FrozenEntrypoint, str]]:
    servicer = FrozenEntrypoint()
    with generate_server(servicer) as address:
        yield servicer, address
        servicer.release.set()


@pytest.mark.parametrize("ready_first", [False, True], ids=["first-event", "next-event"])
async def test_frozen_entrypoint_is_504(
    encoder: PromptEncoder, frozen: tuple[FrozenEntrypoint, str], ready_first: bool
) -> None:
    servicer, address = frozen
    servicer.ready_first = ready_first
    backend = GrpcGenerateBackend(address, first_event_timeout=0.5, event_timeout=0.5)
    flag = "--event-timeout" if ready_first else "--first-event-timeout"
    try:
        app = app_of(encoder, backend)
        async with strict_http(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        ) as http:
            t0 = time.monotonic()
            r = await http.post("/v1/chat/completions", json=chat())
            a = await http.post("/v1/messages", json=messages())
            assert time.monotonic() - t0 < 10
    finally:
        await backend.close()
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert flag in r.json()["error"]["message"]
    assert a.status_code == 504 and a.json()["error"]["type"] == "timeout_error"


# -- 6. nothing private on the public port ---------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, **headers: str) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_only_on_the_ops_port_with_hashed_tenants(
    frozen: tuple[FrozenEntrypoint, str],
) -> None:
    _, address = frozen
    api, ops = _free_port(), _free_port()
    argv = [
        sys.executable,
        "-m",
        "services.recipe",
        "--port",
        str(api),
        "--http-port",
        str(ops),
        "--entrypoint-address",
        address,
        "--model",
        "tiny",
        "--model-name",
        MODEL,
        "--api-keys",
        "sk-secret=acme-corp",
        "--first-event-timeout",
        "0.5",
        "--nats-url",
        "nats://127.0.0.1:9",
    ]
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while _probe(f"http://127.0.0.1:{api}/healthz") != 200:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = json.dumps(chat()).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{api}/v1/chat/completions",
            data=body,
            headers={"Authorization": "Bearer sk-secret", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 504
        assert _get(f"http://127.0.0.1:{api}/metrics")[0] == 404
        status, text = _get(f"http://127.0.0.1:{ops}/metrics")
        assert status == 200
        label = tenant_label("acme-corp")
        assert f'route="chat_completions",status="504",tenant="{label}"' in text
        assert "acme-corp" not in text and "sk-secret" not in text
        assert _get(f"http://127.0.0.1:{ops}/healthz")[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)


def _probe(url: str) -> int:
    try:
        return _get(url)[0]
    except OSError:
        return 0
