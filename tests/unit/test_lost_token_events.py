"""Token events lost on the bus (a NATS outage) come back from the decode instance.

The decode side's record of what it published (``libs/serving/replay.py``), and the
entrypoint handler asking for the events from the first missing position after a gap or a
bus reconnection, over the in-process bus of ``test_entrypoint_handlers``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from libs.proto.deepserve.v1 import control_pb2
from libs.serving.replay import EventLog
from services.entrypoint.handlers import EntrypointHandlers, HandlerConfig, ResendFailed

from .test_entrypoint_handlers import (
    LIMITS,
    SECRET,
    FakeBus,
    FakeContext,
    FakeLookup,
    greedy_events,
    req,
)

# -- decode: EventLog ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_event_log_sends_again_from_any_position_including_prefills_first_token() -> None:
    log = EventLog()
    log.start("r", first_token=50, prompt_tokens=7, cached_tokens=4)
    for t in (51, 52):
        log.token("r", t, False, "")
    (ev,) = log.since("r", 1) or []
    assert (ev.index, list(ev.token_ids), ev.finished) == (1, [51, 52], False)
    assert (ev.prompt_tokens, ev.cached_tokens) == (7, 4)
    (ev,) = log.since("r", 0) or []
    assert list(ev.token_ids) == [50, 51, 52]
    assert log.since("r", 3) == []  # nothing past what was published, not finished
    assert log.since("other", 0) is None


def test_event_log_keeps_an_ended_request_for_the_grace_then_forgets_it() -> None:
    clock = Clock()
    log = EventLog(grace_s=30.0, clock=clock)
    log.start("r", 50, 7, 0)
    log.token("r", 51, True, "length")
    log.end("r")
    (ev,) = log.since("r", 2) or []  # a bare finish at the end
    assert (ev.index, list(ev.token_ids), ev.finished, ev.finish_reason) == (2, [], True, "length")
    clock.now += 31
    assert log.since("r", 0) is None
    assert len(log) == 0


def test_event_log_repeats_the_error_and_forgets_aborted_requests() -> None:
    log = EventLog(max_ended=1)
    log.start("r", 50, 7, 0)
    err = control_pb2.TokenEvent(request_id="r", index=1, error="boom", retryable=True)
    log.error("r", err)
    log.end("r")
    evs = log.since("r", 1) or []
    assert [e.error for e in evs] == ["boom"]
    log.start("s", 60, 7, 0)
    log.drop("s")
    assert log.since("s", 0) is None
    log.start("t", 70, 7, 0)
    log.end("t")  # max_ended=1: r goes
    assert log.since("r", 0) is None and log.since("t", 0) is not None


def test_event_log_rejects_negative_limits() -> None:
    with pytest.raises(ValueError):
        EventLog(grace_s=-1)


# -- entrypoint: asking for what was lost -----------------------------------------------------


OUT = [7, 8, 9, 10, 11, 12]


class FakeResender:
    """The decode twin's KVTransfer.Resend: the full greedy completion from any position."""

    def __init__(self, known: bool = True, fail_first: int = 0) -> None:
        self.count = 0
        self.known, self.fail_first = known, fail_first
        self.asked: list[tuple[str, str, int]] = []
        self.task: control_pb2.PrefillTask | None = None

    def reconnects(self) -> int:
        return self.count

    async def settle(self) -> None:
        pass

    async def resend(
        self, address: str, request_id: str, from_index: int
    ) -> list[control_pb2.TokenEvent] | None:
        self.asked.append((address, request_id, from_index))
        if len(self.asked) <= self.fail_first:
            raise ResendFailed("decode unreachable")
        if not self.known:
            return None
        assert self.task is not None
        evs = greedy_events(self.task, OUT)[from_index:]
        return [
            control_pb2.TokenEvent(
                request_id=request_id,
                index=from_index,
                token_ids=[t for e in evs for t in e.token_ids],
                finished=True,
                finish_reason="length",
                prompt_tokens=evs[0].prompt_tokens,
            )
        ]


