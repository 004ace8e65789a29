"""DeepSeek-V4 attention: shared-KV MQA with sinks over the sliding window plus the compressed
entries (HCA: all; CSA: the indexer's picks), per sequence or, for decode rows, as one batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .compressor import Compressor, CSACompressor, HCACompressor
from .config import CSA, HCA, SLIDING, V4Config
from .layers import GroupedLinear, RMSNorm, V4Rotary, _linear, _param, _unweighted_rms
from .state import CompressorState, LayerState


class Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer: int) -> None:
        super().__init__()
        self.cfg, self.kind = cfg, cfg.layer_types[layer]
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.q_a_proj = _linear(cfg.q_lora_rank, cfg.hidden_size)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(h * d, cfg.q_lora_rank)
        self.kv_proj = _linear(d, cfg.hidden_size)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups
        )
        self.o_b_proj = _linear(cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank)
        self.sinks = _param(h)
        self.use_kernels = False  # decode attention through the Triton kernels
        self.compressor: Compressor | None = (
            CSACompressor(cfg)
            if self.kind == CSA
            else HCACompressor(cfg)
            if self.kind == HCA
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        spans: Sequence[tuple[int, int, torch.Tensor]],
        states: Sequence[LayerState],
        rotary: dict[str, V4Rotary],
        trig: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``x [T, hidden]``: the rows of every sequence in ``spans`` (first row, rows,
        positions), each attending over its own state in ``states``; ``trig``: each rotary
        table's cos/sin at every row's position. Projections run over all rows at once; the
        attention per sequence, or, when every sequence has one row, as one batch
        (:meth:`_attend_decode`)."""
        cfg = self.cfg
        t, h, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        table = _rotary_of(self.kind)
        rot, (cos, sin) = rotary[table], trig[table]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = _unweighted_rms(self.q_b_proj(q_res).view(t, h, d), cfg.rms_norm_eps)
        q = V4Rotary.apply(q, cos, sin)
        kv = V4Rotary.apply(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]
        comp = self.compressor
        proj: list[torch.Tensor] = []
        if comp is not None:
            proj = [comp.kv_proj(x), comp.gate_proj(x)]
            if isinstance(comp, CSACompressor):
                ind = comp.indexer
                proj += [ind.kv_proj(x), ind.gate_proj(x), *ind.queries(x, q_res, cos, sin)]
        if len(spans) > 1 and all(n == 1 for _, n, _ in spans):
            out = self._attend_decode(q, kv, proj, states, rot)
        else:
            ctx = [
                self._attend(
                    q[o : o + n], kv[o : o + n], [p[o : o + n] for p in proj], pos, st, rot
                )
                for (o, n, pos), st in zip(spans, states, strict=True)
            ]
            out = ctx[0] if len(ctx) == 1 else torch.cat(ctx)
        out = V4Rotary.apply(out, cos, -sin)  # K = V carried RoPE: undo it at the query
        grouped = self.o_a_proj(out.reshape(t, cfg.o_groups, -1)).flatten(1)
        result: torch.Tensor = self.o_b_proj(grouped)
        return result

    def _attend_decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        proj: list[torch.Tensor],
        states: Sequence[LayerState],
        rot: V4Rotary,
    ) -> torch.Tensor:
        """:meth:`_attend` for ``B`` sequences of one new token each, as one batch: each state
        still takes its token (window, compressors: small per-sequence updates), then the
        indexer's pick and the attention run over every sequence's window and entries at
        once. Returns ``[B, heads, head_dim]``."""
        cfg = self.cfg
        d, w = cfg.head_dim, cfg.sliding_window
        # Every sequence's window rows then its new row, in one copy; each state's window
        # becomes a view of it (all within the query's window).
        pieces: list[torch.Tensor] = []
        for i, st in enumerate(states):
            if st.window is not None and st.window.shape[0]:
                pieces.append(st.window)
            pieces.append(kv[i : i + 1])
        joined = torch.cat(pieces)
        windows = []
        at = 0
        for st in states:
            n = (0 if st.window is None else st.window.shape[0]) + 1
            rows = joined[at : at + n]
            at += n
            st.window = rows[-(w - 1) :] if w > 1 else rows[:0]
            windows.append(rows)
        comp = self.compressor
        entries: list[torch.Tensor] = []
        index_keys: list[torch.Tensor] = []
        if comp is not None:
            # Every entry a state holds after its token is closed for that token's query.
            cst = [st.compressors.setdefault("compressor", CompressorState()) for st in states]
            entries = comp.absorb_rows(proj[0], proj[1], cst, rot)
            if isinstance(comp, CSACompressor):
                ind = comp.indexer
                ist = [st.compressors.setdefault("indexer", CompressorState()) for st in states]
                index_keys = ind.absorb_rows(proj[2], proj[3], ist, rot)
        if self.use_kernels:
            return self._attend_gathered(q, proj, joined, windows, entries, index_keys)
        b = q.shape[0]
        keys = _pad(windows, left=True)  # [B, Wk, D]
        width = keys.shape[1]
        lengths = torch.tensor([r.shape[0] for r in windows], device=q.device)
        pad = torch.arange(width, device=q.device)[None, :] < (width - lengths)[:, None]
        bias = torch.zeros(b, width, device=q.device).masked_fill(pad, float("-inf"))
        if comp is not None:
            ent = _pad(entries)  # [B, T, D]
            t = ent.shape[1]
            counts = torch.tensor([e.shape[0] for e in entries], device=q.device)
            hidden = torch.arange(t, device=q.device)[None, :] >= counts[:, None]
            if isinstance(comp, CSACompressor):
                hidden = comp.indexer.unpicked(proj[4], proj[5], _pad(index_keys), hidden)
            eb = torch.zeros(b, t, device=q.device).masked_fill(hidden, float("-inf"))
            keys = torch.cat([keys, ent], dim=1)
            bias = torch.cat([bias, eb], dim=1)
        logits = torch.einsum("bhd,bkd->bhk", q, keys) * d**-0.5 + bias.to(q.dtype)[:, None, :]
        probs = _softmax_with_sink(logits, self.sinks.view(1, -1, 1)).to(keys.dtype)
        out: torch.Tensor = torch.einsum("bhk,bkd->bhd", probs, keys)
        return out

    def _attend_gathered(
        self,
        q: torch.Tensor,
        proj: list[torch.Tensor],
        joined: torch.Tensor,
        windows: list[torch.Tensor],
        entries: list[torch.Tensor],
        index_keys: list[torch.Tensor],
    ) -> torch.Tensor:
        """The decode attention through the Triton kernels: every sequence's window rows
        (``joined``, ``windows`` its consecutive parts) and entries in one row pool, each
        query gathering its own (for CSA, the window and the indexer's picks; the indexer is
        skipped while no sequence holds more entries than it picks, as it would pick them
        all)."""
        from ..kernels.v4_attention import indexer_scores, sparse_decode_attention

        dev, b = q.device, q.shape[0]
        wl = [r.shape[0] for r in windows]
        el = [e.shape[0] for e in entries]
        wbase = _starts(wl)
        ebase = _starts(el, sum(wl))
        meta = torch.tensor([wbase, wl, ebase or [0] * b, el or [0] * b], device=dev)
        pool = torch.cat([joined, *entries]) if entries else joined  # windows are in order
        cols = torch.arange(max(wl), device=dev)[None, :]
        index = [torch.where(cols < meta[1, :, None], meta[0, :, None] + cols, -1)]
        if max(el, default=0):
            cols = torch.arange(max(el), device=dev)[None, :]
            comp = self.compressor
            topk = comp.indexer.topk if isinstance(comp, CSACompressor) else 0
            if topk and max(el) > topk:
                assert isinstance(comp, CSACompressor)
                ind = comp.indexer
                scores = indexer_scores(
                    proj[4], proj[5], torch.cat(index_keys), meta[2] - sum(wl), meta[3],
                    max(el), ind.dim**-0.5,
                )  # fmt: skip
                cols = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
            index.append(torch.where(cols < meta[3, :, None], meta[2, :, None] + cols, -1))
        return sparse_decode_attention(
            q, pool, torch.cat(index, dim=1), self.sinks, self.cfg.head_dim**-0.5
        )

    def _attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        proj: list[torch.Tensor],
        positions: torch.Tensor,
        st: LayerState,
        rot: V4Rotary,
    ) -> torch.Tensor:
        """One sequence's attention output ``[S, heads, head_dim]`` (still rotated) over its
        window and compressed entries; its state advanced past these rows."""
        cfg = self.cfg
        s, h, d, w = q.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        past = st.window if st.window is not None else kv.new_zeros(0, d)
        keys = torch.cat([past, kv])
        st.window = keys[-(w - 1) :] if w > 1 else keys[:0]
        key_pos = torch.arange(keys.shape[0], device=q.device) + positions[0] - past.shape[0]
        rel = positions[:, None] - key_pos[None, :]
        bias = torch.zeros(s, keys.shape[0], dtype=torch.float32, device=q.device)
        bias = bias.masked_fill((rel < 0) | (rel >= w), float("-inf"))
        comp = self.compressor
        if comp is not None:
            cst = st.compressors.setdefault("compressor", CompressorState())
            entries = comp.absorb(proj[0], proj[1], cst, rot)
            t = entries.shape[0]
            if isinstance(comp, CSACompressor):
                ist = st.compressors.setdefault("indexer", CompressorState())
                index_keys = comp.indexer.absorb(proj[2], proj[3], ist, rot)
                picked = comp.indexer.pick(proj[4], proj[5], index_keys, positions)
                eb = torch.full((s, t + 1), float("-inf"), device=q.device)
                eb.scatter_(1, torch.where(picked >= 0, picked, t), 0.0)
                eb = eb[:, :t]
            else:
                closed = (positions + 1) // comp.rate
                future = torch.arange(t, device=q.device)[None, :] >= closed[:, None]
                eb = torch.zeros(s, t, device=q.device).masked_fill(future, float("-inf"))
            keys = torch.cat([keys, entries])
            bias = torch.cat([bias, eb], dim=1)
        logits = torch.einsum("shd,kd->hsk", q, keys) * d**-0.5 + bias.to(q.dtype)
        probs = _softmax_with_sink(logits, self.sinks.view(h, 1, 1)).to(keys.dtype)
        out: torch.Tensor = torch.einsum("hsk,kd->shd", probs, keys)
        return out


def _softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis with one more logit per row, the head's sink (``sink``
    broadcasts to the rows), whose share is dropped: the rows sum to less than 1."""
    both = torch.cat([logits, sink.to(logits.dtype).expand(*logits.shape[:-1], 1)], dim=-1)
    both = both - both.max(dim=-1, keepdim=True).values
    return F.softmax(both, dim=-1)[..., :-1]


def _pad(rows: Sequence[torch.Tensor], left: bool = False) -> torch.Tensor:
    """``[n_i, D]`` tensors as one ``[B, max n_i, D]`` batch, zero-padded at the end (or at
    the start: ``left``)."""
    n = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros(len(rows), n, rows[0].shape[-1])
    for i, r in enumerate(rows):
        m = r.shape[0]
        if m:
            (out[i, n - m :] if left else out[i, :m]).copy_(r)
    return out


def _rotary_of(kind: str) -> str:
    """The rotary table a layer of this kind uses: sliding layers the main one."""
    return "main" if kind == SLIDING else "compress"


def _starts(lengths: list[int], first: int = 0) -> list[int]:
    """Where each of consecutive runs of ``lengths`` starts, the first at ``first``."""
    out, at = [], first
    for n in lengths:
        out.append(at)
        at += n
    return out
