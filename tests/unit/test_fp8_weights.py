"""FP8 (e4m3, 128x128 block scales) weights: format, Triton GEMM, checkpoint load, engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepserve.bench.engine import bench_quality, capture_logits, compare_logits, quality_inputs
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kernels.fp8_gemm import (
    FP8_DTYPE,
    Fp8Weight,
    dequantize_fp8_blocks,
    fp8_linear,
    fp8_linear_reference,
    quantize_fp8_blocks,
    quantize_fp8_tokens,
)
from libs.engine.model.layers import Fp8Linear
from libs.engine.sizing import _weight_dtype
from tests.hf_reference import require_reference


def test_block_scales_follow_the_checkpoint_convention() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)  # partial tiles on both edges
    q = quantize_fp8_blocks(w)
    assert q.q.dtype == FP8_DTYPE and q.q.shape == (200, 300) and q.scale.shape == (2, 3)
    # weight_scale_inv multiplies: w ~ q * s per tile, s = amax(tile) / 448
    assert torch.equal(q.scale[1, 2], w[128:, 256:].abs().max() / 448)
    s = q.scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(dequantize_fp8_blocks(q), q.q.float() * s)
    err = (dequantize_fp8_blocks(q) - w).abs() / s
    assert err.max() <= 16  # half an e4m3 step at the top binade (step 32 of 448)
    # A checkpoint's tiles (largest element +-448) re-quantize to themselves, bit for bit.
    again = quantize_fp8_blocks(dequantize_fp8_blocks(q))
    assert torch.equal(again.q.view(torch.uint8), q.q.view(torch.uint8))
    assert torch.equal(again.scale, q.scale)
    zero = quantize_fp8_blocks(torch.zeros(3, 4, 130))  # stacked experts, an all-zero tile
    assert zero.scale.shape == (3, 1, 2) and torch.all(zero.scale == 1)


def test_activations_get_one_scale_per_token_and_group() -> None:
    x = torch.randn(5, 260, generator=torch.Generator().manual_seed(1))
    xq, xs = quantize_fp8_tokens(x)
    assert xs.shape == (5, 3)
    torch.testing.assert_close(xs[:, 1], x[:, 128:256].abs().amax(-1) / 448)
    back = xq.float() * xs.repeat_interleave(128, -1)[:, :260]
    assert ((back - x).abs() <= xs.repeat_interleave(128, -1)[:, :260] * 16).all()


def test_activation_quantization_kernel_matches_torch() -> None:
    """The one-launch Triton quantizer (the CUDA path) gives the torch ops' bytes, an all-zero
    group and a bf16 input included."""
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[2, :128] = 0  # 37 rows: three 16-row programs, the last one partly outside
    want_q, want_s = quantize_fp8_tokens(x, kernel=False)
    got_q, got_s = quantize_fp8_tokens(x, kernel=True)
    assert got_q.dtype == FP8_DTYPE and torch.equal(got_s, want_s) and got_s[2, 0] == 1
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize(
    "m,n,k,bias", [(1, 64, 128, False), (3, 200, 300, True), (40, 136, 256, False)]
)
def test_triton_fp8_gemm_matches_reference(m: int, n: int, k: int, bias: bool) -> None:
    """Under TRITON_INTERPRET=1 the kernel's e4m3 tl.dot runs on fp32-widened operands (the
    interpreter has no fp8 dot): exact products, so only fp32 summation order differs."""
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g)
    w = quantize_fp8_blocks(0.05 * torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    ref = fp8_linear_reference(x, w, b)
    torch.testing.assert_close(fp8_linear(x, w, b, kernel=True), ref, rtol=1e-5, atol=1e-5)
    exact = x @ dequantize_fp8_blocks(w).T + (b if b is not None else 0)
    assert (ref - exact).abs().max() < 0.05 * exact.abs().max()  # activation rounding only


@pytest.mark.parametrize(
    "m,k,config",
    [
        (70, 300, None),  # prefill tiles (128x128, grouped sweeps), a ragged K tail
        (5, 640, {"SPLIT_K": 2}),  # 5 K blocks in runs of 3 and 2
        (5, 640, {"SPLIT_K": 4}),  # runs of 2: the fourth split holds nothing
        (33, 384, {"SPLIT_K": 3, "BLOCK_N": 32}),
    ],
)
def test_triton_fp8_gemm_tiles_and_split_k(m: int, k: int, config: dict[str, int] | None) -> None:
    """Split-K (decode) sums fp32 partials in a fixed order, bias added once."""
    from libs.engine.kernels.fp8_gemm import _gemm_config, fp8_gemm

    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g)
    w = quantize_fp8_blocks(0.05 * torch.randn(200, k, generator=g))
    b = torch.randn(200, generator=g)
    cfg = None if config is None else _gemm_config(m, 200, k) | config
    xq, xs = quantize_fp8_tokens(x)
    out = fp8_gemm(xq, xs, w, torch.float32, b, config=cfg)
    torch.testing.assert_close(out, fp8_linear_reference(x, w, b), rtol=1e-5, atol=1e-5)


def _exact_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose 128-channel groups are e4m3 values times a power of two, each group holding
    a +-448: their quantization is exact, so a kernel quantizing them on Triton's interpreter
    (whose e4m3 cast rounds wrongly) must give what the host quantizer gives."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8).view(FP8_DTYPE).float()
    q = torch.where(q.isfinite(), q, torch.zeros_like(q))
    q[:, ::128] = 448.0 * torch.sign(torch.randn(m, q[:, ::128].shape[1], generator=g))
    scale = 2.0 ** torch.randint(-12, -2, (m, -(-k // 128)), generator=g).float()
    return q * scale.repeat_interleave(128, -1)[:, :k]


@pytest.mark.parametrize(
    "m,k,config",
    [
        (3, 300, None),  # decode tiles, split-K, a ragged K tail
        (70, 384, {"SPLIT_K": 3}),
        # two weight-scale columns a tile
        (70, 300, {"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8, "SPLIT_K": 1}),
        (33, 256, {"BLOCK_N": 32}),
    ],
)
def test_fp8_gemm_quantizes_activations_in_the_kernel(
    m: int, k: int, config: dict[str, int] | None
) -> None:
    """QUANT_A (no separate quantizer launch; decode's path) gives the two-launch result."""
    from libs.engine.kernels.fp8_gemm import _gemm_config, fp8_gemm

    x = _exact_activations(m, k, m + k)
    w = quantize_fp8_blocks(0.05 * torch.randn(200, k, generator=torch.Generator().manual_seed(k)))
    b = torch.randn(200, generator=torch.Generator().manual_seed(m))
    cfg = _gemm_config(m, 200, k) | (config or {})
    xq, xs = quantize_fp8_tokens(x, kernel=False)
    assert torch.equal(xq.float() * xs.repeat_interleave(128, -1)[:, :k], x)  # exact by design
    fused = fp8_gemm(x, None, w, torch.float32, b, config=cfg)
    torch.testing.assert_close(fused, fp8_gemm(xq, xs, w, torch.float32, b, config=cfg))
    torch.testing.assert_close(fused, fp8_linear_reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_gemm_config_splits_k_for_decode_only() -> None:
    from libs.engine.kernels.fp8_gemm import _gemm_config

    assert _gemm_config(256, 3072, 2048)["SPLIT_K"] == 1
    assert _gemm_config(256, 3072, 2048)["BLOCK_M"] == 64  # 48 tiles of 128x128: under a wave
    assert _gemm_config(256, 576, 2048)["SPLIT_K"] == 4  # kv_a_proj at batch 256: 36 tiles
    assert _gemm_config(16384, 3072, 2048)["BLOCK_M"] == 128  # prefill
    small = _gemm_config(1, 576, 2048)  # kv_a_proj at batch 1: 9 tiles of 64 columns
    assert small["SPLIT_K"] == 16 and 9 * 16 <= 264
    assert _gemm_config(1, 1408 * 2, 128)["SPLIT_K"] == 1  # one K block: nothing to split


def test_fp8_linear_from_linear_and_expert_slices() -> None:
    lin = torch.nn.Linear(130, 70, bias=True)
    fp8 = Fp8Linear.from_linear(lin)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale_inv.shape == (1, 2)
    x = torch.randn(4, 130)
    assert (fp8(x) - lin(x)).abs().max() < 0.05 * lin(x).abs().max()
    stacked = quantize_fp8_blocks(torch.randn(3, 256, 128))
    one = Fp8Weight(stacked.q[1], stacked.scale[1])
    torch.testing.assert_close(dequantize_fp8_blocks(one), dequantize_fp8_blocks(stacked)[1])


def _quality(engines: dict[str, EngineConfig]) -> dict[str, float]:
    rows = {}
    for name, config in engines.items():
        engine = Engine(config)
        prompts, forced = quality_inputs(engine.model_config.vocab_size, 2, 24, 4)
        rows[name] = capture_logits(engine, prompts, forced)
    return compare_logits(rows["fp8"], rows["bf16"], 24)


def _fp8_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny DeepSeek-V3 checkpoint in the released FP8 format: every attention and MLP
    projection (experts too) e4m3 with ``weight_scale_inv``; config with quantization_config."""
    from tests.hf_reference import build_hf, save_hf

    base = save_hf(build_hf("v3-yarn-grouped", seed=5), tmp_path / "base")
    state = load_file(str(base / "model.safetensors"))
    for k in list(state):
        if k.endswith("proj.weight") and ".layers." in k:
            q = quantize_fp8_blocks(state[k])
            state[k], state[k + "_scale_inv"] = q.q, q.scale
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out, state


def test_fp8_checkpoint_keeps_its_fp8_weights(tmp_path: Path) -> None:
    require_reference("transformers")
    path, state = _fp8_checkpoint(tmp_path)
    fp8 = EngineConfig(model=str(path), num_kv_blocks=8)  # auto: the checkpoint's FP8 kept
    params = dict(Engine(fp8).model.named_parameters())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert params[name].dtype == FP8_DTYPE
    assert torch.equal(params[name].view(torch.uint8), state[name].view(torch.uint8))
    assert torch.equal(params[name + "_scale_inv"], state[name + "_scale_inv"])
    bf16 = EngineConfig(model=str(path), num_kv_blocks=8, weight_dtype="bf16")  # dequantized
    assert dict(Engine(bf16).model.named_parameters())[name].dtype != FP8_DTYPE
    # Where FP8 weights cannot serve, auto dequantizes instead of refusing the checkpoint
    # (this checkpoint's experts are too narrow for FP4 ones: the choice alone is checked).
    auto = Engine(EngineConfig(model=str(path), num_kv_blocks=8, batch_invariant=True))
    assert dict(auto.model.named_parameters())[name].dtype != FP8_DTYPE
    assert _weight_dtype(EngineConfig(model=str(path), expert_dtype="fp4")) == "bf16"
    q = _quality({"fp8": fp8, "bf16": bf16})
    # Same linear weights bit for bit; the differences: per-token e4m3 activations and the
    # experts' tiles re-cut over the fused [gate; up] rows (I=... is not a multiple of 128
    # here). Measured on CPU: rel 0.149, top-1 see q.
    assert q["relative_error"] < 0.25 and q["top1_agreement"] >= 0.6, q


def test_tiny_preset_with_fp8_weights_generates_close_to_bf16() -> None:
    args = argparse.Namespace(
        preset="tiny",
        device="cpu",
        dtype="auto",
        quality_prompts=2,
        quality_tokens=24,
        quality_steps=4,
    )
    q = bench_quality(args, {"weight_dtype": "fp8"})
    # Weight and activation rounding on random weights (measured: rel ~0.08, top-1 0.9).
    assert 0 < q["relative_error"] < 0.15 and q["top1_agreement"] >= 0.6, q


def test_a_stacked_weight_quantized_in_chunks_equals_it_whole(monkeypatch) -> None:
    """Quantizing experts a few at a time (what bounds the fp32 working copy of a V3-width
    expert stack) gives the very bytes and scales of one pass over the whole stack."""
    import torch

    from libs.engine.kernels import fp8_gemm

    w = torch.randn(5, 3, 200, 300, generator=torch.Generator().manual_seed(0)) * 0.05
    whole = fp8_gemm.quantize_fp8_blocks(w)
    monkeypatch.setattr(fp8_gemm, "QUANTIZE_CHUNK_BYTES", 2 * 256 * 384 * 4)  # 2 matrices a chunk
    parts = fp8_gemm.quantize_fp8_blocks(w)
    assert parts.q.shape == whole.q.shape == (5, 3, 200, 300)
    assert parts.scale.shape == whole.scale.shape == (5, 3, 2, 3)
    assert torch.equal(parts.q.view(torch.uint8), whole.q.view(torch.uint8))
    assert torch.equal(parts.scale, whole.scale)
