"""Whether the MTP test model's draft confidences say anything about acceptance: the confidences
of accepted and of rejected drafts, and how the confidence schedule's AcceptanceModel binned them.

Run from the repository root: ``PYTHONPATH=$PWD python3 scripts/spec_confidence.py [preset]
[wrong fraction] [flat|confident]`` (default tiny, 0.5, flat: the test model's head as it is, or
made confident, ``make_mtp_test_model(confident=True)``; CPU). Eight greedy requests of 32 random
prompt tokens decode 24 tokens each with K = 3.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence

import torch

from deepserve.bench import spec
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.speculative import make_mtp_test_model


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    wrong = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    confident = len(sys.argv) > 3 and sys.argv[3] == "confident"
    loaded = spec._loaded(preset, "cpu")
    make_mtp_test_model(loaded.model, 0.0, wrong, seed=1, confident=confident)
    cfg = EngineConfig(
        model=preset,
        device="cpu",
        num_kv_blocks=64,
        max_running=8,
        time_budget_s=None,
        with_mtp=True,
        speculative_tokens=3,
    )
    eng = Engine(cfg, loaded=loaded)
    assert eng.speculative is not None
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(8):
        eng.add_request(f"r{i}", torch.randint(3, 1000, (32,), generator=g).tolist(), sp)
    seen: list[tuple[list[float], int]] = []
    model = eng.speculative.acceptance
    observe = model.observe

    def recording(confidences: Sequence[float], num_accepted: int) -> None:
        seen.append((list(confidences), num_accepted))
        observe(confidences, num_accepted)

    model.observe = recording  # type: ignore[method-assign]
    while eng.has_unfinished():
        eng.step()
    accepted = [c for cs, n in seen for c in cs[:n]]
    rejected = [cs[n] for cs, n in seen if n < len(cs)]
    for name, vals in (("accepted", accepted), ("rejected", rejected)):
        if vals:
            print(
                f"{name}: {len(vals)} drafts, confidence median {statistics.median(vals):.3g}, "
                f"min {min(vals):.3g}, max {max(vals):.3g}"
            )
    print("AcceptanceModel observations per confidence bin (after its prior of 2):", end=" ")
    print([int(s - model.PRIOR) for s in model.seen])


if __name__ == "__main__":
    main()
