"""Prompt chunks interleave by tenant (issue 33 item 4): a short prompt of one tenant is not
stuck behind another tenant's long prefill; one tenant is served exactly as before."""

from __future__ import annotations

import random

import pytest

from libs.common.sampling import SamplingParams
from libs.engine.cost_model import CostModel
from libs.engine.engine import Engine, EngineConfig
from libs.engine.intake import InvalidRequest
from libs.engine.kv.block_manager import BlockManager
from libs.engine.prefill_fairness import Demand, FairScheduler, PrefillFairness, fair_shares
from libs.engine.presets import PRESETS
from libs.engine.scheduler import Request, Scheduler, SchedulerConfig, StepPlan

A, B, C = b"tenant-a", b"tenant-b", b"tenant-c"


def cost() -> CostModel:
    return CostModel.for_model(PRESETS["v3-slice"], 2, 2, flop_rate=5e14, byte_rate=4e12)


def sched(
    cls: type[Scheduler] = FairScheduler, blocks: int = 4096, block_size: int = 128, **kw
) -> Scheduler:
    cfg = SchedulerConfig(**{"time_budget_s": None, **kw})
    return cls(cfg, BlockManager(blocks, block_size), cost(), (1,))


def req(rid: str, n: int, salt: bytes, max_tokens: int = 4, weight: float = 1.0) -> Request:
    r = Request(
        rid,
        list(range(10, 10 + n)),
        n,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        cache_salt=salt,
    )
    r.weight = weight
    return r


def drive(s: Scheduler, plan: StepPlan, token: int = 7) -> None:
    s.update(plan, {q.request_id: token for q in plan.seqs if q.sample})


def chunks(plan: StepPlan) -> dict[str, int]:
    return {q.request_id: q.num_tokens for q in plan.seqs}


# -- the policy ------------------------------------------------------------------------------
def test_fair_shares_give_small_demands_all_and_split_the_rest_by_weight() -> None:
    d = {A: Demand(30000), B: Demand(6), C: Demand(30000, weight=3.0)}
    assert fair_shares(d, 4096) == {B: 6, A: 1023, C: 3067}
    assert sum(fair_shares({A: Demand(10), B: Demand(20)}, 4096).values()) == 30
    with pytest.raises(ValueError, match="weight must be positive"):
        Demand(10, weight=0.0)


def test_an_arriving_tenant_starts_level_and_smaller_demands_break_ties() -> None:
    f = PrefillFairness(min_share=128)
    turns = f.turns({A: Demand(30000), C: Demand(30000)}, 4096)
    assert [(t.tenant, t.share) for t in turns] == [(A, 2048), (C, 2048)]
    f.charge(A, 2048)
    f.charge(C, 1000)  # C got less (out of time): it goes first next step
    assert [t.tenant for t in f.turns({A: Demand(1), C: Demand(1)}, 4096)] == [C, A]
    f.charge(C, 1048)
    # B arrives: level with the least served, so its smaller demand puts it first
    assert [t.tenant for t in f.turns({A: Demand(9), B: Demand(6), C: Demand(9)}, 4096)][0] == B


def test_shares_are_at_least_a_block_while_there_is_room() -> None:
    f = PrefillFairness(min_share=128)
    demands = {bytes([i]): Demand(1000) for i in range(40)}
    turns = f.turns(demands, 4096)
    assert [t.share for t in turns] == [128] * 32  # the other 8 go first next step


# -- the scheduler ---------------------------------------------------------------------------
@pytest.mark.parametrize("time_budget_s", [None, 0.05])
def test_short_prompt_of_another_tenant_is_done_in_the_next_step(time_budget_s) -> None:
    s = sched(max_tokens_per_step=8192, time_budget_s=time_budget_s)
    s.add(req("long", 30000, A))
    first = s.schedule()
    drive(s, first)
    s.add(req("short", 6, B))
    plan = s.schedule()
    got = {q.request_id: q for q in plan.seqs}
    assert got["short"].num_tokens == 6 and got["short"].sample  # its first token this step
    assert got["long"].num_tokens >= 128  # and the long prompt went on beside it
    drive(s, plan)
    assert s.requests["long"].num_computed < 30000  # still being chunked


def test_plain_fifo_keeps_the_short_prompt_waiting_behind_the_long_one() -> None:
    """What the fairness changes: the same steps with one tenant (or the plain scheduler)."""
    for cls, salt in ((FairScheduler, A), (Scheduler, B)):
        s = sched(cls, max_tokens_per_step=8192)
        s.add(req("long", 30000, A))
        drive(s, s.schedule())
        s.add(req("short", 6, salt))
        assert "short" not in chunks(s.schedule())


def test_one_tenant_is_scheduled_step_for_step_as_before() -> None:
    rng = random.Random(5)
    kw = dict(blocks=64, block_size=16, max_tokens_per_step=256, max_running=6)
    plain, fair = sched(Scheduler, **kw), sched(FairScheduler, **kw)
    steps = 0
    while steps < 2000:
        if steps < 60 and rng.random() < 0.4:
            n, m = rng.choice([5, 40, 200, 500]), rng.randint(1, 200)
            for s in (plain, fair):
                s.add(req(f"r{steps}", n, A, max_tokens=m))
        p, f = plain.schedule(), fair.schedule()
        assert p == f, f"step {steps}"
        if steps >= 60 and p.empty and not plain.has_unfinished():
            break
        drive(plain, p)
        drive(fair, f)
        steps += 1
    assert plain.num_preemptions > 0  # the run went through preemption too
    assert not fair.has_unfinished()


