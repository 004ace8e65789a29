"""``deepserve bench eplb``: EPLB placements on a skewed, drifting routing trace.

The trace, per MoE layer: a few traffic *domains* (code, chat, languages...), each with a
Zipf-distributed expert popularity (exponent ``--skew``) over its own random order of the
experts; the traffic mix rotates through the domains over ``--drift-period`` steps, so the hot
set shifts over time. Each step, ``--tokens-per-step`` tokens each choose ``--topk`` distinct
experts: expert ``e`` is chosen by a token with probability ``pi_e = 1 - exp(-lambda p_e)``,
``lambda`` set so that ``sum(pi) = topk`` (the standard inclusion probabilities of top-k
sampling without replacement; :func:`route_tokens` samples tokens exactly and the unit test
checks the two agree), so an expert's count in a step is ``Binomial(tokens, pi_e)`` (drawn
by its normal approximation).

The real :class:`~libs.engine.ep.eplb.Eplb` (tracker and re-placement) runs over the timeline;
each window of ``window_steps`` steps is measured, with the placement then in force, on load
it has not seen, against the contiguous placement (``Placement.contiguous``) on the same load:

* window max/mean: busiest rank over the mean, tokens summed over the window (what placement
  controls; sampling noise averages out);
* per-step max/mean, averaged over steps (what a step waits for), and its *noise floor*: the
  same step's sampling noise around a perfectly balanced expectation, which no placement
  removes.

An expert's tokens are split evenly over its replicas (the dispatch's job). Deterministic for
a given ``--seed``; no I/O besides the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from libs.engine.ep.eplb import Eplb, EplbConfig, imbalance, max_mean, moved_slots_per_rank
from libs.engine.ep.eplb import share_matrix as share
from libs.engine.ep.placement import Placement

# DeepSeek-V3 routed expert: gate, up and down projections, 7168 x 2048 each, fp8.
V3_EXPERT_BYTES = 3 * 7168 * 2048
DRIFT_RESOLUTION = 10  # popularity is recomputed every this many steps


@dataclass(frozen=True)
class Setup:
    ranks: int = 64
    experts: int = 256
    topk: int = 8
    redundant: int = 1
    layers: int = 8
    window_steps: int = 1_000
    rebalance_every: int = 10_000
    steps: int = 60_000
    tokens_per_step: int = 4_096
    skew: float = 0.6
    domains: int = 4
    drift_period: int = 1_000_000
    seed: int = 0
    bytes_per_expert: int = V3_EXPERT_BYTES

    def __post_init__(self) -> None:
        if self.rebalance_every % self.window_steps:
            raise ValueError(
                f"rebalance_every ({self.rebalance_every}) must be a multiple of window_steps "
                f"({self.window_steps}): the bench measures whole windows"
            )
        if self.steps % self.window_steps:
            raise ValueError(f"steps ({self.steps}) must be a multiple of {self.window_steps}")
        if not 1 <= self.topk <= self.experts:
            raise ValueError(f"topk must be in [1, {self.experts}], got {self.topk}")
        if min(self.ranks, self.layers, self.tokens_per_step, self.domains) < 1:
            raise ValueError("ranks, layers, tokens_per_step and domains must be >= 1")
        if self.skew < 0 or self.drift_period < 1:
            raise ValueError("skew must be >= 0 and drift_period >= 1")


def inclusion(p: np.ndarray, topk: int) -> np.ndarray:
    """Per-token probability of choosing each expert, ``1 - exp(-lambda p)`` with ``lambda``
    solved (Newton, from below: the sum is concave in lambda) so each row sums to ``topk``."""
    lam = np.full(p.shape[:-1] + (1,), float(topk))
    for _ in range(100):
        q = np.exp(-lam * p)
        f = (1.0 - q).sum(axis=-1, keepdims=True) - topk
        if np.abs(f).max() < 1e-9 * topk:
            break
        lam = lam - f / (p * q).sum(axis=-1, keepdims=True)
    out: np.ndarray = 1.0 - np.exp(-lam * p)
    return out


def route_tokens(p: np.ndarray, tokens: int, topk: int, rng: np.random.Generator) -> np.ndarray:
    """Exact top-k without replacement for ``tokens`` tokens (Gumbel top-k on ``log p``):
    per-expert counts. Slow; the trace uses the same model through :func:`inclusion`."""
    keys = np.log(np.maximum(p, 1e-300)) + rng.gumbel(size=(tokens, len(p)))
    top = np.argpartition(-keys, topk - 1, axis=1)[:, :topk]
    out: np.ndarray = np.bincount(top.ravel(), minlength=len(p))
    return out


class Trace:
    """Per-step popularity of every expert of every layer, and sampled counts."""

    def __init__(self, s: Setup, rng: np.random.Generator) -> None:
        zipf = 1.0 / np.arange(1, s.experts + 1) ** s.skew
        dom = np.stack(
            [np.stack([rng.permutation(zipf) for _ in range(s.domains)]) for _ in range(s.layers)]
        )
        self.domains = dom / dom.sum(axis=-1, keepdims=True)  # (L, D, E)
        self.phase = rng.uniform(size=s.layers)
        self.s = s

    def popularity(self, steps: np.ndarray) -> np.ndarray:
        """``(steps, layers, experts)``: a mix of domains, weight ``1 + cos`` rotating."""
        d = np.arange(self.s.domains) / self.s.domains
        ang = 2 * np.pi * (steps[:, None, None] / self.s.drift_period + self.phase[:, None] + d)
        w = 1.0 + np.cos(ang) if self.s.domains > 1 else np.ones_like(ang)  # (S, L, D)
        p = np.einsum("sld,lde->sle", w, self.domains)
        out: np.ndarray = p / p.sum(axis=-1, keepdims=True)
        return out

    def window(self, start: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Sampled counts and their expectation for steps ``[start, start + n)``."""
        grid = np.arange(start, start + n, DRIFT_RESOLUTION)
        pi = inclusion(self.popularity(grid), self.s.topk)
        pi = np.repeat(pi, DRIFT_RESOLUTION, axis=0)[:n]
        t = self.s.tokens_per_step
        mu = pi * t
        # Binomial(t, pi) by its normal approximation (8x faster than numpy's binomial; the
        # mean count is >= 10 at the defaults, where the two agree to well under a percent).
        z = rng.standard_normal(pi.shape)
        counts = np.clip(np.rint(mu + np.sqrt(mu * (1.0 - pi)) * z), 0, t).astype(np.int64)
        return counts, mu


