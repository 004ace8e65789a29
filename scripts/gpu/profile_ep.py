"""Where EP's MoE layer spends its time beside the single-device layer: one v2-lite-shaped routed
experts layer (random bf16 weights, kernels on), captured in a CUDA graph as the decode step
captures it, replayed alone: microseconds per replay for the plain ``Experts`` and for
``EPExperts`` over a 1-rank NCCL group (the engine's EP decode path), and each one's kernels
(torch.profiler over the replays: launches per layer and the top kernels by device time).

With ``--paths`` naming both ``torch`` and ``fused``, the EP layer runs its exchange both ways
(``EPExperts.fused_exchange``), side by side in one run.

Run: PYTHONPATH=$PWD python3 scripts/gpu/profile_ep.py [--model v2-lite] [--batch 64,256]
"""

from __future__ import annotations

import argparse
import copy
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from libs.engine.ep.fixed import StepBound
from libs.engine.ep.group import EPGroup
from libs.engine.ep.moe import EPExperts
from libs.engine.ep.placement import Placement
from libs.engine.loader import model_config
from libs.engine.model.moe import Experts


def _graph(fn, warm: int = 3) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _replay_us(g: torch.cuda.CUDAGraph, n: int = 200) -> float:
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def _kernels(g: torch.cuda.CUDAGraph, n: int = 10) -> tuple[int, list[tuple[str, int, float]]]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else 0.0)
    rows = sorted(((name, len(v) // n, sum(v) / n) for name, v in per.items()), key=lambda r: -r[2])
    return sum(c for _, c, _ in rows), rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="v2-lite")
    p.add_argument("--batch", default="64,256")
    p.add_argument("--paths", default="torch,fused")
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    cfg = model_config(args.model)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    plain = Experts(cfg, torch.bfloat16, dev)
    with torch.no_grad():
        for t in (plain.w13, plain.w2):
            t.normal_(0, 0.02)
    plain.use_kernels = True
    group = EPGroup.single(dev)
    layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    print(
        f"{args.model}: {layers} MoE layers, {cfg.n_routed_experts} experts, top-"
        f"{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}"
    )
    try:
        for b in [int(x) for x in args.batch.split(",")]:
            x = torch.randn(b, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
            logits = torch.randn(b, cfg.n_routed_experts, device=dev)
            w, idx = torch.softmax(logits, -1).topk(cfg.num_experts_per_tok, -1)
            cases = {"single": lambda: plain(x, w, idx)}
            for path in args.paths.split(","):
                if path not in ("torch", "fused"):
                    raise SystemExit(f"--paths: torch or fused, got {path!r}")
                local = copy.deepcopy(plain)
                placement = Placement.contiguous(cfg.n_routed_experts, 1)
                local.keep_slots(placement.experts_of(0))
                bound = StepBound(tokens=b, live=torch.full((1,), b, device=dev))
                layer = EPExperts(local, group, placement, bound)
                layer.fused_exchange = path == "fused"
                cases[f"ep-{path}"] = lambda layer=layer: layer(x, w, idx)
            want = cases["single"]()
            base = None
            for name, fn in cases.items():
                got = fn()
                err = (got.float() - want.float()).abs().max().item()
                g = _graph(fn)
                us = _replay_us(g)
                launches, rows = _kernels(g)
                base = us if base is None else base
                print(
                    f"\nbatch {b} {name}: {us:8.1f} us/layer (+{us - base:6.1f}; x{layers} = "
                    f"+{(us - base) * layers / 1e3:.2f} ms/step), {launches} kernels/layer, "
                    f"max |diff| vs single {err:.2e}"
                )
                for kname, count, dev_us in rows[: args.top]:
                    print(f"   {dev_us:8.1f} us  x{count:<3d} {kname[:100]}")
    finally:
        group.close()


if __name__ == "__main__":
    with torch.no_grad():
        main()
