"""The Generate handler over an in-process bus and kvstore: no NATS, no gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from libs.common import subjects
from libs.common.hashchain import chain_hashes, tenant_salt
from libs.gateway.policy import Limits
from libs.proto.deepserve.v1 import common_pb2, control_pb2, generate_pb2
from services.entrypoint.handlers import (
    BusUnavailable,
    EntrypointHandlers,
    HandlerConfig,
    LookupFailed,
)

LIMITS = Limits(model_name="tiny", vocab_size=1000, max_context=4096, block_size=4)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    trailing: tuple[tuple[str, str], ...] = ()

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self.metadata)

    def set_trailing_metadata(self, md: tuple[tuple[str, str], ...]) -> None:
        self.trailing = md

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class FakeSub:
    def __init__(self, bus: FakeBus, subject: str) -> None:
        self.bus, self.subject = bus, subject
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def next(self, timeout: float) -> bytes:
        return await asyncio.wait_for(self.queue.get(), timeout)

    def ready(self) -> bool:
        return not self.queue.empty()

    async def close(self) -> None:
        self.bus.subs.pop(self.subject, None)


Prefill = Callable[[control_pb2.PrefillTask], list[control_pb2.TokenEvent]]


class FakeBus:
    """Balancer and prefill/decode twins: a task in gives scripted token events out."""

    def __init__(self, prefill: Prefill | None = None) -> None:
        self.subs: dict[str, FakeSub] = {}
        self.published: list[tuple[str, bytes]] = []
        self.routes: list[control_pb2.RouteRequest] = []
        self.decision = control_pb2.RouteDecision(
            prefill_instance="p1", decode_instance="d1", decode_address="127.0.0.1:7001"
        )
        self.balancer_up = True
        self.prefill = prefill or (lambda task: greedy_events(task, [7, 8, 9]))

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        assert subject == subjects.ROUTE
        if not self.balancer_up:
            raise BusUnavailable(f"nothing listens on {subject}")
        self.routes.append(control_pb2.RouteRequest.FromString(data))
        return self.decision.SerializeToString()

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))
        if subject == subjects.prefill_task("p1"):
            task = control_pb2.PrefillTask.FromString(data)
            sub = self.subs[task.events_subject]  # subscribed before the task went out
            for ev in self.prefill(task):
                sub.queue.put_nowait(ev.SerializeToString())

    async def subscribe(self, subject: str) -> FakeSub:
        self.subs[subject] = FakeSub(self, subject)
        return self.subs[subject]

    def aborts(self) -> list[control_pb2.Abort]:
        return [control_pb2.Abort.FromString(d) for s, d in self.published if s == subjects.ABORT]

    def tasks(self) -> list[control_pb2.PrefillTask]:
        return [
            control_pb2.PrefillTask.FromString(d)
            for s, d in self.published
            if s.startswith("ds.prefill.")
        ]


def greedy_events(
    task: control_pb2.PrefillTask, out: list[int], order: list[int] | None = None
) -> list[control_pb2.TokenEvent]:
    evs = [
        control_pb2.TokenEvent(
            request_id=task.request_id,
            index=i,
            token_ids=[t],
            prompt_tokens=len(task.prompt_token_ids),
            cached_tokens=task.cached_blocks * LIMITS.block_size,
            finished=i == len(out) - 1,
            finish_reason="length" if i == len(out) - 1 else "",
        )
        for i, t in enumerate(out)
    ]
    return [evs[i] for i in order] if order else evs


class FakeLookup:
    def __init__(self, present: int = 0, fail: bool = False) -> None:
        self.present, self.fail = present, fail
        self.calls: list[list[bytes]] = []

    async def lookup(self, hashes: list[bytes]) -> int:
        self.calls.append(hashes)
        if self.fail:
            raise LookupFailed("down")
        return min(self.present, len(hashes))


SECRET = b"test-salt-secret"
ACME = tenant_salt(SECRET, "acme")  # acme's cache salt under SECRET


def make(bus: FakeBus, kv: FakeLookup | None = None, **cfg: Any) -> EntrypointHandlers:
    cfg.setdefault("salt_secret", SECRET)
    return EntrypointHandlers(HandlerConfig(limits=LIMITS, **cfg), bus, kv or FakeLookup())


def req(prompt: list[int], max_tokens: int = 3, **kw: Any) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw
    )


async def collect(h: EntrypointHandlers, r: generate_pb2.GenerateRequest) -> list[Any]:
    return [ev async for ev in h.Generate(r, FakeContext())]


async def test_generate_relays_tokens_in_order_with_ready_and_usage() -> None:
    bus = FakeBus(lambda t: greedy_events(t, [7, 8, 9], order=[2, 1, 0]))
    kv = FakeLookup(present=1)
    prompt = list(range(1, 11))  # 10 tokens, blocks of 4: prompt[:-1] holds 2 full blocks
    events = await collect(make(bus, kv), req(prompt, tenant="acme", request_id="r1"))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "ready" and kinds[-1] == "finish" and set(kinds[1:-1]) == {"tokens"}
    assert (
        events[0].ready.request_id,
        events[0].ready.prompt_tokens,
        events[0].ready.cached_tokens,
    ) == ("r1", 10, 4)
    assert [t for e in events[1:-1] for t in e.tokens.token_ids] == [7, 8, 9]
    assert events[-1].finish.reason == "length"
    assert (
        events[-1].finish.usage.prompt_tokens,
        events[-1].finish.usage.cached_tokens,
        events[-1].finish.usage.completion_tokens,
    ) == (10, 4, 3)

    hashes = chain_hashes(prompt[:8], 4, salt=ACME)
    assert kv.calls == [hashes]
    (route,) = bus.routes
    (task,) = bus.tasks()
    wire = task.request_id  # this attempt's upstream id: the client's id plus a unique suffix
    assert wire.startswith("r1-") and len(wire) == len("r1-") + 8
    assert (route.request_id, route.model, route.prompt_tokens, route.cached_blocks) == (
        wire,
        "tiny",
        10,
        1,
    )
    assert list(task.prompt_token_ids) == prompt and task.cache_salt == ACME
    assert (task.cached_blocks, task.decode_instance, task.decode_address) == (
        1,
        "d1",
        "127.0.0.1:7001",
    )
    assert task.events_subject == subjects.token_events(wire)
    assert task.sampling.max_tokens == 3 and task.sampling.top_p == 1.0
    assert not bus.aborts() and not bus.subs  # clean finish: no abort, unsubscribed


async def test_request_id_is_assigned_when_empty() -> None:
    bus = FakeBus()
    events = await collect(make(bus), req([1, 2, 3]))
    rid = events[0].ready.request_id
    assert rid.startswith("req-") and bus.tasks()[0].request_id.startswith(rid + "-")


async def test_invalid_request_is_refused_before_any_routing() -> None:
    bus = FakeBus()
    with pytest.raises(Aborted) as info:
        await collect(make(bus), req([1, 5000]))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids[1]" in info.value.details
    assert not bus.routes and not bus.published


async def test_unknown_model_is_not_found() -> None:
    with pytest.raises(Aborted) as info:
        await collect(make(FakeBus()), req([1], model="other"))
    assert info.value.code == grpc.StatusCode.NOT_FOUND


async def test_no_balancer_is_unavailable() -> None:
    bus = FakeBus()
    bus.balancer_up = False
    with pytest.raises(Aborted) as info:
        await collect(make(bus), req([1, 2]))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "retry" in info.value.details


async def test_no_instance_is_unavailable_with_the_balancers_reason() -> None:
    bus = FakeBus()
    bus.decision = control_pb2.RouteDecision(error="no live decode instance (0 live)")
    with pytest.raises(Aborted) as info:
        await collect(make(bus), req([1, 2]))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no live decode instance" in info.value.details


async def test_kvstore_down_is_a_miss_not_an_error() -> None:
    bus = FakeBus()
    events = await collect(make(bus, FakeLookup(present=5, fail=True)), req(list(range(20))))
    assert events[0].ready.cached_tokens == 0 and bus.tasks()[0].cached_blocks == 0


async def test_retryable_instance_error_is_unavailable_and_aborts() -> None:
    def failing(task: control_pb2.PrefillTask) -> list[control_pb2.TokenEvent]:
        first = greedy_events(task, [7, 8, 9])[0]
        return [
            first,
            control_pb2.TokenEvent(
                request_id=task.request_id, index=1, error="KV push to d1 failed", retryable=True
            ),
        ]

    bus = FakeBus(failing)
    got: list[Any] = []
    with pytest.raises(Aborted) as info:
        async for ev in make(bus, max_attempts=1).Generate(
            req([1, 2], request_id="r2"), FakeContext()
        ):
            got.append(ev)
    assert (
        info.value.code == grpc.StatusCode.UNAVAILABLE
        and "KV push to d1 failed" in info.value.details
    )
    assert [e.WhichOneof("event") for e in got] == ["ready", "tokens"]
    await asyncio.sleep(0)  # the abort goes out on its own task
    assert [a.request_id for a in bus.aborts()] == [t.request_id for t in bus.tasks()]


async def test_silence_past_the_request_timeout_is_deadline_exceeded() -> None:
    bus = FakeBus(lambda task: greedy_events(task, [7, 8, 9])[:1])  # decode never answers
    with pytest.raises(Aborted) as info:
        await collect(make(bus, request_timeout=0.2), req([1, 2], request_id="r3"))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0)
    assert [(a.request_id, a.reason) for a in bus.aborts()] == [
        (bus.tasks()[0].request_id, "timeout")
    ]


async def test_client_going_away_aborts_upstream() -> None:
    bus = FakeBus(lambda task: greedy_events(task, [7, 8, 9])[:1])
    h = make(bus)
    gen = h.Generate(req([1, 2], request_id="r4"), FakeContext())
    assert (await gen.__anext__()).WhichOneof("event") == "ready"
    assert (await gen.__anext__()).WhichOneof("event") == "tokens"
    await gen.aclose()  # what a cancelled RPC does to the handler
    await asyncio.sleep(0)
    assert [a.request_id for a in bus.aborts()] == [t.request_id for t in bus.tasks()]
    assert not bus.subs and h.inflight == 0


async def test_cancelled_task_aborts_upstream() -> None:
    bus = FakeBus(lambda task: [])  # nothing ever comes back

    async def consume(h: EntrypointHandlers) -> None:
        async for _ in h.Generate(req([1, 2], request_id="r5"), FakeContext()):
            pass

    task = asyncio.create_task(consume(make(bus)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert [a.request_id for a in bus.aborts()] == [t.request_id for t in bus.tasks()]


async def test_same_request_id_twice_in_flight_is_refused() -> None:
    bus = FakeBus(lambda task: [])
    h = make(bus)
    first = h.Generate(req([1, 2], request_id="dup"), FakeContext())
    pending = asyncio.ensure_future(first.__anext__())
    await asyncio.sleep(0.05)
    with pytest.raises(Aborted) as info:
        await collect(h, req([1, 2], request_id="dup"))
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    await first.aclose()


async def test_a_retry_under_the_same_request_id_is_a_new_attempt_upstream() -> None:
    """Instances remember aborted ids for a while; a client's retry must not look like one."""
    bus = FakeBus()
    await collect(make(bus), req([1, 2, 3], request_id="same"))
    await collect(make(bus), req([1, 2, 3], request_id="same"))
    first, second = (t.request_id for t in bus.tasks())
    assert first != second and first.startswith("same-") and second.startswith("same-")