def test_within_a_tenant_no_request_overtakes_an_older_one() -> None:
    s = sched(max_tokens_per_step=4096)
    s.add(req("a1", 20000, A))
    s.add(req("a2", 50, A))
    s.add(req("b1", 20000, B))
    while "a2" not in (got := chunks(plan := s.schedule())):
        assert got["b1"] >= 2048  # the other tenant goes on meanwhile
        drive(s, plan)
    assert s.requests["a1"].num_computed + got.get("a1", 0) >= 20000  # a1's prompt is done


def test_long_prompt_is_never_starved_by_a_stream_of_short_ones() -> None:
    s = sched(max_tokens_per_step=4096)
    s.add(req("long", 30000, A))
    for step in range(40):
        s.add(req(f"b{step}", 1000, B, max_tokens=2))
        s.add(req(f"c{step}", 700, C, max_tokens=2))
        plan = s.schedule()
        left = 30000 - s.requests["long"].num_computed
        assert chunks(plan).get("long", 0) >= min(1300, left)
        drive(s, plan)
        if "long" not in s.requests or s.requests["long"].num_output_tokens:
            break
    assert step < 25  # 30,000 tokens at >= a third of 4,096 per step


def test_two_long_prompts_share_every_step_by_weight() -> None:
    s = sched(max_tokens_per_step=4096)
    s.add(req("a", 20000, A, weight=1.0))
    s.add(req("c", 20000, C, weight=3.0))
    for _ in range(3):
        plan = s.schedule()
        assert chunks(plan) == {"a": 1024, "c": 3072}
        drive(s, plan)


def test_under_the_time_budget_two_long_prompts_share_each_step() -> None:
    s = sched(max_tokens_per_step=32768, time_budget_s=0.05)
    s.add(req("a", 30000, A))
    s.add(req("c", 30000, C))
    for _ in range(3):
        plan = s.schedule()
        got = chunks(plan)
        assert min(got.values()) >= 0.4 * max(got.values())  # about half the step each
        assert s.cost.seconds(plan.shape) <= 0.05 * 1.05  # and the step stays in its budget
        drive(s, plan)


def test_decodes_are_scheduled_first_whatever_the_tenants() -> None:
    s = sched(max_tokens_per_step=2048)
    s.add(req("d", 10, C, max_tokens=50))
    drive(s, s.schedule())
    s.add(req("a", 20000, A))
    s.add(req("b", 20000, B))
    for _ in range(4):
        plan = s.schedule()
        assert plan.seqs[0].request_id == "d" and plan.seqs[0].num_tokens == 1
        got = chunks(plan)
        assert min(got["a"], got["b"]) >= 1023 and plan.num_tokens == 2048
        drive(s, plan)


# -- the engine (tiny model, CPU) --------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_gives_another_tenant_its_first_token_while_a_long_prompt_is_chunked(
    tiny_loaded, overlap
) -> None:
    def engine() -> Engine:
        cfg = EngineConfig(
            model="tiny",
            block_size=16,
            num_kv_blocks=128,
            time_budget_s=None,
            max_tokens_per_step=32,
            overlap=overlap,
        )
        return Engine(cfg, loaded=tiny_loaded)

    e = engine()
    e.add_request("long", prompt(512, 1), GREEDY, cache_salt=A)  # 16 steps of 32 tokens
    e.step()
    e.add_request("short", prompt(6, 2), GREEDY, cache_salt=B)
    first: int | None = None
    for step in range(1, 4):
        got = [ev.token_id for ev in e.step() if ev.request_id == "short" and ev.token_id]
        if got:
            first = got[0]
            break
    assert first is not None, "no token for the other tenant's request in 3 steps"
    assert e.info("long").num_computed_tokens < 512  # the long prompt is still being chunked
    alone = engine()
    alone.add_request("short", prompt(6, 2), GREEDY, cache_salt=B)
    want = None
    while want is None:
        want = next((ev.token_id for ev in alone.step() if ev.token_id is not None), None)
    assert first == want  # and it is the token the request gets alone


def test_engine_shares_prompt_tokens_by_the_tenants_weights(tiny_loaded) -> None:
    """The weight the entrypoint sends (``--tenant-weights``) reaches the engine's request:
    64 prompt tokens a step split 16 / 48 between tenants weighted 1 and 3."""
    cfg = EngineConfig(
        model="tiny", block_size=16, num_kv_blocks=256, time_budget_s=None, max_tokens_per_step=64
    )
    e = Engine(cfg, loaded=tiny_loaded)
    e.add_request("a", prompt(1024, 1), GREEDY, cache_salt=A)
    e.add_request("c", prompt(1024, 3), GREEDY, cache_salt=C, weight=3.0)
    for _ in range(2):
        e.step()
    assert (e.info("a").num_computed_tokens, e.info("c").num_computed_tokens) == (32, 96)
    with pytest.raises(InvalidRequest, match="weight must be a positive number"):
        e.add_request("z", prompt(8, 4), GREEDY, cache_salt=B, weight=0.0)


async def test_the_entrypoint_sends_each_tenants_weight_with_its_prefill_task() -> None:
    from .test_entrypoint_handlers import FakeBus, collect, make, req

    bus = FakeBus()
    h = make(bus, tenant_weights={"acme": 3.0})
    await collect(h, req([1, 2, 3], tenant="acme"))
    await collect(h, req([1, 2, 3], tenant="globex"))  # unlisted: 1
    assert [t.tenant_weight for t in bus.tasks()] == [3.0, 1.0]
