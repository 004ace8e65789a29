"""Fused RMSNorm (+ residual add) and rotary kernels against the model's PyTorch ops."""

from __future__ import annotations

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.kernels.fused_ops import rms_norm, rope
from libs.engine.model.layers import RMSNorm
from libs.engine.model.rope import Rotary
from libs.engine.presets import PRESETS


@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 200), (33, 128)])
def test_rms_norm_matches_module(rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(dim, 1e-6, torch.float32, torch.device("cpu"))
    norm.weight.data = 1 + 0.1 * torch.randn(dim, generator=g)
    x = torch.randn(rows, 2 * dim, generator=g)[:, :dim]  # strided rows
    res = torch.randn(rows, dim, generator=g)
    out, summed = rms_norm(x, norm.weight, 1e-6)
    torch.testing.assert_close(out, norm(x), rtol=1e-5, atol=1e-6)
    assert summed is x
    out, summed = rms_norm(x, norm.weight, 1e-6, res)
    torch.testing.assert_close(summed, res + x)
    torch.testing.assert_close(out, norm(res + x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_matches_rotary(interleave: bool) -> None:
    cfg: ModelConfig = PRESETS["tiny"]
    rot = Rotary(cfg, torch.device("cpu"))
    rot.interleave = interleave
    g = torch.Generator().manual_seed(int(interleave))
    pos = torch.randint(0, 5000, (9,), generator=g)
    cos, sin = rot.cos_sin(pos)
    d = cfg.qk_rope_head_dim
    q = torch.randn(9, 5, 3 * d, generator=g)[..., d : 2 * d]  # a strided slice, as in the model
    k = torch.randn(9, d, generator=g)
    torch.testing.assert_close(rope(q, cos, sin, interleave), rot.apply(q, cos, sin))
    torch.testing.assert_close(rope(k, cos, sin, interleave), rot.apply(k, cos, sin))


def test_silu_mul_matches_torch() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2 * 300, generator=g)
    from libs.engine.kernels.fused_ops import silu_mul

    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_latent_write_is_norm_rope_and_cache_write_in_one(interleave: bool, dtype) -> None:
    """The fused latent path gives the unfused kernels' numbers, in the step's latents and in
    the cache rows it was told to write -- and writes no other row."""
    from libs.engine.kernels.fused_ops import latent_write

    r, p, rows = 64, 16, 7
    g = torch.Generator().manual_seed(7 + int(interleave))
    kv_a = (torch.randn(rows, 3 * (r + p), generator=g) * 3).to(dtype)[:, r + p : 2 * (r + p)]
    w = (torch.rand(r, generator=g) + 0.5).to(dtype)
    pos = torch.randint(0, 3000, (rows,), generator=g)
    cfg: ModelConfig = PRESETS["tiny"]
    rot = Rotary(cfg, torch.device("cpu"))
    rot.interleave = interleave
    cos, sin = rot.cos_sin(pos)
    slots = torch.tensor([5, 0, 9, 3, 12, 7, 1])
    cache = torch.full((16, r + p), 7.0, dtype=dtype)
    got = latent_write(kv_a, w, 1e-6, cos, sin, interleave, slots, cache)
    want = torch.cat(
        (rms_norm(kv_a[:, :r], w, 1e-6)[0], rope(kv_a[:, r:], cos, sin, interleave)), dim=-1
    )
    assert torch.equal(got, want)
    assert torch.equal(cache[slots], want)
    untouched = [i for i in range(16) if i not in slots.tolist()]
    assert torch.equal(cache[untouched], torch.full((len(untouched), r + p), 7.0, dtype=dtype))