# -- capacity-aware admission ------------------------------------------------------------------


def beat(
    h: EntrypointHandlers,
    iid: str,
    role: control_pb2.Role,
    blocks: int,
    free: int | None = None,
) -> None:
    h.on_status(
        control_pb2.InstanceStatus(
            instance_id=iid,
            role=role,
            model="tiny",
            address="127.0.0.1:7001" if role == control_pb2.ROLE_DECODE else "",
            free_kv_blocks=blocks if free is None else free,
            total_kv_blocks=blocks,
        )
    )


def with_capacity(bus: FakeBus, decode_blocks: int = 10, **cfg: Any) -> EntrypointHandlers:
    """A handler fed heartbeats of p1 and d1 (d1 with ``decode_blocks`` KV blocks of 4 tokens)."""
    h = make(bus, capacity_admission=True, **cfg)
    beat(h, "p1", control_pb2.ROLE_PREFILL, 1000)
    beat(h, "d1", control_pb2.ROLE_DECODE, decode_blocks)
    return h


async def test_a_burst_beyond_capacity_is_refused_quickly_with_a_retry_hint() -> None:
    """The H200 run before this: requests waited silently in engine queues until the 60 s
    token timeout. Now what does not fit waits at most admit_wait, then RESOURCE_EXHAUSTED."""
    bus = FakeBus(lambda task: [])  # nothing ever finishes: the admitted hold their KV
    h = with_capacity(bus, decode_blocks=10, admit_wait=0.2, max_waiting=2)
    prompt = list(range(1, 11))  # 10 tokens + max_tokens 10 = 5 blocks: d1 holds two
    calls = [(FakeContext(), req(prompt, max_tokens=10)) for _ in range(6)]
    loop = asyncio.get_running_loop()
    started, ended = loop.time(), []
    tasks = [asyncio.ensure_future(collect_with(h, r, ctx)) for ctx, r in calls]
    for t in tasks:
        t.add_done_callback(lambda _: ended.append(loop.time()))
    done, pending = await asyncio.wait(tasks, timeout=1.5)
    assert len(done) == 4 and len(pending) == 2
    assert max(ended) - started < 1.0  # two at once (queue full), two after admit_wait
    assert len(bus.tasks()) == 2  # only the admitted ones reached an instance
    for (ctx, _), t in zip(calls, tasks, strict=True):
        if t in done:
            err = t.exception()
            assert isinstance(err, Aborted) and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "no decode instance has 5 free KV blocks" in err.details
            assert dict(ctx.trailing)["retry-after-ms"] == "500"  # no drain measured yet
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert h.admission.running == 0 and h.capacity is not None and h.capacity.tickets == 0


