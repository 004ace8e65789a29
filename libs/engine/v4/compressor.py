"""DeepSeek-V4's compressors: a window of ``rate`` tokens pooled into one entry (HCA), with the
overlapping series and the indexer that picks the top entries per query (CSA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import V4Config
from .layers import RMSNorm, V4Rotary, _linear, _param
from .state import CompressorState


class Compressor(nn.Module):
    """Gated pooling of every ``rate`` tokens into one entry (HCA: ``dim``-wide windows; CSA:
    two series per token, an entry pooling the previous window's first series with this
    window's second), normed and RoPE'd at the window's first position."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = _linear(width, hidden)
        self.gate_proj = _linear(width, hidden)
        self.position_bias = _param(rate, width)
        self.kv_norm = RMSNorm(dim, eps)

    def absorb(
        self, kv: torch.Tensor, gate: torch.Tensor, st: CompressorState, rotary: V4Rotary
    ) -> torch.Tensor:
        """Feed one sequence's next tokens, as their ``kv_proj`` and ``gate_proj`` rows (a
        batch's computed together); returns every entry so far ``[T, dim]``."""
        first = st.count * self.rate
        if kv.shape[0] == 1 and st.buffered + 1 < self.rate:  # decode, the window stays open
            st.append(kv, gate)
            if st.entries is None:
                st.entries = kv.new_zeros(0, self.dim)
            return st.entries
        if st.buf_kv is not None and st.buf_kv.shape[0]:
            assert st.buf_gate is not None
            kv, gate = torch.cat([st.buf_kv, kv]), torch.cat([st.buf_gate, gate])
        usable = kv.shape[0] // self.rate * self.rate
        st.buf_kv, st.buf_gate = kv[usable:], gate[usable:]
        n = usable // self.rate
        if n == 0:
            if st.entries is None:
                st.entries = kv.new_zeros(0, self.dim)
            return st.entries
        ckv = kv[:usable].view(n, self.rate, -1)
        cgate = gate[:usable].view(n, self.rate, -1) + self.position_bias
        prev: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.overlap:  # each window's previous one: this state's last, then in the chunk
            d = self.dim
            first_kv, first_gate = self._carried(st, ckv, cgate)
            prev = (
                torch.cat([first_kv[None], ckv[:-1, :, :d]]),
                torch.cat([first_gate[None], cgate[:-1, :, :d]]),
            )
            # Copies: a view would keep the whole chunk's projection alive.
            st.overlap_kv, st.overlap_gate = ckv[-1, :, :d].clone(), cgate[-1, :, :d].clone()
        pos = torch.arange(n, device=kv.device) * self.rate + first
        pooled = self._pool(ckv, cgate, prev, pos, rotary)
        st.entries = pooled if st.entries is None else torch.cat([st.entries, pooled])
        return st.entries

    def absorb_rows(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        states: Sequence[CompressorState],
        rotary: V4Rotary,
    ) -> list[torch.Tensor]:
        """:meth:`absorb` of one token for each of ``B`` sequences (``kv``/``gate [B, width]``):
        a token that leaves its window open waits in its state; the windows that close are
        pooled together, in one batch. Returns each sequence's entries so far."""
        closing = []
        for i, st in enumerate(states):
            if st.buffered + 1 < self.rate:
                st.append(kv[i : i + 1], gate[i : i + 1])
                if st.entries is None:
                    st.entries = kv.new_zeros(0, self.dim)
            else:
                closing.append(i)
        if closing:
            kv_rows: list[torch.Tensor] = []
            gate_rows: list[torch.Tensor] = []
            for i in closing:
                st = states[i]
                k_parts, g_parts = st.take()
                kv_rows += [*k_parts, kv[i : i + 1]]
                gate_rows += [*g_parts, gate[i : i + 1]]
            m = len(closing)
            ckv = torch.cat(kv_rows).view(m, self.rate, -1)
            cgate = torch.cat(gate_rows).view(m, self.rate, -1) + self.position_bias
            prev: tuple[torch.Tensor, torch.Tensor] | None = None
            if self.overlap:
                carried = [self._carried(states[i], ckv, cgate) for i in closing]
                prev = (
                    torch.stack([c[0] for c in carried]),
                    torch.stack([c[1] for c in carried]),
                )
            first = [states[i].count * self.rate for i in closing]
            pos = torch.tensor(first, device=kv.device)
            pooled = self._pool(ckv, cgate, prev, pos, rotary)
            d = self.dim
            for j, i in enumerate(closing):
                st = states[i]
                if self.overlap:
                    st.overlap_kv, st.overlap_gate = ckv[j, :, :d], cgate[j, :, :d]
                new = pooled[j : j + 1]
                st.entries = new if st.entries is None else torch.cat([st.entries, new])
        out: list[torch.Tensor] = []
        for st in states:
            assert st.entries is not None
            out.append(st.entries)
        return out

    def _carried(
        self, st: CompressorState, ckv: torch.Tensor, cgate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first-half series a state carries from its last closed window (``[rate, dim]``
        each), or, before its first, zeros with ``-inf`` gates (they weigh nothing)."""
        if st.overlap_kv is not None and st.overlap_gate is not None:
            return st.overlap_kv, st.overlap_gate
        shape = (self.rate, self.dim)
        return ckv.new_zeros(shape), cgate.new_full(shape, float("-inf"))

    def _pool(
        self,
        ckv: torch.Tensor,
        cgate: torch.Tensor,
        prev: tuple[torch.Tensor, torch.Tensor] | None,
        pos: torch.Tensor,
        rotary: V4Rotary,
    ) -> torch.Tensor:
        """Entries ``[n, dim]`` of ``n`` closed windows (``ckv``, ``cgate [n, rate, width]``,
        the gates biased), each at its first position ``pos``; CSA (``prev``: each window's
        previous first-half series ``[n, rate, dim]``) pools that series with this window's
        second."""
        if prev is not None:
            d = self.dim
            ckv = torch.cat([prev[0], ckv[..., d:]], dim=1)
            cgate = torch.cat([prev[1], cgate[..., d:]], dim=1)
        weights = cgate.softmax(dim=1, dtype=torch.float32).to(ckv.dtype)
        pooled = self.kv_norm((ckv * weights).sum(dim=1))
        cos, sin = rotary.cos_sin(pos, pooled.dtype)
        out: torch.Tensor = V4Rotary.apply(pooled, cos, sin)
        return out


class Scorer(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.weights_proj = _linear(cfg.index_n_heads, cfg.hidden_size)


class Indexer(Compressor):
    """CSA's lightning indexer: its own compressor at ``index_head_dim``, queries from the
    attention's q residual; per query the top ``index_topk`` closed entries by
    ``sum_h w_h * relu(q_h . k)``."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, cfg.rms_norm_eps)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = _linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        self.scorer = Scorer(cfg)

    def queries(
        self, x: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the rotated indexer queries ``[S, heads, dim]`` and head weights
        ``[S, heads]`` (fp32)."""
        s = x.shape[0]
        q = V4Rotary.apply(self.q_b_proj(q_res).view(s, self.heads, self.dim), cos, sin)
        return q, self.scorer.weights_proj(x).float() * self.heads**-0.5

    def pick(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The chosen entries per query ``[S, k]`` (``-1``: none; not yet closed) among one
        request's indexer ``keys``."""
        s = q.shape[0]
        scores = F.relu(torch.einsum("shd,td->sht", q.float(), keys.float())) * self.dim**-0.5
        scores = (scores * w[..., None]).sum(dim=1)  # [S, T]
        t = keys.shape[0]
        k = min(self.topk, t)
        if t == 0:
            return torch.full((s, 0), -1, dtype=torch.long, device=q.device)
        closed = (positions + 1) // self.rate  # entries a query may see
        future = torch.arange(t, device=q.device)[None, :] >= closed[:, None]
        # Stable sort, not topk: exactly tied scores (ReLU zeros) go to the lower entry, so the
        # pick does not depend on how many entries the row holds (chunking, replay).
        masked = scores.masked_fill(future, float("-inf"))
        picked = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
        return torch.where(picked >= closed[:, None], torch.full_like(picked, -1), picked)

    def unpicked(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, unseen: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`pick` for ``B`` sequences of one query each over their padded keys
        ``[B, T, dim]``, as a mask: True where an entry is not picked (``unseen``: not closed
        for the query, or padding: never picked). Ties go to the lower entry, as in
        :meth:`pick`."""
        scores = F.relu(torch.einsum("bhd,btd->bht", q.float(), keys.float())) * self.dim**-0.5
        scores = (scores * w[..., None]).sum(dim=1).masked_fill(unseen, float("-inf"))  # [B, T]
        k = min(self.topk, keys.shape[1])
        picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        out = torch.ones_like(unseen)
        out.scatter_(1, picked, False)
        return out | unseen


class CSACompressor(Compressor):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.csa_rate, True, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg)


class HCACompressor(Compressor):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.hca_rate, False, cfg.rms_norm_eps)
