"""DeepSeek-V4 under expert parallelism: an EP group of CPU rank processes (gloo on 127.0.0.1)
generates the greedy tokens of one V4 engine -- experts sharded unevenly, replicated,
re-placed live mid-generation, hash-routed layers among them -- while each rank feeds its
prompts in rounds cut at block ends (a rank done sooner steps empty rounds with the others)."""

from __future__ import annotations

import json

import pytest
import torch

from deepserve.cli import main
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep.placement import EMPTY, Placement
from libs.engine.llm import LLM
from libs.engine.v4.load import v4_config
from libs.serving.ep.generate import collect_outputs, generate_ranks

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
# Block 16: the 40-token prompt takes three rounds in its first step, the 5-token one one.
ENGINE = dict(block_size=16, num_kv_blocks=48, time_budget_s=None)
PROMPTS = [
    [(i * 7919 + s * 104729) % 120000 + 3 for i in range(n)]
    for s, n in enumerate([5, 23, 40, 9, 17])
]
CFG = v4_config("v4-tiny")


@pytest.fixture(scope="module")
def want() -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens from one V4 engine without EP (all prompts together)."""
    llm = LLM(engine=Engine(EngineConfig(model="v4-tiny", **ENGINE)))
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, decode_text=False)]


def _check_counts(results, prompts) -> None:
    """Every routed (token, expert) pair of every MoE layer is counted once, at home."""
    tokens = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    total = sum(torch.tensor(r.load_counts) for r in results)
    layers, k = len(CFG.mlp_layer_types), CFG.num_experts_per_tok
    assert total.shape == (layers, CFG.n_routed_experts)
    assert int(total.sum()) == tokens * k * layers


def test_two_ranks_with_uneven_experts(want) -> None:
    """8 experts as 5 + 3 (two empty slots); each rank holds only its slots' weights."""
    placement = Placement(8, ((0, 1, 2, 3, 4), (5, 6, 7, EMPTY, EMPTY)))
    results = generate_ranks(
        "v4-tiny", PROMPTS, GREEDY, ep=2, placement=placement, decode_text=False, **ENGINE
    )
    assert [o.token_ids for o in collect_outputs(results, len(PROMPTS))] == want
    assert len({r.steps for r in results}) == 1  # lockstep
    _check_counts(results, PROMPTS)


def replaced_live(prompts, **engine):
    """v4-tiny's greedy tokens over 3 ranks x (3 experts + 1 spare slot holding a replica);
    after step 3 the experts move to a shuffled placement with an empty slot."""
    moved = Placement(8, ((7, 3, EMPTY, 0), (1, 4, 6, 3), (2, 5, 0, 7)))
    return generate_ranks(
        "v4-tiny",
        prompts,
        GREEDY,
        ep=3,
        placement=Placement.contiguous(8, 3, redundant=1),
        replace=(3, moved),
        decode_text=False,
        **ENGINE,
        **engine,
    )


def test_three_ranks_with_replicas_then_replaced_live(want) -> None:
    """3 ranks with spare replicas, re-placed live after step 3: tokens unchanged."""
    results = replaced_live(PROMPTS)
    assert [o.token_ids for o in collect_outputs(results, len(PROMPTS))] == want
    assert len({r.steps for r in results}) == 1 and results[0].steps > 3
    _check_counts(results, PROMPTS)


def test_a_rank_without_prompts_steps_with_the_others(want) -> None:
    """Four ranks, two prompts: two ranks only compute experts for the others."""
    prompts = [PROMPTS[2], PROMPTS[0]]  # the three-round prompt and a one-round one
    results = generate_ranks("v4-tiny", prompts, GREEDY, ep=4, decode_text=False, **ENGINE)
    assert [o.token_ids for o in collect_outputs(results, 2)] == [want[2], want[0]]
    assert results[3].outputs == () and len({r.steps for r in results}) == 1
    _check_counts(results, prompts)


def test_cli_generates_v4_over_two_ranks(want, capsys) -> None:
    ids = ",".join(map(str, PROMPTS[1]))
    args = ["generate", "--model", "v4-tiny", "--prompt-ids", ids, "--max-tokens", "5"]
    assert main([*args, "--ignore-eos", "--json", "--ep", "2"]) == 0
    assert tuple(json.loads(capsys.readouterr().out)["token_ids"]) == want[1]
