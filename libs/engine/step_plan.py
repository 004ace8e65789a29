"""What a scheduler step produces: the :class:`StepPlan` (which tokens of which requests the
step computes), built seq by seq with a :class:`StepBuilder`, and the :class:`TokenEvent` s
that applying its results gives (no torch, no I/O; the policy is
:class:`~libs.engine.scheduler.Scheduler`'s)."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.common.sampling import TokenLogprob

from .cost_model import StepShape


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    start: int  # first position computed this step
    num_tokens: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    sample_position: int  # position of the token to be sampled (keys seeded sampling)
    # Speculative decoding: the last ``num_drafts`` of ``token_ids`` are drafted tokens that
    # this step verifies (a decode of 1 + num_drafts tokens; see libs/engine/speculative/).
    num_drafts: int = 0


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[str, ...] = ()
    shape: StepShape = StepShape()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None  # None for events without a token (abort)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_cached_tokens: int = 0  # prompt tokens served from cache (prefix hit or KV import)
    logprobs: TokenLogprob | None = None  # when the request asked (SamplingParams.logprobs)
    # On a finishing event of a speculatively decoded request: (drafted, verified, accepted).
    speculative: tuple[int, int, int] | None = None
    # On the request's first output token here: (taken, first scheduled), time.monotonic()
    # when the engine took it and when a step first computed any of it.
    timing: tuple[float, float] | None = None


@dataclass
class StepBuilder:
    """A step being scheduled: its seqs so far, the token budget left, what was preempted.
    ``shape`` is (new tokens, context after) per seq, made a :class:`StepShape` only where a
    prompt chunk is priced and at the end (``StepShape.add`` copies: O(batch^2) seq by seq)."""

    budget: int
    shape: list[tuple[int, int]] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    preempted: list[str] = field(default_factory=list)
    # Chain digests of the full prompt blocks this step computes (Scheduler._claim): a
    # request whose next uncached block is among them waits a step and finds it cached.
    computing: set[bytes] = field(default_factory=set)

    def add(self, seq: ScheduledSeq, context: int) -> None:
        self.seqs.append(seq)
        self.scheduled.add(seq.request_id)
        self.shape.append((seq.num_tokens, context))
        self.budget -= seq.num_tokens

    def plan(self) -> StepPlan:
        return StepPlan(tuple(self.seqs), tuple(self.preempted), StepShape(tuple(self.shape)))
