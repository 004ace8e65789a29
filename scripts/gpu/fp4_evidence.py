"""Why FP4 experts do not pay on Hopper: the e2m1 decode, measured apart from everything else.

Run from the repository root: ``PYTHONPATH=$PWD python3 scripts/gpu/fp4_evidence.py``
(``--check``: small shapes, each mode against PyTorch; runs under ``TRITON_INTERPRET=1`` too).

One Triton kernel, the fused MoE's decode-time structure (a 32-row activation tile against
128-column weight tiles streamed along K, ``tl.dot`` on the tensor cores, fp32 accumulator),
over one large weight ``W [N, K]`` in four formats:

* ``bf16``: the weights as they are;
* ``fp4``: e2m1 codes, two per byte, one bf16 scale per 32 (the engine's ``Fp4Weight``),
  decoded in registers exactly as the fused MoE does (``_e2m1_halves``: integer masks, fp16
  bit patterns, scale multiply, bf16) before the bf16 MMA -- Hopper has no FP4 MMA;
* ``fp4-nodecode``: the same packed bytes, widened by one int-to-bf16 conversion per byte and
  no scales (wrong numbers on purpose): what the tile structure alone reaches on FP4's bytes;
* ``fp8``: e4m3 weights with one fp32 scale per 128x128 tile, activations e4m3 per 128
  channels, one e4m3 MMA per 128-wide K step (the engine's FP8 experts).

Printed per format: time, weight bytes per second and weight elements per second, and the
elements per second against bf16's. If ``fp4`` streams far below ``fp4-nodecode``, the decode
(integer and conversion work on the CUDA cores per weight element) bounds the FP4 GEMM, not
its bytes. Writes ``$OUT/fp4_evidence.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import triton
import triton.language as tl

from libs.engine.kernels.fp8_gemm import quantize_fp8_blocks

# The fused MoE's own pieces: the e2m1 decode and its dots (upcast under the interpreter).
from libs.engine.kernels.fused_moe import _dot, _dot8, _e2m1_halves, dequantize_fp4, quantize_fp4

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MODES = {"bf16": 0, "fp4": 1, "fp4-nodecode": 2, "fp8": 3}


@triton.jit
def _probe(  # type: ignore[no-untyped-def]
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[M, BLOCK_N tile] = x[M, K] @ W[tile, K]^T in the format MODE says."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M)
    acc = tl.zeros([M, BLOCK_N], dtype=tl.float32)
    if MODE == 0:
        kk = tl.arange(0, 64)
        for k0 in range(0, K, 64):
            a = tl.load(x_ptr + m[:, None] * K + (k0 + kk)[None, :])
            b = tl.load(w_ptr + n[None, :] * K + (k0 + kk)[:, None])
            acc = _dot(a, b, acc, "tf32", UPCAST)
    elif MODE == 3:
        kk = tl.arange(0, 128)
        for k0 in range(0, K, 128):
            a = tl.load(x_ptr + m[:, None] * K + (k0 + kk)[None, :])
            b = tl.load(w_ptr + n[None, :] * K + (k0 + kk)[:, None])
            part = _dot8(a, b, UPCAST)
            a_s = tl.load(xs_ptr + m * (K // 128) + k0 // 128)
            w_s = tl.load(s_ptr + (n // 128) * (K // 128) + k0 // 128)
            acc += part * (a_s[:, None] * w_s[None, :])
    else:
        j = tl.arange(0, 32)
        for kb in range(0, K // 2, 32):  # 32 bytes: one 64-wide group of elements
            kg = 2 * kb
            a_lo = tl.load(x_ptr + m[:, None] * K + (kg + j)[None, :])
            a_hi = tl.load(x_ptr + m[:, None] * K + (kg + 32 + j)[None, :])
            byte = tl.load(w_ptr + n[None, :] * (K // 2) + (kb + j)[:, None])
            if MODE == 1:
                s_lo = tl.load(s_ptr + n * (K // 32) + kb // 16).to(tl.float32) * 16384.0
                s_hi = tl.load(s_ptr + n * (K // 32) + kb // 16 + 1).to(tl.float32) * 16384.0
                c_lo, c_hi = _e2m1_halves(byte)
                w_lo = (c_lo * s_lo[None, :]).to(a_lo.dtype)
                w_hi = (c_hi * s_hi[None, :]).to(a_lo.dtype)
            else:
                w_lo = byte.to(a_lo.dtype)
                w_hi = w_lo
            acc = _dot(a_lo, w_lo, acc, "tf32", UPCAST)
            acc = _dot(a_hi, w_hi, acc, "tf32", UPCAST)
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc)


def make(mode: str, n: int, k: int, m: int, device: str, seed: int = 0) -> dict[str, Any]:
    """Inputs of one format and the PyTorch result it must give (None for fp4-nodecode)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device, dtype=torch.float32).bfloat16()
    x = torch.randn(m, k, generator=g, device=device, dtype=torch.float32).bfloat16()
    dummy = torch.zeros(1, device=device)
    if mode == "bf16":
        return dict(x=x, xs=dummy, w=w, s=dummy, bytes=w.nbytes, want=x.float() @ w.float().T)
    if mode == "fp8":
        q = quantize_fp8_blocks(w)
        xg = x.float().view(m, k // 128, 128)
        xs = (xg.abs().amax(-1) / 448.0).clamp_min(1e-12)
        x8 = (xg / xs[..., None]).to(torch.float8_e4m3fn).view(m, k)
        xd = (x8.float().view(m, k // 128, 128) * xs[..., None]).view(m, k)
        wd = q.q.float() * q.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return dict(
            x=x8,
            xs=xs.contiguous(),
            w=q.q,
            s=q.scale.contiguous(),
            bytes=q.q.nbytes + q.scale.nbytes,
            want=xd @ wd[:n, :k].T,
        )
    q4 = quantize_fp4(w[None])
    packed, scales = q4.packed[0].contiguous(), q4.scales[0].contiguous()
    if mode == "fp4":
        want = x.float() @ dequantize_fp4(q4, torch.float32)[0].T
        return dict(x=x, xs=dummy, w=packed, s=scales, bytes=q4.nbytes, want=want)
    return dict(x=x, xs=dummy, w=packed, s=dummy, bytes=packed.nbytes, want=None)


def run(args: dict[str, Any], mode: str, n: int, k: int, m: int, out: torch.Tensor) -> None:
    block_n = 128
    _probe[(n // block_n,)](
        args["x"],
        args["xs"],
        args["w"],
        args["s"],
        out,
        n,
        K=k,
        M=m,
        BLOCK_N=block_n,
        MODE=MODES[mode],
        UPCAST=_INTERPRET,
        num_warps=4,
        num_stages=3,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="small shapes against PyTorch only")
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--rows", type=int, default=32, help="activation rows (a decode-time tile)")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not _INTERPRET else "cpu"
    n, k, m = (256, 256, 16) if a.check else (a.n, a.k, a.rows)
    rows = []
    for mode in MODES:
        args = make(mode, n, k, m, device)
        out = torch.empty(m, n, device=device)
        run(args, mode, n, k, m, out)
        err = None
        if args["want"] is not None:
            err = float((out - args["want"]).norm() / args["want"].norm())
        row: dict[str, Any] = {"mode": mode, "rel_err": err, "weight_bytes": args["bytes"]}
        if not a.check:
            ms = triton.testing.do_bench(
                lambda args=args, mode=mode: run(args, mode, n, k, m, out), return_mode="median"
            )
            row.update(
                ms=ms,
                TBps=args["bytes"] / (ms * 1e-3) / 1e12,
                Telem_per_s=n * k / (ms * 1e-3) / 1e12,
            )
        rows.append(row)
        del args
    base = next(r for r in rows if r["mode"] == "bf16")
    for r in rows:
        if "ms" in r:
            r["elements_vs_bf16"] = r["Telem_per_s"] / base["Telem_per_s"]
        timing = (
            f"{r['ms']:8.3f} ms {r['TBps']:5.2f} TB/s {r['Telem_per_s']:5.2f} Telem/s "
            f"{r['elements_vs_bf16']:4.2f}x bf16"
            if "ms" in r
            else ""
        )
        err = "" if r["rel_err"] is None else f"rel_err {r['rel_err']:.1e}"
        print(f"{r['mode']:13s} {timing} {err}", flush=True)
    if a.check:
        bad = [r["mode"] for r in rows if r["rel_err"] is not None and r["rel_err"] > 2e-2]
        if bad:
            raise SystemExit(f"modes off their PyTorch result: {bad}")
    out_dir = os.environ.get("OUT")
    if out_dir and not a.check:
        name = torch.cuda.get_device_name(0)
        with open(os.path.join(out_dir, "fp4_evidence.json"), "w") as f:
            json.dump({"device": name, "n": n, "k": k, "rows": m, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
