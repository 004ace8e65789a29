"""Verification, row by row: what a request's drafts become once the main model has seen them.

A verified request runs as ``1 + j`` rows (its last token and ``j`` drafts); row ``i`` gives
the target distribution for draft ``i + 1``. Greedy (:func:`greedy_accept`): drafts are kept
while they equal the target's argmax, then the target's token at the first mismatch (or after
the last draft) is the bonus token. Sampling (:func:`verify_row`): a draft ``d`` (the MTP head's
argmax, a deterministic proposal) is kept with probability ``p(d)`` under the request's
processed target distribution; at the first rejection the token is drawn from ``p`` with ``d``
removed, renormalised; so each emitted token is distributed exactly as the target's.

The sampler's rules hold row by row: a row's penalties count the drafts before it as output
(:func:`penalize_rows`), a row before the request's ``min_tokens``-th output has its stop tokens
masked (:func:`mask_min_tokens_rows`), and under a constraint row ``i`` allows what the grammar
allows after the first ``i`` drafts (:func:`mask_constrained_rows`). Logprobs of verified tokens
come from the target's distribution at their rows, as the sampler reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from ..sampler import TokenHistory, apply_penalties, drawn_logits, mask_stops, position_seed
from ..scheduler import ScheduledSeq

if TYPE_CHECKING:
    from ..grammar import GrammarBackend


def token_logprob(logits: torch.Tensor, params: SamplingParams, token: int) -> TokenLogprob:
    """What the sampler reports for ``token`` drawn from this row: its log probability and the
    top ``params.logprobs`` under the distribution drawn from
    (:func:`libs.engine.sampler.drawn_logits`)."""
    lp = drawn_logits(logits, params).log_softmax(-1)
    n = int(params.logprobs or 0)
    top = lp.topk(n) if n else None
    return TokenLogprob(
        float(lp[token]),
        tuple(top.indices.tolist()) if top is not None else (),
        tuple(top.values.tolist()) if top is not None else (),
    )


def verify_row(
    probs: torch.Tensor,
    drafts: Sequence[int],
    generator: Callable[[int], torch.Generator | None],
    first_position: int,
) -> list[int]:
    """Rejection sampling of deterministic drafts. ``probs [j + 1, V]``: the target's
    distributions at the drafts' positions and after the last one; ``generator(position)``
    the generator for the token at that position (seeded requests: their own). Returns the
    accepted drafts and the token after them."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        gen = generator(first_position + i)
        p = probs[i]
        u = torch.rand((), generator=gen, device=p.device)
        if bool(u < p[d]):
            out.append(int(d))
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = residual.sum()
        if not bool(total > 0):  # p was all on d and u == 1: cannot happen but for rounding
            out.append(int(d))
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=gen)))
        return out
    gen = generator(first_position + len(drafts))
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=gen)))
    return out


