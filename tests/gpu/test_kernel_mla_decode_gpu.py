"""The Triton paged MLA decode kernel at DeepSeek shapes on a CUDA device.

R = 512, P = 64, 128-token pages, H in (16, 128), B in (1, 16, 64, 256), contexts up to 4K
with a zero-length padding row, shuffled page tables over a pool larger than needed.
Tolerances (||out - ref|| / ||ref||): bf16 < 1e-2 against the fp32 reference on the same bf16
inputs (the kernel rounds probabilities and the output to bf16: ~2^-9 each); fp8 < 1e-2
against the reference on the same quantized cache and < 5e-2 against the unquantized one;
fp32 (IEEE dots) < 1e-4. With e4m3 dots (``fp8_dots``: the query and the probabilities
rounded to e4m3 as well, ~2.3% each) < 5e-2 against the quantized-cache reference and < 8e-2
against the unquantized one. bf16 runs only here: Triton's CPU interpreter gets bf16 tl.dot wrong.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.engine.kernels.mla_decode import (  # noqa: E402
    mla_decode,
    mla_decode_reference,
    quantize_latent_fp8,
)

R, P, BLOCK = 512, 64, 128


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _case(batch: int, heads: int, max_ctx: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen, device="cuda")
    lens[0] = max_ctx
    if batch > 1:
        lens[-1] = 0  # CUDA-graph padding row
    max_blocks = -(-max_ctx // BLOCK)
    pool = batch * max_blocks + 64
    pages = torch.randperm(pool, generator=gen, device="cuda")[: batch * max_blocks]
    table = pages.view(batch, max_blocks).int()
    q = torch.randn(batch, heads, R + P, generator=gen, device="cuda").to(dtype)
    kv = torch.randn(pool * BLOCK, R + P, generator=gen, device="cuda").to(dtype)
    return dict(
        q_lat=q[..., :R],
        q_pe=q[..., R:],
        latent=kv[:, :R],
        rope=kv[:, R:],
        block_table=table,
        seq_lens=lens.int(),
        block_size=BLOCK,
        sm_scale=192**-0.5,
    )


def _checked_run(case: dict, **kw: object) -> torch.Tensor:
    out = torch.full_like(case["q_lat"], float("nan"), memory_format=torch.contiguous_format)
    mla_decode(**case, out=out, **kw)  # type: ignore[arg-type]
    assert not out.isnan().any()
    assert (out[case["seq_lens"] == 0] == 0).all()
    return out


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("batch,max_ctx", [(1, 4096), (16, 4096), (64, 2048), (256, 1024)])
def test_bf16(batch: int, heads: int, max_ctx: int) -> None:
    case = _case(batch, heads, max_ctx, torch.bfloat16, seed=batch + heads)
    ref = mla_decode_reference(**case)
    for splits in (None, 1, 4):
        assert _rel(_checked_run(case, num_splits=splits), ref) < 1e-2


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("batch,max_ctx", [(1, 4096), (64, 2048), (256, 1024)])
def test_fp8(batch: int, heads: int, max_ctx: int) -> None:
    case = _case(batch, heads, max_ctx, torch.bfloat16, seed=7 * batch + heads)
    exact = mla_decode_reference(**case)
    latent8, scale = quantize_latent_fp8(case["latent"])
    case8 = dict(case, latent=latent8, rope=case["rope"], kv_scale=scale)
    ref8 = mla_decode_reference(**case8)
    for splits in (None, 1, 4):
        out = _checked_run(case8, num_splits=splits)
        assert _rel(out, ref8) < 1e-2
        assert _rel(out, exact) < 5e-2
        out = _checked_run(case8, num_splits=splits, fp8_dots=True)
        assert _rel(out, ref8) < 5e-2
        assert _rel(out, exact) < 8e-2


def test_fp32_ieee() -> None:
    case = _case(4, 16, 1024, torch.float32, seed=3)
    assert _rel(_checked_run(case, num_splits=3), mla_decode_reference(**case)) < 1e-4


def test_cuda_graph_replay_follows_new_lengths_and_tables() -> None:
    """Captured once, replayed after seq_lens / block_table change in place."""
    case = _case(16, 128, 2048, torch.bfloat16, seed=11)
    out = torch.empty_like(case["q_lat"], memory_format=torch.contiguous_format)
    mla_decode(**case, num_splits=4, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(**case, num_splits=4, out=out)
    new = _case(16, 128, 2048, torch.bfloat16, seed=12)
    case["seq_lens"].copy_(new["seq_lens"])
    case["block_table"].copy_(new["block_table"])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, mla_decode_reference(**case)) < 1e-2
