"""Each decode step's wall time, one line per step, for a V4 batch decoding past the point
where its CSA layers first hold more entries than the indexer picks (2,048 tokens of context
with V4-Flash's top-512 at rate 4): spikes show one-off costs (compiles, block writes).

Run: PYTHONPATH=$PWD python3 scripts/gpu/v4_step_times.py [preset] [batch] [context] [steps]
"""

from __future__ import annotations

import sys
import time

import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "v4-flash-slice"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 24
    engine = Engine(
        EngineConfig(
            model=preset, device="cuda", time_budget_s=None, max_running=batch,
            max_model_len=ctx + steps + 8, num_kv_blocks=batch * (ctx // 128 + 3) + 8,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(3, 100000, (ctx,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    while any(engine.scheduler.requests[f"r{i}"].num_computed < ctx for i in range(batch)):
        engine.step()
    for k in range(steps):
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        print(f"step {k:3d} (position {ctx + k}): {(time.perf_counter() - t0) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