def greedy_accept(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Greedy verification: drafts while they equal the target's argmax, then its token."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        if target[i] != d:
            break
        out.append(int(d))
    out.append(int(target[len(out)]))
    return out


def row_offsets(seqs: list[ScheduledSeq], first: int) -> list[tuple[ScheduledSeq, int]]:
    out, o = [], first
    for s in seqs:
        out.append((s, o))
        o += s.num_tokens
    return out


def penalize_rows(
    logits: torch.Tensor,
    verify: list[ScheduledSeq],
    first: int,
    params: dict[str, SamplingParams],
    histories: dict[str, tuple[list[int], int]],
) -> torch.Tensor:
    """``logits`` (a step's sampled rows; ``verify``'s from row ``first`` on, 1 + drafts each)
    with the verification rows of requests using a penalty penalized as the sampler does, row
    ``i``'s history holding the ``i`` drafts before it as output. ``histories``: (prompt +
    output tokens before the step, prompt length) per such request."""
    rows: list[int] = []
    tokens: list[list[int]] = []
    prompts: list[int] = []
    row_params = [SamplingParams()] * logits.shape[0]
    for s, o in row_offsets(verify, first):
        p = params[s.request_id]
        if not p.uses_penalties:
            continue
        base, num_prompt = histories[s.request_id]
        for i in range(s.num_tokens):
            rows.append(o + i)
            tokens.append([*base, *s.token_ids[1 : 1 + i]])
            prompts.append(num_prompt)
            row_params[o + i] = p
    if not rows:
        return logits
    history = TokenHistory.build(rows, tokens, prompts, logits.device)
    return apply_penalties(logits, row_params, history)


def mask_min_tokens_rows(
    logits: torch.Tensor,
    verify: list[ScheduledSeq],
    first: int,
    params: dict[str, SamplingParams],
    generated: dict[str, int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """Verification rows of requests short of ``min_tokens`` with their stop tokens masked,
    row ``i`` counting ``i`` more outputs (the sampler's rule, row by row)."""
    rows, ps, counts = [], [], []
    for s, o in row_offsets(verify, first):
        p = params[s.request_id]
        if not p.min_tokens:
            continue
        base = generated[s.request_id]
        for i in range(s.num_tokens):
            rows.append(o + i)
            ps.append(p)
            counts.append(base + i)
    if not rows:
        return logits
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    masked = mask_stops(logits[index], ps, counts, eos_token_ids)
    return logits.index_copy(0, index, masked)


def mask_constrained_rows(
    logits: torch.Tensor, verify: list[ScheduledSeq], off: int, grammar: GrammarBackend
) -> torch.Tensor:
    """The verification rows of constrained requests (from row ``off``, as
    :func:`penalize_rows` lays them out) masked by their grammar: row ``i`` of a request to what
    may follow its first ``i`` drafts, as the sampler masks a plain row."""
    from ..grammar import apply_masks

    rows: list[int] = []
    parts: list[torch.Tensor] = []
    for s, o in row_offsets(verify, off):
        if not grammar.has(s.request_id):
            continue
        taken, bits = grammar.draft_masks(s.request_id, s.token_ids[1:])
        assert taken == s.num_drafts, "drafts are cut to what the grammar allows when chosen"
        rows.extend(range(o, o + s.num_tokens))
        parts.append(bits)
    if not rows:
        return logits
    bitmask = torch.zeros(logits.shape[0], parts[0].shape[1], dtype=parts[0].dtype)
    bitmask[rows] = torch.cat(parts)
    logits = logits.clone()
    apply_masks(logits, (rows, bitmask))
    return logits


def seeded_generator(
    params: SamplingParams, shared: torch.Generator, scratch: torch.Generator
) -> Callable[[int], torch.Generator]:
    """The generator for the token at a position: the request's own stream when it has a seed
    (keyed by position, as the sampler does), else the engine's."""
    if params.seed is None:
        return lambda _pos: shared
    seed = params.seed

    def gen(position: int) -> torch.Generator:
        scratch.manual_seed(position_seed(seed, position))
        return scratch

    return gen


@dataclass
class SpecStats:
    """Counters since start (the engine's metrics read them): steps that verified drafts,
    requests whose drafts a step verified (one per request and step), drafts made, drafts
    verified, drafts accepted, tokens emitted by those verifications."""

    steps: int = 0
    verifications: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    emitted: int = 0

    def count_verification(self, verified: int, emitted: int) -> None:
        """One request's ``verified`` drafts gave ``emitted`` tokens (accepted ones + 1)."""
        self.verifications += 1
        self.verified += verified
        self.accepted += emitted - 1
        self.emitted += emitted


@dataclass
class SpecStep:
    """What :meth:`SpecDecoder.run` leaves for :meth:`SpecDecoder.draft`."""

    sampled: dict[str, int | list[int]]
    seconds: float
    hidden: torch.Tensor  # the main model's final hidden states, one row per step token
    rows: dict[str, int] = field(default_factory=dict)  # request -> its first row in hidden
    # Verified requests that asked for logprobs: one per token they were given, in order.
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


def sample_verified(
    logits: torch.Tensor,
    verify: list[ScheduledSeq],
    off: int,
    params: dict[str, SamplingParams],
    generated: dict[str, int],
    histories: dict[str, tuple[list[int], int]],
    grammar: GrammarBackend | None,
    eos_token_ids: Sequence[int],
    generators: tuple[torch.Generator, torch.Generator],
) -> tuple[dict[str, int | list[int]], dict[str, list[TokenLogprob]]]:
    """The tokens of the verified seqs (their rows of ``logits`` from row ``off`` on, 1 + drafts
    each): the rows processed by the sampler's rules (penalties, min_tokens, constraints),
    then the accepted drafts and the token after them per request (greedy: while the drafts
    equal the argmax; else rejection sampling with ``generators``, the engine's shared one
    and a scratch one for seeded requests), and the logprobs of those that asked."""
    sampled: dict[str, int | list[int]] = {}
    lps: dict[str, list[TokenLogprob]] = {}
    logits = penalize_rows(logits, verify, off, params, histories)
    logits = mask_min_tokens_rows(logits, verify, off, params, generated, eos_token_ids)
    if grammar is not None:
        logits = mask_constrained_rows(logits, verify, off, grammar)
    greedy_rows = [(s, off0) for s, off0 in row_offsets(verify, off) if params[s.request_id].greedy]
    if greedy_rows:
        best = logits.argmax(-1).tolist()
        for s, o in greedy_rows:
            sampled[s.request_id] = greedy_accept(best[o : o + s.num_tokens], s.token_ids[1:])
    for s, o in row_offsets(verify, off):
        p = params[s.request_id]
        if p.greedy:
            continue
        probs = torch.stack(
            [drawn_logits(logits[o + i], p).softmax(-1) for i in range(s.num_tokens)]
        )
        gen = seeded_generator(p, *generators)
        sampled[s.request_id] = verify_row(probs, s.token_ids[1:], gen, s.sample_position)
    for s, o in row_offsets(verify, off):
        p = params[s.request_id]
        got = sampled[s.request_id]
        if p.logprobs is not None and isinstance(got, list):
            lps[s.request_id] = [token_logprob(logits[o + i], p, t) for i, t in enumerate(got)]
    return sampled, lps
