"""The fixed-shape EP exchange (libs/engine/ep/fixed.py): the same numbers as the variable-size
exchange, no host sync on its path (what lets the decode step's CUDA graph hold it), padding
rows that no expert runs, and greedy tokens under N CPU ranks equal to one engine."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep import fixed
from libs.engine.ep.group import EPGroup
from libs.engine.ep.moe import EPExperts
from libs.engine.ep.placement import EMPTY, Placement
from libs.engine.kernels.fused_moe import _align
from libs.engine.llm import LLM
from libs.serving.ep.generate import collect_outputs, generate_ranks
from tests.unit.test_ep_dispatch import CFG, ODD, _experts, _routing


@pytest.fixture
def group() -> Iterator[EPGroup]:
    g = EPGroup.single()
    yield g
    g.close()


def _layer(group: EPGroup, placement: Placement, bound: fixed.StepBound) -> EPExperts:
    local = copy.deepcopy(_experts())
    local.keep_slots(placement.experts_of(0))
    return EPExperts(local, group, placement, bound)


@pytest.mark.parametrize("placement", [Placement.contiguous(8, 1), ODD], ids=["plain", "odd"])
@pytest.mark.parametrize(("t", "agreed"), [(37, 0), (37, 64), (5, 512), (0, 16)])
def test_fixed_exchange_gives_the_variable_exchanges_numbers(group, placement, t, agreed) -> None:
    """A step bound above this rank's tokens (another rank's step is bigger, or the graph's
    padding) leaves padding rows in the buffers; the real rows' outputs do not change."""
    x, weights, idx = _routing(t)
    fixed_layer = _layer(group, placement, fixed.StepBound(tokens=agreed))
    variable = _layer(group, placement, fixed.StepBound(fixed_max_tokens=-1))  # never fixed
    assert fixed_layer.shape.fixed(t) and not variable.shape.fixed(t)
    got, want = fixed_layer(x, weights, idx), variable(x, weights, idx)
    assert got.shape == (t, CFG.hidden_size) and torch.equal(got, want)
    full = _experts()(x, weights, idx)
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)


