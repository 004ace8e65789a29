"""EPLB inside the engine: the ranks of an EP group sum their load counts, re-place experts
live every few steps, and keep generating the greedy tokens of one engine; the balance gauge
reads the window under the placements in force."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep.eplb import Eplb, EplbConfig, layers_max_mean
from libs.engine.ep.group import EPGroup
from libs.engine.ep.placement import Placement
from libs.engine.llm import LLM
from libs.serving.ep.launch import run_group

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
ENGINE = dict(model="tiny", block_size=16, num_kv_blocks=48, time_budget_s=None)
FAST = EplbConfig(window_steps=4, rebalance_every=4, redundant_per_rank=1)
PROMPTS = [
    [(i * 7919 + s * 104729) % 120000 + 3 for i in range(n)]
    for s, n in enumerate([5, 23, 40, 9, 17, 31])
]


@dataclass(frozen=True)
class _Seen:
    outputs: tuple[tuple[int, tuple[int, ...]], ...]  # (prompt index, greedy tokens)
    rebalances: tuple[tuple[int, int, float, float], ...]  # (step, moved, before, after)
    gauge: tuple[float, ...]  # ep_balance().max_mean after every step
    placements: tuple[Placement, ...]


def _rank(group: EPGroup, _: None) -> _Seen:
    engine = Engine(EngineConfig(**ENGINE, eplb=FAST), ep=group)
    mine = [i for i in range(len(PROMPTS)) if i % group.size == group.rank]
    rebalances: list[tuple[int, int, float, float]] = []
    gauge: list[float] = []

    def on_step(step: int) -> None:
        b = engine.ep_balance()
        assert b is not None
        gauge.append(b.max_mean)
        last = b.last
        if last is not None and (not rebalances or rebalances[-1][0] != last.step):
            rebalances.append((last.step, sum(last.moved_slots), last.before, last.after))

    outs = LLM(engine=engine).generate(
        [PROMPTS[i] for i in mine], GREEDY, decode_text=False, on_step=on_step
    )
    assert engine.ep is not None
    return _Seen(
        tuple((i, o.token_ids) for i, o in zip(mine, outs)),
        tuple(rebalances),
        tuple(gauge),
        tuple(engine.ep.placements),
    )


def test_two_ranks_rebalance_live_and_keep_the_tokens_of_one(tiny_loaded) -> None:
    llm = LLM(engine=Engine(EngineConfig(**ENGINE), loaded=tiny_loaded))
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, decode_text=False)]
    seen = run_group(_rank, 2, None, deadline_s=120.0)
    got = dict(pair for s in seen for pair in s.outputs)
    assert [got[i] for i in range(len(PROMPTS))] == want
    # Both ranks decided the same re-placements (same group counts, deterministic policy).
    assert seen[0].rebalances == seen[1].rebalances
    assert seen[0].placements == seen[1].placements
    assert seen[0].placements != (Placement.contiguous(16, 2, 1),) * 2  # EPLB moved experts
    assert seen[0].rebalances and all(moved > 0 for _, moved, _, _ in seen[0].rebalances)
    assert all(step % FAST.rebalance_every == 0 for step, _, _, _ in seen[0].rebalances)
    for _, _, before, after in seen[0].rebalances:
        assert after <= before + FAST.tolerance  # never worse than staying put (within tol)
    assert all(g >= 1.0 for g in seen[0].gauge) and seen[0].gauge == seen[1].gauge


def test_the_gauge_improves_on_a_skewed_load() -> None:
    """Zipf-skewed routing over 4 ranks x (4 + 1 spare) slots: one re-placement lowers the
    busiest rank's share, and the gauge reads the same window under the new placement."""
    layers, experts, ranks = 3, 16, 4
    rng = np.random.default_rng(0)
    zipf = 1.0 / np.arange(1, experts + 1) ** 1.2
    policy = Eplb(EplbConfig(window_steps=8, rebalance_every=8), layers, experts, ranks)
    rebalance = None
    for _ in range(8):
        counts = np.stack([rng.multinomial(512, zipf / zipf.sum()) for _ in range(layers)])
        rebalance = policy.step(counts)
    assert rebalance is not None
    gauge = policy.balance()
    assert gauge.window_steps == 8 and len(gauge.per_layer) == layers
    assert rebalance.before > 1.5  # contiguous: the hot experts share rank 0
    assert gauge.max_mean == pytest.approx(rebalance.after) and gauge.max_mean < 1.2
    assert gauge.max_mean == pytest.approx(
        layers_max_mean(policy.placements, policy.tracker.loads())
    )
    assert gauge.rebalances == 1 and gauge.moved_slots == sum(rebalance.moved_slots) > 0


@pytest.mark.parametrize(
    ("window", "every", "k"),
    [(1_000, 10_000, 25), (100, 1_000, 25), (4, 4, 4), (6, 9, 3), (7, 5, 1)],
)
def test_counts_are_synced_in_chunks_that_divide_both_intervals(window, every, k) -> None:
    cfg = EplbConfig(window_steps=window, rebalance_every=every)
    assert cfg.sync_interval() == k
    chunked = cfg.in_chunks(k)
    assert chunked.window_steps * k == window and chunked.rebalance_every * k == every


def test_engine_option_names_the_defaults() -> None:
    assert EngineConfig(eplb="decode").eplb == EplbConfig.decode()
    assert EngineConfig(eplb="prefill").eplb_config == EplbConfig.prefill()
    with pytest.raises(ValueError, match="decode, prefill"):
        EngineConfig(eplb="sometimes")


def test_one_rank_group_runs_eplb_in_process(tiny_loaded) -> None:
    """The same driver at N = 1 (gloo group of one): counts synced and re-placements decided
    at steps 4 and 8 (nothing to move on one rank), tokens unchanged, gauge 1.0."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)  # re-placed after steps 4 and 8
    llm = LLM(engine=Engine(EngineConfig(**ENGINE), loaded=tiny_loaded))
    want = [o.token_ids for o in llm.generate(PROMPTS[:1], params, decode_text=False)]
    group = EPGroup.single()
    try:
        engine = Engine(EngineConfig(**ENGINE, eplb=FAST), ep=group, placement=None)
        outs = LLM(engine=engine).generate(PROMPTS[:1], params, decode_text=False)
        balance = engine.ep_balance()
    finally:
        group.close()
    assert [o.token_ids for o in outs] == want
    assert balance is not None and balance.max_mean == 1.0 and balance.window_steps == 4
    # One rank is always even: the policy keeps the placement it has (spare replica included).
    assert engine.ep is not None and engine.ep.placements[0] == Placement.contiguous(16, 1, 1)
