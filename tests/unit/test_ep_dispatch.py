"""Expert parallelism on one process (a gloo group of one): dispatch/combine against the
single-device experts, live re-placement, load counts, and loading only a rank's experts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.config import ModelConfig
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep.group import EPGroup
from libs.engine.ep.moe import EPExperts, RouteTable, combine, plan_dispatch
from libs.engine.ep.placement import EMPTY, Placement
from libs.engine.ep.runtime import plan_moves
from libs.engine.llm import LLM
from libs.engine.model.moe import Experts
from tests.hf_reference import require_reference

CFG = ModelConfig(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=1,
    topk_group=1,
)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ENGINE = dict(model="tiny", block_size=16, num_kv_blocks=64, time_budget_s=None)


@pytest.fixture
def group():
    g = EPGroup.single()
    yield g
    g.close()


def _experts(seed: int = 0) -> Experts:
    ex = Experts(CFG, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=gen) * 0.2)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=gen) * 0.2)
    return ex


def _routing(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, CFG.hidden_size, generator=gen)
    idx = torch.argsort(torch.rand(t, 8, generator=gen), dim=1)[:, :3]  # 3 distinct experts
    weights = torch.rand(t, 3, generator=gen)
    return x, weights, idx


# Shuffled experts, two replicas of expert 5 and one of 0, an empty slot.
ODD = Placement(8, ((3, 5, 0, 7, 1, EMPTY, 6, 2, 5, 4, 0),))


@pytest.mark.parametrize("placement", [Placement.contiguous(8, 1), ODD], ids=["plain", "odd"])
@pytest.mark.parametrize("t", [0, 1, 37])
def test_dispatch_and_combine_equal_the_single_device_experts(group, placement, t) -> None:
    full = _experts()
    x, weights, idx = _routing(t)
    want = full(x, weights, idx)
    local = copy.deepcopy(full)
    local.keep_slots(placement.experts_of(0))
    got = EPExperts(local, group, placement)(x, weights, idx)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if placement.slots_per_rank == 8:  # same rows per expert: the very same numbers
        assert torch.equal(got, want)


def test_routes_prefer_a_local_replica_then_spread_by_token() -> None:
    # rank 0 holds 0, 1 and a replica of 2; ranks 1 and 2 both hold 3.
    p = Placement(4, ((0, 1, 2), (2, 3, EMPTY), (3, EMPTY, EMPTY)))
    table = RouteTable.build(p, 0, torch.device("cpu"))
    idx = torch.tensor([[2, 3], [2, 3], [0, 3]])
    dest = table.route(idx).view(3, 2)
    assert dest[:, 0].tolist() == [2, 2, 0]  # expert 2 and 0 stay home (global slots 2, 0)
    assert dest[:, 1].tolist() == [4, 6, 4]  # expert 3 alternates: rank 1 slot 1, rank 2 slot 0
    plan = plan_dispatch(idx, table)
    assert plan.counts.tolist() == [1, 0, 2, 0, 2, 0, 1, 0, 0]
    # Send order: by destination slot, stable: pairs (token, j) 4=(2,0), 0=(0,0), 2=(1,0),
    # 1=(0,1), 5=(2,1), 3=(1,1).
    assert plan.order.tolist() == [4, 0, 2, 1, 5, 3]
    y = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 2)  # sent row i carries i
    weights = torch.tensor([[1.0, 10.0], [100.0, 1000.0], [0.5, 0.25]])
    out = combine(y, plan, weights, idx)
    # What one device computes: token t sums weights[t, j] * (its pair's output). Pair p's
    # output is the sent row holding it: pairs 0..5 -> rows 1, 3, 2, 5, 0, 4.
    want = [1 * 1 + 10 * 3, 100 * 2 + 1000 * 5, 0.5 * 0 + 0.25 * 4]
    assert out.tolist() == [[w, w] for w in want]  # [[31, 31], [5200, 5200], [1, 1]]


def test_moves_keep_local_copies_and_fetch_the_rest() -> None:
    old = Placement(4, ((0, 1), (2, 3)))
    new = Placement(4, ((1, 3), (2, 0)))
    m0, m1 = plan_moves(old, new, 0), plan_moves(old, new, 1)
    assert (m0.keep_src, m0.keep_dst) == ([1], [0])  # expert 1 moves within rank 0
    assert (m0.recv_dst, m0.recv_splits) == ([1], [0, 1])  # expert 3 from rank 1
    assert (m0.send_src, m0.send_splits) == ([0], [0, 1])  # expert 0 to rank 1
    assert (m1.send_src, m1.recv_dst) == ([1], [1])
    assert m0.cross and not plan_moves(old, old, 0).cross


def test_a_replacement_moves_weights_without_changing_outputs(group) -> None:
    full = _experts()
    x, weights, idx = _routing(20)
    want = full(x, weights, idx)
    local = copy.deepcopy(full)
    start = Placement.contiguous(8, 1)
    local.keep_slots(start.experts_of(0))
    layer = EPExperts(local, group, start)
    from libs.engine.ep.runtime import EPRuntime

    runtime = EPRuntime(group, [layer], CFG.hidden_size, 3, torch.float32)
    runtime.apply_placement(ODD)
    assert layer.local.slots == ODD.experts_of(0) and layer.local.w13.shape[0] == 11
    torch.testing.assert_close(layer(x, weights, idx), want, rtol=1e-6, atol=1e-6)
    counts = runtime.load_counts()
    assert counts.shape == (1, 8) and int(counts.sum()) == 20 * 3
    assert int(runtime.load_counts().sum()) == 0  # each call starts a new count


def test_engine_of_one_rank_generates_as_without_ep(group, tiny_loaded) -> None:
    prompts = [[5, 6, 7, 8, 9], [(i * 7919) % 120000 + 3 for i in range(40)]]
    plain = LLM(engine=Engine(EngineConfig(**ENGINE), loaded=tiny_loaded))
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, decode_text=False)]
    # EP changes the model in place: a copy, not the session's shared weights.
    engine = Engine(EngineConfig(**ENGINE), copy.deepcopy(tiny_loaded), ep=group, placement=ODD_16)
    assert engine.runner.cuda_graphs is False
    llm = LLM(engine=engine)
    runtime = engine.ep
    assert runtime is not None

    def replace(step: int) -> None:
        if step == 3:
            runtime.apply_placement(Placement.contiguous(16, 1, redundant=3))

    got = [o.token_ids for o in llm.generate(prompts, GREEDY, decode_text=False, on_step=replace)]
    assert got == want
    moe_layers = (
        tiny_loaded.model.cfg.num_hidden_layers - tiny_loaded.model.cfg.first_k_dense_replace
    )
    tokens = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    counts = runtime.load_counts()
    assert counts.shape == (moe_layers, 16)
    assert int(counts.sum()) == tokens * 4 * moe_layers
    engine.step()  # nothing scheduled: an empty step (0 tokens) still runs every MoE layer


ODD_16 = Placement(16, (tuple(reversed(range(16))) + (3, EMPTY),))


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_a_rank_loads_only_its_experts(tmp_path: Path, layout: str) -> None:
    require_reference("transformers")
    from libs.engine.loader import load
    from tests.hf_reference import build_hf, save_hf

    path = save_hf(build_hf("v2-group-limited", seed=3), tmp_path / "ckpt", layout)
    full = load(str(path))
    slots = (5, 2, EMPTY, 2)
    mine = load(str(path), expert_slots=slots)
    fp, mp = dict(full.model.named_parameters()), dict(mine.model.named_parameters())
    assert fp.keys() == mp.keys()
    for name, p in mp.items():
        if name.endswith(("experts.w13", "experts.w2")) and not name.startswith("mtp"):
            want = fp[name][[5, 2, 0, 2]].clone()
            want[2] = 0
            assert torch.equal(p, want), name
        else:
            assert torch.equal(p, fp[name]), name
    assert mine.model_id == full.model_id


def test_lockstep_idles_steps_and_stops_together(group, tiny_loaded) -> None:
    from libs.serving.ep.lockstep import Lockstep

    engine = Engine(EngineConfig(**ENGINE), copy.deepcopy(tiny_loaded), ep=group)
    loop = Lockstep(engine, poll_s=0.001)
    idle = loop.tick()
    assert not idle.stepped and not idle.stop and idle.events == []
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    events = []
    for _ in range(4):
        tick = loop.tick()
        assert tick.stepped
        events += tick.events
        if not engine.has_unfinished():
            break
    assert [e.token_id is not None for e in events] == [True, True] and events[-1].finished
    assert loop.tick(stopping=True).stop
