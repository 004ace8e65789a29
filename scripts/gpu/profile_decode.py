"""Where a decode step's time goes on the GPU: wall time per engine step, device time per step
(CUDA events), graph replay alone, and the top kernels of one eager step (torch.profiler).

Run: PYTHONPATH=$PWD python3 scripts/gpu/profile_decode.py [preset] [batches] [extra k=v ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "v2-lite"
    batches = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "64,256").split(",")]
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    ctx = 2048
    engine = Engine(
        EngineConfig(
            model=preset,
            device="cuda",
            num_kv_blocks=max(batches) * 18 + 64,
            time_budget_s=None,
            max_running=max(batches),
            max_model_len=4096,
            **extra,
        )
    )  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    for b in batches:
        rids = [f"b{b}-{i}" for i in range(b)]
        for r in rids:
            engine.add_request(
                r,
                torch.randint(3, 100000, (ctx,), generator=g).tolist(),
                SamplingParams(max_tokens=64, ignore_eos=True),
            )
        while any(engine.scheduler.requests[r].num_computed < ctx for r in rids):
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        walls, devs, launches = [], [], []
        for _ in range(20):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
            devs.append(engine.last_step_seconds)
            if engine._inflight is not None:
                launches.append(engine._inflight.wall_s)
        graphs = [v for bg, v in engine.runner.graphs.items() if bg >= b]
        replay = float("nan")
        if graphs:
            gr = min(graphs, key=lambda x: x.inputs.shape[0])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                gr.graph.replay()
            torch.cuda.synchronize()
            replay = (time.perf_counter() - t0) / 10
        print(
            f"[{preset} {extra}] batch {b}: wall/step {statistics.median(walls) * 1e3:.2f} ms, "
            f"device/step {statistics.median(devs) * 1e3:.2f} ms, "
            f"graph replay {replay * 1e3:.2f} ms, "
            f"host launch {statistics.median(launches or [float('nan')]) * 1e3:.2f} ms"
        )
        import cProfile
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(10):
            engine.step()
        prof_host.disable()
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(14)
        engine.runner.cuda_graphs = False
        engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        engine.runner.cuda_graphs = True
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=14, max_name_column_width=60
            )
        )
        for r in rids:
            engine.abort(r)
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
