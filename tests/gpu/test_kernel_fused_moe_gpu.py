"""Fused MoE kernels compiled on a CUDA device, at DeepSeek-V2-Lite and V3 expert shapes.

bf16 activations and weights (bf16 or FP4) against the fp32 ``fused_moe_reference`` on the same
(for FP4: decoded) weights: relative Frobenius error < 1e-2. Also checks that one call can be
captured in a CUDA graph and replayed on new routing (no host synchronisation inside).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.engine.kernels.fp8_gemm import Fp8Weight, quantize_fp8_blocks  # noqa: E402
from libs.engine.kernels.fused_moe import (  # noqa: E402
    Fp4Weight,
    _align,
    fused_moe,
    fused_moe_reference,
    quantize_fp4,
)

CUDA = torch.device("cuda")
# name: (E, k, H, I)
SHAPES = {"v2_lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048)}
TOKENS = (1, 64, 256, 4096)

Weights = tuple[torch.Tensor, torch.Tensor, Fp4Weight, Fp4Weight]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request: pytest.FixtureRequest) -> Iterator[tuple[str, Weights]]:
    e, _, h, i = SHAPES[request.param]
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=CUDA, dtype=torch.bfloat16).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=CUDA, dtype=torch.bfloat16).mul_(i**-0.5)
    yield request.param, (w13, w2, quantize_fp4(w13), quantize_fp4(w2))
    del w13, w2
    torch.cuda.empty_cache()


def _inputs(name: str, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e, k, h, _ = SHAPES[name]
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=CUDA).to(torch.bfloat16)
    ids = torch.rand(t, e, generator=g, device=CUDA).topk(k, dim=-1).indices
    weights = torch.rand(t, k, generator=g, device=CUDA) + 0.1
    return x, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("fp4", [False, True], ids=["bf16", "fp4"])
def test_matches_reference(model: tuple[str, Weights], t: int, fp4: bool) -> None:
    name, (w13, w2, q13, q2) = model
    x, weights, ids = _inputs(name, t, seed=t)
    a13, a2 = (q13, q2) if fp4 else (w13, w2)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, a13, a2, weights, ids, out=out)
    torch.cuda.synchronize()
    ref = fused_moe_reference(x, a13, a2, weights, ids)
    assert bool(out.isfinite().all())
    assert _rel(out, ref) < 1e-2, f"{name} T={t} fp4={fp4}"


def test_all_tokens_to_one_expert(model: tuple[str, Weights]) -> None:
    name, (w13, w2, q13, _) = model
    e, k, _, _ = SHAPES[name]
    x, weights, _ = _inputs(name, 256, seed=7)
    scores = torch.rand(256, e, device=CUDA)
    scores[:, 5] = 2.0  # expert 5 is in every token's top-k
    ids = scores.topk(k, dim=-1).indices
    for a13 in (w13, q13):
        out = fused_moe(x, a13, w2, weights, ids)
        assert _rel(out, fused_moe_reference(x, a13, w2, weights, ids)) < 1e-2


@pytest.mark.parametrize("t", [1, 64])
def test_cuda_graph_capture_and_replay(model: tuple[str, Weights], t: int) -> None:
    name, (_, _, q13, q2) = model
    x, weights, ids = _inputs(name, t, seed=11)
    out = torch.empty_like(x)
    fused_moe(x, q13, q2, weights, ids, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, q13, q2, weights, ids, out=out)
    for seed in (12, 13):
        x2, weights2, ids2 = _inputs(name, t, seed=seed)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, fused_moe_reference(x, q13, q2, weights, ids)) < 1e-2


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("t", [1, 64, 256, 2048])
def test_align_kernel_matches_sort(name: str, t: int) -> None:
    e, k, _, _ = SHAPES[name]
    _, _, ids = _inputs(name, t, seed=t)
    skewed = ids.clone()
    skewed[:, 0] = 3  # expert 3 in every token
    for block_m in (16, 64):
        for routing in (ids, skewed):
            got = _align(routing, e, block_m, method="kernel")
            want = _align(routing, e, block_m, method="sort")
            assert got[3] == want[3]
            for a, b in zip(got[:3], want[:3], strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("t", [1, 64, 256])
@pytest.mark.parametrize("fp4", [False, True], ids=["bf16", "fp4"])
@pytest.mark.parametrize(("block_m", "block_n", "block_k"), [(16, 64, 128), (32, 128, 64)])
def test_swap_ab_matches_reference(
    model: tuple[str, Weights], t: int, fp4: bool, block_m: int, block_n: int, block_k: int
) -> None:
    name, (w13, w2, q13, q2) = model
    x, weights, ids = _inputs(name, t, seed=t + 100)
    a13, a2 = (q13, q2) if fp4 else (w13, w2)
    cfg = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": 1,
        "num_warps": 4,
        "num_stages": 4,
        "SWAP_AB": True,
    }
    out = torch.full_like(x, float("nan"))
    fused_moe(x, a13, a2, weights, ids, out=out, config=cfg)
    torch.cuda.synchronize()
    ref = fused_moe_reference(x, a13, a2, weights, ids)
    assert bool(out.isfinite().all())
    assert _rel(out, ref) < 1e-2, f"{name} T={t} fp4={fp4} {cfg}"


# -- FP8 experts: e4m3 weights with 128x128 block scales, activations quantized per token -----


@pytest.fixture(scope="module", params=list(SHAPES))
def fp8_model(request: pytest.FixtureRequest) -> Iterator[tuple[str, Fp8Weight, Fp8Weight]]:
    e, _, h, i = SHAPES[request.param]
    torch.manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device=CUDA, dtype=torch.bfloat16).mul_(h**-0.5)
    q13 = quantize_fp8_blocks(w13)
    del w13
    w2 = torch.randn(e, h, i, device=CUDA, dtype=torch.bfloat16).mul_(i**-0.5)
    q2 = quantize_fp8_blocks(w2)
    del w2
    yield request.param, q13, q2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("t", TOKENS)
def test_fp8_matches_reference(fp8_model: tuple[str, Fp8Weight, Fp8Weight], t: int) -> None:
    """Hopper's e4m3 dots against the fp32 reference on the same quantized operands; what
    differs beyond summation order is the bf16 rounding of ``silu(gate) * up`` before its own
    FP8 quantization (an e4m3 step where it flips a rounding)."""
    name, q13, q2 = fp8_model
    x, weights, ids = _inputs(name, t, seed=t + 50)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, q13, q2, weights, ids, out=out)
    torch.cuda.synchronize()
    ref = fused_moe_reference(x, q13, q2, weights, ids)
    assert bool(out.isfinite().all())
    assert _rel(out, ref) < 3e-2, f"{name} T={t}"


def test_fp8_cuda_graph_capture_and_replay(fp8_model: tuple[str, Fp8Weight, Fp8Weight]) -> None:
    name, q13, q2 = fp8_model
    x, weights, ids = _inputs(name, 64, seed=21)
    out = torch.empty_like(x)
    fused_moe(x, q13, q2, weights, ids, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, q13, q2, weights, ids, out=out)
    for seed in (22, 23):
        x2, weights2, ids2 = _inputs(name, 64, seed=seed)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, fused_moe_reference(x, q13, q2, weights, ids)) < 3e-2
