"""A step's sampled rows as the sampler reads them and as the token events carry them.

:func:`sampling_inputs` gathers, for the sampling seqs of a plan, what the sampler's rules need
beyond the logits (params, outputs so far for ``min_tokens``, histories for the penalties);
:func:`join_logprobs` puts each committed token's logprob on its event. Plain and speculative
steps use both (no torch, no I/O).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from libs.common.sampling import SamplingParams, TokenLogprob

from .scheduler import Request, ScheduledSeq, TokenEvent

# Per penalized row: (row, prompt + output tokens so far, prompt length).
History = tuple[int, list[int], int]


def sampling_inputs(
    requests: Mapping[str, Request], sampling: Sequence[ScheduledSeq]
) -> tuple[list[SamplingParams], list[int] | None, list[History] | None]:
    """For the sampler, per sampling seq: params; output tokens so far (when one sets
    min_tokens); (row, prompt + output tokens, prompt length) of those using penalties."""
    reqs = [(s, requests[s.request_id]) for s in sampling]
    params = [r.params for _, r in reqs]
    num_generated = None
    if any(p.min_tokens for p in params):
        num_generated = [s.sample_position - r.num_prompt_tokens for s, r in reqs]
    histories = [
        # a copy: advance() appends
        (i, r.token_ids[: s.sample_position], r.num_prompt_tokens - r.num_prior_outputs)
        for i, (s, r) in enumerate(reqs)
        if r.params.uses_penalties
    ]
    return params, num_generated, histories or None


def join_logprobs(
    events: list[TokenEvent], lps: Mapping[str, Sequence[TokenLogprob]]
) -> list[TokenEvent]:
    """``events`` with each token's logprob joined (a request's in the order of its events: a
    verified run gives several); events without a token, or past the logprobs given, as
    they are."""
    if not lps:
        return events
    taken: dict[str, int] = {}
    for i, ev in enumerate(events):
        mine = lps.get(ev.request_id)
        if ev.token_id is None or mine is None:
            continue
        k = taken.get(ev.request_id, 0)
        taken[ev.request_id] = k + 1
        if k < len(mine):
            events[i] = dataclasses.replace(ev, logprobs=mine[k])
    return events
