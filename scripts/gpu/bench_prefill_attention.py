"""Prompt attention on the H200: which fused SDPA backend and value padding is fastest.

Causal attention over one L-token prompt, DeepSeek shapes (q/k head dim 192, v head dim 128),
H = 16 (V2-Lite) and 128 (V3). Prints TFLOP/s for each variant (FLOPs of the causal half:
2 * H * L^2/2 * (192 + 128)). Run: PYTHONPATH=$PWD python3 scripts/gpu/bench_prefill_attention.py
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def main() -> None:
    rows = []
    for heads in (16, 128):
        for length in (4096, 16384, 32768):
            q = torch.randn(1, heads, length, 192, device="cuda", dtype=torch.bfloat16)
            k = torch.randn_like(q)
            v = torch.randn(1, heads, length, 128, device="cuda", dtype=torch.bfloat16)
            vp = F.pad(v, (0, 64))
            flops = 2 * heads * length * length / 2 * (192 + 128)
            ref = None
            for name, backend, vv in (("flash+pad", SDPBackend.FLASH_ATTENTION, vp),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION, v),
                                      ("cudnn+pad", SDPBackend.CUDNN_ATTENTION, vp),
                                      ("efficient", SDPBackend.EFFICIENT_ATTENTION, v)):
                try:
                    with sdpa_kernel([backend]):
                        fn = lambda: F.scaled_dot_product_attention(q, k, vv, is_causal=True)  # noqa: E731
                        out = fn()[..., :128]
                        ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"H={heads} L={length} {name}: unavailable ({str(exc)[:80]})")
                    continue
                if ref is None:
                    ref = out.float()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                tf = flops / ms / 1e9
                rows.append({"heads": heads, "tokens": length, "variant": name, "ms": ms, "tflops": tf, "rel_err": err})
                print(f"H={heads:>3} L={length:>6} {name:<10} {ms:8.3f} ms {tf:7.1f} TFLOP/s  err {err:.1e}")
            del q, k, v, vp
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefill_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
