"""Rotary position embedding with DeepSeek's YaRN scaling.

Frequencies and the attention factor follow the YaRN paper as DeepSeek applies it
(correction range from beta_fast/beta_slow, linear ramp, cos/sin scaled by
mscale(factor, mscale) / mscale(factor, mscale_all_dim)); the softmax scale gets
mscale(factor, mscale_all_dim)**2, see :func:`softmax_scale`.
"""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig, RopeConfig
from .quant import SummedBy


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, ``dim // 2``) and the cos/sin scale."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.mscale and rope.mscale_all_dim:
        attn_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, attn_factor


def softmax_scale(cfg: ModelConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    rope = cfg.rope
    if rope.type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return float(scale)


class Rotary(SummedBy):
    """Applies RoPE to the rotary slice of queries and keys at given positions.

    ``interleave`` rotates adjacent pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints
    lay them out; otherwise the two halves are rotated against each other. The output keeps
    the input's layout; queries and keys use the same one, so their dot products are the
    model's whichever layout the cache stores.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        inv_freq, self.attention_factor = inv_freq_and_attention_factor(
            cfg.rope, cfg.qk_rope_head_dim
        )
        self.inv_freq = inv_freq.to(device)
        self.interleave = cfg.rope_interleave
        self.use_kernels = False

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = self.arith.rows(torch.cos, freqs), self.arith.rows(torch.sin, freqs)
        return cos * self.attention_factor, sin * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: [tokens, ..., rope_dim]; ``cos``/``sin``: [tokens, rope_dim // 2]."""
        if self.use_kernels and x.dim() in (2, 3) and x.stride(-1) == 1:
            from ..kernels.fused_ops import rope

            return rope(x, cos, sin, self.interleave)
        shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
        c, s = cos.view(shape), sin.view(shape)
        xf = x.to(torch.float32)
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return out.to(x.dtype)
