"""An EP group of N CPU rank processes (gloo on 127.0.0.1) generates the greedy tokens of one
engine: experts sharded unevenly, replicated, re-placed live mid-generation; prompts spread
over the ranks; a dead peer fails the group instead of hanging it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from deepserve.cli import main
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep.group import EPGroup
from libs.engine.ep.placement import EMPTY, Placement
from libs.engine.llm import LLM
from libs.serving.ep.generate import collect_outputs, generate_ranks
from libs.serving.ep.launch import RankFailed, run_group

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
ENGINE = dict(block_size=16, num_kv_blocks=48, time_budget_s=None)
PROMPTS = [
    [(i * 7919 + s * 104729) % 120000 + 3 for i in range(n)]
    for s, n in enumerate([5, 23, 40, 9, 17])
]


@pytest.fixture(scope="module")
def want(tiny_loaded) -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens from one engine without EP (all prompts batched together)."""
    llm = LLM(engine=Engine(EngineConfig(model="tiny", **ENGINE), loaded=tiny_loaded))
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, decode_text=False)]


def _check_counts(results, prompts) -> None:
    """Every routed (token, expert) pair of every MoE layer is counted once, at home."""
    tokens = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    total = sum(torch.tensor(r.load_counts) for r in results)
    assert total.shape == (2, 16)  # tiny: 2 MoE layers, 16 experts
    assert int(total.sum()) == tokens * 4 * 2


def test_cli_two_ranks_print_the_tokens_of_one(want, capsys) -> None:
    """One prompt: rank 0 serves it, rank 1 runs empty steps and computes its experts."""
    ids = ",".join(map(str, PROMPTS[2]))
    args = ["generate", "--model", "tiny", "--prompt-ids", ids, "--max-tokens", "5"]
    assert main([*args, "--ignore-eos", "--json", "--ep", "2"]) == 0
    assert tuple(json.loads(capsys.readouterr().out)["token_ids"]) == want[2]


def test_three_ranks_uneven_then_replaced_live(want) -> None:
    """16 experts over 3 ranks (6/5/5 slots), prompts spread 2/2/1; after step 3 the experts
    move to a shuffled placement with replicas and an empty slot, tokens unchanged."""
    moved = Placement(
        16,
        (
            (15, 3, 9, 0, 12, 3, EMPTY),
            (1, 4, 7, 10, 13, 14, 3),
            (2, 5, 6, 8, 11, 9, 15),
        ),
    )
    results = generate_ranks(
        "tiny", PROMPTS, GREEDY, ep=3, replace=(3, moved), decode_text=False, **ENGINE
    )
    assert [o.token_ids for o in collect_outputs(results, len(PROMPTS))] == want
    assert len({r.steps for r in results}) == 1 and results[0].steps > 3  # lockstep
    _check_counts(results, PROMPTS)


def test_four_ranks_with_redundant_replicas(want) -> None:
    """4 ranks x (4 experts + 1 spare slot holding a replica); a rank idles while others work."""
    placement = Placement.contiguous(16, 4, redundant=1)
    prompts = PROMPTS[:3]  # rank 3 has no prompt of its own
    results = generate_ranks(
        "tiny", prompts, GREEDY, ep=4, placement=placement, decode_text=False, **ENGINE
    )
    assert [o.token_ids for o in collect_outputs(results, 3)] == want[:3]
    assert results[3].outputs == ()
    _check_counts(results, prompts)


def _exchange_after_peer_left(group: EPGroup, _: None) -> int:
    if group.rank == 1:
        return 0  # leaves the group before the exchange rank 0 waits in
    x = torch.ones(4, 8)
    group.all_to_all(x, [2, 2], [2, 2])
    return 1


def test_a_dead_peer_fails_the_group_within_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0 failed"):
        run_group(_exchange_after_peer_left, 2, None, timeout_s=3.0, deadline_s=60.0)
    assert time.monotonic() - t0 < 30.0