def _measure(x: np.ndarray, mu: np.ndarray, m: np.ndarray) -> tuple[float, float, float]:
    """(window max/mean, mean per-step max/mean, mean per-step noise floor) of one layer."""
    rl, erl = x @ m, mu @ m
    floor = imbalance(rl - erl + erl.mean(axis=1, keepdims=True)).mean()
    return float(imbalance(rl.sum(axis=0))), float(imbalance(rl).mean()), float(floor)


def run(s: Setup) -> dict[str, Any]:
    rng = np.random.default_rng(s.seed)
    trace = Trace(s, rng)
    cfg = EplbConfig(s.window_steps, s.rebalance_every, s.redundant)
    eplb = Eplb(cfg, s.layers, s.experts, s.ranks)
    contiguous = share(Placement.contiguous(s.experts, s.ranks, s.redundant))
    current = [share(p) for p in eplb.placements]
    windows: list[dict[str, Any]] = []
    rebalances: list[dict[str, Any]] = []
    last = None  # step of the latest re-placement
    for start in range(0, s.steps, s.window_steps):
        counts, mu = trace.window(start, s.window_steps, rng)
        x = counts.astype(np.float64)
        before = [_measure(x[:, i], mu[:, i], contiguous) for i in range(s.layers)]
        after = [_measure(x[:, i], mu[:, i], current[i]) for i in range(s.layers)]
        windows.append(
            {
                "start": start,
                "since_rebalance": None if last is None else start - last,
                "before": float(np.mean([b[0] for b in before])),
                "after": float(np.mean([a[0] for a in after])),
                "before_per_step": float(np.mean([b[1] for b in before])),
                "after_per_step": float(np.mean([a[1] for a in after])),
                "noise_floor_per_step": float(np.mean([a[2] for a in after])),
            }
        )
        old = eplb.placements
        for step_counts in counts:
            reb = eplb.step(step_counts)
            if reb is None:
                continue
            assert reb.step == start + s.window_steps, "re-placements fall on window ends"
            last = reb.step
            seen = eplb.tracker.loads()
            per_rank = sum(moved_slots_per_rank(o, n) for o, n in zip(old, reb.placements))
            rebalances.append(
                {
                    "step": reb.step,
                    "moved_slots": int(sum(reb.moved_slots)),
                    "bytes_moved": int(sum(reb.moved_slots)) * s.bytes_per_expert,
                    "max_rank_bytes_in": int(np.max(per_rank)) * s.bytes_per_expert,
                    "seen_before": _mean_ratio(old, seen),
                    "seen_after": _mean_ratio(reb.placements, seen),
                }
            )
            current = [share(p) for p in reb.placements]
    return _summary(s, windows, rebalances)


def _mean_ratio(placements: tuple[Placement, ...], loads: np.ndarray) -> float:
    return float(np.mean([max_mean(p, loads[i]) for i, p in enumerate(placements)]))


