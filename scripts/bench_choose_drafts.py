"""Host time of speculative decoding's draft choice (``choose_drafts``, the confidence schedule)
per step, pricing each candidate draft count by building the step's shape (as before) against
``CostModel.seconds_with_counts`` (every count from the shape's totals in one pass), side by
side in one run.

Run from the repository root: ``PYTHONPATH=$PWD python3 scripts/bench_choose_drafts.py``.
V2-Lite's cost model, every request decoding at 2K context, K = 3 drafts each with random
confidences; prints milliseconds per call at batch 16 / 64 / 256 and whether both gave the same
choice. The choice runs on the host between the drafting pass and the verification, with the
device idle, so its time adds to every speculative step.
"""

from __future__ import annotations

import random
import time

import numpy as np

from libs.engine.cost_model import CostModel, StepShape
from libs.engine.presets import PRESETS
from libs.engine.speculative import AcceptanceModel, choose_drafts


def main() -> None:
    cost = CostModel.for_model(PRESETS["v2-lite"], 2, 2, 7e14, 4.0e12)
    acceptance = AcceptanceModel()
    rng = random.Random(0)
    for batch in (16, 64, 256):
        confs = [[rng.random() for _ in range(3)] for _ in range(batch)]
        limits = [3] * batch
        ctx = 2048 + batch
        timings: dict[str, float] = {}
        choices = {}
        for name in ("built", "totals"):
            calls = 20
            start = time.perf_counter()
            for _ in range(calls):
                base = StepShape(tuple((1, 2048 + i) for i in range(batch)))  # totals not cached

                def seconds(ms: np.ndarray, base: StepShape = base, name: str = name) -> np.ndarray:
                    if name == "built":
                        return np.asarray(
                            [cost.seconds(base.add(int(m), ctx) if m else base) for m in ms]
                        )
                    out = cost.seconds_with_counts(base, np.maximum(ms, 1), ctx)
                    out[ms == 0] = cost.seconds(base)
                    return out

                choices[name] = choose_drafts(confs, limits, acceptance, seconds)
            timings[name] = (time.perf_counter() - start) / calls * 1e3
        print(
            f"batch {batch:4d}: shape built per count {timings['built']:7.2f} ms, "
            f"from the totals {timings['totals']:6.2f} ms "
            f"({timings['built'] / timings['totals']:.1f}x), "
            f"same choice: {choices['built'] == choices['totals']}"
        )


if __name__ == "__main__":
    main()
