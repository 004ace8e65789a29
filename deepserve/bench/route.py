"""``deepserve bench route``: replay a synthetic multi-tenant trace through the balancer policy.

Simulated prefill instances, each with an LRU prefix cache of ``--cache-blocks`` 128-token
blocks and a single FIFO server whose service time is ``overhead + uncached tokens / rate``
(with attention cost growing with context). They heartbeat every second (queued tokens,
running, the ``--summary`` most recently used digests, exactly as the engine builds them) into
the real :class:`~libs.routing.policy.RoutingPolicy` on a simulated clock. The same trace
is replayed through three routers:

* ``policy``: the balancer as deployed (buckets, load cap, then locality from heartbeat
  summaries priced against load);
* ``oracle``: locality only (no load cap or price), seeing every cache and queue exactly at
  every request: the hit-rate ceiling;
* ``round_robin``: instances in turn.

``hit_rate`` counts prompt tokens found in the chosen instance's GPU cache (token-weighted,
like the seeds' 56% / 96% figures; the kvstore on SSD would serve many of the misses).
``max_mean_load`` is busy seconds (prefill time actually spent, so cache hits count as the
work they save) of the busiest instance over the mean, over the whole run;
``max_mean_load_60s`` is the same per 60 s window, summed over windows (sum of the busiest
instance's busy time in each window / sum of the mean's), so an instance that takes all of
one burst and none of the next counts as unbalanced even if its total is average.
``--sweep KNOB=V1,V2,...`` replays the policy once per value of a ``RoutingPolicy`` knob
(``load_cap``, ``load_weight``, ``load_half_life``) and reports the trade-off.
Deterministic for a given ``--seed``; no I/O besides the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from libs.routing import buckets as bk
from libs.routing.policy import DECODE, DIGEST_BYTES, PREFILL, Instance, RoutingPolicy

BLOCK = 128
TRACES = ("agent", "chat", "mixed")
LOCALITY_ONLY = {"load_cap": math.inf, "load_weight": 0.0}
KNOBS = ("load_cap", "load_weight", "load_half_life")
WINDOWS_S = (10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Request:
    arrival: float
    request_id: str
    tokens: int
    blocks: tuple[bytes, ...]  # chain digests (first 8 bytes) of the full blocks


@dataclass(frozen=True)
class TraceShape:
    """One kind of traffic: sessions of a tenant's system prompt plus growing turns."""

    sessions_per_s: float
    tenants: int
    system_tokens: tuple[int, int]  # range of a tenant's system prompt
    first_user: tuple[int, int]  # first user message (documents, code, ...)
    growth: tuple[int, int]  # tokens added per turn (answer + next message)
    turns: tuple[int, int]
    think_s: tuple[float, float]


SHAPES = {
    # Coding agents: large tool/system prompts, many quick turns, contexts into 100K+.
    "agent": [
        TraceShape(0.5, 6, (6_000, 24_000), (1_000, 30_000), (200, 800), (10, 40), (1.0, 6.0))
    ],
    # Chat: short system prompts, few turns, people think between turns.
    "chat": [TraceShape(6.0, 20, (500, 2_500), (50, 1_500), (100, 400), (1, 8), (5.0, 30.0))],
}
SHAPES["mixed"] = [
    TraceShape(0.3, 6, (6_000, 24_000), (1_000, 30_000), (200, 800), (10, 40), (1.0, 6.0)),
    TraceShape(3.0, 20, (500, 2_500), (50, 1_500), (100, 400), (1, 8), (5.0, 30.0)),
    # Long documents: one or two questions over 64K-300K tokens.
    TraceShape(0.04, 3, (1_000, 2_000), (60_000, 300_000), (100, 300), (1, 2), (10.0, 30.0)),
]


def _digest(parent: bytes, key: str) -> bytes:
    return hashlib.blake2b(parent + key.encode(), digest_size=DIGEST_BYTES).digest()


