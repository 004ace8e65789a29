"""Multi-head latent attention (MLA) over the paged latent cache.

Per token and layer the cache holds ``kv_lora_rank`` normalized latent values followed by
``qk_rope_head_dim`` rotated key values (576 numbers for DeepSeek-V3), in 128-token pages.
Two equivalent ways to attend:

* expanded (prefill): the context's latents are up-projected through ``kv_b_proj`` to
  per-head keys and values -- cheaper when many queries share one context;
* absorbed (decode): ``kv_b_proj``'s key half is folded into the query and its value half
  applied after attention, so the cache is read as is -- cheaper for one query per request.

Both compute softmax in fp32. :class:`AttentionMetadata` describes one step's batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from .layers import RMSNorm, _linear
from .rope import Rotary, softmax_scale

# Query rows per attention tile in the expanded path: bounds the score matrix to
# heads x 512 x context fp32 values (a 32K context with 128 heads: 8 GiB -> tiles of 512).
_QUERY_TILE = 512


@dataclass
class SeqAttention:
    """One sequence of a step attended on the expanded path."""

    q_start: int  # first row of this sequence in the step's flattened tokens
    q_len: int
    ctx_slots: torch.Tensor  # [ctx_len] cache slots of positions 0..ctx_len-1
    q_positions: torch.Tensor  # [q_len] absolute positions of the queries


@dataclass
class AttentionMetadata:
    """Everything attention needs about a step's batch, shared by all layers.

    ``slot_mapping[t]`` is the cache slot the step's token ``t`` writes. Sequences with a
    single query (decode) are batched on the absorbed path: ``decode_rows`` are their token
    rows, ``decode_slots`` [B, Lmax] their context slots padded with slot 0, masked by
    ``decode_mask``. All other sequences are listed in ``seqs``.
    """

    slot_mapping: torch.Tensor
    seqs: list[SeqAttention]
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, dtype: torch.dtype, device: torch.device,
                 absorb_decode: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        self.absorb_decode = absorb_decode
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.scale = softmax_scale(cfg)
        if cfg.q_lora_rank is None:
            self.q_proj = _linear(nh * cfg.qk_head_dim, h, False, dtype, device)
        else:
            self.q_a_proj = _linear(cfg.q_lora_rank, h, cfg.attention_bias, dtype, device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, device)
            self.q_b_proj = _linear(nh * cfg.qk_head_dim, cfg.q_lora_rank, False, dtype, device)
        self.kv_a_proj_with_mqa = _linear(cfg.kv_cache_dim, h, cfg.attention_bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype, device)
        self.kv_b_proj = _linear(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
                                 False, dtype, device)
        self.o_proj = _linear(h, nh * cfg.v_head_dim, cfg.attention_bias, dtype, device)

    # -- projections -------------------------------------------------------------------------
    def _queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return q_nope, self.rotary.apply(q_pe, cos, sin)

    def _latents(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        return torch.cat((self.kv_a_layernorm(c), self.rotary.apply(k_pe, cos, sin)), dim=-1)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as (W_uk [H, nope, r], W_uv [H, v, r])."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                       cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """``cache``: this layer's pages viewed as [num_slots, kv_cache_dim]; written in place."""
        cfg = self.cfg
        q_nope, q_pe = self._queries(x, cos, sin)
        cache.index_copy_(0, meta.slot_mapping, self._latents(x, cos, sin).to(cache.dtype))
        out = x.new_empty(x.shape[0], cfg.num_attention_heads, cfg.v_head_dim)
        for seq in meta.seqs:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self._expanded(q_nope[rows], q_pe[rows], seq, cache)
        if meta.decode_rows is not None:
            assert meta.decode_slots is not None and meta.decode_mask is not None
            r = meta.decode_rows
            if self.absorb_decode:
                o = self._absorbed(q_nope[r], q_pe[r], meta.decode_slots, meta.decode_mask, cache)
            else:
                o = self._expanded_padded(q_nope[r], q_pe[r], meta.decode_slots, meta.decode_mask, cache)
            out[r] = o
        result: torch.Tensor = self.o_proj(out.flatten(1))
        return result

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, seq: SeqAttention,
                  cache: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ctx = cache.index_select(0, seq.ctx_slots).to(q_nope.dtype)
        latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(-1, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_nope_f, k_pe_f, v_f = k_nope.float(), k_pe.float(), v.float()
        key_pos = torch.arange(ctx.shape[0], device=ctx.device)
        outs = []
        for t0 in range(0, q_nope.shape[0], _QUERY_TILE):
            qn = q_nope[t0 : t0 + _QUERY_TILE].float()
            qp = q_pe[t0 : t0 + _QUERY_TILE].float()
            scores = torch.einsum("qhd,khd->hqk", qn, k_nope_f) + torch.einsum("qhd,kd->hqk", qp, k_pe_f)
            allowed = key_pos[None, :] <= seq.q_positions[t0 : t0 + _QUERY_TILE, None]
            scores = (scores * self.scale).masked_fill(~allowed[None], float("-inf"))
            probs = scores.softmax(dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v_f))
        return torch.cat(outs).to(q_nope.dtype)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """One query per sequence; ``slots``/``mask``: [B, L]."""
        cfg = self.cfg
        w_uk, w_uv = self._kv_b()
        ctx = cache[slots].float()  # [B, L, r + rope]
        latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk.float())
        scores = torch.einsum("bhr,blr->bhl", q_lat, latent) + torch.einsum("bhd,bld->bhl", q_pe.float(), k_pe)
        scores = (scores * self.scale).masked_fill(~mask[:, None, :], float("-inf"))
        o_lat = torch.einsum("bhl,blr->bhr", scores.softmax(dim=-1), latent)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv.float()).to(q_nope.dtype)

    def _expanded_padded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, slots: torch.Tensor,
                         mask: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ctx = cache[slots].to(q_nope.dtype)
        latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(*latent.shape[:2], cfg.num_attention_heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        scores = (torch.einsum("bhd,blhd->bhl", q_nope.float(), k_nope.float())
                  + torch.einsum("bhd,bld->bhl", q_pe.float(), k_pe.float()))
        scores = (scores * self.scale).masked_fill(~mask[:, None, :], float("-inf"))
        return torch.einsum("bhl,blhd->bhd", scores.softmax(dim=-1), v.float()).to(q_nope.dtype)