async def collect_with(
    h: EntrypointHandlers, r: generate_pb2.GenerateRequest, ctx: FakeContext
) -> list[Any]:
    return [ev async for ev in h.Generate(r, ctx)]


async def test_a_waiting_request_starts_when_a_heartbeat_shows_room() -> None:
    bus = FakeBus(lambda task: [])
    h = with_capacity(bus, decode_blocks=5, admit_wait=5.0)
    holder = asyncio.ensure_future(collect(h, req(list(range(1, 11)), max_tokens=10)))
    waiter = asyncio.ensure_future(collect(h, req(list(range(1, 11)), max_tokens=10)))
    await asyncio.sleep(0.05)
    assert len(bus.tasks()) == 1 and not waiter.done()
    bus.prefill = lambda task: greedy_events(task, [7, 8, 9])
    beat(h, "d1", control_pb2.ROLE_DECODE, 10)  # the instance grew (or others finished)
    events = await asyncio.wait_for(waiter, 2)
    assert [t for e in events if e.WhichOneof("event") == "tokens" for t in e.tokens.token_ids] == [
        7,
        8,
        9,
    ]
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)


async def test_a_request_no_instance_could_hold_is_invalid_not_overloaded() -> None:
    bus = FakeBus()
    h = with_capacity(bus, decode_blocks=10)
    with pytest.raises(Aborted) as info:
        await collect(h, req([1, 2, 3], max_tokens=100))  # 103 tokens: 26 blocks of 4
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("sampling.max_tokens: ")
    assert "can never run here" in info.value.details and not bus.routes