def _chain(parts: list[tuple[str, int]]) -> list[bytes]:
    """Digests of the full blocks of a prompt made of (content key, tokens) parts."""
    total = sum(n for _, n in parts)
    keys: list[str] = []
    pos = 0
    for key, n in parts:  # a block is named by its index and the part its last token is in
        keys.extend(f"{key}:{b}" for b in range(pos // BLOCK, (pos + n) // BLOCK))
        pos += n
    assert len(keys) == total // BLOCK
    out: list[bytes] = []
    parent = b""
    for k in keys:
        parent = _digest(parent, k)
        out.append(parent)
    return out


def trace(kind: str, seed: int, duration_s: float) -> list[Request]:
    """Requests of ``kind`` arriving over ``duration_s``: bursty session starts, growing turns."""
    rng = random.Random(seed)
    out: list[Request] = []
    for si, shape in enumerate(SHAPES[kind]):
        systems = [rng.randint(*shape.system_tokens) for _ in range(shape.tenants)]
        t, n = 0.0, 0
        while t < duration_s:
            # Bursts: the session rate switches between 3x and 0.33x every ~20 s.
            burst = 3.0 if int(t / 20) % 2 == 0 and rng.random() < 0.7 else 0.33
            t += rng.expovariate(shape.sessions_per_s * burst)
            tenant = rng.randrange(shape.tenants)
            parts = [
                (f"sys{si}.{tenant}", systems[tenant]),
                (f"s{si}.{n}.u0", rng.randint(*shape.first_user)),
            ]
            at = t
            for turn in range(rng.randint(*shape.turns)):
                if at >= duration_s:
                    break
                tokens = sum(p for _, p in parts)
                out.append(Request(at, f"{kind}{si}.{n}.{turn}", tokens, tuple(_chain(parts))))
                parts.append((f"s{si}.{n}.u{turn + 1}", rng.randint(*shape.growth)))
                at += rng.uniform(*shape.think_s) + tokens / 50_000
            n += 1
    out.sort(key=lambda r: (r.arrival, r.request_id))
    return out


@dataclass
class SimInstance:
    """A prefill instance: LRU block cache and one FIFO server."""

    name: str
    capacity: int
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    free_at: float = 0.0
    busy_s: float = 0.0
    backlog: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens)
    spans: list[tuple[float, float]] = field(default_factory=list)  # every (start, end) served

    def hit(self, blocks: tuple[bytes, ...]) -> int:
        n = 0
        for b in blocks:
            if b not in self.cache:
                break
            n += 1
        return n

    def admit(self, blocks: tuple[bytes, ...]) -> None:
        """The request's blocks become most recent, prefix last (as the engine releases them)."""
        for b in reversed(blocks):
            self.cache[b] = None
            self.cache.move_to_end(b)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def recent(self, n: int) -> frozenset[bytes]:
        out: list[bytes] = []
        for b in reversed(self.cache):
            if len(out) >= n:
                break
            out.append(b)
        return frozenset(out)

    def load(self, now: float) -> tuple[int, int]:
        """(tokens queued not yet started, requests started or queued and not finished)."""
        self.backlog = [x for x in self.backlog if x[1] > now]
        return sum(tok for s, _, tok in self.backlog if s > now), len(self.backlog)


def service_s(tokens: int, cached: int) -> float:
    """Prefill time: 20 ms + uncached tokens at 20K tok/s, slower as the context grows."""
    new = max(tokens - cached, 0)
    return 0.02 + new / 20_000 * (1 + (cached + new / 2) / 131_072)


def simulate(
    requests: list[Request],
    router: str,
    *,
    instances: int,
    cache_blocks: int,
    summary: int,
    bounds: tuple[int, ...],
    knobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    sims = [SimInstance(f"p{i:02d}", cache_blocks) for i in range(instances)]
    clock = [0.0]
    policy = RoutingPolicy(
        clock=lambda: clock[0], bucket_bounds=bounds, block_size=BLOCK, **(knobs or {})
    )
    names = bk.bucket_names(bounds)
    waits: dict[str, list[float]] = {n: [] for n in names}
    hit_tokens = total_tokens = 0
    next_beat = 0.0

    def beat(exact: bool) -> None:
        for s in sims:
            queued, running = s.load(clock[0])
            policy.observe(
                Instance(
                    s.name,
                    PREFILL,
                    queued_tokens=queued,
                    running=running,
                    resident=frozenset(s.cache) if exact else s.recent(summary),
                )
            )
        policy.observe(Instance("d0", DECODE, address="d0:1", total_kv_blocks=1, free_kv_blocks=1))

    for i, r in enumerate(requests):
        clock[0] = r.arrival
        if router == "oracle":
            beat(exact=True)
        elif router == "policy":
            while next_beat <= r.arrival:  # heartbeats every second, up to this arrival
                clock[0] = next_beat
                beat(exact=False)
                next_beat += 1.0
            clock[0] = r.arrival
        if router == "round_robin":
            sim = sims[i % instances]
        else:
            chosen = policy.route(
                request_id=r.request_id, prompt_tokens=r.tokens, block_hashes=r.blocks
            )
            sim = next(s for s in sims if s.name == chosen.prefill.instance_id)
        cached = min(sim.hit(r.blocks) * BLOCK, r.tokens)
        sim.admit(r.blocks)
        start = max(r.arrival, sim.free_at)
        dur = service_s(r.tokens, cached)
        sim.free_at = start + dur
        sim.busy_s += dur
        sim.backlog.append((start, start + dur, r.tokens - cached))
        sim.spans.append((start, start + dur))
        waits[names[bk.bucket_of(r.tokens, bounds)]].append(start - r.arrival)
        hit_tokens += cached
        total_tokens += r.tokens
    busy = [s.busy_s for s in sims]
    return {
        "hit_rate": hit_tokens / max(total_tokens, 1),
        "max_mean_load": max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
        "busy_s": [round(b, 3) for b in busy],
        "max_mean_load_60s": balance([s.spans for s in sims], 60.0),
        "max_mean_load_windows": {
            f"{w:g}s": round(balance([s.spans for s in sims], w), 4) for w in WINDOWS_S
        },
        "queueing": {n: _stats(w) for n, w in waits.items() if w},
    }


def balance(spans: list[list[tuple[float, float]]], window: float) -> float:
    """Sum over ``window``-second windows of the busiest instance's busy time / of the mean's."""
    buckets: dict[int, list[float]] = {}
    n = len(spans)
    for i, sp in enumerate(spans):
        for s, e in sp:
            while s < e:
                w = int(s // window)
                end = min(e, (w + 1) * window)
                buckets.setdefault(w, [0.0] * n)[i] += end - s
                s = end
    top = sum(max(b) for b in buckets.values())
    mean = sum(sum(b) for b in buckets.values()) / n
    return top / mean if mean else 1.0


def _stats(w: list[float]) -> dict[str, float]:
    s = sorted(w)
    return {
        "requests": len(s),
        "mean_wait_s": sum(s) / len(s),
        "p99_wait_s": s[min(len(s) - 1, int(0.99 * len(s)))],
    }


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``"load_cap=inf,1.5,1.15"`` -> (knob, values); ValueError names what is wrong."""
    knob, _, vals = text.partition("=")
    if knob not in KNOBS or not vals:
        raise ValueError(f"--sweep must be KNOB=V1,V2,... with KNOB one of {KNOBS}, got {text!r}")
    try:
        return knob, [float(v) for v in vals.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep values must be numbers (inf: off), got {vals!r}") from None


def run(
    kind: str,
    *,
    seed: int = 0,
    duration_s: float = 300.0,
    instances: int = 8,
    cache_blocks: int = 4096,
    summary: int = 2048,
    bounds: tuple[int, ...] = bk.DEFAULT_BOUNDS,
    sweep: tuple[str, list[float]] | None = None,
) -> dict[str, Any]:
    """The three routers on one trace; with ``sweep``, also the policy once per knob value."""
    if kind not in TRACES:
        raise ValueError(f"--trace must be one of {TRACES}, got {kind!r}")
    reqs = trace(kind, seed, duration_s)
    kw: dict[str, Any] = {
        "instances": instances,
        "cache_blocks": cache_blocks,
        "summary": summary,
        "bounds": bounds,
    }
    res = {
        "policy": simulate(reqs, "policy", **kw),
        "oracle": simulate(reqs, "oracle", knobs=LOCALITY_ONLY, **kw),
        "round_robin": simulate(reqs, "round_robin", **kw),
    }
    out = {
        "trace": kind,
        "seed": seed,
        "duration_s": duration_s,
        "requests": len(reqs),
        "prompt_tokens": sum(r.tokens for r in reqs),
        "instances": instances,
        "cache_blocks": cache_blocks,
        "summary_digests": summary,
        "bucket_bounds": list(bounds),
        "hit_rate": res["policy"]["hit_rate"],
        "oracle_hit_rate": res["oracle"]["hit_rate"],
        "round_robin_hit_rate": res["round_robin"]["hit_rate"],
        "max_mean_load": res["policy"]["max_mean_load"],
        "max_mean_load_60s": res["policy"]["max_mean_load_60s"],
        "routers": res,
    }
    if sweep is not None:
        knob, values = sweep
        oracle = res["oracle"]["hit_rate"]
        rows = []
        for v in values:
            r = simulate(reqs, "policy", knobs={knob: v}, **kw)
            rows.append(
                {
                    knob: v if math.isfinite(v) else None,
                    "hit_ratio_to_oracle": r["hit_rate"] / oracle,
                    **r,
                }
            )
        out["sweep"] = {"knob": knob, "rows": rows}
    return out


def _lines(result: dict[str, Any]) -> Iterator[str]:
    yield (
        f"{result['trace']}: {result['requests']} requests, "
        f"{result['prompt_tokens']:,} prompt tokens, "
        f"{result['instances']} prefill instances"
    )
    for name, r in result["routers"].items():
        q = " ".join(
            f"{b}: mean {v['mean_wait_s']:.3f}s p99 {v['p99_wait_s']:.3f}s"
            for b, v in r["queueing"].items()
        )
        yield (
            f"  {name:12s} hit {r['hit_rate']:.3f}  max/mean load {r['max_mean_load']:.2f}"
            f" (60 s windows {r['max_mean_load_60s']:.2f})  {q}"
        )
    if "sweep" in result:
        knob = result["sweep"]["knob"]
        yield f"  sweep {knob}: hit (/ oracle)  max/mean run / 60 s  p99 wait by bucket"
        for r in result["sweep"]["rows"]:
            q = " ".join(f"{b} {v['p99_wait_s']:.2f}s" for b, v in r["queueing"].items())
            yield (
                f"  {knob}={_knob(r[knob]):<6} {r['hit_rate']:.3f} ({r['hit_ratio_to_oracle']:.3f})"
                f"  {r['max_mean_load']:.2f} / {r['max_mean_load_60s']:.2f}  {q}"
            )


def _knob(v: float | None) -> str:
    return "off" if v is None else f"{v:g}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``deepserve bench route`` (also ``python -m deepserve.bench.route``)."""
    p.add_argument("--trace", choices=TRACES, default="agent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of simulated traffic")
    p.add_argument("--instances", type=int, default=8, help="simulated prefill instances")
    p.add_argument("--cache-blocks", type=int, default=4096, help="128-token blocks each caches")
    p.add_argument("--summary", type=int, default=2048, help="digests per heartbeat summary")
    p.add_argument("--prefill-buckets", default="16384,65536,262144", help="bucket bounds (tokens)")
    p.add_argument(
        "--sweep",
        default=None,
        help=f"KNOB=V1,V2,...: also replay the policy once per value ({', '.join(KNOBS)}; "
        "inf: off), e.g. load_cap=inf,1.5,1.3,1.15,1.05",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    sweep = getattr(args, "sweep", None)
    result = run(
        args.trace,
        seed=args.seed,
        duration_s=args.duration,
        instances=args.instances,
        cache_blocks=args.cache_blocks,
        summary=args.summary,
        bounds=bk.parse_bounds(args.prefill_buckets),
        sweep=parse_sweep(sweep) if sweep else None,
    )
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["machine"] = platform.machine()
    for line in _lines(result):
        print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m deepserve.bench.route", description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
