"""Token sampling over a batch of logits with per-request settings.

Sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. draws the
token with probability ``p``. For a seeded request the ``E`` vector for the token at sequence
position ``n`` comes from a generator seeded with ``mix(seed, n)``, so its draw depends on
nothing else in the batch and can be replayed anywhere (after preemption or KV import).

Before the draw (greedy rows too) the penalties change the logits and ``min_tokens`` masks
the stop tokens; each step is skipped when no row of the batch uses it, so a batch without
them runs exactly the plain argmax/race it always did.

Rows that ask for ``logprobs`` get the log-softmax of the logits they were drawn from (a
sampled row's after temperature and cuts, a greedy row's after penalties and masking): the
drawn token's value and the top N, gathered on the device (:attr:`Sampler.last_logprobs`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libs.common.sampling import SamplingParams, TokenLogprob


def position_seed(seed: int, position: int) -> int:
    """63-bit seed for (request seed, token position), stable across processes."""
    digest = hashlib.sha256(struct.pack("<QQ", seed, position)).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class TokenHistory:
    """The tokens the penalties read, for the sampling rows that use a penalty.

    ``tokens[j]`` holds row ``rows[j]``'s prompt then its output so far (the tokens before the
    one being sampled), padded with negative ids; its first ``num_prompt[j]`` are the prompt.
    """

    rows: tuple[int, ...]
    tokens: torch.Tensor  # [len(rows), L] int64 on the logits' device
    num_prompt: torch.Tensor  # [len(rows)] int64 on the logits' device

    @classmethod
    def build(
        cls,
        rows: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        num_prompt: Sequence[int],
        device: torch.device,
    ) -> TokenHistory:
        width = max([len(t) for t in token_lists] + [1])
        host = torch.full((len(rows), width), -1, dtype=torch.int64)
        for j, toks in enumerate(token_lists):
            host[j, : len(toks)] = torch.as_tensor(toks, dtype=torch.int64)
        return cls(
            tuple(rows),
            host.to(device, non_blocking=True),
            torch.as_tensor(num_prompt, dtype=torch.int64).to(device, non_blocking=True),
        )


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], history: TokenHistory
) -> torch.Tensor:
    """``logits`` [B, V] fp32 with the rows of ``history`` penalized (out of place).

    repetition (HF/vLLM): a token seen in prompt or output has a positive logit divided and a
    negative one multiplied by the penalty; frequency and presence (OpenAI): minus
    ``frequency * count + presence * (count > 0)`` over the output only.
    """
    if not history.rows:
        return logits
    vocab = logits.shape[-1]
    dev = logits.device
    idx = torch.as_tensor(history.rows, dtype=torch.int64).to(dev, non_blocking=True)
    tok = history.tokens
    valid = tok >= 0
    col = torch.arange(tok.shape[1], device=dev)[None, :]
    generated = valid & (col >= history.num_prompt[:, None])
    tok = torch.where(valid, tok, vocab)  # padding counts into a spare column, dropped below
    zeros = torch.zeros(tok.shape[0], vocab + 1, dtype=torch.float32, device=dev)
    counts = zeros.scatter_add(1, tok, generated.float())[:, :vocab]
    seen = zeros.scatter_add(1, tok, valid.float())[:, :vocab] > 0

    def column(name: str) -> torch.Tensor:
        vals = [float(getattr(params[r], name)) for r in history.rows]
        return torch.tensor(vals, dtype=torch.float32).to(dev, non_blocking=True)[:, None]

    rep, freq, pres = (
        column("repetition_penalty"),
        column("frequency_penalty"),
        column("presence_penalty"),
    )
    x = logits.index_select(0, idx)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).float()
    return logits.index_copy(0, idx, x)


def mask_stops(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """``logits`` with EOS (unless ignore_eos) and stop_token_ids at -inf in every row that
    has generated fewer than its ``min_tokens`` (out of place)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if num_generated[i] < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            stops = {t for t in stops if t < logits.shape[-1]}
            rows += [i] * len(stops)
            cols += sorted(stops)
    if not rows:
        return logits
    dev = logits.device
    index = (
        torch.as_tensor(rows, dtype=torch.int64).to(dev, non_blocking=True),
        torch.as_tensor(cols, dtype=torch.int64).to(dev, non_blocking=True),
    )
    return logits.index_put(index, torch.tensor(float("-inf"), device=dev))


@dataclass(frozen=True)
class RowRules:
    """What the sampler's rules need for a set of logits rows: each row's settings; the
    outputs before its token (needed where a row sets ``min_tokens``); the token history of
    the rows that use a penalty; the rows a constraint limits and the bitmask that says to
    what. A plain step has one row per request; a verified request has ``1 + drafts`` rows,
    row ``i`` counting the ``i`` drafts before it as output (``speculative/verify.py``)."""

    params: Sequence[SamplingParams]
    num_generated: Sequence[int] | None = None
    history: TokenHistory | None = None
    masks: tuple[list[int], torch.Tensor] | None = None


