"""Micro-benchmark of the fused MoE Triton kernels on one CUDA GPU (H200 peaks by default).

Run from the repository root: ``PYTHONPATH=$PWD python3 scripts/gpu/bench_fused_moe.py``.
For DeepSeek-V2-Lite and V3 routed-expert shapes, T in (1, 16, 64, 256, 4096, 16384), uniform
random distinct experts per token, bf16 and FP4 weights: sweeps up to 6 launch configs per shape
(the default heuristic first), checks the default against the fp32 reference once per shape and
times each with ``triton.testing.do_bench`` (median). Bytes = weights of the experts actually hit
(FP4: codes + scales) + x read + out written; FLOPs = 6*T*k*H*I. The plain-PyTorch
``Experts.forward`` loop (bf16 weights) is timed for comparison. Prints a table; writes JSON to
``$OUT/fused_moe.json`` when ``OUT`` is set. Once ``BUDGET_S`` has passed, only the default
config is timed, so the whole run stays within about four minutes.

``--quick``: V2-Lite and V3 at T in (64, 256), bf16 and FP4, no torch loop. Per (model,
format) one set of <= 11 configs (defaults for T=64/256, the previous H200 best ones, SWAP_AB
variants; shared by both T so each compiles once) is run, checked against
``fused_moe_reference`` (rel err printed per config) and timed as the engine runs decode:
``fused_moe`` captured once in a CUDA graph, replayed 30 times, median per replay. Prints each
config, then per (model, T, format) a ``BEST`` line with the full config dict and a
``SPEEDUP`` line bf16 vs FP4. Configs not yet compiled are skipped once ``QUICK_BUDGET_S`` of
compiling runs are spent per (model, format).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import triton
import triton.testing
from torch import nn

from libs.engine.config import ModelConfig
from libs.engine.kernels.fused_moe import (
    Fp4Weight,
    default_config,
    fused_moe,
    fused_moe_reference,
    quantize_fp4,
)
from libs.engine.model.moe import Experts

PEAK_BW = 4.15e12  # B/s, H200 HBM3e
PEAK_FLOPS = 775e12  # dense bf16 FLOP/s quoted for comparison
SHAPES = {"v2_lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048)}  # E, k, H, I
TOKENS = (1, 16, 64, 256, 4096, 16384)
BUDGET_S = 170.0
CUDA = torch.device("cuda")


def candidate_configs(t: int, k: int, e: int, n: int, kdim: int, fp4: bool) -> list[dict[str, int]]:
    """The default first, then a few variations for the regime (at most 6, no duplicates)."""
    base = default_config(t, k, e, n, kdim, fp4)
    bm = base["BLOCK_M"]
    if bm < 128 and fp4:  # FP4 decode: decode ALU and activation re-reads vs tile width
        variants = [
            {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8},
            {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4},
            {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
            {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4},
            {"BLOCK_M": min(64, 2 * bm), "num_stages": 3},
        ]
    elif bm < 128:  # decode: bandwidth-bound, vary the weight tile
        variants = [
            {"BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 4},
            {"BLOCK_N": 64, "BLOCK_K": 256, "num_stages": 3},
            {"BLOCK_N": 128, "BLOCK_K": 128, "num_stages": 3},
            {"BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 5},
            {"BLOCK_M": min(64, 2 * bm), "BLOCK_N": 64, "BLOCK_K": 128, "num_stages": 4},
        ]
    else:  # prefill: compute-bound
        variants = [
            {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
            {"BLOCK_N": 256, "num_stages": 3},
            {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
            {"BLOCK_K": 128, "num_stages": 2},
            {"BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 2},
        ]
    out = [base]
    for v in variants:
        cfg = base | v
        if cfg not in out:
            out.append(cfg)
    return out


def _routing(t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.rand(t, e, device=CUDA).topk(k, dim=-1).indices
    weights = torch.rand(t, k, device=CUDA) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True), ids.unique()


def _expert_bytes(w13: torch.Tensor | Fp4Weight, w2: torch.Tensor | Fp4Weight) -> float:
    def per_expert(w: torch.Tensor | Fp4Weight) -> float:
        return (w.nbytes if isinstance(w, Fp4Weight) else w.numel() * w.element_size()) / w.shape[0]

    return per_expert(w13) + per_expert(w2)


def _torch_experts(w13: torch.Tensor, w2: torch.Tensor) -> Experts:
    e, two_i, h = w13.shape
    cfg = ModelConfig(
        n_routed_experts=e,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        hidden_size=h,
        moe_intermediate_size=two_i // 2,
    )
    experts = Experts(cfg, w13.dtype, torch.device("meta"))
    experts.w13 = nn.Parameter(w13, requires_grad=False)
    experts.w2 = nn.Parameter(w2, requires_grad=False)
    return experts


def graph_ms(fn: Any, replays: int = 50) -> float:
    """Median ms per replay of ``fn`` captured once in a CUDA graph (after one eager warm-up)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


