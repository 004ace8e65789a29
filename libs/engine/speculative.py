"""Speculative decoding with the model's MTP head, lossless, drafts verified by confidence.

One engine step with ``speculative_tokens = K``:

1. **Verify.** A running request that holds drafts from the previous step is scheduled as
   ``1 + j`` tokens (its last token and ``j <= K`` drafts) in the same batch as everything
   else; the main model computes them like a prompt chunk (causal inside the chunk). Row ``i``
   gives the target distribution for draft ``i + 1``.
2. **Accept** (:func:`verify_row`). Greedy: drafts are kept while they equal the target's
   argmax, then the target's token at the first mismatch (or after the last draft) is the
   bonus token. Sampling: a draft ``d`` (the MTP head's argmax, a deterministic proposal) is
   kept with probability ``p(d)`` under the request's processed target distribution; at the
   first rejection the token is drawn from ``p`` with ``d`` removed, renormalised; so each
   emitted token is distributed exactly as the target's (rejection sampling). Rejected
   drafts' KV is left behind the request's computed length and overwritten later: rolling
   back is not advancing.
3. **Catch up and draft** (:class:`Drafter`). The MTP layer (its own KV pages in the same
   blocks) runs over every position the main model just made final, fed the main model's
   hidden state there and the token after it (DeepSeek-V3's MTP: ``eh_proj([enorm(emb);
   hnorm(h)])``, one decoder layer, the shared head). Its output at the last position is
   draft 1; drafts 2..K chain the MTP layer on its own hidden state and previous draft. A
   prompt chunk fills the MTP KV of its positions the same way, so prefix hits and KV
   exported to another engine carry it. A request held for export after its first token
   (prefill's) is drafted for too: :meth:`Engine.take_drafts` hands the drafts over with the
   KV (``DecodeTask.draft_token_ids``) and the importing engine verifies them in its first
   step (:meth:`SpecDecoder.checked` refuses drafts that cannot be).
4. **Choose what to verify** (:func:`choose_drafts`). Each draft's confidence is the MTP
   head's probability for it; :class:`AcceptanceModel` maps confidence to the probability of
   acceptance given its predecessors were accepted, learnt online from what verification
   observed. The number of drafts verified per request maximises the step's expected
   emitted tokens per second under the engine's measured step-time model (the
   :class:`~.cost_model.CostModel` the scheduler calibrates every step); ``"all"`` verifies
   every draft, for comparison.

The sampler's rules hold row by row: a row's penalties count the drafts before it as output, a
row before the request's ``min_tokens``-th output has its stop tokens masked, and under a
constraint (structured output) row ``i`` allows what the grammar allows after the first ``i``
drafts; a request's drafts are cut before the first the grammar refuses (or that would end
its output), so a constrained request is verified only on drafts it could emit.
Logprobs of verified tokens come from the target's distribution at their rows, as the sampler
reports them.

:func:`make_mtp_test_model` turns a model into one whose MTP head reproduces the main model's
next-token function exactly (then perturbed to a chosen acceptance), so acceptance and
speed-up can be measured without trained weights.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from .cost_model import StepShape
from .model.attention import AttentionMetadata
from .model.model import DeepseekForCausalLM, MTPLayer
from .rows import sampling_inputs
from .sampler import TokenHistory, apply_penalties, drawn_logits, mask_stops, position_seed
from .scheduler import Request, ScheduledSeq, Scheduler, Status, StepPlan, TokenEvent

if TYPE_CHECKING:
    from .grammar import GrammarBackend
    from .runner import ModelRunner

SCHEDULES = ("confidence", "all")


class AcceptanceModel:
    """P(a draft is accepted | the drafts before it were), by the draft's confidence.

    Ten confidence bins, each a Beta posterior over its acceptance rate, whose prior (two
    pseudo-observations) is centred on the bin's own confidence: trust the head until
    verification says otherwise. :meth:`rate` adds an exploration bonus that shrinks as a bin
    is observed (``EXPLORE / sqrt(observations)``): without it a bin whose prior is low (a head
    that is right while unsure of itself, as the test model's nearly flat one) would never be
    verified, so never learnt."""

    BINS = 10
    PRIOR = 2.0
    EXPLORE = 0.5

    def __init__(self) -> None:
        self.accepted = [self.PRIOR * (b + 0.5) / self.BINS for b in range(self.BINS)]
        self.seen = [self.PRIOR] * self.BINS

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.BINS), 0), self.BINS - 1)

    def rate(self, confidence: float) -> float:
        b = self._bin(confidence)
        return min(1.0, self.accepted[b] / self.seen[b] + self.EXPLORE / math.sqrt(self.seen[b]))

    def observe(self, confidences: Sequence[float], num_accepted: int) -> None:
        """A verification of these drafts (in order) accepted the first ``num_accepted``."""
        for i, c in enumerate(confidences):
            b = self._bin(c)
            self.seen[b] += 1
            if i < num_accepted:
                self.accepted[b] += 1
            else:
                break  # the drafts after a rejection say nothing: they were not reached


def choose_drafts(
    confidences: Sequence[Sequence[float]],
    limits: Sequence[int],
    model: AcceptanceModel,
    step_seconds: Callable[[np.ndarray], np.ndarray | float],
    schedule: str = "confidence",
) -> list[int]:
    """How many leading drafts of each request to verify this step.

    ``confidences[r]``: request r's drafts' confidences; ``limits[r]``: at most that many;
    ``step_seconds(m)``: the step's estimated time with ``m`` draft tokens added to it, for
    an array of counts at once.
    ``"confidence"``: the ``m`` most valuable drafts over the whole batch (a draft's value is
    the probability that it and its predecessors are accepted), for the ``m`` that maximises
    (requests + expected accepted drafts) / step time. ``"all"``: every draft up to the
    limit."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    caps = [min(len(c), max(lim, 0)) for c, lim in zip(confidences, limits, strict=True)]
    if schedule == "all":
        return caps
    gains: list[tuple[float, int, int]] = []  # (value, draft index, request)
    for r, confs in enumerate(confidences):
        value = 1.0
        for i, c in enumerate(confs[: caps[r]]):
            value *= model.rate(c)
            gains.append((value, i, r))
    gains.sort(key=lambda g: (-g[0], g[1]))  # a request's values never grow: prefixes stay
    # Every m at once: step_seconds takes the array 0..len(gains) (a constant broadcasts).
    counts = np.arange(len(gains) + 1)
    secs = np.broadcast_to(np.asarray(step_seconds(counts), dtype=np.float64), counts.shape)
    expected = np.concatenate(([0.0], np.cumsum([g[0] for g in gains])))
    rates = (len(confidences) + expected) / np.maximum(secs, 1e-9)
    best_m = int(np.argmax(rates))  # the first of equal rates: the fewest drafts
    out = [0] * len(confidences)
    for _, _, r in gains[:best_m]:
        out[r] += 1
    return out


def token_logprob(logits: torch.Tensor, params: SamplingParams, token: int) -> TokenLogprob:
    """What the sampler reports for ``token`` drawn from this row: its log probability and the
    top ``params.logprobs`` under the distribution drawn from (:func:`~.sampler.drawn_logits`)."""
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


# Catch-ups up to this many positions run as single-token decode rows (see SpecDecoder.draft);
# longer ones (a prompt the MTP layer covers after prefill) stay prompt chunks.
_CATCH_UP_ROWS_MAX = 16


def _single_rows(
    seqs: list[ScheduledSeq], split: Callable[[ScheduledSeq], bool]
) -> list[ScheduledSeq]:
    """``seqs`` with each multi-token one that ``split`` picks replaced by single-token rows
    in order: row ``i`` at position ``start + i``, attending to the context up to itself, so
    the batched decode attention serves them all in one call (a prompt chunk would make one
    call per sequence and, in MLA, re-expand its whole context)."""
    out: list[ScheduledSeq] = []
    for s in seqs:
        if s.num_tokens == 1 or not split(s):
            out.append(s)
            continue
        # Built directly: dataclasses.replace took twice as long (2.3 against 1.2 ms for 1,024
        # rows on a 2-core CPU), on the host while the device waits.
        out.extend(
            ScheduledSeq(
                s.request_id,
                s.start + i,
                1,
                (s.token_ids[i],),
                s.block_table,
                s.sample,
                s.start + i + 1,
            )
            for i in range(s.num_tokens)
        )
    return out


def _offsets(seqs: list[ScheduledSeq], first: int) -> list[tuple[ScheduledSeq, int]]:
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
    for s, o in _offsets(verify, first):
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
    for s, o in _offsets(verify, first):
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


def mask_constrained_rows(
    logits: torch.Tensor, verify: list[ScheduledSeq], off: int, grammar: GrammarBackend
) -> torch.Tensor:
    """The verification rows of constrained requests (from row ``off``, as
    :func:`penalize_rows` lays them out) masked by their grammar: row ``i`` of a request to what
    may follow its first ``i`` drafts, as the sampler masks a plain row."""
    from .grammar import apply_masks

    rows: list[int] = []
    parts: list[torch.Tensor] = []
    for s, o in _offsets(verify, off):
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


def _draftable(req: Request) -> bool:
    """Drafted for after a step: a running request, or one held for export after its first
    token ran out its length (a prefill's: the drafts go with the hand-over)."""
    held = req.status is Status.FINISHED and req.hold_kv and req.finish_reason == "length"
    return req.status is Status.RUNNING or held


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


@torch.inference_mode()
def make_mtp_test_model(
    model: DeepseekForCausalLM,
    layer_scale: float = 0.0,
    wrong_fraction: float = 0.0,
    seed: int = 0,
    confident: bool = False,
) -> None:
    """Rewrite ``model`` (a :class:`~.model.model.DeepseekForCausalLM` with an MTP layer,
    unquantized weights) in place so that its MTP head predicts what the main model will:

    * every main decoder layer's output projections (attention ``o_proj``, the MLP's or the
      experts' down projections) are scaled by ``layer_scale``: at 0 the main model's next
      token depends only on the current one (``lm_head(norm(emb(t)))``); above 0 attention
      and context matter again and acceptance falls;
    * the MTP layer passes the next token's embedding through (``eh_proj = [I 0]``, its own
      block's output projections zeroed) into the main model's norm and head, so it computes
      that same function of the token: with ``layer_scale`` 0 every greedy draft is accepted
      (up to float rounding, a positive rescaling of the logits);
    * ``wrong_fraction`` of the vocabulary is then given another token's embedding in the MTP
      layer (a random cycle over that subset): drafts made from those tokens are wrong, so
      acceptance per draft is about ``1 - wrong_fraction``;
    * ``confident``: the head's confidence says something about acceptance, as a trained
      head's does. With random weights every token's logits look alike (nearly flat: a
      confidence of ~2e-5 over a 129K vocabulary, the same for right and wrong drafts), so the
      confidence schedule would see one acceptance rate for every draft. Here the vocabulary
      projection is replaced by a planted one: a random permutation ``pi`` of the vocabulary,
      and row ``pi(t)`` the direction of token ``t``'s final hidden state (at the original
      rows' mean norm), so the main model's next token after ``t`` is ``pi(t)`` by a wide
      margin (other rows meet that hidden state at random angles). The MTP head's norm is then
      scaled (every argmax kept) until the median right draft has confidence 0.9, and a
      remapped token gets the sum of the next two tokens' embeddings in the cycle (so at least
      three are remapped): two wrong successors of about equal weight, each at ~0.7 of a
      right draft's logit, so a wrong draft's confidence is well under a half. Acceptance
      stays about ``1 - wrong_fraction``."""
    from .model.layers import Experts, Fp8Linear

    mtp = [cast(MTPLayer, m) for m in model.mtp]
    if not mtp:
        raise ValueError("the model has no MTP layer (load it with with_mtp=True)")
    if any(isinstance(m, Fp8Linear) for m in model.modules()) or any(
        isinstance(m, Experts) and (m.fp8 is not None or m.fp4 is not None) for m in model.modules()
    ):
        raise ValueError("make_mtp_test_model needs unquantized weights")
    if not 0.0 <= wrong_fraction <= 1.0:
        raise ValueError(f"wrong_fraction must lie in [0, 1], got {wrong_fraction}")

    def scale_outputs(layer: torch.nn.Module, factor: float) -> None:
        for name, p in layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                p.mul_(factor)

    for layer in model.model.layers:
        scale_outputs(layer, layer_scale)
    embed = model.model.embed_tokens.weight
    vocab, hidden = embed.shape
    if confident:
        _plant_successors(model, seed)
    for m in mtp:
        scale_outputs(m, 0.0)
        table = embed.clone()
        n_wrong = int(round(wrong_fraction * vocab))
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(vocab, generator=g).to(embed.device)
        subset = order[:n_wrong]
        if n_wrong >= 2:
            table[subset] = embed[subset.roll(1)]  # each takes the next one's: no fixed point
            if confident and n_wrong >= 3:
                table[subset] += embed[subset.roll(2)]  # and the one after: two peaks
        m.embed_tokens.weight.copy_(table)
        m.enorm.weight.fill_(1.0)
        m.hnorm.weight.fill_(1.0)
        m.eh_proj.weight.zero_()
        m.eh_proj.weight[:, :hidden].copy_(torch.eye(hidden, dtype=embed.dtype))
        m.shared_head.norm.weight.copy_(model.model.norm.weight)
        m.shared_head.head.weight.copy_(model.lm_head.weight)
        if confident:
            right = order[n_wrong : n_wrong + 64]  # tokens whose drafts are right
            sharpness = _sharpness(m.head(m.enorm(m.embed_tokens(right))), 0.9)
            m.shared_head.norm.weight.mul_(sharpness)


def _plant_successors(model: DeepseekForCausalLM, seed: int) -> None:
    """Replace ``model.lm_head`` so that, with the decoder layers' outputs at zero, the next
    token after ``t`` is ``pi(t)`` for a random permutation ``pi``: row ``pi(t)`` is ``t``'s
    final hidden state's direction at the original rows' mean norm (see make_mtp_test_model,
    whose inference mode this runs under)."""
    w = model.lm_head.weight
    vocab = w.shape[0]
    scale = float(w.float().norm(dim=-1).mean())
    g = torch.Generator().manual_seed(seed + 7919)
    pi = torch.randperm(vocab, generator=g).to(w.device)
    chunk = 8192  # the final hidden states of the whole vocabulary, a slice at a time
    for start in range(0, vocab, chunk):
        ids = torch.arange(start, min(start + chunk, vocab), device=w.device)
        h = model.model.norm(model.model.embed_tokens(ids)).float()
        w[pi[ids]] = (h * (scale / h.norm(dim=-1, keepdim=True))).to(w.dtype)


def _sharpness(logits: torch.Tensor, target: float) -> float:
    """The factor that scales ``logits`` (rows of a head's output) so that the median row's
    largest probability is ``target`` (bisection over its logarithm)."""
    lo, hi = 0.0, math.log(1e4)

    def median_top(log_factor: float) -> float:
        p = (logits * math.exp(log_factor)).softmax(-1).amax(-1)
        return float(p.median())

    for _ in range(40):
        mid = (lo + hi) / 2
        if median_top(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


# One drafting depth on the device: each live request's draft, its confidence, and which
# requests (indices into the pass's list) those rows are.
_Depth = tuple[torch.Tensor, torch.Tensor, list[int]]

# The token id a deeper draft pass is prepared with; its real input (the previous depth's
# draft) is handed to the model as a device tensor.
_DRAFT_ON_DEVICE = 0


@dataclass
class SpecStep:
    """What :meth:`SpecDecoder.run` leaves for :meth:`SpecDecoder.draft`."""

    sampled: dict[str, int | list[int]]
    seconds: float
    hidden: torch.Tensor  # the main model's final hidden states, one row per step token
    rows: dict[str, int] = field(default_factory=dict)  # request -> its first row in hidden
    # Verified requests that asked for logprobs: one per token they were given, in order.
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


class SpecDecoder:
    """The engine's speculative half: drafts per request, verification, the MTP passes.

    ``num_tokens``: drafts made per request and step (K); ``schedule``: :func:`choose_drafts`'
    policy. Drafts live here, by request id, until the request's next step."""

    def __init__(self, runner: ModelRunner, num_tokens: int, schedule: str = "confidence") -> None:
        model = runner.model
        if not model.mtp:
            raise ValueError(
                "speculative decoding drafts with the model's MTP layers; this model has none"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"speculative schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.runner = runner
        self.model = model
        self.mtp = cast(MTPLayer, model.mtp[0])
        self.num_tokens = num_tokens
        self.schedule = schedule
        self.mtp_cache = runner.cache.layers[model.cfg.num_hidden_layers]
        self.acceptance = AcceptanceModel()
        self.stats = SpecStats()
        self._drafts: dict[str, tuple[list[int], list[float]]] = {}
        # The last draft() pass, still on the device: read into _drafts when first asked for,
        # so the host schedules the next step (and the caller handles this step's events)
        # while the device drafts.
        self._pending: tuple[list[_Depth], list[str]] | None = None
        # Drafts made per request and step: K, or with the confidence schedule one more than
        # the most it verified for a request last time (each draft past the first costs an
        # MTP pass and a vocabulary projection; a schedule that declines them all then pays
        # for one draft, not K).
        self.depth = num_tokens
        # Per request while it runs (drafted, verified, accepted...; dropped when it ends).
        self.per_request: dict[str, SpecStats] = {}
        self._shared = torch.Generator(device=runner.device)
        self._shared.seed()
        self._scratch = torch.Generator(device=runner.device)
        # The MTP passes through CUDA graphs where the decode steps have them: the layer over
        # decode rows (catch-up rows and each depth's drafts), and the head's pick per request.
        width = (model.cfg.hidden_size, self.mtp.embed_tokens.weight.dtype)
        # Optional: a capture that fails leaves them eager (logged), not the engine down.
        runner.add_graphs(
            "mtp", self._block_body, runner.max_graph_batch, x_in=width, optional=True
        )
        runner.add_graphs(
            "mtp_head",
            self._pick,
            max(1, runner.max_graph_batch // (1 + num_tokens)),
            rows=False,
            x_in=width,
            optional=True,
        )

    def _block_body(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, x: torch.Tensor
    ) -> tuple[torch.Tensor]:
        return (self.mtp.block(x, ids, positions, meta, self.mtp_cache),)

    def _pick(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draft (the head's argmax) and its probability."""
        logits = self.mtp.head(state)
        top, tok = logits.max(-1)
        return tok, (top - logits.logsumexp(-1)).exp()

    def _block(
        self, rows: list[ScheduledSeq], x: torch.Tensor, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MTP layer over ``rows`` (its KV written), fed hidden states ``x`` and the rows'
        token ids (``ids`` on the device, if given): a graph replay when one holds them."""
        out = self.runner.replay("mtp", rows, x=x, ids=ids)
        if out is not None:
            return out[0]
        ids_h, pos, meta, _ = self.runner._prepare(rows, None)
        return self.mtp.block(x, ids_h if ids is None else ids, pos, meta, self.mtp_cache)

    @property
    def drafts(self) -> dict[str, tuple[list[int], list[float]]]:
        """Per request: the drafts to verify next and their confidences (the host waits here
        for the device's last drafting pass, once)."""
        self._settle()
        return self._drafts

    def _settle(self) -> None:
        """Read the last drafting pass from the device into :attr:`drafts`."""
        if self._pending is not None:
            picked, ids = self._pending
            self._pending = None
            toks = torch.cat([t for t, _, _ in picked]).tolist()
            probs = torch.cat([c for _, c, _ in picked]).tolist()
            vocab = self.model.cfg.vocab_size
            if toks and not 0 <= min(toks) <= max(toks) < vocab:
                # The head's argmax cannot leave the vocabulary: memory was overwritten.
                raise RuntimeError(
                    f"the MTP head drafted token ids outside [0, {vocab}) "
                    f"(min {min(toks)}, max {max(toks)}): its outputs were overwritten on the "
                    "device before they were read"
                )
            drafts: list[list[int]] = [[] for _ in ids]
            confs: list[list[float]] = [[] for _ in ids]
            at = 0
            for _, _, rows in picked:
                for w in rows:
                    drafts[w].append(int(toks[at]))
                    confs[w].append(float(probs[at]))
                    at += 1
            for w, rid in enumerate(ids):
                self._drafts[rid] = (drafts[w], confs[w])

    def forget(self, request_id: str) -> SpecStats | None:
        """Drop a request's drafts; its counters, if it had any."""
        self.drafts.pop(request_id, None)
        return self.per_request.pop(request_id, None)

    def checked(
        self, tokens: Sequence[int], confidences: Sequence[float]
    ) -> tuple[list[int], list[float]]:
        """Drafts made elsewhere (a prefill's, handed over with its KV), as this engine keeps
        its own in :attr:`drafts`: verified like those, so they cannot change what is emitted.
        ValueError for drafts that cannot be (more than K, ids or confidences out of range)."""
        if len(tokens) != len(confidences) or len(tokens) > self.num_tokens:
            raise ValueError(
                f"{len(tokens)} drafts with {len(confidences)} confidences; at most "
                f"{self.num_tokens} drafts, one confidence each"
            )
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"draft token ids must lie in [0, {vocab})")
        if any(not 0.0 <= c <= 1.0 for c in confidences):  # NaN fails too
            raise ValueError("draft confidences must lie in [0, 1]")
        return [int(t) for t in tokens], [float(c) for c in confidences]

    # -- 1. what to verify ----------------------------------------------------------------------
    def add_drafts(
        self, plan: StepPlan, scheduler: Scheduler, grammar: GrammarBackend | None = None
    ) -> StepPlan:
        """``plan`` with each running decode that holds drafts extended by those
        :func:`choose_drafts` picks (blocks reserved for them; fewer when the cache is full)."""
        cands: list[tuple[int, ScheduledSeq, list[int], list[float], int]] = []
        max_len = scheduler.config.max_model_len
        for i, seq in enumerate(plan.seqs):
            held = self.drafts.pop(seq.request_id, None)
            req = scheduler.requests[seq.request_id]
            if held is None or seq.num_tokens != 1 or not seq.sample:
                continue
            if seq.start + 1 != len(req.token_ids):
                continue
            if grammar is not None and grammar.has(seq.request_id):
                n, _ = grammar.draft_masks(seq.request_id, held[0])
                if not n:
                    continue
                held = (held[0][:n], held[1][:n])
            limit = min(
                req.params.max_tokens - req.num_output_tokens - 1,  # the bonus token too
                max_len - len(req.token_ids) - 1,
            )
            cands.append((i, seq, held[0], held[1], limit))
        if not cands:
            return plan
        base = plan.shape
        ctx = max(c[1].start for c in cands) + 1  # the drafts' tokens, as one more sequence
        cost = scheduler.cost

        def seconds(extra: np.ndarray) -> np.ndarray:
            if all(q == 1 for q, _ in base.seqs):  # decode rows only: the measured table
                measured = cost.rows_seconds_for(
                    base.tokens + extra, base.pairs + extra * (ctx + 1)
                )
                if measured is not None:
                    return measured
            out = np.empty(extra.shape, dtype=np.float64)
            out[extra == 0] = cost.seconds(base)
            more = extra > 0
            out[more] = cost.seconds_with_counts(base, extra[more], ctx)
            return out

        counts = choose_drafts(
            [c[3] for c in cands], [c[4] for c in cands], self.acceptance, seconds, self.schedule
        )
        if self.schedule == "confidence":
            self.depth = min(self.num_tokens, max(counts) + 1)
        seqs = list(plan.seqs)
        for (i, seq, drafts, confs, _), j in zip(cands, counts, strict=True):
            req = scheduler.requests[seq.request_id]
            while j and not scheduler._try_allocate(req, 1 + j):
                j -= 1
            self.stats.drafted += len(drafts)
            self.per_request.setdefault(seq.request_id, SpecStats()).drafted += len(drafts)
            if not j:
                continue
            self.drafts[seq.request_id] = (drafts[:j], confs[:j])  # kept for run()'s accounting
            seqs[i] = ScheduledSeq(  # built directly: dataclasses.replace takes twice as long
                seq.request_id,
                seq.start,
                1 + j,
                seq.token_ids + tuple(drafts[:j]),
                tuple(req.blocks),
                seq.sample,
                seq.sample_position,
                num_drafts=j,
            )
        # One pass (StepShape.add copies the tuple: O(batch^2) seq by seq).
        shape = StepShape(tuple((s.num_tokens, s.start + s.num_tokens) for s in seqs))
        return StepPlan(tuple(seqs), plan.preempted, shape)

    # -- 2. verify --------------------------------------------------------------------------------
    def verify(
        self,
        plan: StepPlan,
        requests: Mapping[str, Request],
        grammar: GrammarBackend | None = None,
    ) -> SpecStep:
        """:meth:`run` for the engine: the plain rows sampled by the runner's sampler with the
        engine's rules (penalties, min_tokens, masks, logprobs), the verified rows by
        :meth:`run`'s, each with its request's params, outputs so far and history."""
        plain_lps: dict[str, list[TokenLogprob]] = {}

        def sample_plain(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> list[int]:
            params, num_generated, histories = sampling_inputs(requests, seqs)
            runner = self.runner
            history = runner._history(seqs, histories, None) if histories else None
            masks = None
            if grammar is not None and any(grammar.has(s.request_id) for s in seqs):
                masks = grammar.masks([s.request_id for s in seqs])
            sampler = runner.sampler
            sampler.last_logprobs = None
            out = sampler.sample_device(
                logits,
                params,
                [s.sample_position for s in seqs],
                num_generated,
                history,
                masks=masks,
            )
            rows = sampler.last_logprobs
            if rows is not None:
                unpacked = rows.unpack(rows.values.tolist(), rows.ids.tolist())
                plain_lps.update({seqs[r].request_id: [lp] for r, lp in zip(rows.rows, unpacked)})
            tokens: list[int] = out.tolist()
            return tokens

        params = {s.request_id: requests[s.request_id].params for s in plan.seqs}
        # The verified seqs' min_tokens counts and penalty histories, by the sampler's rules.
        verify = [s for s in plan.seqs if s.num_drafts]
        _, outputs, penalized = sampling_inputs(requests, verify)
        generated = (
            {}
            if outputs is None
            else dict(zip([s.request_id for s in verify], outputs, strict=True))
        )
        histories = {verify[r].request_id: (toks, n) for r, toks, n in penalized or []}
        step = self.run(plan, params, sample_plain, generated, histories, grammar)
        step.logprobs.update(plain_lps)
        return step

    def with_counts(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """``events`` with each finished request's speculative counts (drafted, verified,
        accepted) joined, and its drafts and counters dropped here."""
        for i, ev in enumerate(events):
            if ev.finished:
                counts = self.forget(ev.request_id)
                if counts is not None:
                    events[i] = dataclasses.replace(
                        ev, speculative=(counts.drafted, counts.verified, counts.accepted)
                    )
        return events

    def run(
        self,
        plan: StepPlan,
        params: dict[str, SamplingParams],
        sample_plain: Callable[[torch.Tensor, list[ScheduledSeq]], list[int]],
        generated: dict[str, int] | None = None,
        histories: dict[str, tuple[list[int], int]] | None = None,
        grammar: GrammarBackend | None = None,
    ) -> SpecStep:
        """Run the main model over ``plan``; the sampled tokens: for a seq that verified drafts
        the accepted ones and the next (a list), for any other sampling seq one token, drawn by
        ``sample_plain(logits, seqs)`` (the engine's sampler with penalties, masks...).
        ``generated``: output tokens so far per request (needed when one sets min_tokens);
        ``histories``: (prompt + output tokens so far, prompt length) of those using a penalty."""
        t0 = time.perf_counter()
        runner, model = self.runner, self.model
        # A verified seq runs as 1 + j decode rows, not as a prompt chunk (_single_rows).
        rows_plan = _single_rows(list(plan.seqs), lambda s: s.num_drafts > 0)
        rows_step = StepPlan(tuple(rows_plan))
        graphed = runner.decode_rows(rows_step)  # a captured graph when every row decodes
        all_logits: torch.Tensor | None = None
        if graphed is not None:
            hidden, all_logits = graphed
            ordered = rows_plan
        else:
            ids, positions, meta, ordered, _ = runner.prepare(rows_step)
            hidden = model(ids, positions, meta, runner.cache.layers)
        rows: dict[str, int] = {}  # a request's first row (its rows are contiguous)
        r = 0
        for s in ordered:
            rows.setdefault(s.request_id, r)
            r += s.num_tokens
        plain = [s for s in plan.seqs if s.sample and not s.num_drafts]
        verify = [s for s in plan.seqs if s.num_drafts]
        pick = [rows[s.request_id] + s.num_tokens - 1 for s in plain]
        for s in verify:
            pick.extend(range(rows[s.request_id], rows[s.request_id] + s.num_tokens))
        sampled: dict[str, int | list[int]] = {}
        lps: dict[str, list[TokenLogprob]] = {}
        if pick:
            index = torch.tensor(pick, dtype=torch.int64).to(hidden.device, non_blocking=True)
            logits = model.logits(hidden[index]) if all_logits is None else all_logits[index]
            if plain:
                tokens = sample_plain(logits[: len(plain)], plain)
                sampled.update({s.request_id: t for s, t in zip(plain, tokens, strict=True)})
            off = len(plain)
            logits = penalize_rows(logits, verify, off, params, histories or {})
            logits = mask_min_tokens_rows(
                logits, verify, off, params, generated or {}, self.runner.sampler.eos_token_ids
            )
            if grammar is not None:
                logits = mask_constrained_rows(logits, verify, off, grammar)
            greedy_rows = [
                (s, off0) for s, off0 in _offsets(verify, off) if params[s.request_id].greedy
            ]
            if greedy_rows:
                best = logits.argmax(-1).tolist()
                for s, o in greedy_rows:
                    sampled[s.request_id] = greedy_accept(
                        best[o : o + s.num_tokens], s.token_ids[1:]
                    )
            for s, o in _offsets(verify, off):
                p = params[s.request_id]
                if p.greedy:
                    continue
                probs = torch.stack(
                    [drawn_logits(logits[o + i], p).softmax(-1) for i in range(s.num_tokens)]
                )
                gen = seeded_generator(p, self._shared, self._scratch)
                sampled[s.request_id] = verify_row(probs, s.token_ids[1:], gen, s.sample_position)
            for s, o in _offsets(verify, off):
                p = params[s.request_id]
                got = sampled[s.request_id]
                if p.logprobs is not None and isinstance(got, list):
                    lps[s.request_id] = [
                        token_logprob(logits[o + i], p, t) for i, t in enumerate(got)
                    ]
        for s in verify:
            got = sampled[s.request_id]
            assert isinstance(got, list)
            _, confs = self.drafts.pop(s.request_id)
            self.acceptance.observe(confs, len(got) - 1)
            for counts in (self.stats, self.per_request.setdefault(s.request_id, SpecStats())):
                counts.count_verification(s.num_drafts, len(got))
        if verify:
            self.stats.steps += 1
        if hidden.is_cuda:
            torch.cuda.synchronize(hidden.device)
        return SpecStep(sampled, time.perf_counter() - t0, hidden, rows, lps)

    # -- 3. catch up and draft ------------------------------------------------------------------
    def draft(self, plan: StepPlan, step: SpecStep, scheduler: Scheduler) -> None:
        """After the scheduler committed ``step``: the MTP layer over every position that became
        final (its KV), then K drafts for each running request that may be drafted for. The
        drafts stay on the device until :attr:`drafts` is read (the next step's add_drafts)."""
        self._settle()
        runner = self.runner
        catch: list[ScheduledSeq] = []
        for seq in plan.seqs:
            req = scheduler.requests.get(seq.request_id)
            # A finished request kept for export (prefill's hand-off) gets its MTP KV too.
            if (
                req is None
                or not req.blocks
                or (req.status is not Status.RUNNING and not req.hold_kv)
            ):
                continue
            c = req.num_computed - seq.start  # positions made final this step
            if c <= 0 or len(req.token_ids) < seq.start + c + 1:
                continue
            catch.append(
                ScheduledSeq(
                    seq.request_id,
                    seq.start,
                    c,
                    tuple(req.token_ids[seq.start + 1 : seq.start + c + 1]),
                    tuple(req.blocks),
                    sample=False,
                    sample_position=seq.start + c + 1,
                )
            )
        if not catch:
            return
        # Drafts follow a sampled token: a prompt chunk that samples none (more of the prompt
        # to come) gets its MTP KV, not drafts that the next step would throw away.
        sampled = {s.request_id for s in plan.seqs if s.sample}
        want = [
            s
            for s in catch
            if self.num_tokens
            and s.request_id in sampled
            and _draftable(scheduler.requests[s.request_id])
        ]
        first = {s.request_id: s.start for s in catch}
        # A decode's catch-up (its accepted drafts and the bonus token, at most 1 + K) runs as
        # single-token rows through the absorbed decode path, as verification does: as a
        # prompt chunk it would re-expand the whole context through kv_b_proj every step.
        catch = _single_rows(catch, lambda s: s.num_tokens <= _CATCH_UP_ROWS_MAX)
        if runner.use_kernels:
            catch.sort(key=lambda s: s.num_tokens == 1)  # decodes last, as the kernels read them
        # Index tensors go over pinned and non-blocking (runner._to_device): a plain copy to
        # the device would wait for the work queued before it.
        h_index = runner._to_device(
            np.concatenate(
                [
                    np.arange(s.num_tokens)
                    + step.rows[s.request_id]
                    + (s.start - first[s.request_id])
                    for s in catch
                ]
            ).astype(np.int64)
        )
        x = self._block(catch, step.hidden[h_index])
        if not want:
            return
        # A request's rows stay contiguous and in order: its last row ends its last piece.
        last = {s.request_id: r + s.num_tokens - 1 for s, r in _offsets(catch, 0)}
        index = runner._to_device(np.asarray([last[s.request_id] for s in want], dtype=np.int64))
        state = x[index]
        # Each depth's drafts stay on the device: the next depth takes them as its input ids,
        # and the host reads all depths once at the end (not one wait per depth).
        picked: list[_Depth] = []
        live = list(range(len(want)))
        max_len = scheduler.config.max_model_len
        for depth in range(self.depth):
            graphed = runner.replay("mtp_head", len(live), x=state)
            if graphed is not None:  # the graph's outputs are overwritten by its next replay
                tok, conf = (t.clone() for t in graphed)
            else:
                tok, conf = self._pick(state)
            picked.append((tok, conf, live))
            if depth + 1 == self.depth:
                break
            # Next depth: the MTP layer at the draft's position, fed its own hidden state.
            nxt: list[ScheduledSeq] = []
            keep: list[int] = []
            for j, w in enumerate(live):
                req = scheduler.requests[want[w].request_id]
                p = req.num_computed + depth  # the position whose next token is drafted
                if p + 1 >= max_len or not scheduler._try_allocate(req, depth + 1):
                    continue
                nxt.append(
                    ScheduledSeq(
                        req.request_id,
                        p,
                        1,
                        (_DRAFT_ON_DEVICE,),  # replaced by the draft on the device below
                        tuple(req.blocks),
                        sample=False,
                        sample_position=p + 1,
                    )
                )
                keep.append(j)
            if not nxt:
                break
            sel = runner._to_device(np.asarray(keep, dtype=np.int64))
            state = self._block(nxt, state[sel], tok[sel])
            live = [live[j] for j in keep]
        self._pending = (picked, [s.request_id for s in want])
