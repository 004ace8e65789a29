"""Multi-head latent attention (MLA) over the paged latent cache.

Per token and layer the cache holds ``kv_lora_rank`` normalized latent values followed by
``qk_rope_head_dim`` rotated key values (576 numbers for DeepSeek-V3), in 128-token pages.
Two equivalent ways to attend:

* expanded (prefill): the context's latents are up-projected through ``kv_b_proj`` to
  per-head keys and values -- cheaper when many queries share one context;
* absorbed (decode): ``kv_b_proj``'s key half is folded into the query and its value half
  applied after attention, so the cache is read as is -- cheaper for one query per request.

Both compute softmax in fp32. :class:`AttentionMetadata` describes one step's batch.

With ``use_kernels`` (the GPU path) prompts go through PyTorch's fused scaled-dot-product
attention (flash/cuDNN on CUDA) and decodes through the Triton paged decode kernel
(:mod:`libs.engine.kernels.mla_decode`), which reads the cache in place, bfloat16 or FP8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..kv.cache import LayerCache
from .attention_torch import TorchPaths
from .layers import RMSNorm, _linear, linear_weight, stack_weights
from .quant import SummedBy
from .rope import Rotary, softmax_scale

# Context rows up-projected at once for the prompt chunks over cached prefixes of one step
# (their keys and values: 8 KiB a row for V2-Lite's 16 heads, 64 KiB for V3's 128); a group
# holds at least one request, however long its context.
EXTEND_GROUP_ROWS = 32768
# Whether the kernel path sends prompt chunks over cached prefixes through the one-launch
# varlen kernel (:mod:`libs.engine.kernels.extend_attention`) instead of one fused attention
# call per request (kept for comparison: scripts/gpu/profile_extend.py).
EXTEND_KERNEL = True
# Fresh prompts (nothing cached) of at least this many rows keep PyTorch's flash attention, one
# call each (the quadratic part dominates there); shorter ones join the extend launch, so a
# burst of short prompts is one launch per layer instead of one call per request.
FLASH_MIN_ROWS = 1024


def _extends(seq: SeqAttention) -> bool:
    """Whether the kernel path attends ``seq`` through the extend launch."""
    return seq.ctx_slots.shape[0] > seq.q_len or seq.q_len < FLASH_MIN_ROWS


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

    The kernel path instead takes the decodes as the step's last rows, from
    ``decode_start`` on, described by ``block_table`` (int32 [B, max_blocks]) and
    ``seq_lens`` (int32 [B], 0 for CUDA-graph padding rows).

    Batch-invariant steps (:meth:`MLAttention.forward`, batch-invariant ``arith``) describe every
    row that way, prompt rows too (``decode_start = 0``; a prompt row at position ``p`` has its
    sequence's table and length ``p + 1``), on either path, and leave ``seqs`` empty.
    """

    slot_mapping: torch.Tensor
    seqs: list[SeqAttention]
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_start: int | None = None
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_size: int = 128
    num_splits: int = 1
    # The kernel path's prompt chunks over cached prefixes, grouped for one launch each
    # (:meth:`MLAttention._extend_groups`): made by the first layer, reused by the others.
    extend_groups: list[tuple[torch.Tensor, Any]] | None = None


