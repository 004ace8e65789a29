"""Where a speculative step's time goes, on the GPU: ``deepserve bench spec``'s workload with the
device synchronized around each phase of every decode step, so each phase's time is its own
(the overlap between the host and the device that the engine normally gets is taken away:
the phases add up to more than an unsynchronized step).

    PYTHONPATH=$PWD python3 scripts/gpu/spec_phases.py --preset v2-lite --device cuda \\
        --batches 1,64,256 --acceptance 0.8 --speculative-tokens 3

Per batch size and mode, the mean milliseconds per decode step of:
  schedule  the scheduler's plan (host)
  choose    SpecDecoder.add_drafts: confidences read, drafts chosen, blocks reserved (host)
  verify    SpecDecoder.run: the main model over 1 + j rows per request, acceptance (device+host)
  commit    the scheduler's commit and the step's events (host)
  draft     SpecDecoder.draft: MTP catch-up and the drafting depths (device+host)
and the rows verified per step (the main model's batch). ``off`` rows time whole steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from deepserve.bench import spec
from libs.engine import engine as engine_mod
from libs.engine import speculative
from libs.engine.speculative import make_mtp_test_model

PHASES: dict[str, list[float]] = defaultdict(list)
ROWS: list[int] = []


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync()
        PHASES[name].append(time.perf_counter() - t0)
        if name == "choose":
            ROWS.append(out.num_tokens)
        return out

    return wrapper


def main() -> int:
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    args = p.parse_args()
    sd, sched, eng = speculative.SpecDecoder, engine_mod.Scheduler, engine_mod.Engine
    sd.add_drafts = _timed("choose", sd.add_drafts)  # type: ignore[method-assign]
    sd.run = _timed("verify", sd.run)  # type: ignore[method-assign]
    sd.draft = _timed("draft", sd.draft)  # type: ignore[method-assign]
    sched.schedule = _timed("schedule", sched.schedule)  # type: ignore[method-assign]
    sched.commit = _timed("commit", sched.commit)  # type: ignore[method-assign]
    eng.step = _timed("step", eng.step)  # type: ignore[method-assign]
    loaded = spec._loaded(args.preset, args.device)
    for level in [float(a) for a in args.acceptance.split(",") if a]:
        make_mtp_test_model(loaded.model, 0.0, 1.0 - level, seed=1)
        for b in [int(x) for x in args.batches.split(",") if x]:
            for mode in spec.MODES:
                PHASES.clear()
                ROWS.clear()
                r = spec._run(loaded, args, b, mode)
                # Decode steps only: the last r["decode_steps"] of each phase's calls.
                n = r["decode_steps"]
                ms = {k: 1e3 * sum(v[-n:]) / max(len(v[-n:]), 1) for k, v in PHASES.items()}
                rows = ROWS[-n:]
                line = " ".join(
                    f"{k} {ms[k]:6.2f}"
                    for k in ("step", "schedule", "choose", "verify", "commit", "draft")
                    if k in ms
                )
                print(
                    f"acceptance {level:.2f} batch {b:4d} {mode:10s} "
                    f"{r['output_tokens_per_s']:9.1f} tok/s (synchronized)  ms/step: {line}"
                    + (f"  rows/step {sum(rows) / len(rows):.0f}" if rows else ""),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
