"""Engine behaviour on the tiny preset: what a caller sees must not depend on how it was served."""

from __future__ import annotations

import dataclasses

import pytest

from libs.common.hashchain import chain_hashes
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig, InvalidRequest, MissingPrefix, NoFreeBlocks
from libs.engine.kv.transfer import KVFormatError, decode_frame

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True
)


MODE: dict[str, object] = {}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def _overlap(request, monkeypatch):
    """Every behaviour holds with and without overlapped scheduling (tokens one step late)."""
    monkeypatch.setitem(MODE, "overlap", request.param)


def make(tiny_loaded, **kw) -> Engine:
    base = dict(model="tiny", block_size=16, num_kv_blocks=512, time_budget_s=None, **MODE)
    base.update(kw)
    return Engine(EngineConfig(**base), loaded=tiny_loaded)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


def run(
    engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]], **add_kw
) -> dict[str, list[int]]:
    """Serve the requests together; the generated tokens as the caller sees them (events)."""
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp, **add_kw)
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
    return out


def alone(tiny_loaded, p: list[int], sp: SamplingParams, **kw) -> list[int]:
    return run(make(tiny_loaded, **kw), {"x": (p, sp)})["x"]


REQS = {
    "a": (prompt(5, 1), GREEDY),
    "b": (prompt(40, 2), GREEDY),
    "c": (prompt(77, 3), SEEDED),
    "d": (prompt(16, 4), SamplingParams(temperature=0.8, seed=99, max_tokens=10, ignore_eos=True)),
}


def test_batched_equals_one_at_a_time(tiny_loaded) -> None:
    together = run(make(tiny_loaded), REQS)
    for rid, (p, sp) in REQS.items():
        assert together[rid] == alone(tiny_loaded, p, sp), f"request {rid} changed when batched"
    assert len(set(map(tuple, together.values()))) == len(REQS)


def test_chunked_prefill_equals_whole_prefill(tiny_loaded) -> None:
    p = prompt(150, 5)
    whole = alone(tiny_loaded, p, GREEDY)
    engine = make(tiny_loaded, max_tokens_per_step=32)
    steps = []
    engine.add_request("x", p, GREEDY, hold_kv=True)
    while engine.has_unfinished():
        engine.step()
        steps.append(engine.last_step_tokens)
    assert max(steps) <= 32 and steps[:4] == [32, 32, 32, 32]
    assert list(engine.info("x").token_ids[150:]) == whole


