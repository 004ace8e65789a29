"""Verification, row by row: what a request's drafts become once the main model has seen them.

A verified request runs as ``1 + j`` rows (its last token and ``j`` drafts); row ``i`` gives
the target distribution for draft ``i + 1``. Greedy (:func:`greedy_accept`): drafts are kept
while they equal the target's argmax, then the target's token at the first mismatch (or after
the last draft) is the bonus token. Sampling (:func:`verify_row`): a draft ``d`` (the MTP head's
argmax, a deterministic proposal) is kept with probability ``p(d)`` under the request's
processed target distribution; at the first rejection the token is drawn from ``p`` with ``d``
removed, renormalised; so each emitted token is distributed exactly as the target's.

The sampler's rules hold row by row, applied by the sampler's own
:func:`~libs.engine.sampler.apply_rules` to the rows :func:`verification_rules` lays out: a
row's penalties count the drafts before it as output, a row before the request's
``min_tokens``-th output has its stop tokens masked, and under a constraint row ``i`` allows
what the grammar allows after the first ``i`` drafts. Logprobs of verified tokens come from the
target's distribution at their rows, as the sampler reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from ..sampler import RowRules, TokenHistory, apply_rules, drawn_logits, position_seed
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


def verification_rules(
    num_rows: int,
    verify: list[ScheduledSeq],
    first: int,
    params: dict[str, SamplingParams],
    generated: dict[str, int],
    histories: dict[str, tuple[list[int], int]],
    grammar: GrammarBackend | None,
    device: torch.device | str = "cpu",
) -> RowRules:
    """The sampler's rules (:class:`~libs.engine.sampler.RowRules`) for a step's ``num_rows``
    sampled rows, ``verify``'s laid out from row ``first`` on (1 + drafts each): row ``i`` of a
    request has its settings, ``generated + i`` outputs before it, its history (prompt and
    outputs before the step: ``histories``) with the ``i`` drafts before it appended, and under
    a constraint what may follow those ``i`` drafts. Other rows get the default settings,
    which no rule touches. ``device``: the logits' (the histories go there)."""
    row_params = [SamplingParams()] * num_rows
    counts = [0] * num_rows
    hist_rows: list[int] = []
    hist_tokens: list[list[int]] = []
    hist_prompts: list[int] = []
    mask_rows: list[int] = []
    mask_parts: list[torch.Tensor] = []
    for s, o in row_offsets(verify, first):
        rid, p = s.request_id, params[s.request_id]
        drafts = s.token_ids[1:]
        for i in range(s.num_tokens):
            row_params[o + i] = p
            counts[o + i] = generated[rid] + i if p.min_tokens else 0
            if p.uses_penalties:
                base, num_prompt = histories[rid]
                hist_rows.append(o + i)
                hist_tokens.append([*base, *drafts[:i]])
                hist_prompts.append(num_prompt)
        if grammar is not None and grammar.has(rid):
            taken, bits = grammar.draft_masks(rid, list(drafts))
            assert taken == s.num_drafts, "drafts are cut to what the grammar allows when chosen"
            mask_rows.extend(range(o, o + s.num_tokens))
            mask_parts.append(bits)
    history = None
    if hist_rows:
        history = TokenHistory.build(hist_rows, hist_tokens, hist_prompts, torch.device(device))
    masks = None
    if mask_rows:
        bitmask = torch.zeros(num_rows, mask_parts[0].shape[1], dtype=mask_parts[0].dtype)
        bitmask[mask_rows] = torch.cat(mask_parts)
        masks = (mask_rows, bitmask)
    return RowRules(row_params, counts, history, masks)


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
    rules = verification_rules(
        logits.shape[0], verify, off, params, generated, histories, grammar, logits.device
    )
    logits = apply_rules(logits, rules, eos_token_ids)
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