def apply_rules(
    logits: torch.Tensor, rules: RowRules, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """``logits`` [rows, V] as fp32 with the penalties, ``min_tokens`` and the constraint
    masks applied, each skipped where no row uses it (the caller's tensor is never changed)."""
    raw = logits.data_ptr()
    logits = logits.float()
    params = rules.params
    if any(p.uses_penalties for p in params):
        if rules.history is None:
            raise ValueError("a row uses a penalty: pass the token history")
        logits = apply_penalties(logits, params, rules.history)
    if any(p.min_tokens for p in params):
        if rules.num_generated is None:
            raise ValueError("a row sets min_tokens: pass num_generated")
        logits = mask_stops(logits, params, rules.num_generated, eos_token_ids)
    if rules.masks is not None:
        from .grammar import apply_masks

        logits = logits.clone() if logits.data_ptr() == raw else logits
        apply_masks(logits, rules.masks)
    return logits


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask (-inf) tokens outside top-k, below min_p times the top probability and outside
    the top-p nucleus; [V] fp32."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed
        floor = logits.max() + torch.log(torch.tensor(min_p, device=logits.device))
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token if the mass strictly before it is below top_p (the first always stays).
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def drawn_logits(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits a row's token is drawn from, the ones its logprobs report: a greedy row's
    as they are (temperature 1), else divided by the temperature and cut by top-k, min-p and
    top-p (:func:`_filter`). ``row [V]`` fp32, after penalties and masks."""
    if params.greedy:
        return row
    return _filter(row / params.temperature, params.top_k, params.top_p, params.min_p)


@dataclass
class LogprobRows:
    """The logprobs of one sampling call (:attr:`Sampler.last_logprobs`)."""

    rows: list[int]  # sampling rows that asked, ascending
    counts: list[int]  # top-N per row
    values: torch.Tensor  # fp32 [len(rows), 1 + max(counts)]: drawn token, then the top N
    ids: torch.Tensor  # int64 [len(rows), max(counts)]

    def unpack(self, values: list[list[float]], ids: list[list[int]]) -> list[TokenLogprob]:
        """Host copies of :attr:`values` / :attr:`ids` to one TokenLogprob per row."""
        return [
            TokenLogprob(v[0], tuple(i[:n]), tuple(v[1 : 1 + n]))
            for v, i, n in zip(values, ids, self.counts, strict=True)
        ]


class Sampler:
    def __init__(
        self,
        device: torch.device,
        seed: int | None = None,
        eos_token_ids: Sequence[int] = (),
        batch_invariant: bool = False,
    ) -> None:
        self.device = device
        # Logprobs normalized one row at a time: a library softmax over [rows, V] may split
        # one row's sum differently for different row counts.
        self.batch_invariant = batch_invariant
        self.eos_token_ids = tuple(eos_token_ids)  # what min_tokens keeps from being drawn
        self._rng = torch.Generator(device=device)
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)
        self._seeded = torch.Generator(device=device)
        # Set by sample_device for the rows that asked for logprobs (else None): the rows,
        # their top-N counts, and on the device [rows, 1 + N_max] log probabilities (the drawn
        # token's first) and [rows, N_max] token ids. Read right after the call.
        self.last_logprobs: LogprobRows | None = None

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        num_generated: Sequence[int] | None = None,
        history: TokenHistory | None = None,
    ) -> list[int]:
        """One token per row. ``positions[i]``: sequence position of the token being sampled;
        ``num_generated[i]``: output tokens before it (needed when a row sets min_tokens);
        ``history``: the rows that use a penalty (needed when one does)."""
        out: list[int] = self.sample_device(
            logits, params, positions, num_generated, history
        ).tolist()
        return out

    def sample_device(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        num_generated: Sequence[int] | None = None,
        history: TokenHistory | None = None,
        *,
        masks: tuple[list[int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As :meth:`sample`, as an int64 tensor on the logits' device, without waiting for it.
        ``masks``: rows whose tokens a constraint limits, and the bitmask that says which."""
        logits = apply_rules(
            logits, RowRules(params, num_generated, history, masks), self.eos_token_ids
        )
        out = logits.argmax(dim=-1)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        dists: dict[int, torch.Tensor] = {}  # row -> the logits it was drawn from
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = drawn_logits(logits[i], p)
            if p.logprobs is not None:
                dists[i] = row
            probs = row.softmax(-1)
            if p.seed is None:
                gen = self._rng
            else:
                gen = self._seeded
                gen.manual_seed(position_seed(p.seed, positions[i]))
            e = torch.empty_like(probs).exponential_(generator=gen).clamp_min_(1e-30)
            out[i] = (probs / e).argmax()
        self.last_logprobs = None
        if wanted:
            counts = [int(params[i].logprobs or 0) for i in wanted]
            picked = [dists.get(i, logits[i]) for i in wanted]
            rows = (
                torch.stack([r.log_softmax(-1) for r in picked])
                if self.batch_invariant
                else torch.stack(picked).log_softmax(-1)
            )
            chosen = rows.gather(1, out[wanted].unsqueeze(1))
            top = rows.topk(max(counts), dim=-1) if max(counts) else None
            vals = chosen if top is None else torch.cat([chosen, top.values], dim=1)
            ids = out.new_empty(len(wanted), 0) if top is None else top.indices
            self.last_logprobs = LogprobRows(wanted, counts, vals, ids)
        return out
