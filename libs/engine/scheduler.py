"""Continuous-batching scheduler as a step function, with no I/O.

``schedule()`` returns a :class:`StepPlan` (which tokens of which requests to compute this
step, which blocks they use); the engine runs the model; ``update(plan, outputs)`` applies
the sampled tokens and returns :class:`TokenEvent` s. Policy:

* running requests first, oldest first: decodes (one token) and unfinished prompt chunks;
* then waiting requests in arrival order, each admitted with its longest cached prefix
  (hash chain over full blocks, never the last prompt token, which must be computed to
  sample from); the engine's :class:`~.prefill_fairness.FairScheduler` shares the prompt
  tokens between tenants instead, when several have prompts to compute;
* a per-step token budget (default 32,768) and a time budget: the :class:`CostModel`
  decides how many prompt tokens still fit, so long prompts are prefilled in chunks;
* when blocks run out, the most recently arrived running request is preempted: its blocks
  are released (their cached names stay findable) and it is recomputed later from its
  prompt plus the tokens it already produced.

``update`` is two halves that an overlapping engine calls apart: ``advance(plan)`` right
after the step is launched (computed counts move on, full blocks are named; each sampling
request gets a :data:`PLACEHOLDER` token, so the next step can be scheduled before the
device has produced it -- the engine feeds the real id from device memory), and
``commit(plan, sampled)`` once the tokens are on the host (placeholders filled, stop
conditions, events). The engine commits step N-1 before it advances step N, so a block is
only ever named over known tokens. A request that stops on a token is known one step late;
the extra step's token is dropped.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libs.common.hashchain import chain_hashes
from libs.common.sampling import SamplingParams

from .cost_model import CostModel, StepShape
from .kv.block_manager import BlockManager
from .step_plan import ScheduledSeq, StepBuilder, StepPlan, TokenEvent

__all__ = [
    "PLACEHOLDER",
    "Request",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "Status",
    "StepPlan",
    "TokenEvent",
]

PLACEHOLDER = -1  # a sampled token not yet copied back from the device


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SchedulerConfig:
    max_tokens_per_step: int = 32768
    time_budget_s: float | None = 1.0
    max_running: int = 256
    max_model_len: int = 163840

    def __post_init__(self) -> None:
        if self.max_tokens_per_step <= 0:
            raise ValueError(
                f"max_tokens_per_step must be positive, got {self.max_tokens_per_step}"
            )
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be positive or None, got {self.time_budget_s}")
        if self.max_running <= 0:
            raise ValueError(f"max_running must be positive, got {self.max_running}")
        if self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")


@dataclass
class Request:
    request_id: str
    token_ids: list[int]  # prompt followed by the tokens generated so far
    num_prompt_tokens: int
    params: SamplingParams
    cache_salt: bytes = b""
    hold_kv: bool = False  # keep blocks after finishing, until the engine exports/frees them
    arrival: int = 0
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in this request's blocks
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0  # leading blocks named in the block manager
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on first admission
    admitted: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None
    pending_finish: str | None = None  # "length": finishes once its last placeholder is filled
    num_prior_outputs: int = 0  # of the prompt, generated elsewhere (prefill): penalties count
    weight: float = 1.0  # its tenant's weight when tenants share prompt tokens (prefill_fairness)
    taken_at: float = 0.0  # time.monotonic() when the engine took it (Scheduler.add)
    scheduled_at: float = 0.0  # when a step first computed any of it (0: not yet)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def full_block_hashes(self, block_size: int, upto_tokens: int) -> list[bytes]:
        """Chain digests of the full blocks among the first ``upto_tokens`` tokens."""
        need = upto_tokens // block_size
        if len(self.block_hashes) < need:
            parent = self.block_hashes[-1] if self.block_hashes else None
            start = len(self.block_hashes)
            self.block_hashes.extend(
                chain_hashes(
                    self.token_ids[: need * block_size],
                    block_size,
                    self.cache_salt,
                    start=start,
                    parent=parent,
                )
            )
        return self.block_hashes[:need]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        cost: CostModel,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.config = config
        self.bm = blocks
        self.cost = cost
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0  # since start, all requests

    # -- requests -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if len(req.token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(req.token_ids)} tokens leaves no room under the "
                f"context limit of {self.config.max_model_len}"
            )
        need = len(req.token_ids) // self.bm.block_size + 1
        if need > self.bm.num_blocks:
            raise ValueError(
                f"prompt of {len(req.token_ids)} tokens needs {need} KV blocks; "
                f"this engine's cache holds {self.bm.num_blocks}"
            )
        req.arrival = next(self._arrivals)
        req.taken_at = time.monotonic()
        self.requests[req.request_id] = req
        if req.status is Status.RUNNING:  # KV imported by the engine: continue where it stopped
            self.running.append(req)
        else:
            self.waiting.append(req)

    def admit_imported(
        self,
        req: Request,
        blocks: list[int],
        names: list[bytes],
        num_named: int,
        num_computed: int,
    ) -> None:
        """Give a request not yet added the KV the engine imported for it, so :meth:`add`
        runs it from ``num_computed`` on instead of queueing it.

        ``blocks`` (acquired by the caller, owned by ``req`` from here on) hold the first
        ``num_computed`` tokens; ``names`` are the chain digests of its full blocks, of which
        the first ``num_named`` are already named in the block manager (prefix hits) and the
        rest are named here.
        """
        assert req.request_id not in self.requests and not req.blocks, "admit before add"
        for i in range(num_named, len(names)):
            self.bm.register(blocks[i], names[i])
        req.blocks = list(blocks)
        req.block_hashes = list(names)
        req.num_registered = len(names)
        req.num_computed = num_computed
        req.num_cached_tokens = min(num_computed, req.num_prompt_tokens)
        req.admitted = True
        req.status = Status.RUNNING

    def abort(self, request_id: str) -> TokenEvent | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is Status.FINISHED:
            self.free(req)
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.status, req.finish_reason = Status.FINISHED, "abort"
        self.free(req)
        return TokenEvent(request_id, None, True, "abort", req.num_cached_tokens)

    def free(self, req: Request) -> None:
        """Release a finished request's blocks and forget it."""
        self.bm.release(req.blocks)
        req.blocks = []
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        step = StepBuilder(self.config.max_tokens_per_step)
        for req in list(self.running):
            if req.status is not Status.RUNNING or step.budget <= 0:
                continue
            self._run_chunk(step, req, step.budget)  # 0: out of time, later decodes may fit
        while (
            self.waiting
            and not step.preempted
            and step.budget > 0
            and len(self.running) < self.config.max_running
        ):
            if not self._admit(step, self.waiting[0], step.budget):
                break
        return step.plan()

    def _run_chunk(self, step: StepBuilder, req: Request, limit: int) -> int:
        """Schedule up to ``limit`` tokens of a running request; how many were."""
        n = self._fit(step.shape, req, limit)
        if n == 0 or not self._reserve(req, n, step.scheduled, step.preempted):
            return 0  # out of time, or the request itself was preempted
        self._claim(step, req, n)
        step.add(self._seq(req, n), req.num_computed + n)
        return n

    def _admit(self, step: StepBuilder, req: Request, limit: int) -> int:
        """Start a waiting request with up to ``limit`` tokens; how many (0: it stays). A
        request whose next uncached block another request computes in this very step waits
        for the next one, where it finds that block cached instead of computing it again
        (prompts over one uncomputed prefix that would share a step compute it once)."""
        hits = self._admit_prefix(req)
        if self._computed_beside(step, req, len(hits)):
            self._undo_prefix(req, hits)
            return 0
        n = self._fit(step.shape, req, limit)
        if n == 0 or not self._try_allocate(req, n):
            self._undo_prefix(req, hits)
            return 0
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)
        self._claim(step, req, n)
        step.add(self._seq(req, n), req.num_computed + n)
        return n

    def _claim(self, step: StepBuilder, req: Request, n: int) -> None:
        """Note the full prompt blocks ``req`` computes in ``step`` (its next ``n`` tokens)."""
        bs = self.bm.block_size
        end = min(req.num_computed + n, req.num_prompt_tokens)
        if end // bs > req.num_computed // bs:
            hashes = req.full_block_hashes(bs, end)
            step.computing.update(hashes[req.num_computed // bs :])

    def _computed_beside(self, step: StepBuilder, req: Request, hits: int) -> bool:
        """Whether the first block ``req`` would compute is one this step computes already."""
        if not step.computing or req.num_computed != hits * self.bm.block_size:
            return False
        hashes = req.full_block_hashes(self.bm.block_size, len(req.token_ids) - 1)
        return len(hashes) > hits and hashes[hits] in step.computing

    def _fit(self, shape: list[tuple[int, int]], req: Request, budget: int) -> int:
        remaining = min(len(req.token_ids) - req.num_computed, budget)
        if self.config.time_budget_s is None or remaining <= 1:
            return remaining
        n = self.cost.max_chunk(
            StepShape(tuple(shape)), req.num_computed, remaining, self.config.time_budget_s
        )
        if n == 0 and not shape:
            n = min(remaining, self.bm.block_size)  # always make progress
        return n

    def _blocks_needed(self, req: Request, n: int) -> int:
        return max(0, math.ceil((req.num_computed + n) / self.bm.block_size) - len(req.blocks))

    def _try_allocate(self, req: Request, n: int) -> bool:
        need = self._blocks_needed(req, n)
        if need > self.bm.num_free:
            return False
        req.blocks.extend(self.bm.allocate(need))
        return True

    def _reserve(self, req: Request, n: int, scheduled: set[str], preempted: list[str]) -> bool:
        """Allocate blocks for ``n`` more tokens of a running request, preempting if needed."""
        while not self._try_allocate(req, n):
            victim = next(
                (
                    r
                    for r in reversed(self.running)
                    if r.status is Status.RUNNING and r.request_id not in scheduled
                ),
                None,
            )
            if victim is None:
                raise RuntimeError("the KV cache cannot hold even one request; raise num_kv_blocks")
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.release(req.blocks)
        req.blocks, req.num_computed, req.num_registered = [], 0, 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Back in arrival order, so the oldest preempted request resumes first.
        pos = next(
            (i for i, w in enumerate(self.waiting) if w.arrival > req.arrival), len(self.waiting)
        )
        self.waiting.insert(pos, req)

    def _admit_prefix(self, req: Request) -> list[int]:
        if req.num_computed or req.blocks:
            return []
        hashes = req.full_block_hashes(self.bm.block_size, len(req.token_ids) - 1)
        hits = self.bm.match_prefix(hashes)
        self.bm.acquire(hits)
        req.blocks = list(hits)
        req.num_registered = len(hits)
        req.num_computed = len(hits) * self.bm.block_size
        if not req.admitted:
            req.num_cached_tokens = min(req.num_computed, req.num_prompt_tokens)
        return hits

    def _undo_prefix(self, req: Request, hits: list[int]) -> None:
        if hits:
            self.bm.release(hits)
            req.blocks, req.num_computed, req.num_registered = [], 0, 0

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        req.admitted = True
        if not req.scheduled_at:
            req.scheduled_at = time.monotonic()
        end = req.num_computed + n
        return ScheduledSeq(
            request_id=req.request_id,
            start=req.num_computed,
            num_tokens=n,
            token_ids=tuple(req.token_ids[req.num_computed : end]),
            block_table=tuple(req.blocks),
            sample=end == len(req.token_ids),
            sample_position=len(req.token_ids),
        )

    # -- update -------------------------------------------------------------------------------
    def update(
        self, plan: StepPlan, sampled: dict[str, int], step_seconds: float | None = None
    ) -> list[TokenEvent]:
        """Apply a step's results: advance computed counts, name full blocks, append tokens."""
        self.advance(plan)
        return self.commit(plan, sampled, step_seconds)

    def advance(self, plan: StepPlan) -> None:
        """The step is running: its tokens count as computed, each sample is a placeholder."""
        for seq in plan.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted or finished while the step ran
            # Drafts count as computed only once verified (commit); the last token always is.
            req.num_computed = seq.start + seq.num_tokens - seq.num_drafts
            self._register_full_blocks(req)
            if seq.sample:
                req.token_ids.append(PLACEHOLDER)
                if self._out_of_length(req):
                    req.pending_finish = "length"
                    self.running.remove(req)  # nothing more to schedule; finishes on commit

    def commit(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int | Sequence[int]],
        step_seconds: float | None = None,
    ) -> list[TokenEvent]:
        """The step's tokens are known: fill placeholders, finish requests, return events.
        A seq that verified drafts gets a sequence: its accepted drafts, then the token
        sampled after them (one event each, up to the first that finishes the request)."""
        if step_seconds is not None and not plan.empty:
            self.cost.observe(plan.shape, step_seconds)
        events: list[TokenEvent] = []
        for seq in plan.seqs:
            req = self.requests.get(seq.request_id)
            if (
                not seq.sample
                or req is None
                or req.status is Status.FINISHED
                or len(req.token_ids) <= seq.sample_position
                or req.token_ids[seq.sample_position] != PLACEHOLDER
            ):
                continue  # aborted, finished, or advanced past by a preemption
            got = sampled[seq.request_id]
            if isinstance(got, int):
                req.token_ids[seq.sample_position] = got
                events.append(self._finish_check(req, got))
                continue
            events.extend(self._commit_verified(seq, req, list(got)))
        return events

    def _commit_verified(
        self, seq: ScheduledSeq, req: Request, tokens: list[int]
    ) -> list[TokenEvent]:
        """Tokens of a step that verified drafts: ``tokens[:-1]`` are the accepted drafts (their
        KV was computed by the step), ``tokens[-1]`` the token sampled after them."""
        if not 1 <= len(tokens) <= seq.num_drafts + 1:
            raise ValueError(f"{len(tokens)} tokens for a step verifying {seq.num_drafts} drafts")
        events: list[TokenEvent] = []
        for i, token in enumerate(tokens):
            if i == 0:
                req.token_ids[seq.sample_position] = token
            else:
                req.token_ids.append(token)
                if req.pending_finish is None and self._out_of_length(req):
                    req.pending_finish = "length"
            # Valid KV: the step's first token and the drafts accepted so far.
            req.num_computed = seq.start + 1 + i
            ev = self._finish_check(req, token)
            events.append(ev)
            if ev.finished:
                break
        if req.status is not Status.FINISHED or req.hold_kv:
            self._register_full_blocks(req)
        return events

    def _out_of_length(self, req: Request) -> bool:
        # The last bound: alone in the cache a request can always run; past it, it never could.
        return (
            req.num_output_tokens >= req.params.max_tokens
            or len(req.token_ids) >= self.config.max_model_len
            or len(req.token_ids) >= self.bm.num_blocks * self.bm.block_size
        )

    def _register_full_blocks(self, req: Request) -> None:
        bs = self.bm.block_size
        hashes = req.full_block_hashes(bs, req.num_computed)
        for i in range(req.num_registered, len(hashes)):
            self.bm.register(req.blocks[i], hashes[i])
        req.num_registered = len(hashes)

    def _finish_check(self, req: Request, token: int) -> TokenEvent:
        p = req.params
        reason = None
        stop = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        # The sampler masks stop tokens before min_tokens; this holds for any sampler.
        if stop and req.num_output_tokens > p.min_tokens:
            reason = "stop"
        elif req.pending_finish is not None:
            reason = req.pending_finish
        timing = (req.taken_at, req.scheduled_at) if req.num_output_tokens == 1 else None
        if reason is None:
            return TokenEvent(
                req.request_id, token, num_cached_tokens=req.num_cached_tokens, timing=timing
            )
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:  # preempted while its last token was on the way
            self.waiting.remove(req)
        if not req.hold_kv:
            self.free(req)
        return TokenEvent(req.request_id, token, True, reason, req.num_cached_tokens, timing=timing)