class MLAttention(SummedBy, TorchPaths, nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: Rotary,
        dtype: torch.dtype,
        device: torch.device,
        absorb_decode: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        self.absorb_decode = absorb_decode
        self.use_kernels = False
        self._absorbed_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._invariant_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._input_weight: torch.Tensor | None = None  # [q_proj | kv_a_proj], stacked
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
        self.kv_b_proj = _linear(
            nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, False, dtype, device
        )
        self.o_proj = _linear(h, nh * cfg.v_head_dim, cfg.attention_bias, dtype, device)

    # -- projections -------------------------------------------------------------------------
    def _queries(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        first: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``first``: ``q_proj(x)`` (or ``q_a_proj(x)`` with q-LoRA) when already computed."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x) if first is None else first
        else:
            qa = self.q_a_proj(x) if first is None else first
            q = self.q_b_proj(self.q_a_layernorm(qa))
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
        w = linear_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype).view(
            cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> torch.Tensor:
        """``cache``: this layer's pages; the step's latents are written in place first."""
        cfg = self.cfg
        stacked = self._stacked_input() if self.use_kernels and cache.kv is not None else None
        if stacked is not None:
            assert cache.kv is not None
            q_nope, q_pe, latents = self._project_and_write(x, stacked, cos, sin, meta, cache.kv)
        else:
            q_nope, q_pe = self._queries(x, cos, sin)
            latents = self._latents(x, cos, sin)
            cache.write(meta.slot_mapping, latents)
        if self.arith.invariant:  # prompt rows as decode rows, one fixed order (see there)
            out = self._forward_invariant(q_nope, q_pe, meta, cache)
        elif self.use_kernels:
            out = self._forward_kernels(q_nope, q_pe, latents, meta, cache)
        else:
            out = x.new_empty(x.shape[0], cfg.num_attention_heads, cfg.v_head_dim)
            for seq in meta.seqs:
                rows = slice(seq.q_start, seq.q_start + seq.q_len)
                out[rows] = self._expanded(q_nope[rows], q_pe[rows], seq, cache)
            if meta.decode_rows is not None:
                assert meta.decode_slots is not None and meta.decode_mask is not None
                r = meta.decode_rows
                if self.absorb_decode:
                    o = self._absorbed(
                        q_nope[r], q_pe[r], meta.decode_slots, meta.decode_mask, cache
                    )
                else:
                    o = self._expanded_padded(
                        q_nope[r], q_pe[r], meta.decode_slots, meta.decode_mask, cache
                    )
                out[r] = o
        result: torch.Tensor = self.o_proj(out.flatten(1))
        return result

    # -- kernel path --------------------------------------------------------------------------
    def _stacked_input(self) -> torch.Tensor | None:
        """The two projections of ``x`` (``q_proj`` or ``q_a_proj``, then ``kv_a_proj``) as one
        weight, made once; None where they cannot be stacked (FP8 weights, biases)."""
        first = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        second = self.kv_a_proj_with_mqa
        if not isinstance(first, nn.Linear) or not isinstance(second, nn.Linear):
            return None
        if first.bias is not None or second.bias is not None:
            return None
        w = self._input_weight
        if w is None or w.data_ptr() != first.weight.data_ptr():
            w = self._input_weight = stack_weights(first, second)
        return w

    def _project_and_write(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kernel path, bf16/fp32 cache: both input projections as one GEMM (``w``, from
        :meth:`_stacked_input`), then the latent's norm, the key's rotation and the cache write
        as one launch (``latent_write``)."""
        from ..kernels.fused_ops import latent_write

        both = self.arith.linear(x, w, None, True)
        first, kv_a = torch.split(
            both, [w.shape[0] - self.cfg.kv_cache_dim, self.cfg.kv_cache_dim], -1
        )
        q_nope, q_pe = self._queries(x, cos, sin, first)
        norm = self.kv_a_layernorm
        latents = latent_write(
            kv_a,
            norm.weight,
            norm.eps,
            cos,
            sin,
            self.rotary.interleave,
            meta.slot_mapping,
            cache_kv,
        )
        return q_nope, q_pe, latents

    def _absorbed_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (W_uk [H, nope, r], W_uv^T [H, r, v]), made once from kv_b_proj."""
        if (
            self._absorbed_weights is None
            or self._absorbed_weights[0].device != self.kv_b_proj.weight.device
        ):
            w_uk, w_uv = self._kv_b()
            self._absorbed_weights = (w_uk.contiguous(), w_uv.transpose(1, 2).contiguous())
        return self._absorbed_weights

    def _forward_kernels(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latents: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> torch.Tensor:
        from ..kernels.extend_attention import extend_attention
        from ..kernels.prefill_attention import prefill_attention

        cfg = self.cfg
        t = q_nope.shape[0]
        out = q_nope.new_empty(t, cfg.num_attention_heads, cfg.v_head_dim)
        groups = self._extend_groups(meta)
        for seq in meta.seqs:
            ctx_len = seq.ctx_slots.shape[0]
            if groups and _extends(seq):
                continue  # in an extend group below
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            # A prompt with nothing cached before it attends to the latents it just made --
            # unless the cache is FP8: then to the cached values, as its later decodes will, so
            # a prompt reads the same numbers whether it is prefilled whole or in chunks.
            ctx = (
                latents[rows]
                if ctx_len == seq.q_len and not cache.fp8
                else cache.gather(seq.ctx_slots, q_nope.dtype)
            )
            latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            kv = self.kv_b_proj(latent).view(ctx_len, cfg.num_attention_heads, -1)
            k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
            q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
            k = torch.cat(
                (k_nope, k_pe[:, None, :].expand(-1, cfg.num_attention_heads, -1)), dim=-1
            )
            out[rows] = prefill_attention(q, k, v, self.scale)
        for slots, plan in groups:
            ctx = cache.gather(slots, q_nope.dtype)
            latent, k_pe = torch.split(ctx, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            kv = self.kv_b_proj(latent).view(slots.shape[0], cfg.num_attention_heads, -1)
            extend_attention(q_nope, q_pe, kv, k_pe, out, plan, self.scale)
        if meta.decode_start is not None and meta.decode_start < t:
            assert meta.block_table is not None and meta.seq_lens is not None
            d = slice(meta.decode_start, t)
            w_uk, w_uv_t = self._absorbed_kv_b()
            q_lat = torch.bmm(q_nope[d].transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, r]
            o_lat = self._paged_decode(q_lat, q_pe[d], meta, cache, meta.num_splits)
            out[d] = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
        return out

    def _extend_groups(self, meta: AttentionMetadata) -> list[tuple[torch.Tensor, Any]]:
        """The step's prompt chunks over cached prefixes, and its short fresh prompts, as
        launches of the extend kernel: each group's context slots (concatenated) and its
        :class:`ExtendPlan`, at most :data:`EXTEND_GROUP_ROWS` context rows a group unless one
        request alone has more. Fresh prompts of :data:`FLASH_MIN_ROWS` rows or more keep the
        fused attention call (flash, one per request)."""
        if meta.extend_groups is not None:
            return meta.extend_groups
        from ..kernels.extend_attention import ExtendPlan, supports

        cfg = self.cfg
        groups: list[tuple[torch.Tensor, Any]] = []
        seqs = [s for s in meta.seqs if _extends(s)]
        if not (EXTEND_KERNEL and seqs and supports(cfg)):
            meta.extend_groups = groups
            return groups
        batches: list[list[SeqAttention]] = [[]]
        rows = 0
        for s in seqs:
            n = int(s.ctx_slots.shape[0])
            if batches[-1] and rows + n > EXTEND_GROUP_ROWS:
                batches.append([])
                rows = 0
            batches[-1].append(s)
            rows += n
        for batch in batches:
            slots = torch.cat([s.ctx_slots for s in batch])
            plan = ExtendPlan(
                [s.q_start for s in batch],
                [s.q_len for s in batch],
                [int(s.ctx_slots.shape[0]) for s in batch],
                slots.device,
            )
            groups.append((slots, plan))
        meta.extend_groups = groups
        return groups

    # -- batch-invariant path -----------------------------------------------------------------
    def _forward_invariant(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> torch.Tensor:
        """Every row as a decode row, whatever the step: ``q_lat = q_nope W_uk`` and
        ``o W_uv^T`` through :func:`matmul_nt` (one summation order per row), attention over
        the row's cached context in ``block_size`` pages from position 0 with an online
        softmax -- the Triton decode kernel with a single split on the kernel path,
        :meth:`_paged_rows` in PyTorch otherwise. A query at position ``p`` then gets the
        same numbers in a prompt of any chunking, in a decode step of any batch, and when
        a continuation re-prefills it (prefill's expanded form would differ in the last bits
        from decode's absorbed one)."""
        from ..kernels.invariant import matmul_nt

        assert meta.block_table is not None and meta.seq_lens is not None
        assert meta.decode_start == 0, "batch-invariant steps describe every row by its table"
        kernel = self.use_kernels
        w_uk_t, w_uv = self._invariant_kv_b()
        q_lat = matmul_nt(q_nope.transpose(0, 1), w_uk_t, kernel=kernel).transpose(0, 1)
        if kernel:
            o_lat = self._paged_decode(q_lat, q_pe, meta, cache, 1)
        else:
            o_lat = self._paged_rows(
                q_lat, q_pe, meta.block_table, meta.seq_lens, meta.block_size, cache
            )
        return matmul_nt(o_lat.transpose(0, 1), w_uv, kernel=kernel).transpose(0, 1)

    def _invariant_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk^T [H, r, nope], W_uv [H, v, r]) contiguous, in the model dtype, made once."""
        cached = self._invariant_weights
        if cached is None or cached[0].device != self.kv_b_proj.weight.device:
            w_uk, w_uv = self._kv_b()
            cached = self._invariant_weights = (
                w_uk.transpose(1, 2).contiguous(),
                w_uv.contiguous(),
            )
        return cached

    def _paged_decode(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
        num_splits: int,
    ) -> torch.Tensor:
        """The Triton decode kernel over the rows ``meta.block_table``/``seq_lens`` describe."""
        from ..kernels.mla_decode import mla_decode

        assert meta.block_table is not None and meta.seq_lens is not None
        return mla_decode(
            q_lat,
            q_pe,
            cache.latent,
            cache.rope,
            meta.block_table,
            meta.seq_lens,
            block_size=meta.block_size,
            sm_scale=self.scale,
            kv_scale=cache.scale,
            num_splits=num_splits,
        )
