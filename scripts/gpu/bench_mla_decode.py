"""Micro-benchmark of the Triton paged MLA decode kernel on one GPU.

Run from the repository root: ``PYTHONPATH=$PWD python3 scripts/gpu/bench_mla_decode.py``.
For H in (16, 128), B in (1, 16, 64, 256), 2048-token contexts (R = 512, P = 64, 128-token
pages in random order over a pool larger than needed), bf16 and fp8 caches (the fp8 one widened
to bf16 in registers, the default, and at batch 64 and 256 also with e4m3 dots, ``fp8_dots``):
checks the kernel once per shape against the reference, sweeps at most 8 launch configs
(BLOCK_N, num_warps, num_stages x two split counts), times each with
``triton.testing.do_bench`` (median) and prints the best per shape with its bandwidth (KV cache
bytes read once per sequence + query and output bytes) as a fraction of the H200's 4.15e12
B/s. Writes ``$OUT/mla_decode.json`` when ``OUT`` is set. ``MLA_HEADS`` and ``MLA_BATCHES``
(comma-separated) narrow the sweep, e.g. ``MLA_HEADS=128 MLA_BATCHES=256`` for issue 17's
128-head target alone.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import triton

from libs.engine.kernels.mla_decode import (
    choose_num_splits,
    mla_decode,
    mla_decode_reference,
    quantize_latent_fp8,
)

R, P, BLOCK, CTX = 512, 64, 128, 2048
PEAK_BYTES_PER_S = 4.15e12
# vs the fp32 reference on the same (bf16 or quantized fp8) cache; e4m3 dots also round the
# query and the probabilities (tests/gpu/test_kernel_mla_decode_gpu.py)
REL_TOL = {"bf16": 1e-2, "fp8": 1e-2, "fp8-dots": 5e-2}


def kernel_configs(heads: int) -> list[dict[str, int]]:
    """Launch configs to sweep (each also at two split counts); BLOCK_H defaults to
    min(64, next_pow2(H)), and many heads also try 32-head blocks (half the registers)."""
    configs = [
        {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    ]
    if heads >= 64:
        configs.append({"BLOCK_N": 32, "BLOCK_H": 32, "num_warps": 4, "num_stages": 2})
    else:
        configs.append({"BLOCK_N": 16, "num_warps": 4, "num_stages": 3})
    return configs


def make_inputs(batch: int, heads: int, fp8: bool, seed: int) -> dict[str, Any]:
    """Random queries and cache, every sequence ``CTX`` tokens over shuffled pages."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = CTX // BLOCK
    pool = 2 * batch * blocks + 16
    table = torch.randperm(pool, generator=gen, device="cuda")[: batch * blocks]
    q = torch.randn(batch, heads, R + P, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(pool * BLOCK, R + P, generator=gen, device="cuda").bfloat16()
    args: dict[str, Any] = dict(
        q_lat=q[..., :R],
        q_pe=q[..., R:],
        latent=kv[:, :R],
        rope=kv[:, R:],
        block_table=table.view(batch, blocks).int(),
        seq_lens=torch.full((batch,), CTX, dtype=torch.int32, device="cuda"),
        block_size=BLOCK,
        sm_scale=192**-0.5,
    )
    if fp8:
        latent8, scale = quantize_latent_fp8(kv[:, :R])
        args.update(latent=latent8, kv_scale=scale)
    return args


def bytes_moved(args: dict[str, Any]) -> int:
    """KV bytes of every context token (read once) plus query and output bytes."""
    tokens = int(args["seq_lens"].sum())
    per_token = (
        R * args["latent"].element_size()
        + P * args["rope"].element_size()
        + (4 if "kv_scale" in args else 0)
    )
    batch, heads, _ = args["q_lat"].shape
    q_and_out = batch * heads * ((R + P) + R) * 2  # bf16 queries in, bf16 output out
    return tokens * per_token + q_and_out


def bench_shape(batch: int, heads: int, cache: str, num_sms: int) -> dict[str, Any]:
    args = make_inputs(batch, heads, cache != "bf16", seed=batch * 1000 + heads)
    if cache == "fp8-dots":
        args["fp8_dots"] = True
    out = torch.empty_like(args["q_lat"], memory_format=torch.contiguous_format)
    ref = mla_decode_reference(**{k: v for k, v in args.items() if k != "fp8_dots"})
    rel = float((mla_decode(**args, out=out).float() - ref.float()).norm() / ref.float().norm())
    del ref
    default_splits = choose_num_splits(batch, heads, CTX, num_sms)
    split_options = sorted({default_splits, max(2, 2 * default_splits)})
    results = []
    for splits in split_options:
        for cfg in kernel_configs(heads):
            try:
                us = 1e3 * triton.testing.do_bench(
                    lambda s=splits, c=cfg: mla_decode(**args, out=out, num_splits=s, config=c),
                    return_mode="median",
                )
            except Exception as exc:  # a config the GPU cannot run (e.g. out of shared memory)
                print(f"  skip {cfg} splits={splits}: {type(exc).__name__}: {exc}"[:200])
                continue
            results.append({"splits": splits, **cfg, "us": us})
    best = min(results, key=lambda r: r["us"])
    gbps = bytes_moved(args) / (best["us"] * 1e-6) / 1e9
    return {
        "heads": heads,
        "batch": batch,
        "cache": cache,
        "rel_err": rel,
        "default_splits": default_splits,
        "best": best,
        "us": best["us"],
        "GBps": gbps,
        "peak_frac": gbps * 1e9 / PEAK_BYTES_PER_S,
        "all": results,
    }


def main() -> None:
    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    heads_list = [int(h) for h in os.environ.get("MLA_HEADS", "16,128").split(",")]
    batches = [int(b) for b in os.environ.get("MLA_BATCHES", "1,16,64,256").split(",")]
    for heads in heads_list:
        for batch in batches:
            for cache in ("bf16", "fp8", "fp8-dots")[: 3 if batch >= 64 else 2]:
                row = bench_shape(batch, heads, cache, num_sms)
                rows.append(row)
                b = row["best"]
                cfg = {k: v for k, v in b.items() if k != "us"}
                ok = "ok" if row["rel_err"] < REL_TOL[cache] else "MISMATCH"
                print(
                    f"H={heads:3d} B={batch:3d} {row['cache']:11s} rel_err={row['rel_err']:.1e} "
                    f"{ok} {row['us']:8.1f} us "
                    f"{row['GBps']:7.0f} GB/s {row['peak_frac']:.2f} of peak "
                    f"best {cfg} (default splits {row['default_splits']})",
                    flush=True,
                )
    print("\n  H    B cache            us    GB/s  peak splits BN BH w s")
    for row in rows:
        b = row["best"]
        print(
            f"{row['heads']:3d} {row['batch']:4d} {row['cache']:11s} {row['us']:7.1f} "
            f"{row['GBps']:7.0f} {row['peak_frac']:5.2f} {b['splits']:6d} {b['BLOCK_N']:2d} "
            f"{b.get('BLOCK_H', '-'):>2} {b['num_warps']} {b['num_stages']}"
        )
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "mla_decode.json"), "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(0), "ctx": CTX, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