def _summary(
    s: Setup, windows: list[dict[str, Any]], rebalances: list[dict[str, Any]]
) -> dict[str, Any]:
    ev = [w for w in windows if w["since_rebalance"] is not None]
    if not ev:
        raise ValueError("no window after a re-placement: raise --steps past --rebalance-every")

    def avg(key: str) -> float:
        return float(np.mean([w[key] for w in ev]))

    by_age: dict[str, float] = {}
    for age in sorted({w["since_rebalance"] for w in ev}):
        by_age[str(age)] = float(np.mean([w["after"] for w in ev if w["since_rebalance"] == age]))
    return {
        "setup": asdict(s),
        "slots_per_rank": -(-s.experts // s.ranks) + s.redundant,
        "max_mean_before": avg("before"),
        "max_mean_after": avg("after"),
        "max_mean_after_worst_window": float(max(w["after"] for w in ev)),
        "max_mean_after_in_sample": float(np.mean([r["seen_after"] for r in rebalances])),
        "max_mean_after_by_age": by_age,
        "per_step": {
            "before": avg("before_per_step"),
            "after": avg("after_per_step"),
            "noise_floor": avg("noise_floor_per_step"),
        },
        "bytes_moved_per_rebalance": float(np.mean([r["bytes_moved"] for r in rebalances])),
        "max_rank_bytes_in_per_rebalance": float(
            np.mean([r["max_rank_bytes_in"] for r in rebalances])
        ),
        "rebalances": rebalances,
        "windows": windows,
    }


def lines(r: dict[str, Any]) -> list[str]:
    s = r["setup"]
    gb = 1e9
    out = [
        f"EP{s['ranks']}: {s['experts']} experts top-{s['topk']}, {r['slots_per_rank']} slots/rank "
        f"({s['redundant']} redundant), {s['layers']} layers, {s['steps']:,} steps of "
        f"{s['tokens_per_step']:,} tokens; window {s['window_steps']:,}, re-placement every "
        f"{s['rebalance_every']:,}; Zipf skew {s['skew']}, {s['domains']} domains rotating "
        f"over {s['drift_period']:,} steps",
        f"max/mean per window (after the first re-placement, unseen load): "
        f"contiguous {r['max_mean_before']:.3f} -> EPLB {r['max_mean_after']:.3f} "
        f"(worst window {r['max_mean_after_worst_window']:.3f}; on the window it saw "
        f"{r['max_mean_after_in_sample']:.3f})",
        "EPLB max/mean by steps since re-placement: "
        + ", ".join(f"{int(k):,}: {v:.3f}" for k, v in r["max_mean_after_by_age"].items()),
        f"per step: contiguous {r['per_step']['before']:.3f} -> EPLB {r['per_step']['after']:.3f}"
        f" (noise floor {r['per_step']['noise_floor']:.3f})",
        f"moved per re-placement: {r['bytes_moved_per_rebalance'] / gb:.1f} GB in all "
        f"({s['layers']} layers), {r['max_rank_bytes_in_per_rebalance'] / gb:.2f} GB into "
        f"the busiest rank",
    ]
    for b in r["rebalances"]:
        out.append(
            f"  step {b['step']:>7,}: {b['moved_slots']:>4} slots moved "
            f"({b['bytes_moved'] / gb:5.1f} GB), seen window {b['seen_before']:.3f} -> "
            f"{b['seen_after']:.3f}"
        )
    return out


def setup_from(args: argparse.Namespace) -> Setup:
    cfg = EplbConfig.prefill() if args.mode == "prefill" else EplbConfig.decode()
    window = args.window or cfg.window_steps
    every = args.rebalance_every or cfg.rebalance_every
    per_rank = 4_096 if args.mode == "prefill" else 64
    return Setup(
        ranks=args.ranks,
        experts=args.experts,
        topk=args.topk,
        redundant=cfg.redundant_per_rank if args.redundant is None else args.redundant,
        layers=args.layers,
        window_steps=window,
        rebalance_every=every,
        steps=args.steps or 6 * every,
        tokens_per_step=args.tokens_per_step or per_rank * args.ranks,
        skew=args.skew,
        domains=args.domains,
        drift_period=args.drift_period or 100 * every,
        seed=args.seed,
        bytes_per_expert=args.bytes_per_expert,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                   help="EplbConfig defaults: decode 1,000/10,000 steps, 1 redundant; "
                   "prefill 100/1,000, 4 redundant")  # fmt: skip
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--redundant", type=int, default=None, help="redundant slots per rank")
    p.add_argument("--layers", type=int, default=8, help="MoE layers (one placement each)")
    p.add_argument("--steps", type=int, default=None, help="default: 6 x --rebalance-every")
    p.add_argument("--window", type=int, default=None, help="tracker window (steps)")
    p.add_argument("--rebalance-every", type=int, default=None, help="steps between placements")
    p.add_argument(
        "--tokens-per-step", type=int, default=None, help="default: 64 (prefill 4,096) per rank"
    )
    p.add_argument("--skew", type=float, default=0.6, help="Zipf exponent of each domain")
    p.add_argument("--domains", type=int, default=4, help="traffic domains in the mix")
    p.add_argument(
        "--drift-period", type=int, default=None, help="steps per rotation of the traffic mix "
        "(default: 100 x --rebalance-every; decode: 1M steps, hours at 20-50 ms a step)"
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bytes-per-expert",
        type=int,
        default=V3_EXPERT_BYTES,
        help="weights copied per moved slot (default: DeepSeek-V3 at fp8, 44 MB)",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    result = run(setup_from(args))
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["machine"] = platform.machine()
    for line in lines(result):
        print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0
