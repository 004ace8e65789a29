"""``deepserve bench ep``: what the expert-parallel code path costs per decode step.

In one run, on one device, the decode step time at each ``--batch`` size of

* ``single``: the engine without a group -- the default path (on CUDA: CUDA graphs and the
  Triton kernels, as ``deepserve bench engine`` runs it);
* ``ep``: the same engine as rank 0 of an EP group of one (NCCL on CUDA, gloo on the CPU),
  experts placed contiguously: every MoE layer routes, exchanges counts and rows with real
  ``all_to_all_single`` calls and combines, exactly as on N GPUs (no world-size-1 shortcut);
* ``ep_redundant``: the same with ``--redundant`` spare slots holding replicas (more local
  slots to route over and to run).

Each path also greedy-decodes a few short prompts; the tokens of the EP paths are compared
with ``single``'s (common prefix per prompt). On the CPU (fp32, PyTorch experts) they must
agree exactly; on CUDA the single path's fused MoE kernel adds the top-k outputs inside the
kernel while the EP path runs the kernel per slot and combines in fp32, so bf16 rounding may
differ and a greedy token may flip: reported, not hidden.

Timing: requests of ``--context`` random tokens, prefill drained, ``--warmup`` decode steps,
then ``--steps`` steps between two ``torch.cuda.synchronize`` calls; per-step milliseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep.group import EPGroup
from libs.engine.ep.placement import Placement
from libs.engine.llm import LLM
from libs.engine.registry import routed_experts

from .hf_peer import decode_prompts, free_memory, sync

# The CPU figures are a smoke test of the path (the tiny preset's step is mostly its 129K-row
# LM head): small enough that batch 64 and 256 run in well under a minute on two cores.
DEFAULTS = {
    "cpu": {"context": 16, "steps": 3, "warmup": 1, "match_tokens": 8},
    "cuda": {"context": 512, "steps": 16, "warmup": 3, "match_tokens": 16},
}
MATCH_LENGTHS = (7, 33, 64, 100, 5, 48, 17, 80)  # prompt lengths of the greedy comparison


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", default="64,256", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (cpu 3, cuda 16)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed decode steps first (cpu 1, cuda 3)"
    )
    p.add_argument("--context", type=int, default=None, help="prompt tokens (cpu 16, cuda 512)")
    p.add_argument(
        "--redundant", type=int, default=1, help="spare slots of the ep_redundant path (0: skip)"
    )
    p.add_argument(
        "--kernels",
        choices=("auto", "triton", "torch"),
        default="auto",
        help="every path's kernels (torch: PyTorch MoE on both paths, to tell kernel rounding "
        "from a dispatch error in the greedy check; no CUDA graphs then)",
    )
    p.add_argument("--match-prompts", type=int, default=4, help="prompts of the greedy check")
    p.add_argument(
        "--match-tokens", type=int, default=None, help="greedy tokens per prompt (cpu 8, cuda 16)"
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")


def decode_step_ms(
    engine: Engine, batch: int, context: int, steps: int, warmup: int
) -> dict[str, Any]:
    """Mean milliseconds per decode step of ``batch`` requests at ``context`` tokens."""
    vocab = engine.model_config.vocab_size
    rids = [f"ep-bench-{batch}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=warmup + steps + 8, ignore_eos=True)
    for rid, ids in zip(rids, decode_prompts(batch, context, vocab).tolist()):
        engine.add_request(rid, ids, params)
    first = set(rids)
    while first:  # prefill: every request has its first token, decode from here
        for ev in engine.step():
            first.discard(ev.request_id)
    for _ in range(warmup):
        engine.step()
    sync(engine.device)
    t0 = time.perf_counter()
    host = []  # each call's host time: with overlap, the device's step in the steady state
    for _ in range(steps):
        t1 = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - t1)
    sync(engine.device)
    seconds = (time.perf_counter() - t0) / steps
    running = len(engine.scheduler.running)
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {
        "batch": batch,
        "step_ms": seconds * 1e3,
        "median_call_ms": statistics.median(host) * 1e3,
        "tokens_per_s": batch / seconds,
        "running_at_end": running,
    }


def match_prompts(vocab: int, n: int) -> list[list[int]]:
    lengths = [MATCH_LENGTHS[i % len(MATCH_LENGTHS)] for i in range(n)]
    return [
        [(i * 7919 + s * 104729) % (vocab - 3) + 3 for i in range(m)] for s, m in enumerate(lengths)
    ]


def greedy_tokens(engine: Engine, n: int, tokens: int) -> list[list[int]]:
    prompts = match_prompts(engine.model_config.vocab_size, n)
    outs = LLM(engine=engine).generate(
        prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), decode_text=False
    )
    return [list(o.token_ids) for o in outs]


def compare(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Common-prefix tokens per prompt (after a first difference the contexts differ, so
    later positions are not compared)."""
    prefix = []
    for a, b in zip(ref, got, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    total = sum(len(a) for a in ref)
    return {
        "prompts": len(ref),
        "tokens": total,
        "matching_prefix_tokens": sum(prefix),
        "matching_sequences": sum(p == len(a) for p, a in zip(prefix, ref)),
        "first_difference": [p if p < len(a) else None for p, a in zip(prefix, ref)],
    }


def _config(
    args: argparse.Namespace, device: str, batches: list[int], context: int
) -> EngineConfig:
    steps = args.warmup + args.steps + 8
    per_request = -(-(context + steps + 8) // 128)
    match = -(-(max(MATCH_LENGTHS) + args.match_tokens + 2) // 128) * args.match_prompts
    return EngineConfig(
        model=args.model,
        device=device,
        dtype=args.dtype,
        num_kv_blocks=max(batches) * per_request + match + 8,
        max_tokens_per_step=max(8192, min(32768, max(batches) * context)),
        time_budget_s=None,
        max_running=max(max(batches), args.match_prompts),
        max_model_len=max(context, max(MATCH_LENGTHS)) + steps + args.match_tokens + 16,
        kernels=args.kernels,
    )


def run_path(
    name: str,
    args: argparse.Namespace,
    config: EngineConfig,
    batches: list[int],
    context: int,
    group: EPGroup | None = None,
    placement: Placement | None = None,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = Engine(config, ep=group, placement=placement)
    built = time.perf_counter() - t0
    decode = [decode_step_ms(engine, b, context, args.steps, args.warmup) for b in batches]
    tokens = greedy_tokens(engine, args.match_prompts, args.match_tokens)
    runner = engine.runner
    info = {
        "name": name,
        "build_seconds": built,
        "ep_ranks": group.size if group else None,
        "backend": group.backend if group else None,
        "slots_per_rank": None if placement is None else placement.slots_per_rank,
        "cuda_graphs": bool(getattr(runner, "cuda_graphs", False)),
        "kernels": bool(getattr(runner, "use_kernels", False)),
        "decode": decode,
        "tokens": tokens,
    }
    for d in decode:
        print(
            f"{name:>13} batch {d['batch']:>4}: {d['step_ms']:9.2f} ms/step "
            f"(median call {d['median_call_ms']:.2f} ms) "
            f"({d['tokens_per_s']:9.1f} tok/s)"
        )
    del engine, runner
    free_memory(torch.device(config.device))
    return info


def main(args: argparse.Namespace) -> int:
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    batches = [int(x) for x in str(args.batch).split(",") if x]
    for name in ("steps", "warmup", "match_tokens"):
        if getattr(args, name) is None:
            setattr(args, name, DEFAULTS[kind][name])
    context = args.context or DEFAULTS[kind]["context"]
    if args.redundant < 0 or not batches or min(batches) < 1 or args.steps < 1:
        raise SystemExit("deepserve bench ep: --batch, --steps must be positive, --redundant >= 0")
    t_start = time.perf_counter()
    config = _config(args, args.device, batches, context)
    paths = [run_path("single", args, config, batches, context)]
    group = EPGroup.single(args.device)
    try:
        ep_config = _config(args, str(group.device), batches, context)
        experts = routed_experts(args.model)
        for name, r in (("ep", 0), ("ep_redundant", args.redundant)):
            if name == "ep_redundant" and r == 0:
                continue
            placement = Placement.contiguous(experts, 1, r)
            paths.append(run_path(name, args, ep_config, batches, context, group, placement))
    finally:
        group.close()
    result = summarize(args, paths, batches, context, kind, time.perf_counter() - t_start)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def summarize(
    args: argparse.Namespace,
    paths: list[dict[str, Any]],
    batches: list[int],
    context: int,
    kind: str,
    seconds: float,
) -> dict[str, Any]:
    single = {d["batch"]: d["step_ms"] for d in paths[0]["decode"]}
    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        for p in paths:
            ms = next(d["step_ms"] for d in p["decode"] if d["batch"] == b)
            row[f"{p['name']}_ms"] = ms
            if p["name"] != "single":
                row[f"{p['name']}_over_single"] = ms / single[b]
        rows.append(row)
    header = "batch  " + "  ".join(f"{p['name']:>13}" for p in paths)
    print(header + "   (ms per decode step; ratio to single)")
    for row in rows:
        cells = [f"{row['single_ms']:13.2f}"] + [
            f"{row[p['name'] + '_ms']:7.2f} x{row[p['name'] + '_over_single']:4.2f}"
            for p in paths[1:]
        ]
        print(f"{row['batch']:>5}  " + "  ".join(cells))
    ref = paths[0]["tokens"]
    match = {p["name"]: compare(ref, p["tokens"]) for p in paths[1:]}
    for name, m in match.items():
        print(
            f"greedy {name} vs single: {m['matching_prefix_tokens']}/{m['tokens']} tokens, "
            f"{m['matching_sequences']}/{m['prompts']} sequences identical"
        )
    device = torch.device(args.device)
    return {
        "bench": "ep",
        "preset": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device)
        if kind == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "context": context,
        "steps": args.steps,
        "warmup": args.warmup,
        "redundant": args.redundant,
        "kernels": args.kernels,
        "decode": rows,
        "greedy_match": match,
        "paths": [{k: v for k, v in p.items() if k != "tokens"} for p in paths],
        "seconds": seconds,
        "method": "mean ms per decode step over --steps steps after --warmup, between "
        "device synchronizations; ep paths: rank 0 of a 1-rank group (real all_to_all_single "
        "calls, NCCL on CUDA, gloo on CPU); greedy match: common prefix per prompt",
    }