def handler(bus: FakeBus, resender: FakeResender, **cfg: Any) -> EntrypointHandlers:
    config = HandlerConfig(limits=LIMITS, salt_secret=SECRET, liveness_poll=0.05, **cfg)
    return EntrypointHandlers(config, bus, FakeLookup(), resender=resender)


def lossy(resender: FakeResender, lost: set[int]) -> Any:
    """Prefill/decode twin whose events at positions ``lost`` never arrive."""

    def prefill(task: control_pb2.PrefillTask) -> list[control_pb2.TokenEvent]:
        resender.task = task
        return [e for e in greedy_events(task, OUT) if e.index not in lost]

    return prefill


async def tokens_of(h: EntrypointHandlers, max_tokens: int = len(OUT)) -> tuple[list[int], str]:
    toks: list[int] = []
    reason = ""
    async for ev in h.Generate(req([1, 2, 3], max_tokens), FakeContext()):
        if ev.WhichOneof("event") == "tokens":
            toks.extend(ev.tokens.token_ids)
        elif ev.WhichOneof("event") == "finish":
            reason = ev.finish.reason
    return toks, reason


async def test_a_gap_in_the_indices_is_filled_from_decode() -> None:
    resender = FakeResender(fail_first=1)  # the first ask fails: asked again a poll later
    bus = FakeBus(prefill=lossy(resender, {2, 3}))
    toks, reason = await tokens_of(handler(bus, resender))
    assert (toks, reason) == (OUT, "length")
    assert [(a, i) for a, _, i in resender.asked] == [("127.0.0.1:7001", 2)] * 2
    assert resender.asked[0][1] == bus.tasks()[0].request_id
    assert not bus.aborts()  # the attempt finished upstream: nothing to abort


async def test_lost_events_at_the_end_come_back_after_a_reconnection() -> None:
    resender = FakeResender()
    bus = FakeBus(prefill=lossy(resender, {3, 4, 5}))  # the finish is lost too: no gap seen

    async def reconnect() -> None:
        await asyncio.sleep(0.1)
        resender.count += 1  # the bus came back during the attempt

    later = asyncio.create_task(reconnect())
    toks, reason = await tokens_of(handler(bus, resender))
    await later
    assert (toks, reason) == (OUT, "length")
    assert [i for _, _, i in resender.asked] == [3]


async def test_unknown_at_decode_keeps_waiting_for_the_bus() -> None:
    resender = FakeResender(known=False)
    bus = FakeBus(prefill=lossy(resender, {1}))
    with pytest.raises(Exception, match="no token for"):
        await tokens_of(handler(bus, resender, request_timeout=0.3))
    assert resender.asked  # asked (and told it is not there), then the usual deadline


def test_resent_events_keep_their_logprobs_aligned_or_carry_none() -> None:
    from libs.common.sampling import TokenLogprob

    log = EventLog()
    first, second = TokenLogprob(-0.5, (7,), (-0.5,)), TokenLogprob(-0.25, (8,), (-0.25,))
    log.start("r", 7, 3, 0, first, with_logprobs=True)
    log.token("r", 8, False, "", second)
    (ev,) = log.since("r", 0) or []
    assert list(ev.token_ids) == [7, 8]
    assert [TokenLogprob.from_proto(lp) for lp in ev.logprobs] == [first, second]
    (ev,) = log.since("r", 1) or []
    assert [TokenLogprob.from_proto(lp) for lp in ev.logprobs] == [second]
    # Prefill's first logprob unknown (an older prefill): none rather than misaligned ones.
    log.start("s", 7, 3, 0, None, with_logprobs=True)
    log.token("s", 8, True, "stop", second)
    assert not log.since("s", 0)[0].logprobs  # type: ignore[index]
    assert len(log.since("s", 1)[0].logprobs) == 1  # type: ignore[index]
    log.start("t", 7, 3, 0)  # did not ask
    log.token("t", 8, True, "stop")
    assert not log.since("t", 0)[0].logprobs  # type: ignore[index]
