"""MLA's plain PyTorch paths (:class:`TorchPaths`, a part of
:class:`~libs.engine.model.attention.MLAttention`): the reference the kernel path is tested
against, and what runs without ``use_kernels`` -- prompts expanded through ``kv_b_proj`` in
query tiles, decodes absorbed (or expanded, padded), and the batch-invariant rows page by page.
Softmax in fp32 throughout."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..kv.cache import LayerCache


class _Seq(Protocol):
    """What the expanded path reads of a :class:`~.attention.SeqAttention`."""

    ctx_slots: torch.Tensor  # [ctx_len] cache slots of positions 0..ctx_len-1
    q_positions: torch.Tensor  # [q_len] absolute positions of the queries


# Query rows per attention tile in the expanded path: bounds the score matrix to
# heads x 512 x context fp32 values (a 32K context with 128 heads: 8 GiB -> tiles of 512).
_QUERY_TILE = 512
# Rows per call of the batch-invariant PyTorch attention (one shape for every batch).
INVARIANT_TILE = 16


class TorchPaths:
    """Methods of :class:`MLAttention` that use only PyTorch (its ``cfg``, ``scale``,
    ``kv_b_proj`` and ``_kv_b``)."""

    cfg: Any
    scale: float
    kv_b_proj: Any
    _kv_b: Any

    def _paged_rows(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        bs: int,
        cache: LayerCache,
    ) -> torch.Tensor:
        """PyTorch twin of the single-split decode kernel: each row attends over its context
        page by page (``block_size`` tokens, the last one masked) with an online softmax in
        fp32. Rows go in fixed tiles of :data:`INVARIANT_TILE` (the last padded with empty
        rows), so every operation sees one shape whatever the batch; a page past a row's
        length is an exact no-op (weight 1 on the old state, 0 on the new)."""
        from ..kernels.invariant import pad_rows

        cfg = self.cfg
        t, nh, r = q_lat.shape
        tile = INVARIANT_TILE
        out = torch.empty(t, nh, r, dtype=torch.float32, device=q_lat.device)
        lens = seq_lens.to(torch.int64)
        table = block_table.to(torch.int64)
        within = torch.arange(bs, device=q_lat.device)
        for r0 in range(0, t, tile):
            n = min(tile, t - r0)
            ql = pad_rows(q_lat[r0 : r0 + n].float(), tile)
            qp = pad_rows(q_pe[r0 : r0 + n].float(), tile)
            rl = pad_rows(lens[r0 : r0 + n], tile)  # empty rows: length 0
            rt = pad_rows(table[r0 : r0 + n], tile)
            m_i = torch.full((tile, nh), float("-inf"), device=ql.device)
            l_i = torch.zeros(tile, nh, device=ql.device)
            acc = torch.zeros(tile, nh, r, device=ql.device)
            for j in range(int((rl.max() + bs - 1) // bs)):
                pos = j * bs + within  # [bs]
                slots = rt[:, j, None] * bs + within[None, :]  # [tile, bs]
                ctx = cache.gather(slots.reshape(-1), torch.float32).view(tile, bs, -1)
                latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
                s = torch.bmm(ql, latent.transpose(1, 2)) + torch.bmm(qp, k_pe.transpose(1, 2))
                s = (s * self.scale).masked_fill(
                    (pos[None, :] >= rl[:, None])[:, None, :], float("-inf")
                )
                m_new = torch.maximum(m_i, s.amax(dim=-1))
                safe = torch.where(torch.isinf(m_new), 0.0, m_new)
                p = torch.exp(s - safe[..., None])
                alpha = torch.exp(torch.where(torch.isinf(m_i), -torch.inf, m_i - safe))
                l_i = l_i * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + torch.bmm(p, latent)
                m_i = m_new
            out[r0 : r0 + n] = (acc / torch.where(l_i > 0, l_i, 1.0)[..., None])[:n]
        return out.to(q_lat.dtype)

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, seq: _Seq, cache: LayerCache
    ) -> torch.Tensor:
        cfg = self.cfg
        ctx = cache.gather(seq.ctx_slots, q_nope.dtype)
        latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(
            -1, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim
        )
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_nope_f, k_pe_f, v_f = k_nope.float(), k_pe.float(), v.float()
        key_pos = torch.arange(ctx.shape[0], device=ctx.device)
        outs = []
        for t0 in range(0, q_nope.shape[0], _QUERY_TILE):
            qn = q_nope[t0 : t0 + _QUERY_TILE].float()
            qp = q_pe[t0 : t0 + _QUERY_TILE].float()
            scores = torch.einsum("qhd,khd->hqk", qn, k_nope_f) + torch.einsum(
                "qhd,kd->hqk", qp, k_pe_f
            )
            allowed = key_pos[None, :] <= seq.q_positions[t0 : t0 + _QUERY_TILE, None]
            scores = (scores * self.scale).masked_fill(~allowed[None], float("-inf"))
            probs = scores.softmax(dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v_f))
        return torch.cat(outs).to(q_nope.dtype)

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        cache: LayerCache,
    ) -> torch.Tensor:
        """One query per sequence; ``slots``/``mask``: [B, L]."""
        cfg = self.cfg
        w_uk, w_uv = self._kv_b()
        ctx = cache.gather(slots, torch.float32)  # [B, L, r + rope]
        latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk.float())
        scores = torch.einsum("bhr,blr->bhl", q_lat, latent) + torch.einsum(
            "bhd,bld->bhl", q_pe.float(), k_pe
        )
        scores = (scores * self.scale).masked_fill(~mask[:, None, :], float("-inf"))
        o_lat = torch.einsum("bhl,blr->bhr", scores.softmax(dim=-1), latent)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv.float()).to(q_nope.dtype)

    def _expanded_padded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        cache: LayerCache,
    ) -> torch.Tensor:
        cfg = self.cfg
        ctx = cache.gather(slots, q_nope.dtype)
        latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(*latent.shape[:2], cfg.num_attention_heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        scores = torch.einsum("bhd,blhd->bhl", q_nope.float(), k_nope.float()) + torch.einsum(
            "bhd,bld->bhl", q_pe.float(), k_pe.float()
        )
        scores = (scores * self.scale).masked_fill(~mask[:, None, :], float("-inf"))
        return torch.einsum("bhl,blhd->bhd", scores.softmax(dim=-1), v.float()).to(q_nope.dtype)
