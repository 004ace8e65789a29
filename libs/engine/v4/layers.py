"""DeepSeek-V4's building blocks: RMSNorm, linears, its two RoPE tables, grouped output
projection, hyper-connections (several residual streams mixed per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.v4_mix import hc_mix, hc_mix_reference
from ..model.rope import inv_freq_and_attention_factor
from .config import V4Config, V4Rope


class RMSNorm(nn.Module):
    """RMS norm in fp32, fp32 weight, one cast at the end (V4 keeps norm weights in fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _linear(out_f: int, in_f: int) -> nn.Linear:
    layer = nn.Linear(in_f, out_f, bias=False)
    layer.weight.requires_grad_(False)
    return layer


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class V4Rotary:
    """Interleaved RoPE (pairs of adjacent channels) on the trailing ``rope_dim`` channels."""

    def __init__(self, spec: V4Rope, rope_dim: int) -> None:
        inv_freq, factor = inv_freq_and_attention_factor(spec.rope, rope_dim)
        self.inv_freq = inv_freq
        self.scale = factor if spec.attention_factor is None else spec.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = (freqs.cos() * self.scale).to(dtype).repeat_interleave(2, dim=-1)
        sin = (freqs.sin() * self.scale).to(dtype).repeat_interleave(2, dim=-1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [S, ..., D]`` rotated on its last ``cos.shape[-1]`` channels; cos/sin ``[S, r]``."""
        r = cos.shape[-1]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
        c, s = cos.view(shape), sin.view(shape)
        rope = x[..., -r:]
        pairs = rope.reshape(*rope.shape[:-1], r // 2, 2)
        swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        rotated = (rope.float() * c + swapped.float() * s).to(x.dtype)
        return torch.cat([x[..., :-r], rotated], dim=-1)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of ``groups`` slices of the input to its own output."""

    def __init__(self, in_per_group: int, out_f: int, groups: int) -> None:
        super().__init__()
        self.weight = _param(out_f, in_per_group)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [S, G, in]`` to ``[S, G, out/G]``."""
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])  # [G, out/G, in]
        return torch.einsum("sgi,goi->sgo", x, w)


class HyperConnection(nn.Module):
    """Mixing weights of the ``hc_mult`` residual streams: ``pre`` collapses them into the
    block's input, ``post`` spreads the block's output, ``comb`` (made doubly stochastic by
    Sinkhorn iterations) mixes the streams into the next residual."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = (
            n,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )
        self.fn = _param((2 + n) * n, n * cfg.hidden_size)
        self.base = _param((2 + n) * n)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)
        self.use_kernels = False  # the mixing weights (Sinkhorn included) in one launch

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = _unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        mix = hc_mix if self.use_kernels else hc_mix_reference
        pre, post, comb = mix(mixed, self.base, self.scale, self.n, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(
        post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, streams: torch.Tensor
    ) -> torch.Tensor:
        """The next residual: the block's output ``y`` spread over the streams by ``post``,
        plus the streams mixed by ``comb`` (transposed: sum over the input stream axis)."""
        dt = streams.dtype
        out: torch.Tensor = (
            post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + comb.to(dt).transpose(-1, -2) @ streams
        )
        return out


class HyperHead(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = _param(n, n * cfg.hidden_size)
        self.hc_base = _param(n)
        self.hc_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(
            F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float()
        )
        return ((pre + self.eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
