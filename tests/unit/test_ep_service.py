"""The engine services' side of expert parallelism, without servers: flags, rank identities,
the engine thread in lockstep (serving, a broken group failing its requests retryably), and a
rank that stops early stepping on while its peer still works."""

from __future__ import annotations

import asyncio
import copy

import pytest

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep.group import EPGroup
from libs.serving.engine_loop import EngineLoop
from libs.serving.ep import EPFlags, rank_instance_id
from libs.serving.ep.launch import run_group
from libs.serving.ep.lockstep import Lockstep
from libs.serving.request_stream import EngineFailed, EngineLoopClosed
from services.decode.config import build_parser as decode_parser
from services.decode.config import config_from as decode_config
from services.prefill.config import build_parser as prefill_parser
from services.prefill.config import config_from as prefill_config

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ENGINE = dict(model="tiny", block_size=16, num_kv_blocks=64, time_budget_s=None)
PROMPT = [(i * 7919) % 120000 + 3 for i in range(19)]


def test_ep_flags_make_a_supervisor_or_a_rank() -> None:
    cfg = decode_config(decode_parser().parse_args(["--ep", "2", "--ep-timeout", "3"]))
    assert cfg.ep.supervises and not cfg.ep.is_rank and cfg.ep.timeout_s == 3
    rank = prefill_config(
        prefill_parser().parse_args(
            ["--ep", "2", "--ep-rank", "1", "--ep-rendezvous", "127.0.0.1:1234"]
        )
    )
    assert rank.ep.is_rank and not rank.ep.supervises and rank.ep.rank == 1
    assert not prefill_config(prefill_parser().parse_args([])).ep.supervises


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--ep", "0"], "--ep must be >= 1"),
        (["--ep", "2", "--model", "fake"], "--model fake has none"),
        (["--ep", "2", "--ep-rank", "2", "--ep-rendezvous", "h:1"], "outside a group"),
        (["--ep", "2", "--ep-rank", "0"], "--ep-rendezvous host:port"),
        (["--ep", "2", "--ep-timeout", "0"], "must be positive"),
    ],
)
def test_bad_ep_flags_are_refused_with_the_flag_named(argv: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_config(decode_parser().parse_args(argv))


def test_rank_ids_change_with_each_restart_of_the_group() -> None:
    assert rank_instance_id("decode-0", 1) == "decode-0-r1"
    assert rank_instance_id("decode-0", 0, 2) == "decode-0-r0-g2"
    assert EPFlags(size=1).supervises is False


def _ep_engine(tiny_loaded) -> tuple[Engine, EPGroup]:
    group = EPGroup.single()
    return Engine(EngineConfig(**ENGINE), copy.deepcopy(tiny_loaded), ep=group), group


async def _tokens(loop: EngineLoop, rid: str) -> list[int]:
    stream = await loop.add(rid, PROMPT, GREEDY)
    return [ev.token_id async for ev in stream if ev.token_id is not None]


async def test_the_engine_thread_drives_an_ep_engine_in_lockstep(tiny_loaded) -> None:
    plain = Engine(EngineConfig(**ENGINE), loaded=tiny_loaded)
    plain.add_request("x", PROMPT, GREEDY)
    want = []
    while plain.has_unfinished():
        want += [ev.token_id for ev in plain.step()]
    engine, group = _ep_engine(tiny_loaded)
    loop = EngineLoop(engine, name="ep")
    loop.start()
    try:
        assert await _tokens(loop, "a") == want
        await asyncio.sleep(0.05)  # idle: the group keeps polling, no step
        steps = loop.stats.steps
        await asyncio.sleep(0.05)
        assert loop.stats.steps == steps
        assert await _tokens(loop, "b") == want
    finally:
        await loop.close()
        group.close()


async def test_a_broken_group_fails_its_requests_and_refuses_more(tiny_loaded) -> None:
    engine, group = _ep_engine(tiny_loaded)
    failures: list[BaseException] = []
    loop = EngineLoop(engine, name="ep", on_group_failed=failures.append)
    assert loop._lockstep is not None
    real = loop._lockstep.group.all_max
    calls = 0

    def flaky(values):  # the peer dies after a few rounds
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("Connection closed by peer")
        return real(values)

    loop._lockstep.group.all_max = flaky  # type: ignore[method-assign]
    loop.start()
    try:
        stream = await loop.add("a", PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
        with pytest.raises(EngineFailed, match="EP group failed"):
            async for _ in stream:
                pass
        await asyncio.sleep(0.05)  # on_group_failed runs on the event loop
        assert len(failures) == 1 and loop.group_failure is failures[0]
        with pytest.raises(EngineLoopClosed):
            await loop.add("b", PROMPT, GREEDY)
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await loop.close()
        group.close()


def _stop_early(group: EPGroup, model: str) -> tuple[int, int]:
    """Rank 0 is stopping from the start and has no work; rank 1 has a request. Returns
    (tokens this rank got, rounds until the group stopped)."""
    from libs.engine.llm import LLM

    if model == "tiny":
        loaded = LLM("tiny", num_kv_blocks=8).engine.loaded
        engine = Engine(EngineConfig(**ENGINE), loaded, ep=group)
    else:  # V4: each engine step is rounds of forwards, the idle rank's too
        engine = Engine(EngineConfig(**{**ENGINE, "model": model}), ep=group)
    if group.rank == 1:
        engine.add_request("r", PROMPT, GREEDY)
    lockstep = Lockstep(engine, poll_s=0.001)
    tokens = rounds = 0
    while True:
        rounds += 1
        tick = lockstep.tick(stopping=group.rank == 0 or not engine.has_unfinished())
        if tick.stop:
            return tokens, rounds
        tokens += sum(ev.token_id is not None for ev in tick.events)


@pytest.mark.parametrize("model", ["tiny", "v4-tiny"])
def test_a_rank_that_stops_first_steps_on_until_its_peer_is_done(model: str) -> None:
    (t0, r0), (t1, r1) = run_group(_stop_early, 2, model, timeout_s=60, deadline_s=120)
    assert (t0, t1) == (0, GREEDY.max_tokens)
    assert r0 == r1  # they left in the same round
