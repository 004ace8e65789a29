"""Where a prefill step's time goes on the GPU: one step of a fresh ``tokens``-long prompt, its
wall time, and the top kernels (torch.profiler), after a warm-up prompt of the same length.

Run: PYTHONPATH=$PWD python3 scripts/gpu/profile_prefill.py [preset] [tokens] [extra k=v ...]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "v2-lite"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    engine = Engine(
        EngineConfig(
            model=preset,
            device="cuda",
            num_kv_blocks=3 * tokens // 128 + 64,
            time_budget_s=None,
            max_tokens_per_step=tokens,
            max_model_len=tokens + 64,
            **extra,
        )
    )  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)

    def one(rid: str) -> float:
        engine.add_request(
            rid,
            torch.randint(3, 100000, (tokens,), generator=g).tolist(),
            SamplingParams(max_tokens=1, ignore_eos=True),
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    one("warm0")
    one("warm1")
    wall = min(one(f"t{i}") for i in range(3))
    print(f"[{preset} {extra}] prefill {tokens}: {wall * 1e3:.1f} ms, {tokens / wall:.0f} tok/s")
    engine.add_request(
        "prof",
        torch.randint(3, 100000, (tokens,), generator=g).tolist(),
        SamplingParams(max_tokens=1, ignore_eos=True),
    )
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    )


if __name__ == "__main__":
    main()
