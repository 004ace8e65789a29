"""The entrypoint's request-level metrics (vLLM's names under ``deepserve:``): one observation
per whole request, at its end, with plausible values, over the in-process bus whose fake
instances emit tokens at a known pace."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from libs.common import subjects
from libs.gateway.policy import Limits
from libs.proto.deepserve.v1 import control_pb2
from services.entrypoint.handlers import EntrypointHandlers, HandlerConfig
from services.entrypoint.request_metrics import HISTOGRAMS, SUCCESS, finished_reason

from .test_entrypoint_handlers import SECRET, Aborted, FakeBus, FakeContext, FakeLookup, req

PREFILL_S = 0.05  # the fake prefill's time to its first token
STEP_S = 0.02  # the fake decode's time per further token
SKIP = ("_bucket", "_created")  # samples a Snapshot leaves out

QUEUE, PREFILL, DECODE, INFERENCE, E2E, TTFT, TPOT = (h._name for h in HISTOGRAMS)


class PacedBus(FakeBus):
    """A task in gives token events out over time: the first after PREFILL_S, then one per
    STEP_S. ``scripts[k]`` (attempt k, the last one repeating) is a list of what each event
    is: a token id, "stop" / "length" (the finishing token), "error" / "retry" (an error
    event, not retryable / retryable)."""

    def __init__(self, *scripts: list[int | str]) -> None:
        super().__init__()
        self.scripts = list(scripts) or [[7, 8, 9, 10, 11, "length"]]
        self.attempts = 0
        self.running: set[asyncio.Task[None]] = set()

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))
        if subject != subjects.prefill_task("p1"):
            return
        task = control_pb2.PrefillTask.FromString(data)
        script = self.scripts[min(self.attempts, len(self.scripts) - 1)]
        self.attempts += 1
        emit = asyncio.get_running_loop().create_task(self._emit(task, script))
        self.running.add(emit)
        emit.add_done_callback(self.running.discard)

    async def _emit(self, task: control_pb2.PrefillTask, script: list[int | str]) -> None:
        sub = self.subs[task.events_subject]
        for i, what in enumerate(script):
            await asyncio.sleep(PREFILL_S if i == 0 else STEP_S)
            ev = control_pb2.TokenEvent(
                request_id=task.request_id,
                index=i,
                prompt_tokens=len(task.prompt_token_ids),
            )
            if what in ("error", "retry"):
                ev.error, ev.retryable = "boom", what == "retry"
            else:
                ev.token_ids.append(100 + i if isinstance(what, str) else what)
                if isinstance(what, str):
                    ev.finished, ev.finish_reason = True, what
            sub.queue.put_nowait(ev.SerializeToString())
            if ev.finished or ev.error:
                return


def make(bus: FakeBus, model: str, **cfg: Any) -> EntrypointHandlers:
    limits = Limits(model_name=model, vocab_size=1000, max_context=4096, block_size=4)
    return EntrypointHandlers(
        HandlerConfig(limits=limits, salt_secret=SECRET, **cfg), bus, FakeLookup()
    )


class Snapshot:
    """Metric values of one model now; :meth:`delta` what changed since."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        out = {}
        for metric in REGISTRY.collect():
            for s in metric.samples:
                if s.labels.get("model_name") == self.model and not s.name.endswith(SKIP):
                    key = s.name + "".join(
                        f"{{{v}}}" for k, v in sorted(s.labels.items()) if k != "model_name"
                    )
                    out[key] = s.value
        return out

    def delta(self) -> dict[str, float]:
        now = self._read()
        was = self.before
        return {k: v - was.get(k, 0.0) for k, v in now.items() if v != was.get(k, 0.0)}

    def count(self, name: str) -> float:
        return self.delta().get(f"{name}_count", 0.0)

    def sum(self, name: str) -> float:
        return self.delta().get(f"{name}_sum", 0.0)

    def reasons(self) -> dict[str, float]:
        prefix = "deepserve:request_success_total{"
        return {k[len(prefix) : -1]: v for k, v in self.delta().items() if k.startswith(prefix)}


