"""``deepserve bench engine``: prefill and decode throughput against the device's own limits.

Measured in one run: the device's copy bandwidth and dense matmul rate (the limits), then
prefill steps of several sizes and decode steps at several batch sizes. Each figure is also
given as a fraction of the limit for the FLOPs / bytes the step must move (from the cost
model), so results read the same on any machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from libs.engine.cost_model import StepShape
from libs.engine.engine import Engine, EngineConfig
from libs.engine.sampling_params import SamplingParams

DEFAULTS = {
    "cpu": {"prefill": [512, 2048], "batches": [1, 4, 16], "context": 512},
    "cuda": {"prefill": [4096, 16384, 32768], "batches": [1, 16, 64, 256], "context": 2048},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_limits(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    n_bytes = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, 5)
    copy_bps = 2 * n_bytes / t  # read + write
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _timed(lambda: a @ b, device, 5)
    return {"copy_bytes_per_s": copy_bps, "matmul_flops_per_s": 2 * n**3 / t}


def _drain_prefill(engine: Engine, rids: list[str]) -> None:
    pending = set(rids)
    while pending:
        for ev in engine.step():
            pending.discard(ev.request_id)


def bench_prefill(engine: Engine, tokens: int, limits: dict[str, float], vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(tokens)
    times = []
    for rep in range(2):
        rid = f"prefill-{tokens}-{rep}"
        ids = torch.randint(3, vocab, (tokens,), generator=g).tolist()
        engine.add_request(rid, ids, SamplingParams(max_tokens=1))
        plan_tokens = 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            plan_tokens += engine.last_step_tokens
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    seconds = min(times)
    shape = StepShape(((tokens, tokens),))
    flops = engine.cost.flops(shape)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "flops": flops, "mfu": flops / seconds / limits["matmul_flops_per_s"]}


def bench_decode(engine: Engine, batch: int, context: int, steps: int, limits: dict[str, float],
                 vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(batch)
    rids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid in rids:
        ids = torch.randint(3, vocab, (context,), generator=g).tolist()
        engine.add_request(rid, ids, SamplingParams(max_tokens=steps + 3, ignore_eos=True))
    _drain_prefill(engine, rids)  # every request has its first token: decode from here
    engine.step()  # warm-up decode step
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.device)
    seconds = (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    shape = StepShape(tuple((1, context + 2) for _ in range(batch)))
    step_bytes = engine.cost.bytes(shape)
    tps = batch / seconds
    return {"batch": batch, "context": context, "step_seconds": seconds, "tokens_per_s": tps,
            "per_user_tokens_per_s": tps / batch, "bytes_per_step": step_bytes,
            "roofline_fraction": step_bytes / seconds / limits["copy_bytes_per_s"]}


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    prefill_sizes = ([int(x) for x in args.prefill_tokens.split(",")] if args.prefill_tokens
                     else DEFAULTS[kind]["prefill"])
    batches = ([int(x) for x in args.decode_batches.split(",")] if args.decode_batches
               else DEFAULTS[kind]["batches"])
    context = args.context or DEFAULTS[kind]["context"]
    max_len = max(max(prefill_sizes), context + args.decode_steps + 8) + 1
    blocks = max(sum(-(-(context + args.decode_steps + 8) // 128) for _ in batches) * 2,
                 -(-max(prefill_sizes) // 128) * 2 + 8, max(batches) * (context // 128 + 2))
    engine = Engine(EngineConfig(model=args.preset, device=args.device, dtype=args.dtype,
                                 num_kv_blocks=blocks, max_tokens_per_step=max(32768, max(prefill_sizes)),
                                 time_budget_s=None, max_running=max(batches), max_model_len=max_len))
    dtype = engine.model.dtype
    limits = measure_limits(device, dtype)
    vocab = engine.model_config.vocab_size
    prefill = [bench_prefill(engine, n, limits, vocab) for n in prefill_sizes]
    decode = [bench_decode(engine, b, context, args.decode_steps, limits, vocab) for b in batches]
    result = {
        "bench": "engine", "preset": args.preset, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if kind == "cuda" else platform.processor() or platform.machine(),
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
        "limits": limits, "prefill": prefill, "decode": decode,
        "prefill_tokens_per_s": {str(p["tokens"]): p["tokens_per_s"] for p in prefill},
        "prefill_mfu": {str(p["tokens"]): p["mfu"] for p in prefill},
        "decode_tokens_per_s": {str(d["batch"]): d["tokens_per_s"] for d in decode},
        "decode_roofline_fraction": {str(d["batch"]): d["roofline_fraction"] for d in decode},
    }
    for p in prefill:
        print(f"prefill {p['tokens']:>6} tokens: {p['tokens_per_s']:>10.0f} tok/s  MFU {p['mfu']:.3f}")
    for d in decode:
        print(f"decode batch {d['batch']:>4} @ {d['context']}: {d['tokens_per_s']:>9.1f} tok/s "
              f"({d['per_user_tokens_per_s']:.1f}/user)  roofline {d['roofline_fraction']:.3f}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
