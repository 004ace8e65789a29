"""How a step's prompt tokens are shared when several tenants have prompts to compute: the
policy (:class:`PrefillFairness`) and the :class:`FairScheduler` that applies it (no torch, no
I/O; the engine's scheduler).

A tenant is a request's ``cache_salt``: the entrypoint's keyed hash of the caller's tenant
(``libs/common/hashchain.py: tenant_salt``), the same for every request of a tenant and never
filled by the caller, so it reaches every engine without a field of its own. Without it one
tenant's 30,000-token prompt took the whole of every step until it was done, and another
tenant's 6-token request waited behind it (issue 33: 59 s).

Each step, :meth:`PrefillFairness.turns` gives every tenant with prompt work a share of the
step's prompt capacity by max-min fairness over their demands (weighted: a tenant of weight 2
gets twice the share of one of weight 1 when both want more than that), at least
``min_share`` tokens while there is room (no crumbs of a few tokens), and orders the tenants by
the prompt tokens each was served since it became active, over its weight (start-time fair
queuing; a tenant that arrives starts level with the least served active one, so idling earns
no credit; ties go to the smaller demand). A short prompt therefore starts in the step after
it arrives and is done in it when it fits its share; a long one keeps its share of every step
(no starvation), and takes the whole step again once it is alone. Within a tenant the
scheduler keeps FIFO order; with one tenant it is the plain :class:`~.scheduler.Scheduler`,
step for step. Decodes go first, as ever: fairness shares only prompt tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .cost_model import CostModel, StepShape
from .kv.block_manager import BlockManager
from .scheduler import Request, Scheduler, SchedulerConfig, Status, StepPlan
from .step_plan import StepBuilder


@dataclass(frozen=True)
class TenantTurn:
    tenant: bytes
    share: int  # prompt tokens this tenant may take this step (its requests in FIFO order)


@dataclass(frozen=True)
class Demand:
    tokens: int  # prompt tokens the tenant's requests still have to compute
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"a tenant's weight must be positive, got {self.weight}")


def fair_shares(demands: Mapping[bytes, Demand], capacity: int) -> dict[bytes, int]:
    """Max-min fair (weighted water-filling) split of ``capacity`` tokens over ``demands``:
    a tenant wanting less than its weighted part gets all it wants, the rest is split again
    among the others; the shares sum to ``min(capacity, total demand)``."""
    shares: dict[bytes, int] = {}
    left = max(0, capacity)
    pending = sorted(demands, key=lambda t: demands[t].tokens / demands[t].weight)
    weight = sum(demands[t].weight for t in pending)
    for i, t in enumerate(pending):
        d = demands[t]
        if i == len(pending) - 1:
            part = left  # the rounding remainder goes to the largest demand
        else:
            part = int(left * d.weight / weight)
        shares[t] = min(d.tokens, part)
        left -= shares[t]
        weight -= d.weight
    return shares


class PrefillFairness:
    """The prompt tokens each active tenant was served, over its weight, since it became active
    (module doc). Engine thread only."""

    def __init__(self, min_share: int) -> None:
        if min_share <= 0:
            raise ValueError(f"min_share must be positive, got {min_share}")
        self.min_share = min_share
        self._served: dict[bytes, float] = {}

    def reset(self) -> None:
        """Fewer than two tenants have prompt work: nothing to be fair about, nothing kept."""
        self._served.clear()

    def turns(self, demands: Mapping[bytes, Demand], capacity: int) -> list[TenantTurn]:
        """This step's turns: tenants in the order they pick, each with its share of
        ``capacity`` prompt tokens. ``demands`` holds every tenant with prompt work, in order of
        its oldest request (the last tie-break)."""
        served = {t: v for t, v in self._served.items() if t in demands}  # idle: forgotten
        floor = min(served.values(), default=0.0)
        for t in demands:
            served.setdefault(t, floor)  # arriving: level with the least served, no credit
        self._served = {t: v - floor for t, v in served.items()}  # keep the numbers small
        rank = {t: i for i, t in enumerate(demands)}
        order = sorted(demands, key=lambda t: (self._served[t], demands[t].tokens, rank[t]))
        shares = fair_shares(demands, capacity)
        turns, left = [], capacity
        for t in order:
            share = min(max(shares[t], min(self.min_share, demands[t].tokens)), left)
            if share > 0:
                turns.append(TenantTurn(t, share))
                left -= share
        return turns

    def charge(self, tenant: bytes, tokens: int, weight: float = 1.0) -> None:
        """``tenant`` was given ``tokens`` prompt tokens this step."""
        if tenant in self._served:
            self._served[tenant] += tokens / weight


class FairScheduler(Scheduler):
    """A :class:`Scheduler` whose prompt chunks interleave by tenant (module doc). A tenant is
    a request's ``cache_salt``; its weight the ``weight`` of its oldest request with prompt
    work."""

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        cost: CostModel,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        super().__init__(config, blocks, cost, eos_token_ids)
        self.fairness = PrefillFairness(min_share=blocks.block_size)

    def schedule(self) -> StepPlan:
        queues = self._prompt_queues()
        if len(queues) < 2:
            self.fairness.reset()
            return super().schedule()
        step = StepBuilder(self.config.max_tokens_per_step)
        for req in list(self.running):  # decodes first, as ever
            if req.status is Status.RUNNING and step.budget > 0 and self._left(req) <= 1:
                self._run_chunk(step, req, step.budget)
        demands = {t: Demand(sum(map(self._left, q)), q[0].weight) for t, q in queues.items()}
        starting = True  # a start that fails ends this step's starts, as in FIFO order
        ctx = sum(q[0].num_computed for q in queues.values()) // len(queues)
        for turn in self.fairness.turns(demands, self._prompt_capacity(step, ctx)):
            left = turn.share
            for req in queues[turn.tenant]:
                limit = min(left, step.budget)
                if limit <= 0:
                    break
                n = 0
                if req.status is Status.RUNNING and req.request_id not in step.scheduled:
                    n = self._run_chunk(step, req, limit)
                elif starting and self._can_start(req, step):
                    n = self._admit(step, req, limit)
                    starting = n > 0
                if n == 0:
                    break  # FIFO within the tenant: nothing overtakes its oldest request
                left -= n
                self.fairness.charge(turn.tenant, n, demands[turn.tenant].weight)
        return step.plan()

    @staticmethod
    def _left(req: Request) -> int:
        return len(req.token_ids) - req.num_computed

    def _prompt_work(self) -> Iterator[Request]:
        """Requests with prompt tokens to compute (more than a decode's one), oldest first:
        running ones, then waiting ones while there is room to start them."""
        for req in self.running:
            if req.status is Status.RUNNING and self._left(req) > 1:
                yield req
        if len(self.running) < self.config.max_running:
            yield from self.waiting

    def _prompt_queues(self) -> dict[bytes, list[Request]]:
        """Each tenant's requests with prompt work, oldest first; tenants in order of their
        oldest request."""
        queues: dict[bytes, list[Request]] = {}
        for req in self._prompt_work():
            queues.setdefault(req.cache_salt, []).append(req)
        return queues

    def _can_start(self, req: Request, step: StepBuilder) -> bool:
        return (
            req.status is Status.WAITING
            and not step.preempted  # blocks were short: no starts this step, as in FIFO order
            and len(self.running) < self.config.max_running
        )

    def _prompt_capacity(self, step: StepBuilder, ctx: int) -> int:
        """Prompt tokens the step still has room for: the token budget, or fewer where the
        time budget ends first (priced as one chunk after ``ctx`` tokens, the heads' mean)."""
        if self.config.time_budget_s is None or step.budget <= 0:
            return max(step.budget, 0)
        shape = StepShape(tuple(step.shape))
        n = self.cost.max_chunk(shape, ctx, step.budget, self.config.time_budget_s)
        return n if n or step.shape else min(step.budget, self.bm.block_size)
