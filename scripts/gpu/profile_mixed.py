"""What a prompt chunk costs the decodes it rides with: an aggregated engine's step with
``batch`` running decodes and N new prompt tokens, against the same decodes alone.

Holds ``batch`` decodes running (contexts of ``context`` tokens), then for each N in ``sizes``
adds prompts of ``prompt`` tokens (after a shared ``prefix``-token cached system prompt, as
chat turns are) summing to N, each asking one token, and times the steps until they have it
(overlapped as served, synchronised around the whole). Prints, per N, the wall time of the
step(s) that carried the prompt tokens, what they added over a decode-only step, and the prompt
rate that addition stands for -- a fixed cost per step plus a cost per token, which is what
the aggregated service's chunk size trades between (for short prompts: over long cached
prefixes, PREFIX=5000 PROMPT=700 CONTEXT=5000 as the agent trace's, a chunk costs far more a
token -- measured through the whole stack, docs/benchmarks.md). Then a torch.profiler table of
one mixed step at ``PROFILE_N`` tokens by host time: where a mixed step's fixed cost goes.

Run: PYTHONPATH=$PWD python3 scripts/gpu/profile_mixed.py [preset] [batch] [sizes]
     [extra k=v ...]     (defaults: v2-lite 128 256,1024,2048,4096,8192)
Env: CONTEXT (512), PREFIX (128), PROMPT (256), PROFILE_N (2048), DEVICE (cuda; cpu with
the tiny preset checks the script itself).
"""

from __future__ import annotations

import cProfile
import io
import itertools
import os
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig

CONTEXT = int(os.environ.get("CONTEXT", "512"))
PREFIX = int(os.environ.get("PREFIX", "128"))
PROMPT = int(os.environ.get("PROMPT", "256"))
PROFILE_N = int(os.environ.get("PROFILE_N", "2048"))
DEVICE = os.environ.get("DEVICE", "cuda")
sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "v2-lite"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    sizes = [
        int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "256,1024,2048,4096,8192").split(",")
    ]
    extra = dict(a.split("=", 1) for a in sys.argv[4:])
    step_tokens = max(sizes + [PROFILE_N]) + batch
    engine = Engine(
        EngineConfig(
            model=preset,
            device=DEVICE,
            time_budget_s=None,
            max_tokens_per_step=step_tokens,
            max_running=batch + step_tokens // PROMPT + 8,
            max_model_len=CONTEXT + 8192,
            **extra,
        )
    )  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 100000, (n,), generator=g).tolist()

    system = rand(PREFIX)
    names = itertools.count()
    for i in range(batch):  # the running decodes: long enough to outlast every case
        engine.add_request(
            f"dec{i}", rand(CONTEXT), SamplingParams(max_tokens=4096, ignore_eos=True)
        )
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(8):  # graphs captured, warm
        engine.step()

    def decode_only(steps: int = 24) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        return (time.perf_counter() - t0) / steps

    def mixed(tokens: int) -> tuple[float, int]:
        """Wall seconds and steps from adding ``tokens`` of prompts to their first tokens."""
        ids = []
        for _ in range(max(1, tokens // PROMPT)):
            rid = f"p{next(names)}"
            ids.append(rid)
            engine.add_request(rid, system + rand(PROMPT), SamplingParams(max_tokens=1))
        sync()
        t0 = time.perf_counter()
        steps, left = 0, set(ids)
        while left:
            for ev in engine.step():
                if ev.finished:
                    left.discard(ev.request_id)
            steps += 1
        sync()
        return time.perf_counter() - t0, steps

    mixed(PROMPT)  # the system prompt's blocks cached, the prompt paths compiled
    for n in sizes:
        mixed(n)
    base = statistics.median(decode_only() for _ in range(3))
    print(f"[{preset} {extra}] decode-only step, batch {batch}: {base * 1e3:.1f} ms")
    print(f"{'prompt tokens':>13} {'wall ms':>8} {'steps':>5} {'added ms':>8} {'prompt tok/s':>12}")
    for n in sizes:
        runs = [mixed(n) for _ in range(3)]
        wall, steps = min(runs)
        added = wall - (steps - 1) * base  # the steps past the mixed one are decode-only
        rate = n / max(added - base, 1e-6)
        print(f"{n:>13} {wall * 1e3:>8.1f} {steps:>5} {(added - base) * 1e3:>8.1f} {rate:>12.0f}")
    host = cProfile.Profile()  # the engine thread's Python, mixed steps to their tokens
    host.enable()
    for _ in range(3):
        mixed(PROFILE_N)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
    print(f"cProfile of 3 mixed steps at {PROFILE_N} prompt tokens, by own time:")
    print(text.getvalue()[-9000:])
    for rid in [f"p{next(names)}" for _ in range(max(1, PROFILE_N // PROMPT))]:
        engine.add_request(rid, system + rand(PROMPT), SamplingParams(max_tokens=1))
    sync()
    kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=kinds) as prof:
        t0 = time.perf_counter()
        engine.step()
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(
        f"profiled mixed step ({PROFILE_N} prompt tokens + {batch} decodes): wall "
        f"{wall * 1e3:.1f} ms, summed kernel time {gpu_us / 1e3:.1f} ms"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()
