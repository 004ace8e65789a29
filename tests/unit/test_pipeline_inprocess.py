"""The whole request path in one process, no servers and no network: an HTTP chat completion
(recipe) -> entrypoint -> balancer -> prefill -> KV push -> decode, wired on the library's
in-process bus and KV push as the services' ``main.py`` wire them on NATS and gRPC, with the
tiny model. What the client gets is what one engine generates for the same prompt."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from libs.common import subjects
from libs.common.errors import InstanceFailed, Unavailable
from libs.common.grpc_auth import ANONYMOUS, OnBehalf
from libs.common.grpc_errors import from_status
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.gateway.policy import Limits
from libs.proto.deepserve.v1 import control_pb2, generate_pb2, kv_transfer_pb2
from libs.routing.policy import RoutingPolicy
from libs.serving.engine_loop import EngineLoop
from libs.serving.handoff import Holding
from libs.serving.runtime import publish_status
from libs.transport.inproc import InProcBus, InProcKVPusher, Msg
from services.balancer.handlers import BalancerHandlers
from services.decode.handlers import DecodeHandler
from services.entrypoint.handlers import EntrypointHandlers, HandlerConfig
from services.prefill.handlers import PrefillHandler
from services.recipe.app import build_app
from services.recipe.encoding import PromptEncoder
from services.recipe.handlers import AppConfig, Metrics

from ..sdk_strict import strict_http

pytestmark = pytest.mark.timeout(120)

BS = 16
MODEL = "deepseek-tiny"
DECODE_ADDRESS = "inproc:decode-0"
# ~37 prompt tokens: two full 16-token blocks, so a repeat finds a cached prefix.
QUESTION = "Tell me, in a few words, " + " ".join(f"item{i}" for i in range(12)) + "?"
log = logging.getLogger(__name__)


def make_engine(tiny_loaded: Any) -> Engine:
    return Engine(
        EngineConfig(model="tiny", block_size=BS, num_kv_blocks=64, time_budget_s=None),
        loaded=tiny_loaded,
    )


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class _Context:
    """What ``Generate`` asks of a gRPC servicer context."""

    def __init__(self, traceparent: str) -> None:
        self._metadata = [("traceparent", traceparent)] if traceparent else []
        self.trailing: Any = ()

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailing = md

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class _Call:
    def __init__(self, entrypoint: EntrypointHandlers, request: Any, traceparent: str) -> None:
        self.entrypoint, self.request, self.traceparent = entrypoint, request, traceparent
        self.token_ids: list[int] = []
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[generate_pb2.GenerateEvent]:
        context = _Context(self.traceparent)
        events = self.entrypoint.Generate(self.request, context)
        async with contextlib.aclosing(events):
            try:
                async for ev in events:
                    if self.cancelled:
                        return
                    self.token_ids += list(ev.tokens.token_ids)
                    yield ev
            except _Aborted as exc:  # what the gRPC client of GrpcGenerateBackend would raise
                raise from_status(exc.code, exc.details, context.trailing) from None

    def cancel(self) -> None:
        self.cancelled = True


class EntrypointBackend:
    """The recipe's GenerateBackend calling the entrypoint's ``Generate`` in this process."""

    def __init__(self, entrypoint: EntrypointHandlers) -> None:
        self.entrypoint = entrypoint
        self.calls: list[_Call] = []
        self.loops: tuple[EngineLoop, ...] = ()  # prefill's and decode's (the fixture's)

    def generate(
        self,
        request: generate_pb2.GenerateRequest,
        traceparent: str = "",
        on_behalf: OnBehalf = ANONYMOUS,
    ) -> _Call:
        self.calls.append(_Call(self.entrypoint, request, traceparent))
        return self.calls[-1]

    async def check(self) -> tuple[bool, str]:
        return True, "in-process entrypoint"

    async def close(self) -> None:
        pass


class NoLookup:
    async def lookup(self, hashes: list[bytes]) -> int:
        return 0


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


@pytest.fixture
async def pipeline(
    tiny_loaded: Any, encoder: PromptEncoder
) -> AsyncIterator[tuple[Any, EntrypointBackend]]:
    bus = InProcBus()
    pusher = InProcKVPusher()
    ploop, dloop = (
        EngineLoop(make_engine(tiny_loaded), name="p"),
        EngineLoop(make_engine(tiny_loaded), name="d"),
    )
    ploop.start()
    dloop.start()
    max_len = ploop.engine.scheduler_config.max_model_len
    decode = DecodeHandler(
        dloop,
        bus.publish,
        instance_id="decode-0",
        model_name=MODEL,
        address=DECODE_ADDRESS,
        block_size=BS,
    )
    pusher.register(DECODE_ADDRESS, decode)
    prefill = PrefillHandler(
        ploop,
        bus.publish,
        pusher,
        instance_id="prefill-0",
        model_name=MODEL,
        block_size=BS,
        max_model_len=max_len,
    )
    balancer = BalancerHandlers(RoutingPolicy(heartbeat_timeout=60.0))

    # As services/*/main.py subscribe on NATS.
    async def on_task(msg: Msg) -> None:
        prefill.submit(control_pb2.PrefillTask.FromString(msg.data))

    async def on_route(msg: Msg) -> None:
        await msg.respond(balancer.on_route(msg.data))

    async def on_heartbeat(msg: Msg) -> None:
        balancer.on_heartbeat(msg.data)

    async def on_abort(msg: Msg) -> None:
        abort = control_pb2.Abort.FromString(msg.data)
        await prefill.on_abort(abort)
        await decode.on_abort(abort)

    subs = [
        await bus.subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat),
        await bus.subscribe(subjects.ROUTE, queue=subjects.BALANCER_QUEUE, cb=on_route),
        await bus.subscribe(subjects.prefill_task("prefill-0"), cb=on_task),
        await bus.subscribe(subjects.ABORT, cb=on_abort),
    ]
    for role, status in (("prefill", prefill.status()), ("decode", decode.status())):
        await publish_status(bus, subjects.heartbeat(role, status.instance_id), status, log)  # type: ignore[arg-type]

    limits = Limits(model_name=MODEL, max_context=max_len, block_size=BS)
    entrypoint = EntrypointHandlers(HandlerConfig(limits=limits), bus, NoLookup())
    backend = EntrypointBackend(entrypoint)
    backend.loops = (ploop, dloop)
    app = build_app(
        AppConfig(model_name=MODEL, default_max_tokens=16, max_context=max_len),
        encoder,
        backend,
        Metrics(CollectorRegistry()),
    )
    try:
        yield app, backend
    finally:
        await entrypoint.wait_idle(5.0)
        for sub in subs:
            await sub.unsubscribe()
        await ploop.close()
        await dloop.close()


def engine_reference(tiny_loaded: Any, request: generate_pb2.GenerateRequest) -> list[int]:
    engine = make_engine(tiny_loaded)
    engine.add_request(
        "ref", list(request.prompt_token_ids), SamplingParams.from_proto(request.sampling)
    )
    out: list[int] = []
    while engine.has_unfinished():
        out += [ev.token_id for ev in engine.step() if ev.token_id is not None]
    return out


def sse_json(body: str) -> list[dict[str, Any]]:
    lines = [ln[len("data: ") :] for ln in body.splitlines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


async def test_chat_completion_through_every_service_equals_the_engine(
    pipeline: tuple[Any, EntrypointBackend], tiny_loaded: Any, encoder: PromptEncoder
) -> None:
    app, backend = pipeline
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
    }
    transport = httpx.ASGITransport(app=app)
    async with strict_http(
        httpx.AsyncClient(transport=transport, base_url="http://testserver")
    ) as http:
        first = await http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        second = await http.post(
            "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert second.status_code == 200, second.text

    call1, call2 = backend.calls
    ref = engine_reference(tiny_loaded, call1.request)
    assert len(ref) == 8 or ref[-1] == encoder.eos
    assert call1.token_ids == ref  # greedy across the prefill -> decode handoff
    answer = first.json()["choices"][0]["message"]["content"]
    assert answer == encoder.full.decode([t for t in ref if t != encoder.eos])
    usage = first.json()["usage"]
    assert usage["completion_tokens"] == len(ref)
    assert usage["prompt_tokens"] == len(call1.request.prompt_token_ids)

    assert list(call2.request.prompt_token_ids) == list(call1.request.prompt_token_ids)
    assert call2.token_ids == ref
    chunks = sse_json(second.text)
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == answer
    usage2 = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    assert usage2["completion_tokens"] == len(ref)
    # The prefill engine kept the first request's full blocks: the repeat reuses them.
    n_prompt = len(call1.request.prompt_token_ids)
    assert usage2["prompt_cache_hit_tokens"] == (n_prompt - 1) // BS * BS > 0


# -- the in-process bus keeps NATS's semantics -------------------------------------------------


async def test_bus_wildcards_queue_groups_and_request_reply() -> None:
    bus = InProcBus()
    every = await bus.subscribe("ds.heartbeat.>")
    one_token = await bus.subscribe("ds.*.route")
    got: list[str] = []

    async def answer(msg: Msg) -> None:
        got.append(msg.subject)
        await msg.respond(b"pong:" + msg.data)

    group = [await bus.subscribe("ds.balancer.route", queue="balancer", cb=answer) for _ in (0, 1)]
    await bus.publish("ds.heartbeat.prefill.p0", b"hb")
    await bus.publish("ds.heartbeat", b"not for >")  # '>' needs at least one more token
    assert [m.data for m in every.take_pending()] == [b"hb"]
    assert await bus.request("ds.balancer.route", b"1", 1.0) == b"pong:1"
    assert await bus.request("ds.balancer.route", b"2", 1.0) == b"pong:2"
    assert got == ["ds.balancer.route"] * 2  # each request answered once by the group
    assert [m.data for m in one_token.take_pending()] == [b"1", b"2"]
    for sub in group:
        await sub.unsubscribe()
    with pytest.raises(Unavailable):
        await InProcBus().request("ds.balancer.route", b"3", 0.1)


async def test_kv_push_to_an_unknown_or_refusing_decode_fails() -> None:
    pusher = InProcKVPusher()
    task = control_pb2.DecodeTask(request_id="r")
    with pytest.raises(InstanceFailed, match="no such instance"):
        await pusher.push("inproc:nowhere", task, b"kv")

    class Refusing:
        async def match(self, block_hashes: list[bytes]) -> Holding:
            return Holding(0, "elsewhere")

        async def accept(self, task: control_pb2.DecodeTask, kv: Any, tp: str = "") -> Any:
            return kv_transfer_pb2.KVPushReply(accepted=False, error="draining")

    pusher.register("inproc:d", Refusing())
    with pytest.raises(InstanceFailed, match="draining"):
        await pusher.push("inproc:d", task, b"kv")


async def test_sampling_extras_survive_the_prefill_decode_handoff(
    pipeline: tuple[Any, EntrypointBackend], tiny_loaded: Any
) -> None:
    """min_tokens = max_tokens and the penalties mean the same split across prefill and decode
    as in one engine (decode counts the prefilled first token as output)."""
    app, backend = pipeline
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
        "min_tokens": 8,
        "frequency_penalty": -1.5,  # negative: whether the first token counts shows
        "presence_penalty": -2.0,
        "repetition_penalty": 1.2,
    }
    transport = httpx.ASGITransport(app=app)
    async with strict_http(
        httpx.AsyncClient(transport=transport, base_url="http://testserver")
    ) as http:
        resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    call = backend.calls[-1]
    sp = call.request.sampling
    assert (sp.min_tokens, round(sp.frequency_penalty, 2), round(sp.repetition_penalty, 2)) == (
        8,
        -1.5,
        1.2,
    )
    ref = engine_reference(tiny_loaded, call.request)
    assert len(ref) == 8 and call.token_ids == ref
    assert resp.json()["usage"]["completion_tokens"] == 8


async def test_logprobs_cross_the_handoff_as_one_engine_gives_them(
    pipeline: tuple[Any, EntrypointBackend], tiny_loaded: Any
) -> None:
    """Generate with sampling.logprobs: every token event carries one TokenLogprobs per token
    (prefill's first one travels in the DecodeTask), equal to a single engine's."""
    _, backend = pipeline
    request = generate_pb2.GenerateRequest(
        model=MODEL,
        prompt_token_ids=[5, 77, 301, 4000, 12],
        sampling=SamplingParams(max_tokens=6, logprobs=3).to_proto(),
    )
    got_ids: list[int] = []
    got: list[Any] = []
    async for ev in backend.generate(request):
        if ev.WhichOneof("event") == "tokens":
            assert len(ev.tokens.logprobs) == len(ev.tokens.token_ids)
            got_ids += list(ev.tokens.token_ids)
            got += list(ev.tokens.logprobs)
    engine = make_engine(tiny_loaded)
    engine.add_request(
        "ref", list(request.prompt_token_ids), SamplingParams(max_tokens=6, logprobs=3)
    )
    ref = []
    while engine.has_unfinished():
        ref += [ev for ev in engine.step() if ev.token_id is not None]
    assert got_ids == [ev.token_id for ev in ref]
    for mine, want in zip(got, ref, strict=True):
        assert list(mine.top_ids) == list(want.logprobs.top_ids)
        assert mine.logprob == pytest.approx(want.logprobs.logprob, abs=1e-4)
        assert list(mine.top_logprobs) == pytest.approx(list(want.logprobs.top_logprobs), abs=1e-4)


async def test_a_schema_past_the_compile_budget_is_a_400_naming_the_limit(
    pipeline: tuple[Any, EntrypointBackend],
) -> None:
    """Bounded grammar compilation end to end: prefill's probe gives up at the budget, and the
    client gets the protocol's 400 naming the limit (not a 500, not a 504 minutes later)."""
    from libs.engine.grammar import GrammarBudget

    app, backend = pipeline
    for loop in backend.loops:
        loop.engine.grammar.limit(GrammarBudget(compile_seconds=1.0, memory_mib=64, probes=1))
    props = {f"p{i}": {"type": "string"} for i in range(1500)}  # ~25 s to compile
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "fill it"}],
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "wide", "schema": {"type": "object", "properties": props}},
        },
    }
    try:
        transport = httpx.ASGITransport(app=app)
        async with strict_http(
            httpx.AsyncClient(transport=transport, base_url="http://testserver")
        ) as http:
            r = await http.post("/v1/chat/completions", json=body)
    finally:
        for loop in backend.loops:
            loop.engine.grammar.close()
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "--grammar-compile-seconds" in message and "within 1 s" in message
