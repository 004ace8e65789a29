"""EPLB: placements hold every expert in uniform slots, balance skewed load by replicating hot
experts, stay put when the load does, and the bench reproduces the win on a drifting trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deepserve import cli
from deepserve.bench import eplb as bench
from libs.engine.ep import eplb
from libs.engine.ep.placement import EMPTY, Placement

E, R = 64, 16  # 4 experts per rank


def zipf_loads(seed: int, experts: int = E, skew: float = 0.8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** skew
    out: np.ndarray = rng.permutation(p) / p.sum() * 1e6
    return out


def check_shape(p: Placement, experts: int, ranks: int, slots: int) -> None:
    assert (p.num_experts, p.num_ranks, p.slots_per_rank) == (experts, ranks, slots)
    assert all(len(p.replicas(e)) >= 1 for e in range(experts))
    for row in p.rank_slots:  # a second replica on the same rank would carry no load
        held = [e for e in row if e != EMPTY]
        assert len(held) == len(set(held))


@pytest.mark.parametrize("redundant", [0, 1, 4])
def test_placement_covers_every_expert_in_uniform_slots(redundant: int) -> None:
    for seed in range(3):
        slots = eplb.slots_per_rank(E, R, redundant)
        p = eplb.place(zipf_loads(seed), R, slots)
        check_shape(p, E, R, slots)
    odd = eplb.place(zipf_loads(0, experts=61), R, eplb.slots_per_rank(61, R, 1))
    check_shape(odd, 61, R, 5)
    with pytest.raises(ValueError, match="cannot hold"):
        eplb.place(zipf_loads(0), R, 3)


def test_placement_balances_skewed_load_far_better_than_contiguous() -> None:
    loads = zipf_loads(1)
    contiguous = Placement.contiguous(E, R, 1)
    placed = eplb.place(loads, R, 5)
    assert eplb.max_mean(contiguous, loads) > 2.0
    assert eplb.max_mean(placed, loads) < 1.03


def test_replicas_go_to_the_hot_experts() -> None:
    loads = zipf_loads(2)
    p = eplb.place(loads, R, 5)
    counts = np.array([len(p.replicas(e)) for e in range(E)])
    assert counts.sum() == R * 5
    hottest = int(np.argmax(loads))
    assert counts[hottest] == counts.max() > 1
    # Water filling: each extra replica went to the highest load per replica, so taking one
    # back from any replicated expert would make it the heaviest per replica.
    heaviest = (loads / counts).max()
    assert all(loads[e] / (counts[e] - 1) >= heaviest for e in np.flatnonzero(counts > 1))
    assert set(np.flatnonzero(counts > 1)) <= set(np.argsort(-loads)[: R * 5 - E])


def test_same_loads_move_nothing_and_small_changes_move_little() -> None:
    loads = zipf_loads(3)
    p = eplb.place(loads, R, 5)
    assert eplb.place(loads, R, 5, p) is p
    rng = np.random.default_rng(0)
    nudged = loads * rng.uniform(0.99, 1.01, E)
    assert eplb.moved_slots(p, eplb.place(nudged, R, 5, p)) == 0
    shifted = loads * rng.uniform(0.8, 1.2, E)
    q = eplb.place(shifted, R, 5, p)
    assert eplb.max_mean(q, shifted) < 1.03
    assert eplb.moved_slots(p, q) < R * 5 // 2  # a fresh packing moves most slots


def test_max_mean_splits_an_expert_over_its_replicas() -> None:
    p = Placement(3, ((0, 1), (2, 0)))
    assert eplb.rank_loads(p, [4, 2, 1]).tolist() == [4.0, 3.0]  # 2 + 2 | 1 + 2
    assert eplb.max_mean(p, [4, 2, 1]) == pytest.approx(4 / 3.5)
    assert eplb.max_mean(p, [0, 0, 0]) == 1.0
    assert eplb.moved_slots(p, Placement(3, ((0, 1), (2, 1)))) == 1


def test_tracker_sums_a_sliding_window() -> None:
    t = eplb.LoadTracker(num_layers=2, num_experts=3, window_steps=3)
    for step in range(1, 6):
        t.record([[step, 0, 1], [0, step, 0]])
        assert t.steps == step and t.window_len == min(step, 3)
        if step == 2:
            assert t.loads().tolist() == [[3, 0, 2], [0, 3, 0]]
    assert t.loads().tolist() == [[3 + 4 + 5, 0, 3], [0, 12, 0]]
    with pytest.raises(ValueError, match="shape"):
        t.record([1, 2, 3])
    with pytest.raises(ValueError, match=">= 1"):
        eplb.LoadTracker(1, 3, 0)


def test_config_defaults_and_validation() -> None:
    d, p = eplb.EplbConfig.decode(), eplb.EplbConfig.prefill()
    assert (d.window_steps, d.rebalance_every, d.redundant_per_rank) == (1_000, 10_000, 1)
    assert (p.window_steps, p.rebalance_every, p.redundant_per_rank) == (100, 1_000, 4)
    with pytest.raises(ValueError, match="window_steps"):
        eplb.EplbConfig(window_steps=0)


def test_eplb_step_replaces_on_schedule_from_the_window() -> None:
    cfg = eplb.EplbConfig(window_steps=2, rebalance_every=4, redundant_per_rank=1)
    ctl = eplb.Eplb(cfg, num_layers=2, num_experts=E, num_ranks=R)
    assert ctl.placements[0] == Placement.contiguous(E, R, 1)
    hot = np.stack([zipf_loads(4), zipf_loads(5)]).astype(np.int64)
    out = [ctl.step(hot // 1000) for _ in range(8)]
    assert [i for i, r in enumerate(out) if r is not None] == [3, 7]
    first, second = out[3], out[7]
    assert first is not None and second is not None and first.step == 4
    assert all(m > 0 for m in first.moved_slots) and second.moved_slots == (0, 0)
    assert eplb.max_mean(ctl.placements[1], hot[1]) < 1.05


def test_trace_model_matches_exact_top_k_sampling() -> None:
    rng = np.random.default_rng(0)
    p = zipf_loads(6, experts=32, skew=1.0)
    p /= p.sum()
    exact = bench.route_tokens(p, 20_000, 4, rng)
    assert exact.sum() == 80_000 and exact.max() <= 20_000  # 4 distinct experts a token
    model = bench.inclusion(p, 4) * 20_000
    assert model.sum() == pytest.approx(80_000)
    assert np.abs(exact - model).max() < 0.03 * model.max()


def test_bench_runs_small_and_eplb_wins(tmp_path: Path) -> None:
    out = tmp_path / "eplb.json"
    argv = "bench eplb --ranks 8 --experts 32 --topk 4 --layers 2 --window 100"
    argv += f" --rebalance-every 500 --steps 1500 --tokens-per-step 512 --skew 1.0 --json {out}"
    assert cli.main(argv.split()) == 0
    r = json.loads(out.read_text())
    assert [b["step"] for b in r["rebalances"]] == [500, 1000, 1500]
    assert r["max_mean_before"] > 1.5 and r["max_mean_after"] < 1.1
    assert r["per_step"]["after"] >= r["per_step"]["noise_floor"] > 1.0
    first = r["rebalances"][0]
    assert first["bytes_moved"] == first["moved_slots"] * bench.V3_EXPERT_BYTES > 0
    assert len(r["windows"]) == 15
