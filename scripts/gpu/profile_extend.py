"""Where a prompt step over long cached prefixes spends its time: ``requests`` prompts that each
share a ``prefix``-token cached prefix and add ``new`` tokens of their own, prefilled in one
step, beside the same new tokens with nothing cached and a single fresh prompt of all of them.
Prints each case's wall time and prompt tok/s (computed tokens only), then the top kernels and
the host time of the extend step (torch.profiler): the agent trace's prefill is this shape.

Run: PYTHONPATH=$PWD python3 scripts/gpu/profile_extend.py [preset] [prefix] [requests] [new]
     [extra k=v ...]
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kernels import extend_attention as ext
from libs.engine.model import attention

DEVICE = os.environ.get("DEVICE", "cuda")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "v2-lite"
    prefix = int(sys.argv[2]) if len(sys.argv) > 2 else 7040
    requests = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    new = int(sys.argv[4]) if len(sys.argv) > 4 else 656
    extra = dict(a.split("=", 1) for a in sys.argv[5:])
    step_tokens = max(requests * new, 4096)
    engine = Engine(
        EngineConfig(
            model=preset,
            device=DEVICE,
            num_kv_blocks=4 * (prefix + requests * new) // 128 + 256,
            time_budget_s=None,
            max_tokens_per_step=step_tokens,
            max_model_len=prefix + step_tokens + 64,
            **extra,
        )
    )  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 100000, (n,), generator=g).tolist()

    def run(prompts: list[list[int]], tag: str) -> tuple[float, int]:
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
        sync()
        t0 = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        sync()
        return time.perf_counter() - t0, steps

    shared = rand(prefix)
    run([shared], "base")  # caches the prefix's blocks
    run([rand(new) for _ in range(requests)], "warm")
    for rnd in range(2):
        run([shared + rand(new) for _ in range(requests)], f"warmx{rnd}-")
    cases = {
        "extend (prefix cached)": lambda k: [shared + rand(new) for _ in range(requests)],
        "same new tokens, no prefix": lambda k: [rand(new) for _ in range(requests)],
        "one fresh prompt of them": lambda k: [rand(new * requests)],
    }
    computed = requests * new

    def loop(k: int) -> list[list[int]]:  # the same, through one fused call per request
        attention.EXTEND_KERNEL = False
        return [shared + rand(new) for _ in range(requests)]

    cases["extend, one SDPA per request"] = loop
    for cfg in os.environ.get("SWEEP", "").split():  # BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES
        bm, bn, nw, ns = (int(v) for v in cfg.split(","))

        def swept(
            k: int, bm: int = bm, bn: int = bn, nw: int = nw, ns: int = ns
        ) -> list[list[int]]:
            attention.EXTEND_KERNEL = True
            ext.BLOCK_M, ext.BLOCK_N, ext.NUM_WARPS, ext.NUM_STAGES = bm, bn, nw, ns
            return [shared + rand(new) for _ in range(requests)]

        cases[f"extend, tiles {cfg}"] = swept
    for c, (name, make) in enumerate(cases.items()):
        best, steps = min(run(make(k), f"case{c}-{k}-") for k in range(3))
        print(
            f"[{preset} {extra}] {name}: {requests} x {new} new over {prefix}: "
            f"{best * 1e3:.1f} ms in {steps} step(s), {computed / best:.0f} tok/s"
        )
    attention.EXTEND_KERNEL = os.environ.get("PROFILE_LOOP") != "1"
    prompts = [shared + rand(new) for _ in range(requests)]
    for i, p in enumerate(prompts):
        engine.add_request(f"prof{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
    sync()
    with profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    ) as prof:
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"profiled extend: wall {wall * 1e3:.1f} ms, summed kernel time {gpu_us / 1e3:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=60))


if __name__ == "__main__":
    main()
