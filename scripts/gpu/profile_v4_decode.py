"""Where a DeepSeek-V4 decode step's time goes on the GPU: wall time per engine step with the
Triton kernels and with plain PyTorch, the CUDA kernels one step launches and the GPU time
they take (torch.profiler), and the host functions that dominate (cProfile).

Run: PYTHONPATH=$PWD python3 scripts/gpu/profile_v4_decode.py [preset] [batches] [context]
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "v4-flash-slice"
    batches = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "16,64").split(",")]
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    engine = Engine(
        EngineConfig(
            model=preset, device="cuda", time_budget_s=None, max_running=max(batches),
            max_model_len=ctx + 256, num_kv_blocks=max(batches) * (ctx // 128 + 3) + 8,
        )
    )  # fmt: skip
    net = engine.runner.net  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(0)
    for b in batches:
        rids = [f"b{b}-{i}" for i in range(b)]
        for r in rids:
            prompt = torch.randint(3, 100000, (ctx,), generator=g).tolist()
            engine.add_request(r, prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        while any(engine.scheduler.requests[r].num_computed < ctx for r in rids):
            engine.step()
        for kernels in (True, False):
            net.set_kernels(kernels)
            for _ in range(2):
                engine.step()
            torch.cuda.synchronize()
            walls = []
            for _ in range(8):
                t0 = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.device_type.name == "CUDA")
            gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
            print(
                f"[{preset}] batch {b} @ {ctx} kernels={kernels}: wall/step "
                f"{statistics.median(walls) * 1e3:.1f} ms, {launches} CUDA kernels a step, "
                f"GPU busy {gpu_us / 1e3:.1f} ms"
            )
            table = events.table(sort_by="self_cuda_time_total", row_limit=10)
            print(table)
        net.set_kernels(True)
        host = cProfile.Profile()
        host.enable()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        host.disable()
        pstats.Stats(host).sort_stats("tottime").print_stats(12)
        for r in rids:
            engine.abort(r)
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
