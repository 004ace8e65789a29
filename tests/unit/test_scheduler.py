"""The scheduler as a pure step function (no model): budgets, chunking, cost calibration."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from libs.common.sampling import SamplingParams
from libs.engine.cost_model import CostModel, StepShape
from libs.engine.kv.block_manager import BlockManager
from libs.engine.presets import PRESETS
from libs.engine.scheduler import Request, Scheduler, SchedulerConfig, Status, StepPlan


def cost() -> CostModel:
    return CostModel.for_model(PRESETS["v3-slice"], 2, 2, flop_rate=5e14, byte_rate=4e12)


def sched(**kw) -> Scheduler:
    cfg = SchedulerConfig(**{"time_budget_s": None, **kw})
    return Scheduler(cfg, BlockManager(4096, 128), cost(), (1,))


def req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(
        rid, list(range(10, 10 + n)), n, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def drive(s: Scheduler, plan, token: int = 7, seconds: float | None = None):
    return s.update(plan, {q.request_id: token for q in plan.seqs if q.sample}, seconds)


def test_token_budget_chunks_a_long_prompt() -> None:
    s = sched(max_tokens_per_step=1000)
    s.add(req("a", 2500))
    sizes = []
    while s.has_unfinished():
        plan = s.schedule()
        sizes.append(plan.num_tokens)
        drive(s, plan)
    assert sizes[:3] == [1000, 1000, 500] and sizes[3:] == [1, 1, 1]


def test_decodes_go_first_and_prompts_fill_the_rest() -> None:
    s = sched(max_tokens_per_step=300)
    s.add(req("a", 100, max_tokens=10))
    drive(s, s.schedule())
    s.add(req("b", 1000))
    plan = s.schedule()
    assert [(q.request_id, q.num_tokens) for q in plan.seqs] == [("a", 1), ("b", 299)]


def test_time_budget_limits_prefill_tokens_by_the_cost_model() -> None:
    s = sched(max_tokens_per_step=32768, time_budget_s=0.05)
    s.add(req("a", 32000))
    plan = s.schedule()
    n = plan.num_tokens
    assert 128 <= n < 32000
    assert s.cost.seconds(plan.shape) <= 0.05 < s.cost.seconds(StepShape(((n + 256, n + 256),)))


def test_measured_slow_steps_shrink_the_next_chunk() -> None:
    s = sched(max_tokens_per_step=32768, time_budget_s=0.05)
    s.add(req("a", 32000))
    first = s.schedule()
    predicted = s.cost.seconds(first.shape)
    drive(s, first, seconds=predicted * 4)  # the machine is 4x slower than assumed
    second = s.schedule()
    assert second.num_tokens < first.num_tokens * 0.5
    assert 3.0 < s.cost.scale < 5.0


def test_prefix_admission_never_counts_the_last_token() -> None:
    s = sched()
    s.add(req("a", 256, max_tokens=1))
    while s.has_unfinished():
        drive(s, s.schedule())
    s.add(req("b", 256, max_tokens=1))  # same tokens: both blocks cached, but one must run
    plan = s.schedule()
    (q,) = plan.seqs
    assert q.start == 128 and q.num_tokens == 128 and s.requests["b"].num_cached_tokens == 128


def test_a_burst_over_one_prefix_computes_it_once() -> None:
    """Requests that arrive together over a shared uncomputed prefix: the first computes it,
    the others wait one step and find it cached (not each its own copy in the same step)."""
    s = sched(max_tokens_per_step=8192)
    shared = list(range(10, 10 + 256))  # two full blocks of 128
    for i, rid in enumerate("abc"):
        tail = [1000 + 100 * i + j for j in range(50)]
        s.add(Request(rid, shared + tail, 306, SamplingParams(max_tokens=2, ignore_eos=True)))
    other = list(range(5000, 5300))  # nothing shared: not held back by their prefix...
    s.add(Request("other", other, 300, SamplingParams(max_tokens=2, ignore_eos=True)))
    first = s.schedule()
    # ...but starts after them, in arrival order: b waits, and so does everything behind it.
    assert [q.request_id for q in first.seqs] == ["a"]
    drive(s, first)
    second = s.schedule()
    starts = {q.request_id: (q.start, q.num_tokens) for q in second.seqs}
    assert starts["b"] == (256, 50) and starts["c"] == (256, 50) and starts["other"] == (0, 300)
    assert s.requests["b"].num_cached_tokens == 256


def test_max_running_caps_the_batch() -> None:
    s = sched(max_running=2)
    for i in range(4):
        s.add(req(f"r{i}", 10))
    assert len(s.schedule().seqs) == 2


def test_cost_model_counts_expert_bytes_by_distinct_experts() -> None:
    c = cost()
    one = c.bytes(StepShape(((1, 1),)))
    many = c.bytes(StepShape(((4096, 4096),)))
    # one token touches 8 of 256 experts per layer; 4096 tokens touch nearly all of them
    expert_all = c.num_moe_layers * c.num_experts * c.expert_bytes
    assert one < c.dense_weight_bytes + 0.05 * expert_all
    assert many > c.dense_weight_bytes + 0.99 * expert_all


def test_one_more_sequence_is_priced_as_the_built_shape() -> None:
    """seconds_with_counts (speculative decoding's draft counts, all at once from the shape's
    totals) equals pricing the shape with the sequence added, decode-sized and prompt-sized,
    calibrated or not."""
    c = cost()
    base = StepShape(tuple((1, 100 + 7 * i) for i in range(64))).add(300, 900)
    qs = [1, 3, 512]
    for scale in (1.0, 2.5):
        c.scale = scale
        for ctx in (50, 2049, 4096):
            got = c.seconds_with_counts(base, np.asarray(qs), ctx).tolist()
            assert got == pytest.approx([c.seconds(base.add(q, ctx)) for q in qs], rel=1e-12)
    one = c.seconds_with_counts(StepShape(), np.asarray([1]), 1)[0]
    assert one == pytest.approx(c.seconds(StepShape(((1, 1),))), rel=1e-12)


def test_a_prompt_chunk_out_of_time_does_not_stall_later_decodes() -> None:
    s = sched(max_tokens_per_step=32768, time_budget_s=0.05)
    s.add(req("d1", 100, max_tokens=50))
    drive(s, s.schedule())
    s.add(req("p", 60000))
    plan = s.schedule()
    drive(s, plan)
    d2 = req("d2", 100, max_tokens=50)  # as a KV import arrives: running, one token to compute
    d2.blocks, d2.num_computed = s.bm.allocate(1), 99
    d2.status = Status.RUNNING
    s.add(d2)
    s.cost.observe(plan.shape, 2.0)  # steps measured far slower than assumed: no room for p
    for _ in range(3):
        plan = s.schedule()
        assert {q.request_id for q in plan.seqs} >= {"d1", "d2"}
        drive(s, plan)


def test_measured_decode_rows_price_verification_by_the_graph_each_count_replays() -> None:
    """A table of measured decode steps by padded rows: a count of rows costs the graph that
    holds it (the next measured size up) plus its attention; beyond the table there is no
    estimate; steps of decode rows calibrate it, a prompt chunk does not."""
    cm = cost()
    assert cm.rows_seconds_for(np.array([4]), np.array([0])) is None  # no table yet
    cm.set_rows_table({1: 0.010, 4: 0.012, 16: 0.020}, 4)
    got = cm.rows_seconds_for(np.array([1, 2, 4, 5, 16]), np.zeros(5))
    assert got is not None and list(np.round(got, 6)) == [0.010, 0.012, 0.012, 0.020, 0.020]
    reading = cm.rows_seconds_for(np.array([4]), np.array([100_000]))
    assert reading is not None and reading[0] > 0.012  # attention over context adds
    assert cm.rows_seconds_for(np.array([17]), np.array([0])) is None
    # Steps measured at twice the table: the table's own factor follows, the analytic one too.
    decode = StepShape(((1, 1), (4, 1), (1, 1)))  # a verification of 3 drafts beside 2 decodes
    for _ in range(20):
        cm.observe(decode, 2 * 0.020)
    assert cm.rows_scale == pytest.approx(2.0, rel=0.02)
    again = cm.rows_seconds_for(np.array([4]), np.array([0]))
    assert again is not None and again[0] == pytest.approx(0.024, rel=0.02)
    cm.observe(StepShape(((512, 512),)), 0.5)  # a prompt chunk: not a decode-rows step
    assert cm.rows_scale == pytest.approx(2.0, rel=0.02)


def _accounting(s: Scheduler) -> None:
    """Blocks against what the requests hold: used exactly while some request holds one, one
    reference per holder (a shared prefix counts twice), free otherwise."""
    refs = Counter(b for r in s.requests.values() for b in r.blocks)
    assert s.bm.num_used == len(refs)
    assert s.bm.num_free == s.bm.num_blocks - len(refs)
    assert [s.bm.ref_count(b) for b in range(s.bm.num_blocks)] == [
        refs[b] for b in range(s.bm.num_blocks)
    ]
    s.bm.check()


def _run_checked(s: Scheduler, out: dict[str, list[int]], steps: int = 1000) -> list[StepPlan]:
    plans = []
    for _ in range(steps):
        if not s.has_unfinished():
            break
        plan = s.schedule()
        _accounting(s)
        plans.append(plan)
        for ev in drive(s, plan):
            if ev.token_id is not None:
                out.setdefault(ev.request_id, []).append(ev.token_id)
        _accounting(s)
    return plans


def test_block_accounting_is_exact_through_reuse_preemption_and_release() -> None:
    """8 blocks of 4 tokens. a runs and finishes (its full blocks stay named); b shares a's
    8-token prefix and c arrives with it: together they need 10 blocks, so c (the later) is
    preempted and resumes once b is done; d is aborted while it runs. After every schedule and
    every update the block counts match what the requests hold, and at the end all is free."""
    s = Scheduler(
        SchedulerConfig(time_budget_s=None, max_tokens_per_step=64),
        BlockManager(8, 4),
        cost(),
        (1,),
    )
    prefix = list(range(100, 108))
    out: dict[str, list[int]] = {}

    def add(rid: str, prompt: list[int], max_tokens: int) -> Request:
        r = Request(
            rid, prompt, len(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        s.add(r)
        return r

    a = add("a", [*prefix, 50, 51], 3)
    _run_checked(s, out)
    assert out == {"a": [7, 7, 7]} and a.num_cached_tokens == 0
    assert s.bm.num_free == 8 and s.bm.num_cached == 3  # 12 of a's 13 tokens sit in full blocks

    b = add("b", [*prefix, 60, 61, 62], 8)
    c = add("c", list(range(70, 79)), 8)
    plans = _run_checked(s, out)
    assert b.num_cached_tokens == 8  # a's two prefix blocks, reused
    assert [p.preempted for p in plans if p.preempted] == [("c",)]
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert out["b"] == [7] * 8 and out["c"] == [7] * 8
    assert s.bm.num_free == 8 and not s.requests

    d = add("d", list(range(200, 210)), 20)
    s.schedule()
    _accounting(s)
    assert len(d.blocks) == 3 and s.bm.num_free == 5
    s.abort("d")
    _accounting(s)
    assert s.bm.num_free == 8 and not s.requests and not s.has_unfinished()
