"""DeepSeek-V4 in plain PyTorch, its per-request state as data.

This is the family's reference: parameter names are the Hugging Face checkpoint's (a
``DeepseekV4ForCausalLM`` state dict loads as it is), and :class:`V4State` holds everything a
request carries between forward calls, per layer:

* ``window``: the last ``sliding_window - 1`` key/value rows (K = V: one shared head, RoPE'd);
* per compressor (``"compressor"``, and for CSA layers the indexer's ``"indexer"``): the tokens
  of the window not yet closed (``buf_kv``/``buf_gate``), the entries emitted so far
  (``entries``; one per ``rate`` tokens), and for CSA the previous window's first-half series
  (``overlap_kv``/``overlap_gate``: an entry pools ``2 * rate`` tokens at stride ``rate``).

A chunk of ``S`` tokens at positions ``p0 .. p0+S-1`` (:meth:`V4ForCausalLM.forward`) attends,
per query at ``t``, to the window rows at positions ``t-W < k <= t``, plus compressed entries
whose windows closed by ``t`` (HCA: all of them; CSA: the indexer's top ``index_topk`` of
them), plus a per-head sink that takes probability mass and gives no value. Chunking a prompt
differently, or decoding token by token, gives what one pass gives: exactly tied indexer scores
go to the lower entry (transformers' ``torch.topk`` breaks such ties by the row's length, so
there, and only there, the two can pick differently).

Several sequences go through one pass (:meth:`V4ForCausalLM.forward_batch`, what the engine's
V4 runner calls): every matrix over all their rows, attention per sequence over its own state
-- for decode rows (one token each) as one batch: padded in PyTorch, or gathered by the Triton
kernels (:meth:`V4ForCausalLM.set_kernels`, on by default on CUDA), the compressor windows that
close at that step pooled together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.v4_mix import hc_mix, hc_mix_reference
from ..model.rope import inv_freq_and_attention_factor
from .config import CSA, HCA, SLIDING, V4Config, V4Rope


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


class CompressorState:
    """One compressor's state (module doc). Rows fed one at a time (decode) wait in a list
    until their window closes or someone reads ``buf_kv``/``buf_gate``: appending a row
    launches nothing on the device (the rows are views of their step's projections, so a
    window of ``rate`` tokens keeps up to ``rate - 1`` steps' projection rows alive)."""

    def __init__(self) -> None:
        self._kv: torch.Tensor | None = None
        self._gate: torch.Tensor | None = None
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # after _kv/_gate
        self.entries: torch.Tensor | None = None
        self.overlap_kv: torch.Tensor | None = None
        self.overlap_gate: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[0])

    @property
    def buffered(self) -> int:
        """Tokens of the open window fed so far."""
        return (0 if self._kv is None else int(self._kv.shape[0])) + len(self._rows)

    def append(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """One more token's ``[1, width]`` rows, joined to the buffer only when read."""
        self._rows.append((kv, gate))

    def take(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The open window's rows (kv pieces, gate pieces) in order; the buffer left empty."""
        kv = ([] if self._kv is None else [self._kv]) + [r[0] for r in self._rows]
        gate = ([] if self._gate is None else [self._gate]) + [r[1] for r in self._rows]
        self._kv = self._gate = None
        self._rows = []
        return kv, gate

    def _join(self) -> None:
        if self._rows:
            kv = [] if self._kv is None else [self._kv]
            gate = [] if self._gate is None else [self._gate]
            self._kv = torch.cat(kv + [r[0] for r in self._rows])
            self._gate = torch.cat(gate + [r[1] for r in self._rows])
            self._rows = []

    @property
    def buf_kv(self) -> torch.Tensor | None:
        self._join()
        return self._kv

    @buf_kv.setter
    def buf_kv(self, value: torch.Tensor | None) -> None:
        self._join()
        self._kv = value

    @property
    def buf_gate(self) -> torch.Tensor | None:
        self._join()
        return self._gate

    @buf_gate.setter
    def buf_gate(self, value: torch.Tensor | None) -> None:
        self._join()
        self._gate = value


@dataclass
class LayerState:
    window: torch.Tensor | None = None
    compressors: dict[str, CompressorState] = field(default_factory=dict)


@dataclass
class V4State:
    """A request's state between forward calls (module doc); ``seen`` tokens so far."""

    layers: list[LayerState]
    seen: int = 0

    @classmethod
    def empty(cls, cfg: V4Config) -> V4State:
        return cls([LayerState() for _ in range(cfg.num_hidden_layers)])


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


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedMLP(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        inter = cfg.moe_intermediate_size
        self.gate_proj = _linear(inter, cfg.hidden_size)
        self.up_proj = _linear(inter, cfg.hidden_size)
        self.down_proj = _linear(cfg.hidden_size, inter)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(
            _clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit)
        )
        return out


class Router(nn.Module):
    """Scores (sqrt-softplus or sigmoid) of every expert; the top-k by score plus the
    correction bias, or (hash layers) the token's fixed ``tid2eid`` row; weights normalized
    and scaled by ``routed_scaling_factor``."""

    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size)
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        f = self.cfg.scoring_func
        scores = torch.sqrt(F.softplus(logits)) if f == "sqrtsoftplus" else torch.sigmoid(logits)
        if self.hashed:
            table = self.get_buffer("tid2eid")
            idx = table[ids].long()
        else:
            k = self.cfg.num_experts_per_tok
            bias = self.get_buffer("e_score_correction_bias")
            idx = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor, idx


class Experts(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = _param(e, 2 * i, h)
        self.down_proj = _param(e, h, i)
        self.limit = cfg.swiglu_limit
        self.use_kernels = False  # the fused Triton MoE (no host synchronization)

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            from ..kernels.fused_moe import fused_moe

            return fused_moe(
                x, self.gate_up_proj, self.down_proj, w.float(), idx, swiglu_limit=self.limit
            )
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(_clamped_swiglu(gate, up, self.limit), self.down_proj[e])
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer: int) -> None:
        super().__init__()
        self.gate = Router(cfg, cfg.mlp_layer_types[layer] == "hash_moe")
        self.experts = Experts(cfg)
        self.shared_experts = SharedMLP(cfg)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x, ids)
        out: torch.Tensor = self.experts(x, w, idx) + self.shared_experts(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self,
        streams: torch.Tensor,
        ids: torch.Tensor,
        spans: Sequence[tuple[int, int, torch.Tensor]],
        states: Sequence[LayerState],
        rotary: dict[str, V4Rotary],
        trig: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``spans``: (first row, rows, positions) of each sequence in the batch, whose
        layer state is the same index of ``states``; everything but attention is per token
        (``trig``: :meth:`Attention.forward`'s)."""
        post, comb, x = self.attn_hc(streams)
        y = self.self_attn(self.input_layernorm(x), spans, states, rotary, trig)
        streams = HyperConnection.expand(post, comb, y, streams)
        post, comb, x = self.ffn_hc(streams)
        y = self.mlp(self.post_attention_layernorm(x), ids)
        return HyperConnection.expand(post, comb, y, streams)


class Backbone(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class V4ForCausalLM(nn.Module):
    """The model (module doc). ``forward(ids, state)`` runs the next chunk of one sequence."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.hf_config: dict[str, Any] | None = None  # the config.json it was read from, if known
        self.model = Backbone(cfg)
        self.lm_head = _linear(cfg.vocab_size, cfg.hidden_size)
        r = cfg.qk_rope_head_dim
        self.rotary = {
            "main": V4Rotary(cfg.rope_main, r),
            "compress": V4Rotary(cfg.rope_compress, r),
        }

    def set_kernels(self, on: bool) -> None:
        """Decode attention, the indexer, the routed experts and the hyper-connections'
        mixing weights through the Triton kernels (on) or plain PyTorch (the reference)."""
        for module in self.modules():
            if isinstance(module, (Attention, Experts, HyperConnection)):
                module.use_kernels = on

    @torch.inference_mode()
    def warm_kernels(self) -> None:
        """Compile, now, every variant of the Triton kernels a step can reach, rather than in
        the middle of someone's stream (the CSA indexer first runs once a request holds more
        entries than it picks: 2,052 tokens into V4-Flash; a compile there stalls the step
        ~0.6 s on an H200). Each kernel once, the attention combine per power-of-two split
        count, the fused MoE per launch config (one, a few and many rows per expert)."""
        from ..kernels.v4_attention import indexer_scores, sparse_decode_attention

        cfg = self.cfg
        p = next(self.parameters())
        dev, dt = p.device, p.dtype
        h, d = cfg.num_attention_heads, cfg.head_dim
        q, rows = (
            torch.zeros(1, h, d, device=dev, dtype=dt),
            torch.zeros(2, d, device=dev, dtype=dt),
        )
        index = torch.tensor([[0, 1]], device=dev, dtype=torch.int32)
        sinks = torch.zeros(h, device=dev)
        for splits in (1, 2, 4, 8, 16):
            sparse_decode_attention(q, rows, index, sinks, 1.0, num_splits=splits)
        if CSA in cfg.layer_types:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            one = torch.ones(1, device=dev, dtype=torch.int32)
            indexer_scores(
                torch.zeros(1, hi, di, device=dev, dtype=dt), torch.zeros(1, hi, device=dev),
                torch.zeros(2, di, device=dev, dtype=dt), one - 1, one, 2, 1.0,
            )  # fmt: skip
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)
        layer.attn_hc(torch.zeros(1, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=dt))
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        for rows_per_expert in (1, 13, 97):
            t = -(-rows_per_expert * e // k)
            idx = torch.arange(t * k, device=dev).remainder(e).view(t, k)
            x = torch.zeros(t, cfg.hidden_size, device=dev, dtype=dt)
            layer.mlp.experts(x, torch.ones(t, k, device=dev), idx)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: V4State) -> torch.Tensor:
        """Logits ``[S, vocab]`` (fp32) of the chunk ``ids [S]`` that follows ``state.seen``
        tokens; ``state`` is advanced past it."""
        return self.forward_batch([ids], [state], last_only=False)

    @torch.inference_mode()
    def forward_batch(
        self, chunks: Sequence[torch.Tensor], states: Sequence[V4State], last_only: bool = True
    ) -> torch.Tensor:
        """Several sequences in one pass: ``chunks[i]`` follows ``states[i].seen`` tokens and
        advances that state. Logits (fp32) of each chunk's last token ``[len(chunks), vocab]``,
        or of every token (``last_only=False``: ``[sum of lengths, vocab]``)."""
        ids = chunks[0] if len(chunks) == 1 else torch.cat(list(chunks))
        lengths = [int(c.shape[0]) for c in chunks]
        # Every row's position in one host-to-device copy; each span's a view of it.
        where = [
            p for n, st in zip(lengths, states, strict=True) for p in range(st.seen, st.seen + n)
        ]
        positions = torch.tensor(where, device=ids.device)
        spans: list[tuple[int, int, torch.Tensor]] = []
        o = 0
        for n in lengths:
            spans.append((o, n, positions[o : o + n]))
            o += n
        x = self.model.embed_tokens(ids)
        # cos/sin at every row's position, once per rotary table the layers use.
        tables = {_rotary_of(kind) for kind in self.cfg.layer_types}
        trig = {n: self.rotary[n].cos_sin(positions, x.dtype) for n in sorted(tables)}
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            states_i = [st.layers[i] for st in states]
            streams = layer(streams, ids, spans, states_i, self.rotary, trig)
        for (_, n, _), st in zip(spans, states, strict=True):
            st.seen += n
        if last_only:
            streams = streams[[o + n - 1 for o, n, _ in spans]]
        hidden = self.model.norm(self.model.hc_head(streams))
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """A transformers ``DeepseekV4ForCausalLM`` state dict (rotary tables, which are
        computed here, and the MTP layers, not run here yet, are skipped)."""
        keep = {
            k: v
            for k, v in state.items()
            if "rotary_emb" not in k and not k.startswith(("mtp.", "model.mtp."))
        }
        try:
            missing, unexpected = self.load_state_dict(keep, strict=False)
        except RuntimeError as exc:  # shapes: the checkpoint is another config's
            raise ValueError(f"V4 checkpoint does not match the config: {exc}") from None
        if missing or unexpected:
            raise ValueError(
                f"V4 checkpoint does not match the config: missing {sorted(missing)[:8]}, "
                f"unexpected {sorted(unexpected)[:8]}"
            )
