"""A request resumed after a failure (the entrypoint's retry once tokens reached the client):
prefill gets ``prompt + tokens sent`` with ``num_prior_outputs`` = tokens sent and the
request's own settings, and prefill + decode produce exactly the rest of what one
uninterrupted engine produces -- for a JSON-schema constrained request (the grammar goes on
mid-JSON), presence/frequency penalties (they remember the earlier completion), min_tokens
larger than what remains, and seeded sampling with logprobs. In-process prefill and decode
handlers (the harness of test_prefill_decode_handlers.py)."""

from __future__ import annotations

import json

import pytest

from libs.common import subjects
from libs.common.sampling import Constraint, SamplingParams
from libs.proto.deepserve.v1 import control_pb2

from ..event_positions import first_positions
from .test_grammar import SCHEMA, _text, _valid
from .test_prefill_decode_handlers import make, prompt, stack  # noqa: F401 - the fixture

JSON = Constraint("json_schema", json.dumps(SCHEMA))


def uninterrupted(tiny_loaded, p: list[int], sp: SamplingParams) -> tuple[list[int], str, list]:
    """One engine, start to end: tokens, finish reason, logprobs."""
    engine = make(tiny_loaded)
    engine.add_request("ref", p, sp)
    toks, reason, lps = [], "", []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                toks.append(ev.token_id)
                lps.append(ev.logprobs)
            if ev.finished:
                reason = ev.finish_reason or ""
    return toks, reason, lps


def resumed_task(
    rid: str, p: list[int], sent: list[int], sp: SamplingParams
) -> control_pb2.PrefillTask:
    """What the entrypoint sends after ``sent`` reached the client and the decode died."""
    return control_pb2.PrefillTask(
        request_id=rid,
        prompt_token_ids=p + sent,
        num_prior_outputs=len(sent),
        sampling=sp.to_proto(),
        decode_instance="decode-0",
        decode_address="inproc:0",
        events_subject=subjects.token_events(rid),
    )


async def _resume(
    handlers: tuple, rid: str, p: list[int], sent: list[int], sp: SamplingParams
) -> list:
    bus, prefill = handlers[0], handlers[1]
    prefill.submit(resumed_task(rid, p, sent, sp))
    events = await bus.wait_done(rid)
    assert not any(e.error for e in events), [e.error for e in events]
    assert [e.index for e in events] == first_positions(events)  # this attempt's positions
    assert all(e.prompt_tokens == len(p) for e in events)  # the true prompt, not prompt + sent
    return events


def _min_tokens_case(tiny_loaded) -> tuple[list[int], SamplingParams]:
    """A greedy request whose stop token the model would pick at output 4 were min_tokens
    (12) not masking it; it stops with it at output 23 (of max_tokens 24)."""
    p = prompt(20, 28)
    free, _, _ = uninterrupted(tiny_loaded, p, SamplingParams(max_tokens=24, ignore_eos=True))
    stop = free[4]
    assert stop not in free[:4]
    return p, SamplingParams(max_tokens=24, min_tokens=12, stop_token_ids=(stop,), ignore_eos=True)


def cases(tiny_loaded) -> dict[str, tuple[list[int], SamplingParams, int]]:
    """name -> (prompt, settings, tokens sent before the failure)."""
    mp, msp = _min_tokens_case(tiny_loaded)
    return {
        "constrained": (prompt(20, 21), SamplingParams(max_tokens=80, constraint=JSON), 9),
        "constrained_seeded": (
            prompt(20, 22),
            SamplingParams(max_tokens=80, temperature=1.2, seed=4, constraint=JSON),
            14,
        ),
        "penalized": (
            prompt(20, 25),
            SamplingParams(
                max_tokens=24, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True
            ),
            10,
        ),
        "min_tokens": (mp, msp, 14),  # 10 remain of max_tokens 24, min_tokens is 12
        "seeded": (
            prompt(20, 25),
            SamplingParams(
                temperature=0.9,
                top_k=40,
                seed=5,
                max_tokens=20,
                presence_penalty=0.5,
                logprobs=3,
                ignore_eos=True,
            ),
            7,
        ),
    }


