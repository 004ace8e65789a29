"""The FP8 linear against bf16 cuBLAS on V2-Lite's dense shapes, timed as the engine runs them:
each variant captured in a CUDA graph and replayed (``do_bench_cudagraph``), so host launch
cost is out. Per row count: bf16 ``x @ w.T``, the default FP8 path, and launch configs with the
activations quantized by a separate launch ("2L") or inside the GEMM ("fused").

Run: PYTHONPATH=$PWD python3 scripts/gpu/bench_fp8_gemm.py [--json OUT] [--rows 1,64,256]
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from triton.testing import do_bench_cudagraph

from libs.engine.kernels.fp8_gemm import (
    _gemm_config,
    fp8_gemm,
    fp8_linear,
    quantize_fp8_blocks,
    quantize_fp8_tokens,
)

SHAPES = {
    "q_proj": (3072, 2048),
    "kv_a": (576, 2048),
    "o_proj": (2048, 2048),
    "shared_gate_up": (5632, 2048),
    "shared_down": (2048, 2816),
}


def _cfg(bm: int, bn: int, warps: int, stages: int, split: int = 1, gm: int = 8) -> dict[str, int]:
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "GROUP_M": gm,
        "SPLIT_K": split,
        "num_warps": warps,
        "num_stages": stages,
    }


def candidates(m: int, n: int, k: int) -> dict[str, dict[str, int]]:
    out = {"default": _gemm_config(m, n, k)}
    if m <= 512:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        for split in (1, 2, 4):
            out[f"{bm}x64 w4 s3 k{split}"] = _cfg(bm, 64, 4, 3, split, 1)
            out[f"{bm}x128 w4 s4 k{split}"] = _cfg(bm, 128, 4, 4, split, 1)
        out["128x128 w8 s4"] = _cfg(128, 128, 8, 4)
    else:
        out["128x128 w8 s4"] = _cfg(128, 128, 8, 4)
        out["128x128 w8 s3"] = _cfg(128, 128, 8, 3)
        out["64x128 w4 s4"] = _cfg(64, 128, 4, 4)
        out["128x64 w4 s4"] = _cfg(128, 64, 4, 4)
        out["256x128 w8 s3"] = _cfg(256, 128, 8, 3)
    return out


def us(fn: Any) -> float:
    return do_bench_cudagraph(fn, rep=40) * 1e3


def main() -> None:
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    rows_arg = sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else None
    row_counts = [int(r) for r in rows_arg.split(",")] if rows_arg else [1, 64, 256, 16384]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        wb = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(torch.bfloat16)
        w8 = quantize_fp8_blocks(wb)
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            xq, xs = quantize_fp8_tokens(x, kernel=True)
            r: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k}
            r["bf16_us"] = us(lambda: x @ wb.T)
            r["default_us"] = us(lambda: fp8_linear(x, w8, kernel=True))
            r["quant_us"] = us(lambda: quantize_fp8_tokens(x, kernel=True))
            var = {}
            for label, c in candidates(m, n, k).items():
                var[label + " 2L"] = r["quant_us"] + us(
                    lambda c=c: fp8_gemm(xq, xs, w8, torch.bfloat16, config=c)
                )
                if m <= 512:
                    var[label + " fused"] = us(
                        lambda c=c: fp8_gemm(x, None, w8, torch.bfloat16, config=c)
                    )
            r["variants_us"] = var
            best = min(var, key=var.get)
            r["best"] = best
            ref = x.float() @ wb.float().T
            got = fp8_linear(x, w8, kernel=True).float()
            r["rel_err"] = float((got - ref).norm() / ref.norm())
            rows.append(r)
            print(
                f"{name:15s} m={m:6d} bf16 {r['bf16_us']:7.1f} us | fp8 default "
                f"{r['default_us']:7.1f} | best {var[best]:7.1f} ({best}) | "
                f"quant {r['quant_us']:.1f} | err {r['rel_err']:.4f}",
                flush=True,
            )
            top = sorted(var.items(), key=lambda kv: kv[1])[:5]
            print("    " + ", ".join(f"{lbl} {v:.1f}" for lbl, v in top), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