async def run(
    h: EntrypointHandlers, prompt: list[int], max_tokens: int = 6, **kw: Any
) -> list[Any]:
    return [ev async for ev in h.Generate(req(prompt, max_tokens=max_tokens, **kw), FakeContext())]


def test_every_series_is_exported_from_the_start_and_none_clashes_with_the_engines() -> None:
    make(FakeBus(), "rm-start")
    got = Snapshot("rm-start").before
    for name in (QUEUE, PREFILL, DECODE, INFERENCE, E2E, TTFT, TPOT):
        assert got[f"{name}_count"] == 0.0, name
    assert {k for k in got if k.startswith("deepserve:request_success_total")} == {
        f"deepserve:request_success_total{{{r}}}"
        for r in ("stop", "length", "abort", "rejected", "error")
    }
    assert {E2E, TTFT} == {
        "deepserve:request_e2e_latency_seconds",
        "deepserve:request_time_to_first_token_seconds",
    }
    # An engine in this process registers its own series beside these: a clash would raise.
    from libs.serving.engine_metrics import EngineMetrics

    EngineMetrics("rm-start", "both").unregister()  # neither role: every engine series
    engine = CollectorRegistry()
    EngineMetrics("rm-start", "both", registry=engine)
    ours = {m.name for m in REGISTRY.collect() if m.name.startswith("deepserve:request_")}
    assert ours == {*(h._name for h in HISTOGRAMS), SUCCESS._name}
    assert not ours & {m.name for m in engine.collect()}


async def test_one_request_observes_each_histogram_once_with_its_pace() -> None:
    tokens = 6
    bus = PacedBus([7, 8, 9, 10, 11, "length"])
    snap = Snapshot("rm-paced")
    events = await run(make(bus, "rm-paced"), [1, 2, 3], max_tokens=tokens)
    assert events[-1].finish.reason == "length"
    assert events[-1].finish.usage.completion_tokens == tokens

    for name in (QUEUE, PREFILL, DECODE, INFERENCE, E2E, TTFT, TPOT):
        assert snap.count(name) == 1, name
    assert snap.reasons() == {"length": 1}
    queue, prefill, decode = snap.sum(QUEUE), snap.sum(PREFILL), snap.sum(DECODE)
    inference, e2e, ttft, tpot = snap.sum(INFERENCE), snap.sum(E2E), snap.sum(TTFT), snap.sum(TPOT)
    slack = 0.5  # a loaded CI machine's scheduling; sleeps are never short
    assert 0 <= queue < 0.1  # nothing else ran: admitted at once
    assert PREFILL_S * 0.9 <= prefill < PREFILL_S + slack
    assert (tokens - 1) * STEP_S * 0.9 <= decode < (tokens - 1) * STEP_S + slack
    assert STEP_S * 0.9 <= tpot < STEP_S + slack / (tokens - 1)
    assert tpot == pytest.approx(decode / (tokens - 1))
    assert inference == pytest.approx(prefill + decode)  # admitted -> first -> last token
    assert queue + prefill <= ttft + 1e-9 and ttft < e2e
    assert queue + inference <= e2e + 1e-9 and e2e < queue + inference + slack


async def test_queue_time_is_the_wait_for_admission() -> None:
    bus = PacedBus([7, 8, 9, 10, 11, "stop"])
    h = make(bus, "rm-queue", max_inflight=1)  # the second waits for the first to finish
    snap = Snapshot("rm-queue")
    first = asyncio.create_task(run(h, [1, 2, 3], tenant="a"))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(run(h, [4, 5, 6], tenant="b"))
    await asyncio.gather(first, second)

    assert snap.count(QUEUE) == 2 and snap.count(E2E) == 2
    assert snap.reasons() == {"stop": 2}
    whole = PREFILL_S + 5 * STEP_S  # one request's run
    # the first waits ~0, the second for (most of) the first's run
    assert whole * 0.8 <= snap.sum(QUEUE) < whole + 0.5
    # the second's time to its first token includes its wait; its prefill time does not
    assert snap.sum(TTFT) >= snap.sum(QUEUE) + 2 * PREFILL_S * 0.9
    assert 2 * PREFILL_S * 0.9 <= snap.sum(PREFILL) < 2 * PREFILL_S + 0.5


