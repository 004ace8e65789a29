"""Retries when an instance fails: the decision (pure) and the handler doing it over the
in-process bus. The client must see the uninterrupted completion or a clear UNAVAILABLE."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from libs.gateway.policy import Finish, Ready, Tokens
from libs.gateway.retry import Action, Progress, Watch, decide, exact_continuation
from libs.proto.deepserve.v1 import control_pb2

from .test_entrypoint_handlers import Aborted, FakeBus, FakeContext, collect, make, req

FULL = [7, 8, 9, 10, 11]  # the uninterrupted completion of every test prompt here


# -- decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retryable", "attempt", "sent", "exact", "want"),
    [
        (True, 1, 0, False, Action.FRESH),  # nothing sent: always safe to start over
        (True, 1, 3, True, Action.CONTINUE),  # sent, greedy/seeded: resend prompt + sent
        (True, 1, 3, False, Action.FAIL),  # sent, unseeded sampling: cannot be the same draw
        (True, 3, 0, True, Action.FAIL),  # out of attempts
        (False, 1, 0, True, Action.FAIL),  # not retryable
    ],
)
def test_decide(retryable: bool, attempt: int, sent: int, exact: bool, want: Action) -> None:
    assert (
        decide(retryable=retryable, attempt=attempt, max_attempts=3, tokens_sent=sent, exact=exact)
        is want
    )


def test_exact_continuation_needs_greedy_or_a_seed() -> None:
    assert exact_continuation(0.0, None) and exact_continuation(0.8, 5)
    assert not exact_continuation(0.8, None)


def test_progress_resends_prompt_plus_sent_and_keeps_the_first_ready() -> None:
    p = Progress((1, 2, 3), max_tokens=5)
    assert p.translate(Ready(3, 2)) == Ready(3, 2)
    assert p.translate(Tokens((7, 8))) == Tokens((7, 8))
    assert p.attempt_prompt == (1, 2, 3, 7, 8) and p.remaining == 3
    assert p.prior_outputs == 2  # the last 2 of the attempt's prompt are output already
    assert p.translate(Ready(5, 4)) is None  # the continuation's Ready is not news to the client
    p.translate(Tokens((9, 10, 11)))
    assert p.translate(Finish("length", 5, 4, 3)) == Finish("length", 3, 2, 5)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Beats:
    def __init__(self, silent: dict[str, float]) -> None:
        self.silent = silent

    def silent_for(self, instance_id: str) -> float | None:
        return self.silent.get(instance_id)


def test_watch_drops_prefill_after_handover_and_gives_unknown_instances_grace() -> None:
    clock, beats = Clock(), Beats({"p1": 5.0, "d1": 0.5})
    w = Watch(beats, "p1", "d1", clock)
    assert w.dead(3.0) == ""  # p1 silent 5 s, but the attempt is 0 s old
    clock.t = 4.0
    assert w.dead(3.0) == "p1"
    w.saw(1)  # a decode token: the KV was handed over, prefill no longer matters
    assert w.dead(3.0) == "" and w.serving == ("d1",)
    beats.silent = {}  # never heard of d1: counts from the attempt's start
    assert w.dead(3.0) == "d1"


# -- the handler retrying ---------------------------------------------------------------------


class FlakyBus(FakeBus):
    """Attempt k goes to prefill p<k>/decode d<k>; ``scripts[k-1]`` says how far it gets."""

    def __init__(self, scripts: list[str]) -> None:
        super().__init__()
        self.scripts = scripts
        self.attempts = 0

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        self.attempts += 1
        self.routes.append(control_pb2.RouteRequest.FromString(data))
        k = self.attempts
        return control_pb2.RouteDecision(
            prefill_instance=f"p{k}", decode_instance=f"d{k}", decode_address="x:1"
        ).SerializeToString()

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))
        if not subject.startswith("ds.prefill."):
            return
        task = control_pb2.PrefillTask.FromString(data)
        sub = self.subs[task.events_subject]
        prompt = list(task.prompt_token_ids)
        done = task.num_prior_outputs  # the end of the prompt: outputs an attempt sent
        assert done == len(prompt) - 3  # the test prompts have 3 tokens
        script = self.scripts[self.attempts - 1]
        for i in range(task.sampling.max_tokens - done):  # max_tokens: the whole completion
            if script == f"error@{i}":
                ev = control_pb2.TokenEvent(
                    request_id=task.request_id, index=i, error="boom", retryable=True
                )
                sub.queue.put_nowait(ev.SerializeToString())
                return
            if script == f"silent@{i}":
                return
            last = i == task.sampling.max_tokens - done - 1
            ev = control_pb2.TokenEvent(
                request_id=task.request_id,
                index=i,
                token_ids=[FULL[done + i]],
                finished=last,
                finish_reason="length" if last else "",
                prompt_tokens=len(prompt) - done,
                cached_tokens=0,
            )
            sub.queue.put_nowait(ev.SerializeToString())


def tokens_of(events: list[Any]) -> list[int]:
    return [t for e in events if e.WhichOneof("event") == "tokens" for t in e.tokens.token_ids]


async def test_failure_before_any_token_is_retried_fresh_elsewhere() -> None:
    bus = FlakyBus(["error@0", "ok"])
    events = await collect(make(bus), req([1, 2, 3], max_tokens=5))
    assert tokens_of(events) == FULL
    assert [list(r.exclude) for r in bus.routes] == [[], ["p1", "d1"]]
    first, second = bus.tasks()
    assert list(second.prompt_token_ids) == [1, 2, 3] and second.request_id != first.request_id
    await asyncio.sleep(0)
    assert [a.request_id for a in bus.aborts()] == [first.request_id]  # survivors free its KV


async def test_failure_after_tokens_resumes_with_the_sent_tokens_as_prior_output() -> None:
    bus = FlakyBus(["error@2", "ok"])
    events = await collect(make(bus), req([1, 2, 3], max_tokens=5))
    assert tokens_of(events) == FULL
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("ready") == 1 and kinds[-1] == "finish"
    assert events[0].ready.prompt_tokens == 3
    assert (events[-1].finish.usage.prompt_tokens, events[-1].finish.usage.completion_tokens) == (
        3,
        5,
    )
    first, second = bus.tasks()
    assert first.num_prior_outputs == 0
    assert list(second.prompt_token_ids) == [1, 2, 3, 7, 8] and second.num_prior_outputs == 2
    # The request's own settings: max_tokens counts the whole completion, prior outputs too.
    assert second.sampling == first.sampling and second.sampling.max_tokens == 5


async def test_min_tokens_past_what_remains_resumes_instead_of_invalid_argument() -> None:
    # Before: the retry was a new request with max_tokens 3 < min_tokens 5, refused mid-stream.
    bus = FlakyBus(["error@2", "ok"])
    r = req([1, 2, 3], max_tokens=5)
    r.sampling.min_tokens = 5
    events = await collect(make(bus), r)
    assert tokens_of(events) == FULL
    second = bus.tasks()[1]
    assert (second.sampling.min_tokens, second.num_prior_outputs) == (5, 2)


async def test_a_failed_hand_over_excludes_only_the_decode_instance() -> None:
    # Prefill pushes the KV after its first token; a push failure arrives as index 1. The only
    # prefill instance of a small stack must stay eligible, else the retry finds none (503).
    bus = FlakyBus(["error@1", "ok"])
    events = await collect(make(bus), req([1, 2, 3], max_tokens=5))
    assert tokens_of(events) == FULL
    assert [list(r.exclude) for r in bus.routes] == [[], ["d1"]]


async def test_unseeded_sampling_after_tokens_fails_retryably_instead_of_guessing() -> None:
    bus = FlakyBus(["error@2", "ok"])
    r = req([1, 2, 3], max_tokens=5)
    r.sampling.temperature = 0.7
    with pytest.raises(Aborted) as info:
        await collect(make(bus), r)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "unseeded" in info.value.details and "retry" in info.value.details
    assert len(bus.tasks()) == 1


async def test_a_silent_dead_instance_is_detected_by_heartbeat_and_retried() -> None:
    bus = FlakyBus(["silent@2", "ok"])
    beats = Beats({})  # nobody heartbeats: every instance dies after the grace
    h = make(bus, instance_dead_after=0.2, liveness_poll=0.05)
    h.liveness = beats
    beats.silent = {"p2": 0.0, "d2": 0.0}
    events = await asyncio.wait_for(collect(h, req([1, 2, 3], max_tokens=5)), 5)
    assert tokens_of(events) == FULL
    assert list(bus.routes[1].exclude) == ["d1"]  # p1 had handed over already


async def test_out_of_attempts_is_unavailable() -> None:
    bus = FlakyBus(["error@0", "error@0"])
    with pytest.raises(Aborted) as info:
        await collect(make(bus, max_attempts=2), req([1, 2, 3], max_tokens=5))
    assert (
        info.value.code == grpc.StatusCode.UNAVAILABLE and "after 2 attempts" in info.value.details
    )


# -- backpressure -----------------------------------------------------------------------------


async def test_over_max_inflight_is_resource_exhausted_with_a_retry_hint() -> None:
    bus = FakeBus(lambda task: [])  # requests hang upstream: they hold their slots
    h = make(bus, max_inflight=2, max_waiting=1, admit_wait=0.1, retry_after_ms=250)
    holders = [asyncio.ensure_future(collect(h, req([1, 2]))) for _ in range(2)]
    await asyncio.sleep(0.05)
    ctx = FakeContext()
    with pytest.raises(Aborted) as info:
        async for _ in h.Generate(req([1, 2]), ctx):
            pass
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry after 250 ms" in info.value.details
    assert ctx.trailing == (("retry-after-ms", "250"),)
    assert len(bus.tasks()) == 2  # the refused request touched no instance
    for t in holders:
        t.cancel()
    await asyncio.gather(*holders, return_exceptions=True)


async def test_a_waiting_request_gets_the_slot_that_frees_up() -> None:
    bus = FakeBus()
    slow = FakeBus(lambda task: [])
    h = make(slow, max_inflight=1, admit_wait=2.0)
    holder = asyncio.ensure_future(collect(h, req([1, 2])))
    await asyncio.sleep(0.05)
    h.bus = bus  # the next request is served normally once it has a slot
    waiter = asyncio.ensure_future(collect(h, req([1, 2, 3])))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    holder.cancel()
    events = await asyncio.wait_for(waiter, 2)
    assert tokens_of(events) == [7, 8, 9]
