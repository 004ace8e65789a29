"""The block-scaled FP8 GEMM on the device (Hopper e4m3 tensor cores) against the reference."""

from __future__ import annotations

import pytest
import torch

from libs.engine.kernels.fp8_gemm import fp8_linear, fp8_linear_reference, quantize_fp8_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "m,n,k", [(1, 576, 7168), (7, 200, 300), (64, 2048, 7168), (300, 7168, 2048), (1000, 4096, 512)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemm_matches_reference_on_device(m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    w = quantize_fp8_blocks(0.02 * torch.randn(n, k, generator=g, device="cuda"))
    b = torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16) if bias else None
    out = fp8_linear(x, w, b, kernel=True)
    ref = fp8_linear_reference(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # Same quantized operands; fp32 accumulation in a different order, then one bf16 rounding.
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=1.6e-2, atol=1e-2 * ref.abs().max().item()
    )


@pytest.mark.parametrize("m,n,k", [(1, 576, 7168), (16, 3072, 2048), (256, 2048, 2816)])
def test_activation_quantization_in_the_gemm_gives_the_two_launch_bytes(
    m: int, n: int, k: int
) -> None:
    """QUANT_A quantizes each K step's activation tile in the GEMM: on real e4m3 (hardware
    rounding) the output equals quantizer-then-GEMM bit for bit, tiles and split-K alike."""
    from libs.engine.kernels.fp8_gemm import _gemm_config, fp8_gemm, quantize_fp8_tokens

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    w = quantize_fp8_blocks(0.02 * torch.randn(n, k, generator=g, device="cuda"))
    xq, xs = quantize_fp8_tokens(x, kernel=True)
    for cfg in (_gemm_config(m, n, k), _gemm_config(m, n, k) | {"SPLIT_K": 1}):
        two = fp8_gemm(xq, xs, w, torch.bfloat16, config=cfg)
        assert torch.equal(fp8_gemm(x, None, w, torch.bfloat16, config=cfg), two)
