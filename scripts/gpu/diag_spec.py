"""Diagnose issue 19's batch-256 crash (a device-side "index out of bounds" in a gather at the
first speculative step) on the GPU: ``deepserve bench spec`` with every graph replay checked.

Run from the repository root, with the bench's own arguments, e.g.::

    PYTHONPATH=$PWD python3 scripts/gpu/diag_spec.py --preset v2-lite --device cuda \\
        --batches 256 --acceptance 0.8 --speculative-tokens 3 --prompt-tokens 256 --max-tokens 8

Before each replay of a captured graph (any set: ``decode``, ``mtp``, ``mtp_head``) the host
waits for the device and reads the graph's staged inputs back: token ids must lie in
[0, vocabulary), positions in [0, max_blocks x block size), slots in [0, scratch slot], lengths in
[0, max_blocks x block size], the pages a row's length covers in [0, cache blocks). The first
replay that breaks one is printed with its set, padded size, rows and the offending values,
and the script exits 1: the bad input is named before the kernel that would trip on it runs.
After each replay the host waits again, so a fault is raised at the replay that caused it.
On the CPU (emulated graphs, tests/unit/test_graph_replay.py) the checks run without waits.
The waits also take the host's lead over the device away, so a clean run rules out inputs
overwritten in memory but not a race between the host and transfers still queued.

Switches (environment): ``DIAG_NO_MTP_GRAPHS=1`` leaves the MTP passes eager (only ``decode``
graphs); ``DIAG_LADDER_MAX=N`` captures no graph past N rows (e.g. 512: batch 256's 1,024
verification rows then run eagerly). Each one that makes the crash go away points at the part
it switched off.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from deepserve.bench import spec
from libs.engine import runner as runner_mod
from libs.engine.runner import ModelRunner, staged_rows
from libs.engine.scheduler import ScheduledSeq

NO_MTP_GRAPHS = os.environ.get("DIAG_NO_MTP_GRAPHS") == "1"
LADDER_MAX = int(os.environ.get("DIAG_LADDER_MAX", "0"))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bad_inputs(r: ModelRunner, inputs: torch.Tensor, n: int) -> list[str]:
    """What is out of range in the first ``n`` staged rows of ``inputs`` (read back)."""
    bs, mb = r.block_size, r.max_blocks
    cols, table = staged_rows(inputs.cpu().numpy(), mb)
    ids, pos, slots, lens = cols[:, :n]
    table = table[:n]
    vocab = r.model.cfg.vocab_size
    blocks = r.cache.scratch_slot // bs
    out = []
    for what, vals, lo, hi in (
        ("id", ids, 0, vocab),
        ("position", pos, 0, r.max_blocks * bs),
        ("slot", slots, 0, r.cache.scratch_slot + 1),
        ("length", lens, 0, mb * bs + 1),
    ):
        bad = np.flatnonzero((vals < lo) | (vals >= hi))
        if len(bad):
            out.append(f"{what}s out of [{lo}, {hi}) at rows {bad[:12].tolist()}: {vals[bad[:12]]}")
    pages = (lens + bs - 1) // bs
    for row in range(n):
        used = table[row, : pages[row]]
        if ((used < 0) | (used >= blocks)).any():
            out.append(f"row {row}: pages {used.tolist()} outside [0, {blocks})")
            break
    return out


def _checked_replay(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _replay(
        self: ModelRunner,
        name: str,
        seqs: Sequence[ScheduledSeq] | int,
        prev: Any,
        *,
        x: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> Any:
        gs = self.graph_sets[name]
        n = seqs if isinstance(seqs, int) else len(seqs)
        size = next(b for b in gs.ladder if b >= n)
        g = gs.graphs[size]
        graph = g.graph

        class Checked:
            def replay(_self) -> None:
                _sync()
                if g.inputs is not None:
                    bad = _bad_inputs(self, g.inputs, n)
                    if bad:
                        rows = [] if isinstance(seqs, int) else list(seqs)
                        print(f"BAD INPUTS: set {name!r}, {n} rows padded to {size}", flush=True)
                        for line in bad:
                            print("  " + line, flush=True)
                        for s in rows[:8]:
                            print(f"  {s.request_id} start {s.start} ids {s.token_ids}", flush=True)
                        sys.exit(1)
                if x is not None and not torch.isfinite(x).all():
                    print(f"NON-FINITE x_in: set {name!r}, {n} rows", flush=True)
                graph.replay()
                _sync()

        g.graph = Checked()
        try:
            return orig(self, name, seqs, prev, x=x, ids=ids)
        finally:
            g.graph = graph

    return _replay


def main() -> int:
    ModelRunner._replay = _checked_replay(ModelRunner._replay)  # type: ignore[method-assign]
    if NO_MTP_GRAPHS:
        add = ModelRunner.add_graphs

        def add_graphs(self: ModelRunner, name: str, *a: Any, **kw: Any) -> None:
            on, self.cuda_graphs = self.cuda_graphs, self.cuda_graphs and name == "decode"
            try:
                add(self, name, *a, **kw)  # an MTP set: none captured, so replay gives None
            finally:
                self.cuda_graphs = on

        ModelRunner.add_graphs = add_graphs  # type: ignore[method-assign]
    if LADDER_MAX:
        ladder = runner_mod.graph_ladder
        runner_mod.graph_ladder = lambda m: ladder(min(m, LADDER_MAX))  # type: ignore[assignment]
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    return spec.main(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