def test_prefix_hit_equals_miss_and_reports_cached_tokens(tiny_loaded) -> None:
    shared = prompt(70, 6)
    engine = make(tiny_loaded)
    run(engine, {"first": (shared + [11, 12, 13], GREEDY)})
    follow = shared + [21, 22, 23, 24]
    engine.add_request("hit", follow, GREEDY, hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    info = engine.info("hit")
    assert info.num_cached_tokens == 64  # 4 full 16-token blocks of the shared 70 tokens
    miss = make(tiny_loaded)
    miss.add_request("miss", follow, GREEDY, hold_kv=True)
    while miss.has_unfinished():
        miss.step()
    assert miss.info("miss").num_cached_tokens == 0
    assert info.token_ids == miss.info("miss").token_ids


def test_cache_salt_separates_tenants(tiny_loaded) -> None:
    engine = make(tiny_loaded)
    p = prompt(40, 7)
    run(engine, {"t1": (p, GREEDY)}, cache_salt=b"tenant-1")
    engine.add_request("t2", p, GREEDY, cache_salt=b"tenant-2", hold_kv=True)
    engine.add_request("t1b", p, GREEDY, cache_salt=b"tenant-1", hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.info("t2").num_cached_tokens == 0
    assert engine.info("t1b").num_cached_tokens == 32


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_export_import_equals_uninterrupted(tiny_loaded, sp: SamplingParams) -> None:
    p = prompt(45, 8)
    full = alone(tiny_loaded, p, sp)
    # "Prefill": compute the prompt and the first token, then hand the KV (with the tail) over.
    pre = make(tiny_loaded)
    pre.add_request("r", p, SamplingParams(**{**sp.__dict__, "max_tokens": 1}), hold_kv=True)
    while pre.has_unfinished():
        pre.step()
    first = pre.info("r").token_ids[-1]
    frame = pre.export_kv("r", include_partial=True, release=True)
    header, _ = decode_frame(frame)
    assert header.num_tokens == 45 and header.num_blocks == 3 and header.model_id == pre.model_id
    assert pre.blocks.num_used == 0 or pre.blocks.num_cached >= 2
    # "Decode": continue from the imported KV in another engine.
    dec = make(tiny_loaded)
    dec.add_request(
        "r",
        p + [first],
        SamplingParams(**{**sp.__dict__, "max_tokens": sp.max_tokens - 1}),
        kv=frame,
        hold_kv=True,
    )
    assert dec.info("r").num_computed_tokens == 45
    while dec.has_unfinished():
        dec.step()
    assert [first] + list(dec.info("r").token_ids[46:]) == full


def test_import_of_full_blocks_recomputes_only_the_rest(tiny_loaded) -> None:
    p = prompt(50, 9)
    full = alone(tiny_loaded, p, GREEDY)
    src = make(tiny_loaded)
    run_kv = src.add_request("s", p, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    frame = src.export_kv("s")  # full blocks only: 48 tokens
    assert decode_frame(frame)[0].num_tokens == 48 and run_kv is None
    dst = make(tiny_loaded)
    dst.add_request("d", p, GREEDY, kv=frame, hold_kv=True)
    assert dst.info("d").num_cached_tokens == 48
    while dst.has_unfinished():
        dst.step()
    assert list(dst.info("d").token_ids[50:]) == full


def test_import_rejects_kv_of_other_tokens_or_models(tiny_loaded) -> None:
    p = prompt(40, 10)
    src = make(tiny_loaded)
    src.add_request("s", p, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    frame = src.export_kv("s")
    dst = make(tiny_loaded)
    free_before = dst.blocks.num_free
    with pytest.raises(KVFormatError, match="chain hash"):
        dst.add_request("x", [5] + p[1:], GREEDY, kv=frame)
    with pytest.raises(KVFormatError, match="chain hash"):
        dst.add_request("y", p, GREEDY, kv=frame, cache_salt=b"other-tenant")
    other_block = make(tiny_loaded, block_size=32, num_kv_blocks=64)
    with pytest.raises(KVFormatError, match="block size"):
        other_block.add_request("z", p, GREEDY, kv=frame)
    with pytest.raises(KVFormatError):
        dst.add_request("w", p, GREEDY, kv=frame[:-7])
    with pytest.raises(KVFormatError, match="magic"):
        dst.add_request("v", p, GREEDY, kv=b"XXXX" + frame[4:])
    assert dst.blocks.num_free == free_before and not dst.has_unfinished()


def test_preemption_by_recompute_equals_uninterrupted(tiny_loaded) -> None:
    reqs = {
        f"r{i}": (
            prompt(30 + 9 * i, 20 + i),
            SamplingParams(temperature=0.7, seed=i, max_tokens=40, ignore_eos=True)
            if i % 2
            else SamplingParams(max_tokens=40, ignore_eos=True),
        )
        for i in range(4)
    }
    small = make(tiny_loaded, num_kv_blocks=14)  # 224 slots for ~4 x 80 tokens: must preempt
    outputs = run(small, reqs)
    assert small.scheduler.num_preemptions > 0, "the test must actually preempt"
    for rid, (p, sp) in reqs.items():
        assert outputs[rid] == alone(tiny_loaded, p, sp), rid
    assert small.blocks.num_free == 14
    small.blocks.check()


def test_seed_gives_same_sample_whatever_the_companions(tiny_loaded) -> None:
    target = (
        prompt(20, 30),
        SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True),
    )
    solo = run(make(tiny_loaded), {"t": target})["t"]
    crowd = {
        "t": target,
        **{
            f"o{i}": (
                prompt(10 + 13 * i, 40 + i),
                SamplingParams(
                    temperature=1.0,
                    seed=None if i % 2 else 1000 + i,
                    max_tokens=12,
                    ignore_eos=True,
                ),
            )
            for i in range(4)
        },
    }
    assert run(make(tiny_loaded), crowd)["t"] == solo
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=12, ignore_eos=True)
    assert run(make(tiny_loaded), {"t": (target[0], other_seed)})["t"] != solo


def test_stop_conditions_and_finish_reasons(tiny_loaded) -> None:
    p = prompt(12, 50)
    free_run = alone(tiny_loaded, p, GREEDY)
    stop_at = free_run[3]
    engine = make(tiny_loaded)
    engine.add_request(
        "s",
        p,
        SamplingParams(max_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True),
        hold_kv=True,
    )
    engine.add_request("l", p, SamplingParams(max_tokens=4, ignore_eos=True), hold_kv=True)
    events = []
    while engine.has_unfinished():
        events += engine.step()
    s, long_ = engine.info("s"), engine.info("l")
    assert (
        list(s.token_ids[12:]) == free_run[: free_run.index(stop_at) + 1]
        and s.finish_reason == "stop"
    )
    assert len(long_.token_ids) == 16 and long_.finish_reason == "length"
    finals = [e for e in events if e.finished]
    assert {(e.request_id, e.finish_reason) for e in finals} == {("s", "stop"), ("l", "length")}


def test_eos_finishes_unless_ignored(tiny_loaded) -> None:
    p = prompt(12, 51)
    first = alone(tiny_loaded, p, SamplingParams(max_tokens=1))[0]
    engine = make(tiny_loaded)
    engine.scheduler.eos_token_ids = frozenset({first})  # pretend that token is EOS
    out = run(engine, {"e": (p, SamplingParams(max_tokens=10)), "i": (p, GREEDY)})
    assert out["e"] == [first]
    assert len(out["i"]) == 10 and out["i"][0] == first


def test_abort_frees_every_block(tiny_loaded) -> None:
    engine = make(tiny_loaded, num_kv_blocks=64)
    engine.add_request("a", prompt(100, 60), GREEDY)
    engine.add_request("b", prompt(30, 61), GREEDY)
    engine.step()
    assert engine.blocks.num_free < 64
    ev = engine.abort("a")
    assert ev is not None and ev.finish_reason == "abort"
    engine.abort("b")
    assert engine.blocks.num_free == 64 and not engine.has_unfinished()
    assert engine.abort("a") is None
    engine.blocks.check()


@pytest.mark.parametrize(
    "tokens,match",
    [
        ([], "must not be empty"),
        ([1, 2, 129280], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
    ],
)
def test_invalid_requests_are_refused_and_leave_nothing(tiny_loaded, tokens, match) -> None:
    engine = make(tiny_loaded)
    with pytest.raises(InvalidRequest, match=match):
        engine.add_request("bad", tokens, GREEDY)
    assert not engine.has_unfinished() and engine.blocks.num_free == 512


def test_context_limit_and_duplicate_ids(tiny_loaded) -> None:
    engine = make(tiny_loaded, max_model_len=64)
    with pytest.raises(InvalidRequest, match="context limit"):
        engine.add_request("long", prompt(64), GREEDY)
    engine.add_request(
        "ok", prompt(60), SamplingParams(max_tokens=50, ignore_eos=True), hold_kv=True
    )
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("ok", prompt(3), GREEDY)
    while engine.has_unfinished():
        engine.step()
    info = engine.info("ok")
    assert len(info.token_ids) == 64 and info.finish_reason == "length"


def test_single_block_frames_import_as_one_prefix(tiny_loaded) -> None:
    p = prompt(60, 70)
    full = alone(tiny_loaded, p, GREEDY)
    src = make(tiny_loaded)
    src.add_request("s", p, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    blocks = src.export_blocks("s")
    assert len(blocks) == 3 and blocks[0][1] == b"" and blocks[1][1] == blocks[0][0]
    dst = make(tiny_loaded)
    dst.add_request("d", p, GREEDY, kv=[b[2] for b in blocks[:2]], hold_kv=True)  # a 2-block prefix
    assert dst.info("d").num_cached_tokens == 32
    while dst.has_unfinished():
        dst.step()
    assert list(dst.info("d").token_ids[60:]) == full
    with pytest.raises(KVFormatError, match="contiguous"):
        make(tiny_loaded).add_request("x", p, GREEDY, kv=[blocks[0][2], blocks[2][2]])
    with pytest.raises(MissingPrefix, match="holds only the first 0 blocks") as missing:
        make(tiny_loaded).add_request("x", p, GREEDY, kv=[blocks[1][2]])
    assert missing.value.have == 0


def test_kv_from_a_later_block_builds_on_the_blocks_this_engine_holds(tiny_loaded) -> None:
    """A second turn sends only the blocks the receiver lacks; the receiver's output is the
    same as with the whole KV, and a receiver that lost the prefix says how much it has."""
    p1 = prompt(40, 71)
    p2 = p1 + prompt(40, 72)  # the next turn extends the first
    full = alone(tiny_loaded, p2, GREEDY)
    src, dst = make(tiny_loaded), make(tiny_loaded)
    for engine in (src, dst):  # both computed turn one (dst as the decode of turn one)
        engine.add_request("t1", p1, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
    src.add_request("t2", p2, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    names = chain_hashes(p2[:64], 16)
    have = dst.resident_blocks(names)
    assert have == 2  # turn one's 40 tokens: two full blocks of 16
    frame = src.export_kv("t2", include_partial=True, start_block=have)
    whole = src.export_kv("t2", include_partial=True)
    assert len(frame) < len(whole) * 0.7
    dst.add_request("d", p2, GREEDY, kv=frame, hold_kv=True)
    assert dst.info("d").num_cached_tokens == 79  # the last prompt token is computed to sample
    while dst.has_unfinished():
        dst.step()
    assert list(dst.info("d").token_ids[80:]) == full


def test_peer_kv_copies_from_a_mapped_pool(tiny_loaded, monkeypatch) -> None:
    """Blocks travel by reference to the owner's shared pool (here mapped a second time
    through /proc, as another process on the host maps it) and decode the same tokens."""
    from libs.engine.kv import peer

    p = prompt(50, 73)
    full = alone(tiny_loaded, p, GREEDY)
    src, dst = make(tiny_loaded), make(tiny_loaded)
    src.add_request("s", p, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    ref = src.peer_kv("s")
    assert ref is not None and len(ref.block_ids) == 4 and ref.num_tokens == 50
    monkeypatch.setattr(peer, "_LOCAL", {})  # map it like a stranger would
    dst.add_request("d", p, GREEDY, kv=ref, hold_kv=True)
    src.release("s")
    while dst.has_unfinished():
        dst.step()
    assert list(dst.info("d").token_ids[50:]) == full
    with pytest.raises(KVFormatError, match="chain hash"):
        dst.add_request("x", prompt(50, 74), GREEDY, kv=ref)


def test_refused_import_takes_no_blocks_with_it(tiny_loaded) -> None:
    p = prompt(80, 80)
    src = make(tiny_loaded, num_kv_blocks=64)
    src.add_request("b", p, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    frame = src.export_kv("b", include_partial=True, release=True)  # 5 blocks
    e = make(tiny_loaded, num_kv_blocks=6)
    run(e, {"a": (p[:48], SamplingParams(max_tokens=1))})  # 3 named blocks, free but cached
    e.add_request("c", prompt(20, 81), SamplingParams(max_tokens=100, ignore_eos=True))
    e.step()  # c holds 2 blocks: 4 free, 3 of them the import's prefix hits
    with pytest.raises(NoFreeBlocks):
        e.add_request("b", p + [7], SamplingParams(max_tokens=5), kv=frame)
    e.abort("c")
    assert e.blocks.num_free == 6 and not e.scheduler.requests
    e.blocks.check()


def test_a_request_never_outgrows_the_cache(tiny_loaded) -> None:
    e = make(tiny_loaded, num_kv_blocks=4)  # 64 token slots
    out = run(e, {"a": (prompt(10, 82), SamplingParams(max_tokens=100, ignore_eos=True))})
    assert len(out["a"]) == 64 - 10  # finished with "length" at the cache's size, never stuck
    assert not e.has_unfinished() and e.blocks.num_free == 4


def test_warm_up_leaves_an_engine_that_serves_as_a_fresh_one(tiny_loaded) -> None:
    engine = make(tiny_loaded, num_kv_blocks=64)
    assert engine.warm_up(lengths=(1, 20, 100, 5000)) > 0  # 5000 tokens do not fit: skipped
    assert not engine.has_unfinished() and not engine.scheduler.requests
    assert engine.blocks.num_free == 64
    p = prompt(40, 75)
    assert run(engine, {"a": (p, GREEDY)})["a"] == alone(tiny_loaded, p, GREEDY)


def test_warm_up_runs_follow_up_turns_over_cached_prefixes(tiny_loaded) -> None:
    """Most served steps are prompt chunks over a cached prefix; the warm-up runs them too."""
    engine = make(tiny_loaded, num_kv_blocks=64)
    hits: list[int] = []
    reset = engine.intake.reset_counts
    engine.intake.reset_counts = lambda: (hits.append(engine.prefix_cache_hits), reset())[1]  # type: ignore[method-assign]
    engine.warm_up(lengths=(1, 20, 100))
    # One at a time, 20 and 100 find their own 1 + 6 full blocks of 16 from the first round;
    # as turns, 20 + 100 finds 20's block and 100 + 1 finds 100's six: 112 tokens each time.
    assert hits == [112 + 112]


def test_a_burst_over_one_system_prompt_computes_it_once_and_answers_as_alone(
    tiny_loaded,
) -> None:
    system = prompt(64, 5)  # four full blocks of 16
    reqs = {f"r{i}": (system + prompt(9 + i, 6 + i), GREEDY) for i in range(3)}
    engine = make(tiny_loaded)
    out = run(engine, reqs)
    assert engine.prefix_cache_hits == 2 * 64  # the second and third found it cached
    for rid, (p, sp) in reqs.items():
        assert out[rid] == alone(tiny_loaded, p, sp)


def test_signed_frames_import_and_forged_ones_never_do(tiny_loaded) -> None:
    """With a MAC key, exported frames carry a MAC over header and bytes; an engine with the
    key imports them, and refuses frames that are unsigned, altered, or signed by another key."""
    from libs.engine.engine import KVIntegrityError

    key = b"serving-tier-secret"
    p = prompt(40, 76)
    src = make(tiny_loaded, kv_mac_key=key)
    src.add_request("s", p, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    blocks = [b[2] for b in src.export_blocks("s")]
    assert decode_frame(blocks[0])[0].mac
    dst = make(tiny_loaded, kv_mac_key=key)
    dst.add_request("ok", p, GREEDY, kv=blocks, hold_kv=True)
    assert dst.info("ok").num_cached_tokens == 32
    altered = bytearray(blocks[1])
    altered[-1] ^= 1
    plain = make(tiny_loaded)  # an engine without the key signs nothing
    plain.add_request("s", p, SamplingParams(max_tokens=1), hold_kv=True)
    while plain.has_unfinished():
        plain.step()
    foreign = make(tiny_loaded, kv_mac_key=b"someone else")
    foreign.add_request("s", p, SamplingParams(max_tokens=1), hold_kv=True)
    while foreign.has_unfinished():
        foreign.step()
    for name, frames in (
        ("altered", [blocks[0], bytes(altered)]),
        ("unsigned", [b[2] for b in plain.export_blocks("s")]),
        ("foreign", [b[2] for b in foreign.export_blocks("s")]),
    ):
        with pytest.raises(KVIntegrityError):
            dst.add_request(name, p, GREEDY, kv=frames)


# -- sampling features: each changes what the caller gets ----------------------------------------


def test_min_tokens_holds_back_a_stop_that_greedy_would_emit(tiny_loaded) -> None:
    p = prompt(12, 60)
    first = alone(tiny_loaded, p, GREEDY)[0]
    stop = SamplingParams(max_tokens=10, stop_token_ids=(first,), ignore_eos=True)
    assert alone(tiny_loaded, p, stop) == [first]
    held = alone(tiny_loaded, p, dataclasses.replace(stop, min_tokens=3))
    assert first not in held[:3] and len(held) >= 4
    engine = make(tiny_loaded)
    engine.scheduler.eos_token_ids = frozenset({first})  # pretend that token is EOS
    engine.sampler.eos_token_ids = (first,)
    out = run(
        engine,
        {
            "eos": (p, SamplingParams(max_tokens=10)),
            "min": (p, SamplingParams(max_tokens=10, min_tokens=4)),
            "ign": (p, SamplingParams(max_tokens=6, ignore_eos=True)),
        },
    )
    assert out["eos"] == [first]
    assert first not in out["min"][:4] and len(out["min"]) >= 5
    assert len(out["ign"]) == 6 and out["ign"][0] == first  # ignore_eos: exactly max_tokens


def test_penalties_steer_greedy_away_from_repeats_in_any_batch(tiny_loaded) -> None:
    p = prompt(9, 61)
    plain = alone(tiny_loaded, p, SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself: something to steer
    pen = SamplingParams(
        max_tokens=24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    )
    got = alone(tiny_loaded, p, pen)
    assert got != plain
    assert len(set(got)) > len(set(plain))
    # The same tokens alone, batched with others, and without overlap (where the newest token
    # is on the host): the history read from the step in flight is the true one.
    batched = run(make(tiny_loaded), {"x": (p, pen), **REQS})["x"]
    sync = alone(tiny_loaded, p, pen, overlap=False)
    assert got == batched == sync
    rep_only = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=5.0)
    rep = alone(tiny_loaded, p, rep_only)
    assert rep != plain and len(set(rep)) > len(set(plain))


def test_prior_outputs_count_as_output_for_the_penalties(tiny_loaded) -> None:
    """A decode after prefill gets the first token inside its prompt: with ``prior_outputs``
    the presence/frequency penalties still see it as output, as one engine does."""
    p = prompt(9, 61)
    # Negative: each use of a token raises it by 4, so counting the first token or not shows.
    pen = SamplingParams(
        max_tokens=24, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0
    )
    whole = alone(tiny_loaded, p, pen)
    rest = dataclasses.replace(pen, max_tokens=23)
    engine = make(tiny_loaded)
    engine.add_request("d", [*p, whole[0]], rest, prior_outputs=1)
    out = []
    while engine.has_unfinished():
        out += [ev.token_id for ev in engine.step() if ev.token_id is not None]
    assert out == whole[1:]
    as_prompt = run(make(tiny_loaded), {"d": ([*p, whole[0]], rest)})["d"]
    assert as_prompt != out  # counted as prompt, the first token gets no boost