@pytest.mark.parametrize(
    "name", ["constrained", "constrained_seeded", "penalized", "min_tokens", "seeded"]
)
async def test_a_resumed_request_finishes_as_the_uninterrupted_one(
    stack,  # noqa: F811
    tiny_loaded,
    name: str,
) -> None:
    p, sp, k = cases(tiny_loaded)[name]
    whole, reason, lps = uninterrupted(tiny_loaded, p, sp)
    assert len(whole) > k + 1  # the failure falls mid-completion
    events = await _resume(stack, name, p, whole[:k], sp)
    assert whole[:k] + [t for e in events for t in e.token_ids] == whole
    assert events[-1].finish_reason == reason
    if sp.constraint is not None:  # mid-JSON at the failure, one valid document in the end
        assert reason == "stop"
        with pytest.raises(json.JSONDecodeError):
            json.loads(_text(whole[:k]))
        assert _valid(json.loads(_text(whole)))
    if sp.logprobs is not None:
        got = [lp for e in events for lp in e.logprobs]
        assert len(got) == len(whole) - k
        for mine, ref in zip(got, lps[k:], strict=True):
            assert ref is not None
            assert mine.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert tuple(mine.top_ids) == ref.top_ids
            assert list(mine.top_logprobs) == pytest.approx(list(ref.top_logprobs), abs=1e-4)


@pytest.mark.parametrize("k", [3, 6, 11, 14, 20])
async def test_min_tokens_counts_the_prior_outputs(stack, tiny_loaded, k: int) -> None:  # noqa: F811
    """The stop token is masked until output 12 and ends the request at output 23: resumed
    before or after output 12 (from 14 on, fewer tokens remain than min_tokens, which the old
    retry refused as INVALID_ARGUMENT) it stops exactly there, neither earlier nor later."""
    p, sp = _min_tokens_case(tiny_loaded)
    whole, reason, _ = uninterrupted(tiny_loaded, p, sp)
    assert reason == "stop" and len(whole) == 23 and whole[-1] in sp.stop_token_ids
    events = await _resume(stack, f"mt{k}", p, whole[:k], sp)
    assert whole[:k] + [t for e in events for t in e.token_ids] == whole
    assert events[-1].finish_reason == "stop"


async def test_penalties_remember_the_earlier_completion(stack, tiny_loaded) -> None:  # noqa: F811
    """The old retry (prompt + sent as a new prompt, max_tokens reduced) forgot the tokens
    sent: the penalties then treat them as prompt and the continuation differs."""
    p, sp, k = cases(tiny_loaded)["penalized"]
    whole, _, _ = uninterrupted(tiny_loaded, p, sp)
    fresh, _, _ = uninterrupted(
        tiny_loaded, p + whole[:k], SamplingParams(**{**_fields(sp), "max_tokens": len(whole) - k})
    )
    assert fresh != whole[k:]  # what a client got before: not the uninterrupted completion
    events = await _resume(stack, "pen", p, whole[:k], sp)
    assert [t for e in events for t in e.token_ids] == whole[k:]


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in sp.__dataclass_fields__}


async def test_prefill_refuses_prior_outputs_that_leave_nothing(stack) -> None:  # noqa: F811
    bus, prefill = stack[0], stack[1]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    bad = resumed_task("all", prompt(10, 3), [5, 6, 7, 8], sp)
    prefill.submit(bad)
    await bus.next()
    bus.settle()
    (ev,) = bus.events[subjects.token_events("all")]
    assert "num_prior_outputs" in ev.error and not ev.retryable
    whole = resumed_task("whole", [5, 6], [], sp)
    whole.num_prior_outputs = 2  # the prompt must keep a token of its own
    prefill.submit(whole)
    await bus.next()
    (ev,) = bus.events[subjects.token_events("whole")]
    assert "num_prior_outputs" in ev.error and not ev.retryable