def test_a_graphs_padding_rows_are_sent_as_padding_and_counted_nowhere(group) -> None:
    """A graph runs its padding rows through the router too: past this rank's real rows (the
    device count the step fills in before the replay) their pairs go out as "no expert" and
    add no load, and the real rows come back as without them."""
    x, weights, idx = _routing(12)
    alone = _layer(group, ODD, fixed.StepBound(tokens=16))
    want = alone(x[:7], weights[:7], idx[:7])
    live = torch.tensor([7])
    padded = _layer(group, ODD, fixed.StepBound(tokens=16, live=live))
    sent = []
    run = padded.local.forward

    def counting(a: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        sent.append(i.numel())
        return run(a, w, i)

    padded.local.forward = counting  # type: ignore[method-assign]
    got = padded(x, weights, idx)
    assert torch.equal(got[:7], want)
    assert sent == [7 * 3]  # the experts ran the real pairs only
    assert torch.equal(padded.load, alone.load) and int(padded.load.sum()) == 7 * 3


def test_rows_are_packed_per_rank_in_pair_order() -> None:
    # Global slots of 2 ranks x 3 slots; capacity 4 rows per rank.
    dest = torch.tensor([4, 0, 5, 2, 3, 1])
    assert fixed.rows_of(dest, 2, 3, 4).tolist() == [4, 0, 5, 1, 6, 2]
    x = torch.arange(12, dtype=torch.float32).view(3, 4)  # 3 tokens, k = 2
    buf = fixed.pack(x, dest, fixed.rows_of(dest, 2, 3, 4), 2, 8, 3)
    rows, slot = fixed.unpack(buf, 4, torch.float32)
    assert slot.squeeze(1).tolist() == [0, 2, 1, 3, 1, 2, 0, 3]  # 3: padding (no expert)
    assert torch.equal(rows[[0, 1, 2, 4, 5, 6]], x[[0, 1, 2, 0, 1, 2]])


def test_a_no_expert_id_is_aligned_nowhere() -> None:
    """Padding rows carry id E: the fused kernel's alignment places them in no block (both
    methods alike), so its GEMMs never read them."""
    ids = torch.tensor([[3], [8], [0], [8], [3], [7]])
    got = {m: _align(ids, 8, 4, method=m) for m in ("kernel", "sort")}
    for a, b in zip(got["kernel"][:3], got["sort"][:3], strict=True):
        assert torch.equal(a, b)
    sorted_ids, expert_ids, total, _ = got["kernel"]
    assert int(total) == 12  # experts 0, 3, 7: one block of 4 rows each
    assert sorted_ids[:12].tolist() == [2, 6, 6, 6, 0, 4, 6, 6, 5, 6, 6, 6]  # 6: padding
    assert expert_ids[:3].tolist() == [0, 3, 7]


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_the_fixed_path_never_reads_the_device(group, monkeypatch) -> None:
    """No tensor reaches the host on the fixed path (a CUDA graph could not hold it): every
    tensor-to-Python conversion raises while a layer dispatches, runs (a stand-in for the
    fused kernel, which takes padding ids itself) and combines."""
    placement = ODD
    layer = _layer(group, placement, fixed.StepBound(tokens=48, live=torch.tensor([37])))
    layer.local.use_kernels = True
    slots = placement.slots_per_rank

    def kernel(x: torch.Tensor, _: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return x * (slot.to(x.dtype) + 1)  # padding (slot == slots) comes back unread

    layer.local.forward = kernel  # type: ignore[method-assign]
    x, weights, idx = _routing(37)
    table = layer.table
    local_slot = table.route(idx).view(37, 3) % slots
    pairs = x.unsqueeze(1) * (local_slot.to(x.dtype) + 1).unsqueeze(-1)
    order = torch.argsort(idx, dim=1, stable=True)
    want = torch.zeros_like(x)
    for j in range(3):
        col = order[:, j : j + 1]
        want += pairs.gather(1, col.unsqueeze(-1).expand(-1, -1, x.shape[1])).squeeze(1) * (
            weights.gather(1, col)
        )

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a host sync on the fixed EP path")

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for name in ("nonzero", "bincount", "unique"):
        monkeypatch.setattr(torch, name, refuse)
    got = layer(x, weights, idx)
    empty = layer(x[:0], weights[:0], idx[:0])  # a rank without tokens: same exchanges
    monkeypatch.undo()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert empty.shape == (0, CFG.hidden_size)


GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
ENGINE = dict(block_size=16, num_kv_blocks=48, time_budget_s=None)
PROMPTS = [
    [(i * 7919 + s * 104729) % 120000 + 3 for i in range(n)]
    for s, n in enumerate([5, 23, 40, 9, 17])
]


def test_three_ranks_uneven_redundant_fp8_weights_give_one_engines_tokens() -> None:
    """16 experts over 3 ranks with FP8 weights (each side quantizes its own copy at load):
    6/5/5 experts plus spare slots holding replicas (expert 0 three times, twice on rank 0)
    and empty ones, all on the fixed-shape exchange; prompts spread 2/2/1, so a rank runs
    empty steps while the others decode."""
    fp8 = dict(ENGINE, weight_dtype="fp8")
    llm = LLM(engine=Engine(EngineConfig(model="tiny", **fp8)))
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, decode_text=False)]
    placement = Placement(
        16,
        (
            (0, 1, 2, 3, 4, 5, 0, 9),
            (6, 7, 8, 9, 10, 0, 15, EMPTY),
            (11, 12, 13, 14, 15, 3, 4, EMPTY),
        ),
    )
    results = generate_ranks(
        "tiny", PROMPTS, GREEDY, ep=3, placement=placement, decode_text=False, **fp8
    )
    assert [o.token_ids for o in collect_outputs(results, len(PROMPTS))] == want
    assert len({r.steps for r in results}) == 1  # lockstep


@pytest.mark.slow
def test_decode_graphs_replay_under_ep_with_the_eager_steps_tokens(tiny_loaded, group) -> None:
    """An EP rank keeps its decode graphs (emulated on the CPU: the captured closures replay
    over the static buffers, kernels under Triton's interpreter): decode steps replay the
    graph of the group's agreed rows with the fixed-shape exchange inside, prompt steps past
    the ladder take the variable-size one, and the tokens are the eager EP engine's."""
    from tests.unit.test_engine import prompt, run

    kw = dict(ENGINE, model="tiny", kernels="triton", max_running=4, max_tokens_per_step=64)
    reqs = {
        "a": (prompt(6, 1), SamplingParams(max_tokens=5, ignore_eos=True)),
        "b": (prompt(21, 2), SamplingParams(max_tokens=3, ignore_eos=True)),
        "c": (prompt(3, 3), SamplingParams(max_tokens=4, ignore_eos=True)),
    }
    eager = Engine(EngineConfig(**kw), loaded=copy.deepcopy(tiny_loaded), ep=group)
    want = run(eager, reqs)
    graphs = Engine(EngineConfig(**kw), loaded=copy.deepcopy(tiny_loaded), ep=group)
    runner = graphs.runner
    runner.emulate_graphs()  # ladder 1, 2, 4: the 30-token prompt step is past it
    assert runner.group is graphs.ep
    got = run(graphs, reqs)
    assert got == want
    assert sum(g.steps for g in runner.graph_sets["decode"].graphs.values()) >= 3
    assert graphs.ep is not None and graphs.ep.shape.tokens == 0  # nothing agreed between steps
