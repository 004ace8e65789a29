"""EP's fixed exchange as Triton kernels (libs/engine/kernels/ep_exchange.py, run here by
Triton's interpreter): the very bytes, rows, load counts and combined outputs of the PyTorch
ops they replace, for one rank and for ranks of wider groups, with a graph's padding rows and
a step bound above the rank's own tokens. A kernel that misplaced one row, counted a padding
pair as load or added a token's experts in another order would change what EP decodes."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from libs.engine.ep import fixed
from libs.engine.ep.group import EPGroup
from libs.engine.ep.moe import EPExperts, RouteTable, _pack_fused, weigh_pairs
from libs.engine.ep.placement import EMPTY, Placement
from libs.engine.kernels.ep_exchange import combine_rows
from tests.unit.test_ep_dispatch import CFG, ODD, _experts, _routing

# Three ranks of four slots: expert 5 on every rank, 0 twice, an empty slot.
WIDE = Placement(8, ((3, 5, 0, 7), (1, 5, EMPTY, 6), (2, 5, 4, 0)))
CASES = [
    ("one rank", Placement.contiguous(8, 1), 0),
    ("one rank, odd", ODD, 0),
    ("rank 0 of 3", WIDE, 0),
    ("rank 2 of 3", WIDE, 2),
    ("rank 1 of 2", Placement.contiguous(8, 2, 1), 1),
]


def _torch_pack(
    x: torch.Tensor, idx: torch.Tensor, table: RouteTable, bound: fixed.StepBound, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    real = bound.real_pairs(idx)
    load = torch.zeros(8, dtype=torch.int64).index_add_(0, idx.reshape(-1), real)
    dest = table.route(idx)
    n, s = table.num_ranks, table.slots_per_rank
    rows = fixed.rows_of(dest, n, s, cap)
    return fixed.pack(x, dest, rows, idx.shape[1], n * cap, s, real), rows, real, load


@pytest.mark.parametrize(("name", "placement", "rank"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(
    ("t", "agreed", "live"), [(37, 0, None), (37, 48, 29), (5, 16, 5), (90, 96, 70)]
)
def test_the_fused_pack_writes_the_torch_packs_bytes(name, placement, rank, t, agreed, live):
    x, _, idx = _routing(t)
    table = RouteTable.build(placement, rank, torch.device("cpu"))
    bound = fixed.StepBound(tokens=agreed, live=None if live is None else torch.tensor([live]))
    cap = fixed.capacity(bound.bound(t), idx.shape[1], table.slots_per_rank)
    want_buf, want_rows, want_real, want_load = _torch_pack(x, idx, table, bound, cap)
    load = torch.zeros(8, dtype=torch.int64)
    buf, rows, real = _pack_fused(x, idx, table, bound.live, load, cap)
    assert torch.equal(rows, want_rows) and torch.equal(real, want_real)
    assert torch.equal(load, want_load)
    hidden, slot = fixed.unpack(buf, CFG.hidden_size, x.dtype)
    want_hidden, want_slot = fixed.unpack(want_buf, CFG.hidden_size, x.dtype)
    assert torch.equal(slot, want_slot)  # every row: a pair's local slot or "no expert"
    assert torch.equal(hidden[rows], want_hidden[rows])  # the rows an expert will read


def test_padding_pairs_go_out_as_no_expert_and_add_no_load() -> None:
    x, _, idx = _routing(12)
    table = RouteTable.build(ODD, 0, torch.device("cpu"))
    load = torch.zeros(8, dtype=torch.int64)
    cap = fixed.capacity(16, 3, table.slots_per_rank)
    buf, rows, real = _pack_fused(x, idx, table, torch.tensor([7]), load, cap)
    _, slot = fixed.unpack(buf, CFG.hidden_size, x.dtype)
    assert real.tolist() == [1] * 21 + [0] * 15
    assert (slot[rows[21:]] == ODD.slots_per_rank).all()
    assert int(load.sum()) == 21 and torch.equal(
        load, torch.bincount(idx[:7].reshape(-1), minlength=8)
    )


@pytest.mark.parametrize("live", [None, 9])
def test_the_fused_combine_adds_as_the_torch_combine(live) -> None:
    """Outputs of padding pairs are garbage (NaN here): masked before the weights, as the
    PyTorch combine masks them; the rest in ascending expert order, in fp32, bit for bit."""
    t, k, h = 13, 3, 40
    gen = torch.Generator().manual_seed(4)
    idx = torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    y = torch.randn(t * k + 5, h, generator=gen).to(torch.bfloat16)
    rows = torch.randperm(t * k + 5, generator=gen)[: t * k]
    real = (torch.arange(t * k) // k < (live if live is not None else t)).to(torch.int64)
    y[rows[real == 0]] = float("nan")
    pairs = y.index_select(0, rows).view(t, k, h)
    pairs = torch.where(real.view(t, k, 1).bool(), pairs, 0)
    want = weigh_pairs(pairs, weights, idx)
    got = combine_rows(y, rows, real, idx, weights)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.fixture
def group() -> Iterator[EPGroup]:
    g = EPGroup.single()
    yield g
    g.close()


@pytest.mark.parametrize("placement", [Placement.contiguous(8, 1), ODD], ids=["plain", "odd"])
def test_a_layer_gives_the_same_tokens_either_way(group, placement) -> None:
    x, weights, idx = _routing(21)
    out, loads = [], []
    for fused in (False, True):
        local = copy.deepcopy(_experts())
        local.keep_slots(placement.experts_of(0))
        bound = fixed.StepBound(tokens=24, live=torch.tensor([19]))
        layer = EPExperts(local, group, placement, bound)
        layer.fused_exchange = fused
        out.append(layer(x, weights, idx)[:19])
        loads.append(layer.load.clone())
    assert torch.equal(out[0], out[1]) and torch.equal(loads[0], loads[1])