async def test_no_heartbeat_at_all_is_unavailable_after_the_startup_wait() -> None:
    bus = FakeBus()
    h = make(bus, capacity_admission=True, admit_wait=0.05, instance_dead_after=0.2)
    with pytest.raises(Aborted) as info:
        await asyncio.wait_for(collect(h, req([1, 2, 3])), 2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no live prefill instance" in info.value.details and not bus.routes


async def test_the_route_avoids_instances_admission_found_full() -> None:
    bus = FakeBus()
    h = with_capacity(bus, decode_blocks=10)
    beat(h, "d2", control_pb2.ROLE_DECODE, 10, free=2)
    await collect(h, req([1, 2, 3], max_tokens=10))  # 4 blocks: only d1 has them
    assert list(bus.routes[0].exclude) == ["d2"]
    bus.decision = control_pb2.RouteDecision(error="no live decode instance (1 excluded)")
    with pytest.raises(Aborted):
        await collect(h, req([1, 2, 3], max_tokens=10))
    assert [list(r.exclude) for r in bus.routes[1:]] == [["d2"], []]  # asked again without


async def test_prefill_queue_counts_only_what_no_instance_holds() -> None:
    """A prompt whose prefix a prefill instance's GPU cache holds (its heartbeat's resident
    summary) adds only its tail to that queue: admitted; the same prompt with nothing
    resident would overflow the queue limit and is refused."""

    def prefill_beat(h: EntrypointHandlers, resident: list[bytes]) -> None:
        h.on_status(
            control_pb2.InstanceStatus(
                instance_id="p1",
                role=control_pb2.ROLE_PREFILL,
                model="tiny",
                queued_tokens=4,
                resident_prefixes=[d[:8] for d in resident],
            )
        )
        beat(h, "d1", control_pb2.ROLE_DECODE, 100)

    prompt = list(range(1, 21))  # 5 blocks of 4 tokens
    digests = chain_hashes(prompt[:16], 4, salt=ACME)
    outcomes = {}
    for name, resident in (("held", digests), ("cold", [])):
        bus = FakeBus(lambda task: [])
        h = make(
            bus, capacity_admission=True, prefill_queue_tokens=8, admit_wait=0.1, max_waiting=4
        )
        prefill_beat(h, resident)
        call = asyncio.ensure_future(collect_with(h, req(prompt, tenant="acme"), FakeContext()))
        done, _ = await asyncio.wait([call], timeout=1.0)
        outcomes[name] = (len(bus.tasks()), bool(done) and call.exception() is not None)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
    assert outcomes == {"held": (1, False), "cold": (0, True)}


async def test_a_prefill_heartbeat_with_a_measured_rate_admits_by_seconds_of_work() -> None:
    """The same queue (30 tokens, limit 8 tokens) holds a request back while the instance has
    measured no rate, and admits it once its heartbeat says it computes 100 tokens/s (30 + 20
    tokens = 0.5 s, within --prefill-queue-seconds 1); the entrypoint exports the instances'
    busy fractions, and each heartbeat's while a request waits."""
    from prometheus_client import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    queued_busy = "deepserve_entrypoint_admission_queued_busy_fraction_bucket"
    outcomes = {}
    for name, rate in (("unmeasured", 0.0), ("measured", 100.0)):
        bus = FakeBus(lambda task: [])
        h = make(
            bus,
            capacity_admission=True,
            prefill_queue_tokens=8,
            prefill_queue_seconds=1.0,
            admit_wait=0.1,
            max_waiting=4,
        )
        status = control_pb2.InstanceStatus(
            instance_id="p1",
            role=control_pb2.ROLE_PREFILL,
            model="tiny",
            queued_tokens=30,
            compute_tokens_per_s=rate,
            busy_fraction=0.9,
        )
        h.on_status(status)
        beat(h, "d1", control_pb2.ROLE_DECODE, 100)
        assert sample(
            "deepserve_entrypoint_engine_busy_fraction", role="prefill", instance="p1"
        ) == pytest.approx(0.9)
        before = sample(queued_busy, role="prefill", le="0.85")
        before_all = sample(queued_busy, role="prefill", le="0.9")
        now = [0.0]
        h.admission_metrics._clock = lambda: now[0]  # the wait's length, without sleeping it
        call = asyncio.ensure_future(collect_with(h, req(list(range(1, 21))), FakeContext()))
        if name == "unmeasured":  # it waits: a heartbeat whose whole second lies in the wait
            await asyncio.sleep(0.02)
            assert sample(queued_busy, role="prefill", le="0.9") == before_all
            now[0] = 0.5
            h.on_status(status)  # half of its window before the wait: not a sample of it
            assert sample(queued_busy, role="prefill", le="0.9") == before_all
            now[0] = 1.0
            h.on_status(status)
            assert sample(queued_busy, role="prefill", le="0.85") == before
            assert sample(queued_busy, role="prefill", le="0.9") == before_all + 1
        done, _ = await asyncio.wait([call], timeout=1.0)
        outcomes[name] = (len(bus.tasks()), bool(done) and call.exception() is not None)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
    assert outcomes == {"unmeasured": (0, True), "measured": (1, False)}


async def test_cache_names_are_keyed_by_a_secret_not_the_tenant_name() -> None:
    """Nobody without the secret can compute a tenant's block names (no offline prefix
    oracle); another secret renames every block."""
    names = {}
    for secret in (SECRET, b"another-secret"):
        bus = FakeBus()
        kv = FakeLookup()
        h = make(bus, kv, salt_secret=secret)
        await collect(h, req(list(range(1, 11)), tenant="acme"))
        (task,) = bus.tasks()
        assert task.cache_salt not in (b"acme", b"")
        names[secret] = kv.calls[0]
    plain = chain_hashes(list(range(1, 9)), 4, salt=b"acme")
    assert names[SECRET] != plain and names[SECRET] != names[b"another-secret"]


async def test_generate_needs_a_key_and_the_key_decides_the_tenant() -> None:
    """With API keys, Generate refuses a caller without one; a key's tenant is used whatever
    tenant the request names (no choosing another tenant's cache); the service token (the
    recipe, which authenticated its client) may name the tenant."""
    keys = {"sk-a": "acme", "sk-g": "globex"}
    cases = {
        "none": ((), "acme"),
        "wrong": ((("authorization", "Bearer sk-nope"),), "acme"),
        "globex-as-acme": ((("authorization", "Bearer sk-g"),), "acme"),
        "service": ((("authorization", "Bearer svc-token"),), "acme"),
    }
    salts = {}
    for name, (md, tenant) in cases.items():
        bus = FakeBus()
        h = make(bus, api_keys=keys, service_token="svc-token")
        ctx = FakeContext(metadata=md)
        try:
            await collect_with(h, req(list(range(1, 11)), tenant=tenant), ctx)
        except Aborted as err:
            assert err.code == grpc.StatusCode.UNAUTHENTICATED, name
            assert "credential" in err.details
            salts[name] = None
            continue
        (task,) = bus.tasks()
        salts[name] = task.cache_salt
    assert salts["none"] is None and salts["wrong"] is None
    assert salts["globex-as-acme"] == tenant_salt(SECRET, "globex")
    assert salts["service"] == ACME


async def test_admission_queues_by_the_keys_tenant_and_another_tenant_passes_a_burst() -> None:
    """Waiting requests queue per tenant -- the key's, whatever tenant the request names -- and
    another tenant's short request starts before the first tenant's queued long ones."""
    bus = FakeBus(lambda task: [])  # nothing finishes: the admitted hold their KV
    keys = {"sk-a": "acme", "sk-g": "globex"}
    h = with_capacity(bus, decode_blocks=5, admit_wait=5.0, api_keys=keys)
    acme = FakeContext(metadata=(("authorization", "Bearer sk-a"),))
    globex = FakeContext(metadata=(("authorization", "Bearer sk-g"),))
    long_prompt = list(range(1, 11))  # 10 tokens + max_tokens 10 = 5 blocks: all of d1
    calls = []
    for _ in range(3):
        calls.append(asyncio.ensure_future(collect_with(h, req(long_prompt, 10), acme)))
        await asyncio.sleep(0.02)
    # globex's key, claiming to be acme: it still queues (and is salted) as globex.
    short = req([1, 2], 2, tenant="acme")  # 1 block
    calls.append(asyncio.ensure_future(collect_with(h, short, globex)))
    await asyncio.sleep(0.02)
    assert len(bus.tasks()) == 1
    assert h.admission.waiting_of("acme") == 2 and h.admission.waiting_of("globex") == 1
    beat(h, "d1", control_pb2.ROLE_DECODE, 10)  # 5 more blocks: globex's 1 fits, acme's 5 not
    await asyncio.sleep(0.05)
    salts = [t.cache_salt for t in bus.tasks()]
    assert salts == [ACME, tenant_salt(SECRET, "globex")]
    assert h.admission.waiting_of("acme") == 2 and h.admission.waiting_of("globex") == 0
    for c in calls:
        c.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert h.admission.running == 0 and h.admission.waiting == 0
