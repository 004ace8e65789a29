"""The fused MoE's expert alignment (``libs/engine/kernels/fused_moe._align``) both ways on one
CUDA GPU: the one-launch Triton kernel against the sort-based torch ops, at the token-expert pair
counts of decode batches, aggregated steps (8,192 tokens x top-6) and prefill steps.

Run from the repository root: ``PYTHONPATH=$PWD python3 scripts/gpu/bench_align.py``. For each
(experts, pairs) it prints the host time of one call (what the engine thread spends launching
it, median of 200 calls, no synchronisation between them) and the device time (CUDA events
around 200 calls, divided), and checks that both ways give the same buffers.
"""

from __future__ import annotations

import statistics
import time

import torch

from libs.engine.kernels.fused_moe import _align

SHAPES = ((64, 6), (256, 8))  # (routed experts, top-k): V2-Lite, V3
TOKENS = (256, 2048, 4096, 8192, 16384)
BLOCK_M = 64


def main() -> None:
    dev = torch.device("cuda")
    for experts, k in SHAPES:
        for tokens in TOKENS:
            ids = torch.stack(
                [torch.randperm(experts, device=dev)[:k] for _ in range(min(tokens, 512))]
            ).repeat((tokens + 511) // 512, 1)[:tokens]
            row = [f"E={experts:3d} pairs={tokens * k:6d}"]
            outs = {}
            for method in ("kernel", "sort"):
                outs[method] = _align(ids, experts, BLOCK_M, method)
                torch.cuda.synchronize()
                host = []
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                for _ in range(200):
                    t0 = time.perf_counter()
                    _align(ids, experts, BLOCK_M, method)
                    host.append(time.perf_counter() - t0)
                end.record()
                end.synchronize()
                device_us = start.elapsed_time(end) * 1e3 / 200
                host_us = statistics.median(host) * 1e6
                row.append(f"{method}: host {host_us:6.1f} us, device {device_us:6.1f} us")
            same = all(
                torch.equal(a, b) for a, b in zip(outs["kernel"][:3], outs["sort"][:3], strict=True)
            )
            print("  ".join(row), "" if same else "  MISMATCH", flush=True)


if __name__ == "__main__":
    main()
