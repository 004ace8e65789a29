"""Balancer routing rules: buckets, cache locality against load, decode by KV memory, ties,
replica consistency, bucket reassignment as demand shifts."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from libs.common.hashchain import chain_hashes
from libs.proto.deepserve.v1 import control_pb2
from libs.routing import buckets as bk
from libs.routing.policy import DECODE, PREFILL, REQUEST_WORK_TOKENS, Instance, RoutingPolicy
from services.balancer.handlers import BalancerHandlers

from .test_balancer_policy import FakeClock, decode, prefill

K = 1024


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def hashes(n: int, seed: int = 0) -> list[bytes]:
    return chain_hashes([seed] * (n * 128), 128)


def resident(hs: list[bytes]) -> frozenset[bytes]:
    return frozenset(h[:8] for h in hs)


def make(clock: FakeClock, *insts: Instance, **kw: object) -> RoutingPolicy:
    p = RoutingPolicy(clock=clock, **kw)  # type: ignore[arg-type]
    for i in insts:
        p.observe(i)
    return p


def test_bucket_of_and_names() -> None:
    b = bk.DEFAULT_BOUNDS
    assert [bk.bucket_of(n, b) for n in (0, 16 * K - 1, 16 * K, 64 * K, 256 * K, 10**7)] == [
        0,
        0,
        1,
        2,
        3,
        3,
    ]
    assert bk.bucket_names(b) == ["<16K", "16K-64K", "64K-256K", ">=256K"]
    assert bk.parse_bounds("1000,2000") == (1000, 2000)
    with pytest.raises(ValueError, match="increasing"):
        bk.parse_bounds("2000,1000")


def test_shares_follow_demand_and_cover_every_busy_bucket() -> None:
    assert bk.shares([90, 10, 0, 0], 4) == [3, 1, 0, 0]
    assert bk.shares([1, 1, 1, 1], 2) == [1, 1, 0, 0]  # fewer instances than busy buckets
    assert bk.shares([0, 0, 0, 0], 3) == [0, 0, 0, 0]  # no demand: everyone serves anything
    assert sum(bk.shares([5, 3, 2, 1], 10)) == 10


def test_requests_go_to_the_instances_of_their_bucket() -> None:
    clock = FakeClock()
    p = make(clock, *(prefill(f"p{i}") for i in range(4)), decode("d1"))
    for i in range(20):  # establish demand in two buckets
        p.route(model="m", request_id=f"w{i}", prompt_tokens=1000 if i % 2 else 100 * K)
    clock.now += 11  # next re-evaluation
    for i in range(4):
        p.observe(prefill(f"p{i}"))
    p.observe(decode("d1"))
    assign = p.assignment("m")
    assert sorted(Counter(assign.values()).items()) == [(0, 1), (2, 3)]  # tokens: 100K >> 1K
    short = {
        p.route(model="m", request_id=f"s{i}", prompt_tokens=500).prefill.instance_id
        for i in range(8)
    }
    long = {
        p.route(model="m", request_id=f"l{i}", prompt_tokens=80 * K).prefill.instance_id
        for i in range(8)
    }
    assert short == {i for i, b in assign.items() if b == 0}
    assert long == {i for i, b in assign.items() if b == 2}
    # A bucket nobody serves still gets an answer (from any instance), never a refusal.
    assert p.route(model="m", request_id="x", prompt_tokens=300 * K).bucket == 3


def test_buckets_move_as_demand_shifts() -> None:
    clock = FakeClock()
    p = make(clock, *(prefill(f"p{i}") for i in range(4)), decode("d1"), demand_half_life=5.0)
    for i in range(10):
        p.route(model="m", request_id=f"a{i}", prompt_tokens=1000)
    clock.now += 11
    for j in range(4):
        p.observe(prefill(f"p{j}"))
    p.observe(decode("d1"))
    assert set(p.assignment("m").values()) == {0}
    for t in range(6):  # long prompts take over
        clock.now += 5
        for i in range(10):
            p.observe(decode("d1"))
            for j in range(4):
                p.observe(prefill(f"p{j}"))
            p.route(model="m", request_id=f"b{t}.{i}", prompt_tokens=40 * K)
    counts = Counter(p.assignment("m").values())
    assert counts[1] >= 3 and counts[0] <= 1


def test_a_long_resident_prefix_beats_a_shorter_queue(clock: FakeClock) -> None:
    hs = hashes(100)  # 12,800-token prefix
    p = make(
        clock,
        prefill("p1", resident=resident(hs), queued_tokens=4000),
        prefill("p2", queued_tokens=0),
        decode("d1"),
    )
    d = p.route(model="m", request_id="r", prompt_tokens=13000, block_hashes=hs)
    assert d.prefill.instance_id == "p1" and d.resident_blocks == 100


def test_load_wins_when_the_cache_saves_less_than_the_queue_costs(clock: FakeClock) -> None:
    hs = hashes(10)  # 1,280 tokens resident on p1, but 8,000 queued there
    p = make(
        clock,
        prefill("p1", resident=resident(hs), queued_tokens=8000),
        prefill("p2", queued_tokens=0),
        decode("d1"),
    )
    assert (
        p.route(model="m", request_id="r", prompt_tokens=2000, block_hashes=hs).prefill.instance_id
        == "p2"
    )


def test_equal_caches_go_to_the_shorter_queue(clock: FakeClock) -> None:
    hs = hashes(20)
    r = resident(hs)
    p = make(
        clock,
        prefill("p1", resident=r, queued_tokens=3000),
        prefill("p2", resident=r, queued_tokens=500),
        decode("d1"),
    )
    assert (
        p.route(model="m", request_id="r", prompt_tokens=3000, block_hashes=hs).prefill.instance_id
        == "p2"
    )


def test_only_the_leading_run_counts(clock: FakeClock) -> None:
    hs = hashes(30)
    p = make(
        clock,
        prefill("p1", resident=resident(hs[1:])),  # everything but block 0
        prefill("p2", resident=resident(hs[:5])),
        decode("d1"),
    )
    assert (
        p.route(model="m", request_id="r", prompt_tokens=3840, block_hashes=hs).prefill.instance_id
        == "p2"
    )


def test_decode_goes_to_the_most_free_kv_memory(clock: FakeClock) -> None:
    p = make(
        clock,
        prefill("p1"),
        decode("d1", free_kv_blocks=100, total_kv_blocks=1000),
        decode("d2", free_kv_blocks=900, total_kv_blocks=1000, running=30),
        decode("d3", free_kv_blocks=500, total_kv_blocks=1000),
    )
    assert p.route(model="m", request_id="r").decode.instance_id == "d2"


def test_decode_counts_free_blocks_its_requests_will_still_grow_into_as_taken(
    clock: FakeClock,
) -> None:
    p = make(
        clock,
        prefill("p1"),
        decode("d1", free_kv_blocks=900, total_kv_blocks=1000, promised_kv_blocks=600),
        decode("d2", free_kv_blocks=500, total_kv_blocks=1000, promised_kv_blocks=0),
    )
    assert p.route(model="m", request_id="r").decode.instance_id == "d2"


def test_decode_with_equal_memory_goes_to_fewer_running(clock: FakeClock) -> None:
    p = make(
        clock,
        prefill("p1"),
        decode("d1", free_kv_blocks=500, total_kv_blocks=1000, running=9),
        decode("d2", free_kv_blocks=505, total_kv_blocks=1000, running=3),
    )
    assert p.route(model="m", request_id="r").decode.instance_id == "d2"


def test_ties_never_pile_onto_one_instance(clock: FakeClock) -> None:
    p = make(
        clock,
        *(prefill(f"p{i}") for i in range(5)),
        *(decode(f"d{i}", free_kv_blocks=64, total_kv_blocks=64) for i in range(3)),
    )
    firsts = Counter()
    for burst in range(40):  # a fresh heartbeat before every request: nothing routed counts
        for i in range(5):
            p.observe(prefill(f"p{i}"))
        firsts[p.route(model="m", request_id=f"q{burst}").prefill.instance_id] += 1
    assert len(firsts) == 5 and max(firsts.values()) <= 16  # the request hash spreads them


def test_replicas_with_the_same_heartbeats_choose_identically() -> None:
    hs = hashes(8)
    insts = [
        prefill("p1", resident=resident(hs[:4])),
        prefill("p2", resident=resident(hs[:4])),
        prefill("p3", queued_tokens=256),
        decode("d1", free_kv_blocks=10, total_kv_blocks=20),
        decode("d2", free_kv_blocks=10, total_kv_blocks=20),
    ]
    a, b = make(FakeClock(), *insts), make(FakeClock(), *reversed(insts))
    # Heartbeats in a different order, the same requests: the same choices. (A replica that
    # answered one request more would differ until that work decays: recent work counts.)
    for p in (a, b):
        p.route(model="m", request_id="warm", prompt_tokens=0)
        p.observe(insts[0]), p.observe(insts[3])
    for i in range(12):
        kw = {
            "model": "m",
            "request_id": f"req-{i}",
            "prompt_tokens": 1024 + 37 * i,
            "block_hashes": hs,
        }
        da, db = a.route(**kw), b.route(**kw)  # type: ignore[arg-type]
        assert (da.prefill.instance_id, da.decode.instance_id) == (
            db.prefill.instance_id,
            db.decode.instance_id,
        )


def test_exclude_and_liveness_still_hold_with_locality(clock: FakeClock) -> None:
    hs = hashes(50)
    p = make(clock, prefill("p1", resident=resident(hs)), prefill("p2"), decode("d1"), decode("d2"))
    assert (
        p.route(model="m", request_id="r", prompt_tokens=6400, block_hashes=hs).prefill.instance_id
        == "p1"
    )
    assert (
        p.route(
            model="m", request_id="r", prompt_tokens=6400, block_hashes=hs, exclude=["p1"]
        ).prefill.instance_id
        == "p2"
    )
    clock.now += 2
    p.observe(prefill("p2")), p.observe(decode("d2"))
    clock.now += 1.5  # p1 silent for 3.5 s: dead however good its cache
    d = p.route(model="m", request_id="r", prompt_tokens=6400, block_hashes=hs)
    assert (d.prefill.instance_id, d.decode.instance_id) == ("p2", "d2")


def test_handler_passes_lengths_hashes_and_resident_prefixes(clock: FakeClock) -> None:
    hs = hashes(20)
    h = BalancerHandlers(RoutingPolicy(clock=clock))
    for name, res in (("p1", []), ("p2", [x[:8] for x in hs])):
        h.on_heartbeat(
            control_pb2.InstanceStatus(
                instance_id=name,
                role=control_pb2.ROLE_PREFILL,
                model="m",
                queued_tokens=100,
                resident_prefixes=res,
            ).SerializeToString()
        )
    h.on_heartbeat(
        control_pb2.InstanceStatus(
            instance_id="d1", role=control_pb2.ROLE_DECODE, model="m", address="h:1"
        ).SerializeToString()
    )
    req = control_pb2.RouteRequest(request_id="r", model="m", prompt_tokens=2560, block_hashes=hs)
    d = control_pb2.RouteDecision.FromString(h.on_route(req.SerializeToString()))
    assert d.prefill_instance == "p2" and not d.error
    assert {i.role for i in h.policy.live()} == {PREFILL, DECODE}


def test_a_rare_short_bucket_shares_the_next_bucket_and_rare_long_ones_keep_their_own() -> None:
    # < 16K is 1% of the tokens next to a busy 16K-64K: it holds no instance of its own.
    assert bk.shares([1, 99, 0, 0], 8) == [0, 8, 0, 0]
    # Next to an idle bucket it keeps one (short prompts never wait behind 100K ones) ...
    assert bk.shares([1, 0, 99, 0], 8) == [1, 0, 7, 0]
    # ... and so do rare long buckets: documents stay apart from everything shorter.
    assert bk.shares([60, 38, 1, 1], 8)[2:] == [1, 1]


def test_rare_short_prompts_go_to_the_next_buckets_instances() -> None:
    clock = FakeClock()
    p = make(clock, *(prefill(f"p{i}") for i in range(4)), decode("d1"))
    for i in range(40):  # 1 short prompt in 20: ~0.2% of the tokens
        p.route(model="m", request_id=f"w{i}", prompt_tokens=1000 if i % 20 == 0 else 40 * K)
    clock.now += 11
    for i in range(4):
        p.observe(prefill(f"p{i}"))
    p.observe(decode("d1"))
    assert set(p.assignment("m").values()) == {1}
    short = {
        p.route(model="m", request_id=f"s{i}", prompt_tokens=500).prefill.instance_id
        for i in range(8)
    }
    assert len(short) == 4  # spread over the 16K-64K instances, not one idling for them


def _hot_tenant(p: RoutingPolicy, n: int) -> Counter[str]:
    """``n`` new sessions of one tenant whose 5,120-token system prompt only p0 holds."""
    hs = hashes(40)
    work: Counter[str] = Counter()
    for i in range(n):
        p.observe(prefill("p0", resident=resident(hs)))  # fresh heartbeats: no queue anywhere
        for j in range(1, 4):
            p.observe(prefill(f"p{j}"))
        d = p.route(model="m", request_id=f"s{i}", prompt_tokens=7000, block_hashes=hs)
        work[d.prefill.instance_id] += 7000 - 128 * d.resident_blocks + REQUEST_WORK_TOKENS
    return work


def test_a_hot_tenant_no_longer_piles_onto_the_instance_holding_its_prefix(
    clock: FakeClock,
) -> None:
    hot = RoutingPolicy(clock=clock, load_cap=math.inf, load_weight=0.0)
    hot.observe(decode("d1"))
    assert set(_hot_tenant(hot, 40)) == {"p0"}  # locality alone: everything on p0
    capped = RoutingPolicy(clock=clock)  # defaults: load_cap 1.15
    capped.observe(decode("d1"))
    work = _hot_tenant(capped, 40)
    mean = sum(work.values()) / 4
    one = 7000 + REQUEST_WORK_TOKENS  # the cap is checked before a request lands
    assert len(work) == 4 and max(work.values()) <= capped.load_cap * mean + one
    assert work.most_common(1)[0][0] == "p0"  # its prefix still makes p0 the first choice


def test_locality_still_wins_when_load_is_even(clock: FakeClock) -> None:
    hs = hashes(100)
    p = make(clock, *(prefill(f"p{i}") for i in range(4)), decode("d1"))
    for i in range(4):  # the same work on each instance: nothing to price
        assert p.route(model="m", request_id=f"e{i}", prompt_tokens=4000).prefill
    p.observe(prefill("p2", resident=resident(hs)))
    d = p.route(model="m", request_id="r", prompt_tokens=13000, block_hashes=hs)
    assert d.prefill.instance_id == "p2" and d.resident_blocks == 100


def test_a_session_whose_context_is_resident_stays_on_an_instance_above_the_mean(
    clock: FakeClock,
) -> None:
    hs = hashes(300)  # 38,400 tokens of one session, resident on p1
    p = make(clock, prefill("p1", resident=resident(hs)), prefill("p2"), decode("d1"))
    p.route(model="m", request_id="a", prompt_tokens=3000, exclude=["p2"])
    p.route(model="m", request_id="b", prompt_tokens=2400, exclude=["p1"])
    # p1 has done 1.1x the mean (under the 1.15 cap). The price of that, 2 x 38,600 x 0.1 =
    # 7.5K tokens, is less than recomputing the 38K resident ones elsewhere: it stays.
    d = p.route(model="m", request_id="r", prompt_tokens=38600, block_hashes=hs)
    assert d.prefill.instance_id == "p1"


def test_bad_load_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="load_cap"):
        RoutingPolicy(load_cap=0.9)
    with pytest.raises(ValueError, match="load_weight"):
        RoutingPolicy(load_weight=-1)
    with pytest.raises(ValueError, match="load_half_life"):
        RoutingPolicy(load_half_life=0)


def test_balancer_flags_reach_the_policy_knobs() -> None:
    from services.balancer.config import build_parser, config_from

    cfg = config_from(build_parser().parse_args(["--load-cap", "inf", "--load-weight", "0"]))
    assert (cfg.load_cap, cfg.load_weight) == (math.inf, 0.0)
    with pytest.raises(ValueError, match="--load-cap"):
        config_from(build_parser().parse_args(["--load-cap", "0.5"]))
