"""Speculative decoding with the model's MTP head, lossless, drafts verified by confidence.

One engine step with ``speculative_tokens = K`` (:class:`SpecDecoder` drives it):

1. **Choose what to verify** (:meth:`SpecDecoder.add_drafts`, :mod:`.policy`). Each draft's
   confidence is the MTP head's probability for it; the number verified per request
   maximises the step's expected emitted tokens per second under the engine's measured
   step-time model (the :class:`~libs.engine.cost_model.CostModel` the scheduler calibrates);
   ``"all"`` verifies every draft. A constrained request's drafts are cut before the first
   its grammar refuses (or that would end its output).
2. **Verify** (:meth:`SpecDecoder.run`, :mod:`.verify`). A running request that holds drafts
   is scheduled as ``1 + j`` tokens (its last token and ``j <= K`` drafts) in the same batch
   as everything else, run as decode rows; greedy acceptance or rejection sampling of the
   deterministic drafts, the sampler's rules row by row. Rejected drafts' KV is left behind
   the request's computed length and overwritten later: rolling back is not advancing.
3. **Catch up and draft** (:class:`~.drafter.Drafter`). The MTP layer runs over every
   position the main model just made final and chains K drafts, kept on the device until the
   next step reads them. A request held for export after its first token (prefill's) is
   drafted for too: :meth:`Engine.take_drafts` hands the drafts over with the KV
   (``DecodeTask.draft_token_ids``) and the importing engine verifies them in its first step
   (:meth:`SpecDecoder.checked` refuses drafts that cannot be).

:func:`~.synthetic.make_mtp_test_model` gives a preset an MTP head that predicts exactly
(perturbed to a chosen acceptance), so acceptance and speed-up can be measured without trained
weights.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from ..cost_model import StepShape
from ..rows import sampling_inputs
from ..scheduler import Request, ScheduledSeq, Scheduler, StepPlan, TokenEvent
from .drafter import Drafter, Pending, read_drafts, single_rows
from .policy import SCHEDULES, AcceptanceModel, choose_drafts
from .verify import SpecStats, SpecStep, sample_verified

if TYPE_CHECKING:
    from ..grammar import GrammarBackend
    from ..runner import ModelRunner


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
        self.num_tokens = num_tokens
        self.schedule = schedule
        self.acceptance = AcceptanceModel()
        self.stats = SpecStats()
        self._drafts: dict[str, tuple[list[int], list[float]]] = {}
        # The last draft() pass, still on the device: read into _drafts when first asked for,
        # so the host schedules the next step (and the caller handles this step's events)
        # while the device drafts.
        self._pending: Pending | None = None
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
        self.drafter = Drafter(runner, num_tokens)  # registers the MTP passes' graphs

    @property
    def drafts(self) -> dict[str, tuple[list[int], list[float]]]:
        """Per request: the drafts to verify next and their confidences (the host waits here
        for the device's last drafting pass, once)."""
        self._settle()
        return self._drafts

    def _settle(self) -> None:
        """Read the last drafting pass from the device into :attr:`drafts`."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._drafts.update(read_drafts(pending, self.model.cfg.vocab_size))

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
        hidden, all_logits, rows = self._forward_rows(plan)
        plain = [s for s in plan.seqs if s.sample and not s.num_drafts]
        verify = [s for s in plan.seqs if s.num_drafts]
        pick = [rows[s.request_id] + s.num_tokens - 1 for s in plain]
        for s in verify:
            pick.extend(range(rows[s.request_id], rows[s.request_id] + s.num_tokens))
        sampled: dict[str, int | list[int]] = {}
        lps: dict[str, list[TokenLogprob]] = {}
        if pick:
            index = torch.tensor(pick, dtype=torch.int64).to(hidden.device, non_blocking=True)
            logits = self.model.logits(hidden[index]) if all_logits is None else all_logits[index]
            if plain:
                tokens = sample_plain(logits[: len(plain)], plain)
                sampled.update({s.request_id: t for s, t in zip(plain, tokens, strict=True)})
            verified, lps = sample_verified(
                logits,
                verify,
                len(plain),
                params,
                generated or {},
                histories or {},
                grammar,
                self.runner.sampler.eos_token_ids,
                (self._shared, self._scratch),
            )
            sampled.update(verified)
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

    def _forward_rows(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, int]]:
        """The main model over ``plan``, a verified seq as 1 + j decode rows (not a prompt
        chunk): (hidden states, the logits of every row when a captured graph ran them, each
        request's first row -- a request's rows are contiguous)."""
        runner = self.runner
        rows_plan = single_rows(list(plan.seqs), lambda s: s.num_drafts > 0)
        rows_step = StepPlan(tuple(rows_plan))
        graphed = runner.decode_rows(rows_step)  # a captured graph when every row decodes
        all_logits: torch.Tensor | None = None
        if graphed is not None:
            hidden, all_logits = graphed
            ordered = rows_plan
        else:
            ids, positions, meta, ordered, _ = runner.prepare(rows_step)
            hidden = self.model(ids, positions, meta, runner.cache.layers)
        rows: dict[str, int] = {}
        r = 0
        for s in ordered:
            rows.setdefault(s.request_id, r)
            r += s.num_tokens
        return hidden, all_logits, rows

    # -- 3. catch up and draft ------------------------------------------------------------------
    def draft(self, plan: StepPlan, step: SpecStep, scheduler: Scheduler) -> None:
        """After the scheduler committed ``step``: the MTP layer over every position that became
        final (its KV), then K drafts for each running request that may be drafted for
        (:meth:`Drafter.draft`). The drafts stay on the device until :attr:`drafts` is read
        (the next step's add_drafts)."""
        self._settle()
        self._pending = self.drafter.draft(plan, step, scheduler, self.depth)