# --quick sweep: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the SWAP_AB variants,
# shared by T=64 and T=256 (a config compiles once per model and format, whatever T is).
QUICK_SWAP = (
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 64, 64, 4, 3),
    (32, 64, 128, 4, 4),
    (32, 128, 128, 4, 3),
    (32, 128, 64, 4, 4),
    (64, 64, 128, 4, 4),
)
# Best non-swapped configs measured on an H200 (graph timing, v2-lite) before SWAP_AB existed.
QUICK_PREV_BEST = {
    "bf16": (
        {
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4,
        },
        {
            "BLOCK_M": 32,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "GROUP_M": 8,
            "num_warps": 4,
            "num_stages": 4,
        },
    ),
    "fp4": (
        {
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4,
        },
        {
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4,
        },
    ),
}
# Seconds of first runs (compiles) per (model, format), env QUICK_BUDGET_S overrides; once spent,
# configs not yet compiled are skipped (those already compiled are still timed at every T).
QUICK_BUDGET_S = float(os.environ.get("QUICK_BUDGET_S", "19"))


def quick_configs(name: str, fp4: bool) -> list[dict[str, Any]]:
    """Defaults for T=64 and T=256, the previous best configs, then SWAP_AB variants (<= 11)."""
    e, k, h, i = SHAPES[name]
    out: list[dict[str, Any]] = []
    cands = [default_config(t, k, e, 2 * i, h, fp4) for t in (64, 256)]
    cands += list(QUICK_PREV_BEST["fp4" if fp4 else "bf16"])
    cands += [
        {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "GROUP_M": 1,
            "num_warps": w,
            "num_stages": st,
            "SWAP_AB": True,
        }
        for bm, bn, bk, w, st in QUICK_SWAP
    ]
    for c in cands:
        c = {**c, "SWAP_AB": bool(c.get("SWAP_AB", False))}
        if c not in out:
            out.append(c)
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error, finite by construction (inf when out has a non-finite value)."""
    d = out.float() - ref.float()
    if not bool(torch.isfinite(d).all()):
        return float("inf")
    return (d.norm() / ref.float().norm().clamp_min(1e-30)).item()


def bench_quick(name: str, start: float, rows: list[dict[str, Any]]) -> None:
    """--quick: sweep configs (incl. SWAP_AB) at T=64/256, bf16 and FP4, CUDA-graph timing."""
    e, k, h, i = SHAPES[name]
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=CUDA, dtype=torch.bfloat16).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=CUDA, dtype=torch.bfloat16).mul_(i**-0.5)
    formats = {"bf16": (w13, w2), "fp4": (quantize_fp4(w13), quantize_fp4(w2))}
    compiled: set[tuple[str, str]] = set()
    spent = {fmt: 0.0 for fmt in formats}  # seconds in first (compiling) runs
    for t in (64, 256):
        x = torch.randn(t, h, device=CUDA, dtype=torch.bfloat16)
        ids, weights, hit = _routing(t, e, k)
        res: dict[str, dict[str, Any]] = {}
        for fmt, (a13, a2) in formats.items():
            ref = fused_moe_reference(x, a13, a2, weights, ids)
            out = torch.empty_like(x)
            moved = hit.numel() * _expert_bytes(a13, a2) + 2 * t * h * x.element_size()
            sweep: list[dict[str, Any]] = []
            for cfg in quick_configs(name, fmt == "fp4"):
                key = (fmt, repr(sorted(cfg.items())))
                if key not in compiled and spent[fmt] > QUICK_BUDGET_S:
                    print(f"  skip (budget) {name} T={t} {fmt} {cfg}", flush=True)
                    continue
                t0 = time.monotonic()
                try:
                    out.fill_(float("nan"))
                    fused_moe(x, a13, a2, weights, ids, out=out, config=cfg)
                    torch.cuda.synchronize()
                    if key not in compiled:
                        spent[fmt] += time.monotonic() - t0
                    compiled.add(key)
                    rel = _rel_err(out, ref)
                    g_ms = graph_ms(
                        lambda cfg=cfg: fused_moe(x, a13, a2, weights, ids, out=out, config=cfg),
                        replays=30,
                    )
                except Exception as exc:  # noqa: BLE001 - report and keep sweeping
                    spent[fmt] += time.monotonic() - t0
                    print(
                        f"  fail {name} T={t} {fmt} {cfg}: {type(exc).__name__}: {str(exc)[:120]}",
                        flush=True,
                    )
                    continue
                ok = rel < 0.03  # bf16 activations and intermediate vs fp32 reference
                sweep.append({"graph_ms": g_ms, "config": cfg, "rel_err_vs_ref": rel, "ok": ok})
                print(
                    f"  {name} T={t} {fmt} {g_ms:.4f} ms rel {rel:.2e}{'' if ok else ' BAD'} {cfg}",
                    flush=True,
                )
            del ref
            good = [r for r in sweep if r["ok"]]
            if not good:
                print(f"{name} T={t} {fmt}: no correct config", flush=True)
                continue
            best = min(good, key=lambda r: r["graph_ms"])
            res[fmt] = {
                "model": name,
                "format": fmt,
                "T": t,
                "experts_hit": hit.numel(),
                "graph_best_ms": best["graph_ms"],
                "best_config": best["config"],
                "rel_err_vs_ref": best["rel_err_vs_ref"],
                "bytes": moved,
                "GBps_graph": moved / best["graph_ms"] / 1e6,
                "sweep": sweep,
            }
            rows.append(res[fmt])
            print(
                f"BEST {name} T={t} {fmt}: graph {best['graph_ms']:.4f} ms "
                f"{res[fmt]['GBps_graph']:.0f} GB/s rel {best['rel_err_vs_ref']:.2e} "
                f"config {best['config']}  [{time.monotonic() - start:.0f}s]",
                flush=True,
            )
        if "fp4" in res and "bf16" in res:
            b, f = res["bf16"], res["fp4"]
            print(
                f"SPEEDUP {name} T={t}: bf16 {b['graph_best_ms']:.4f} ms / fp4 "
                f"{f['graph_best_ms']:.4f} ms = {b['graph_best_ms'] / f['graph_best_ms']:.2f}x "
                f"(fp4/bf16 time {f['graph_best_ms'] / b['graph_best_ms']:.2f})",
                flush=True,
            )
    del formats, w13, w2
    torch.cuda.empty_cache()


def bench_model(name: str, start: float, rows: list[dict[str, Any]]) -> None:
    e, k, h, i = SHAPES[name]
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=CUDA, dtype=torch.bfloat16).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=CUDA, dtype=torch.bfloat16).mul_(i**-0.5)
    formats: dict[str, tuple[torch.Tensor | Fp4Weight, torch.Tensor | Fp4Weight]] = {
        "bf16": (w13, w2),
        "fp4": (quantize_fp4(w13), quantize_fp4(w2)),
    }
    experts = _torch_experts(w13, w2)
    for t in TOKENS:
        x = torch.randn(t, h, device=CUDA, dtype=torch.bfloat16)
        ids, weights, hit = _routing(t, e, k)
        torch_ms = triton.testing.do_bench(
            lambda f=experts: f(x, weights, ids), warmup=5, rep=30, return_mode="median"
        )
        flops = 6.0 * t * k * h * i
        for fmt, (a13, a2) in formats.items():
            moved = hit.numel() * _expert_bytes(a13, a2) + 2 * t * h * x.element_size()
            configs = candidate_configs(t, k, e, 2 * i, h, fmt == "fp4")
            if time.monotonic() - start > BUDGET_S:
                configs = configs[:1]
            out = torch.empty_like(x)
            ref = fused_moe_reference(x, a13, a2, weights, ids)
            fused_moe(x, a13, a2, weights, ids, out=out, config=configs[0])
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            del ref
            timings: list[tuple[float, dict[str, int]]] = []
            for cfg in configs:
                try:
                    ms = triton.testing.do_bench(
                        lambda cfg=cfg: fused_moe(x, a13, a2, weights, ids, out=out, config=cfg),
                        warmup=5,
                        rep=30,
                        return_mode="median",
                    )
                except triton.runtime.errors.OutOfResources:
                    continue
                timings.append((ms, cfg))
            ms, best = min(timings, key=lambda p: p[0])
            row = {
                "model": name,
                "format": fmt,
                "T": t,
                "experts_hit": hit.numel(),
                "rel_err_vs_ref": rel,
                "ms": ms,
                "default_ms": timings[0][0],
                "best_config": best,
                "bytes": moved,
                "GBps": moved / ms / 1e6,
                "bw_frac": moved / (ms * 1e-3) / PEAK_BW,
                "TFLOPs": flops / ms / 1e9,
                "flop_frac": flops / (ms * 1e-3) / PEAK_FLOPS,
                "torch_ms": torch_ms,
                "speedup_vs_torch": torch_ms / ms,
                "sweep": [{"ms": m, "config": c} for m, c in timings],
            }
            rows.append(row)
            print(
                f"{name:8s} {fmt:4s} T={t:6d} {ms:8.3f} ms (default {timings[0][0]:.3f}) "
                f"rel_err {rel:.1e}  [{time.monotonic() - start:.0f}s]",
                flush=True,
            )
    del formats, experts, w13, w2
    torch.cuda.empty_cache()


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':8s} {'fmt':4s} {'T':>6s} {'hit':>4s} {'ms':>8s} {'dflt ms':>8s} "
        f"{'GB/s':>7s} {'%BW':>5s} {'TFLOP/s':>8s} {'%peak':>6s} {'torch ms':>9s} "
        f"{'speedup':>7s} {'rel err':>8s}  best (BM,BN,BK,G,w,s)"
    )
    lines = [head]
    for r in rows:
        c = r["best_config"]
        best = ",".join(
            str(c[key])
            for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
        )
        lines.append(
            f"{r['model']:8s} {r['format']:4s} {r['T']:6d} {r['experts_hit']:4d} {r['ms']:8.3f} "
            f"{r['default_ms']:8.3f} {r['GBps']:7.0f} {100 * r['bw_frac']:5.1f} "
            f"{r['TFLOPs']:8.1f} {100 * r['flop_frac']:6.1f} {r['torch_ms']:9.3f} "
            f"{r['speedup_vs_torch']:7.2f} {r['rel_err_vs_ref']:8.1e}  ({best})"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="V2-Lite and V3 at T=64/256 (+4096 bf16), CUDA-graph timings",
    )
    args = parser.parse_args()
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for name in SHAPES:
        (bench_quick if args.quick else bench_model)(name, start, rows)
    if not args.quick:
        print(_table(rows))
    print(f"total {time.monotonic() - start:.0f} s on {torch.cuda.get_device_name()}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "fused_moe.json"), "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "peak_bw": PEAK_BW,
                    "peak_flops": PEAK_FLOPS,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