async def test_each_request_is_counted_once_by_how_it_ended() -> None:
    # stop; a retried request (the first attempt fails before any token) that ends by length
    for model, scripts, reason in (
        ("rm-stop", [[7, 8, "stop"]], "stop"),
        ("rm-retried", [["retry"], [7, 8, "length"]], "length"),
    ):
        bus = PacedBus(*scripts)
        snap = Snapshot(model)
        await run(make(bus, model), [1, 2, 3], max_tokens=3)
        assert bus.attempts == len(scripts)
        assert snap.reasons() == {reason: 1}, model
        for name in (QUEUE, PREFILL, DECODE, INFERENCE, E2E, TTFT, TPOT):
            assert snap.count(name) == 1, (model, name)

    # an error after 2 tokens were sent: its times up to the last token it had
    bus = PacedBus([7, 8, "error"])
    snap = Snapshot("rm-error")
    with pytest.raises(Aborted) as info:
        await run(make(bus, "rm-error"), [1, 2, 3])
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert snap.reasons() == {"error": 1}
    for name in (QUEUE, PREFILL, DECODE, INFERENCE, E2E, TTFT, TPOT):
        assert snap.count(name) == 1, name
    assert STEP_S * 0.9 <= snap.sum(DECODE) < STEP_S + 0.5  # 2 tokens: one step apart

    # the client goes away after the first token: no decode time with one token
    bus = PacedBus([7, 8, 9, 10, 11, "length"])
    h = make(bus, "rm-abort")
    snap = Snapshot("rm-abort")
    gen = h.Generate(req([1, 2, 3], max_tokens=6), FakeContext())
    assert (await gen.__anext__()).WhichOneof("event") == "ready"
    assert (await gen.__anext__()).WhichOneof("event") == "tokens"
    await gen.aclose()  # what a cancelled RPC does to the handler
    for emitting in set(bus.running):
        emitting.cancel()  # the fake instance's remaining tokens go nowhere
    assert snap.reasons() == {"abort": 1}
    assert snap.count(E2E) == snap.count(TTFT) == snap.count(PREFILL) == 1
    assert snap.count(DECODE) == 1 and snap.sum(DECODE) == 0.0  # first == last token
    assert snap.count(TPOT) == 0  # undefined for one token

    # refused at admission (no room, no queue): only its end-to-end time
    bus = PacedBus([7, 8, 9, 10, 11, "length"])
    h = make(bus, "rm-rejected", max_inflight=1, max_waiting=0)
    snap = Snapshot("rm-rejected")
    holder = asyncio.create_task(run(h, [1, 2, 3]))
    await asyncio.sleep(0.01)
    with pytest.raises(Aborted) as info:
        await run(h, [4, 5, 6])
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    await holder
    assert snap.reasons() == {"rejected": 1, "length": 1}
    assert snap.count(E2E) == 2 and snap.count(QUEUE) == snap.count(TTFT) == 1


async def test_a_request_refused_before_validation_is_not_counted() -> None:
    snap = Snapshot("rm-invalid")
    with pytest.raises(Aborted):
        await run(make(PacedBus(), "rm-invalid"), [1, 2, 3], model="other")
    assert snap.delta() == {}


def test_finished_reason_of_each_outcome() -> None:
    assert finished_reason("ok", "stop") == "stop" and finished_reason("ok", "length") == "length"
    assert finished_reason("ok", "") == "stop"
    assert finished_reason("cancelled", "") == "abort"
    assert finished_reason("overloaded", "") == "rejected"
    assert finished_reason("invalid", "") == "rejected"  # after validation: admission's unfit
    for outcome in ("timeout", "unavailable", "error"):
        assert finished_reason(outcome, "length") == "error"
