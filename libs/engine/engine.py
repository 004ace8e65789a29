"""The engine: model + paged KV cache + scheduler + sampler behind add/step/abort/export/import.

Single-threaded: the service wrapping it owns the loop and the I/O. Each :meth:`Engine.step`
schedules one batch (prompt chunks and decodes together), launches it and returns token
events. With ``overlap`` (on by default on CUDA) a step returns the events of the step
launched by the previous call: while the device runs step N the host schedules and prepares
step N+1 and turns step N-1's tokens into events, so the device never waits for Python.
Requests that stop on a token are then known one step late and that step's extra token is
dropped; the token stream is the same as without overlap.

With expert parallelism (``ep``: one rank of an EP group, :mod:`libs.engine.ep`) each rank
runs its own Engine over its own requests and KV cache, and the ranks step in lockstep: the
driver asks :meth:`Engine.group_has_unfinished` (a collective) and, while it is true, every rank
calls :meth:`Engine.step`, which then runs exactly one forward -- an empty one (0 tokens, every
MoE layer's exchanges) when this rank has nothing scheduled. With ``EngineConfig.eplb`` the
ranks also run EPLB together after those steps (:class:`~libs.engine.ep.runtime.EplbDriver`):
group load counts, live re-placement every ``rebalance_every`` steps, and the balance gauge
:meth:`Engine.ep_balance`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from .config import ModelConfig
from .engine_config import EngineConfig
from .ep.eplb import Balance
from .features import check
from .grammar import GrammarBackend
from .intake import (
    Intake,
    InvalidRequest,
    RequestInfo,
    request_info,
    warmup_batches,
    warmup_prompts,
)
from .kv.block_manager import BlockManager, NoFreeBlocks
from .kv.transfer import KVFormatError, KVIntegrityError, PeerKV
from .kv_port import KVInput, KVPort, MissingPrefix, PreparedKV
from .loader import LoadedModel
from .model.model import DeepseekForCausalLM
from .parts import EngineParts, max_model_len
from .prefill_fairness import FairScheduler
from .registry import build_parts, routed_experts
from .rows import join_logprobs, sampling_inputs
from .runner import Launched, ModelRunner
from .sampler import Sampler
from .scheduler import SchedulerConfig, Status, StepPlan, TokenEvent
from .speculative import SpecDecoder
from .step_profile import StepProfile

if TYPE_CHECKING:
    from .ep.eplb import EplbConfig
    from .ep.group import EPGroup
    from .ep.placement import Placement
    from .ep.runtime import EplbDriver, EPRuntime

log = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "KVFormatError",
    "KVInput",
    "KVIntegrityError",
    "MissingPrefix",
    "NoFreeBlocks",
    "PeerKV",
    "PreparedKV",
    "RequestInfo",
    "TokenEvent",
]


class Engine:
    """Policy around a runner and a KV cache: requests, scheduling, KV export/import.

    ``parts``: what it runs on (model runner, KV cache, cost model...); without them they are
    built from ``config`` by :func:`~libs.engine.registry.build_parts`, which loads the model
    (``loaded``: an already loaded one). The fake engine passes its own.

    ``ep``: this engine is one rank of that expert-parallel group (routed experts sharded by
    ``placement``, default contiguous); see the module doc for the lockstep it then keeps.

    Requests come in through an :class:`~.intake.Intake`, KV through a :class:`~.kv_port.KVPort`.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        *,
        parts: EngineParts | None = None,
        ep: EPGroup | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        if parts is not None and ep is not None:
            raise ValueError("pass ep to build_parts, not beside ready parts")
        eplb = config.eplb_config
        if ep is not None and eplb is not None and placement is None:
            placement = _eplb_start(config, loaded, ep.size, eplb.redundant_per_rank)
        parts = parts or build_parts(config, loaded, ep, placement)
        self.parts = parts
        self.ep: EPRuntime | None = parts.ep
        self.eplb = _eplb_driver(self.ep, eplb)
        self.device = parts.device
        self.model_config = cfg = parts.model_config
        self.model_id = parts.model_id
        self.spec = parts.spec
        self.cache = parts.cache
        self.runner = parts.runner
        self.cost = parts.cost
        self.blocks = BlockManager(parts.num_blocks, config.block_size)
        self.scheduler_config = SchedulerConfig(
            config.max_tokens_per_step,
            config.time_budget_s,
            config.max_running,
            max_model_len(config, cfg),
        )
        self.scheduler = FairScheduler(  # prompt chunks interleave by tenant (cache salt)
            self.scheduler_config, self.blocks, self.cost, cfg.eos_token_ids
        )
        self.kv = KVPort(
            self.model_id, self.spec, self.cache, self.blocks, self.scheduler, config.kv_mac_key
        )
        self._peer_pools = self.kv.peer_pools  # the port's: mapped once per peer pool
        self._grammar: GrammarBackend | None = None  # built for the first constrained request
        self._grammar_lock = threading.Lock()  # built by a service's worker thread or this one
        self.speculative = _spec_decoder(config, self.runner, self.ep)
        self.intake = Intake(
            self.scheduler,
            self.kv,
            cfg.vocab_size,
            lambda: self.grammar,
            lambda: self._grammar,
            self.speculative,
        )
        self._inflight: Launched | None = None
        self.last_step_seconds = 0.0  # of the step that finished last
        self.last_step_tokens = 0  # of the step launched last
        self._profile = StepProfile.from_env()
        self.last_finished_tokens = 0
        self.last_finished_seqs = 0  # requests in the step that finished last (its batch)
        self.finished_steps = 0  # steps whose results came back, since start

    # -- the model behind a real runner (a fake one has none: AttributeError) ------------------
    @property
    def loaded(self) -> LoadedModel:
        if self.parts.loaded is None:
            raise AttributeError(f"engine {self.model_id!r} runs no model")
        return self.parts.loaded

    @property
    def tokenizer_source(self) -> str | None:
        """Where this model's tokenizer is read from (:func:`_tokenizer_source`)."""
        return _tokenizer_source(self.parts, self.config.model)

    @property
    def model(self) -> DeepseekForCausalLM:
        return self.loaded.model

    @property
    def sampler(self) -> Sampler:
        if not isinstance(self.runner, ModelRunner):
            raise AttributeError(f"engine {self.model_id!r} runs no sampler")
        return self.runner.sampler

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in this engine's prefix cache (:class:`~.intake.Intake`)."""
        return self.intake.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens of those lookups the cache held (read by the metrics)."""
        return self.intake.prefix_cache_hits

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: bytes = b"",
        kv: KVInput | None = None,
        hold_kv: bool = False,
        prior_outputs: int = 0,
        drafts: tuple[Sequence[int], Sequence[float]] | None = None,
        weight: float = 1.0,
    ) -> Any:
        """Queue a request (:meth:`Intake.add <libs.engine.intake.Intake.add>` states the
        contract: what ``kv``, ``prior_outputs`` and ``drafts`` are, what it raises).
        ``weight``: its tenant's (``cache_salt``'s) share of each step's prompt tokens beside
        other tenants' (:mod:`~libs.engine.prefill_fairness`)."""
        return self.intake.add(
            request_id,
            [int(t) for t in prompt_token_ids],
            params or SamplingParams(),
            cache_salt,
            kv,
            hold_kv,
            prior_outputs,
            drafts,
            weight,
        )

    def abort(self, request_id: str) -> TokenEvent | None:
        self.runner.forget(request_id)
        self.intake.forget(request_id)
        return self.scheduler.abort(request_id)

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-output backend over this model's tokenizer (built on first use; a
        service builds it at start-up: :func:`libs.serving.engines.warm_grammar`)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = _grammar_backend(self.tokenizer_source, self.model_config)
            return self._grammar

    def take_drafts(self, request_id: str) -> tuple[list[int], list[float]] | None:
        """The drafts for a held request's next step, to hand over (:meth:`Intake.take_drafts`)."""
        return self.intake.take_drafts(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished request kept with ``hold_kv``."""
        self.intake.release(request_id)

    def has_unfinished(self) -> bool:
        """Requests are waiting or running, or the step in flight still owes one a token."""
        reqs = self.scheduler.requests
        return self.scheduler.has_unfinished() or (
            self._inflight is not None
            and any(
                s.request_id in reqs and reqs[s.request_id].status is not Status.FINISHED
                for s in self._inflight.sampling
            )
        )

    def group_has_unfinished(self) -> bool:
        """:meth:`has_unfinished` for this engine alone; with EP, whether any rank of the group
        has (a collective: every rank asks before every lockstep step)."""
        local = self.has_unfinished()
        if self.ep is None:
            return local
        return bool(self.ep.group.all_max([int(local)])[0])

    def ep_balance(self) -> Balance | None:
        """With EPLB: the routed experts' busiest-rank load over the mean (``.max_mean``,
        1.0 = even) over the current window under the placements in force, per layer, and the
        re-placements so far; a gauge to publish. None without EP or EPLB. Not a collective
        (every rank holds the same group counts, so every rank reports the same figure)."""
        return self.eplb.balance() if self.eplb is not None else None

    def info(self, request_id: str) -> RequestInfo:
        return request_info(self.scheduler.requests[request_id])

    # -- KV in and out: the port's (kv_port.py), for a request this engine holds ----------------
    def prepare_kv(self, frames: Sequence[bytes | bytearray | memoryview]) -> PreparedKV:
        """Parse, check and upload KV frames; touches no engine state, so it may run on any
        thread while the engine steps (then pass the result to :meth:`add_request`)."""
        return self.kv.prepare(frames)

    def export_kv(
        self,
        request_id: str,
        *,
        include_partial: bool = False,
        release: bool = False,
        start_block: int = 0,
    ) -> bytes:
        """One frame with the request's computed KV from block ``start_block`` on: its full
        blocks, plus the tail if asked."""
        frame = self.kv.export_async(request_id, include_partial, start_block)()
        if release:
            self.release(request_id)
        return frame

    def export_kv_async(
        self, request_id: str, *, include_partial: bool = False, start_block: int = 0
    ) -> Callable[[], bytes]:
        """:meth:`export_kv` in two halves (:meth:`KVPort.export_async`)."""
        return self.kv.export_async(request_id, include_partial, start_block)

    def export_blocks(
        self, request_id: str, start_block: int = 0
    ) -> list[tuple[bytes, bytes, bytes]]:
        """The request's full blocks as single-block frames (:meth:`KVPort.export_blocks_async`)."""
        return self.kv.export_blocks_async(request_id, start_block)()

    def export_blocks_async(
        self, request_id: str, start_block: int = 0
    ) -> Callable[[], list[tuple[bytes, bytes, bytes]]]:
        """:meth:`export_blocks` in two halves, like :meth:`export_kv_async`."""
        return self.kv.export_blocks_async(request_id, start_block)

    def peer_kv(self, request_id: str, start_block: int = 0) -> PeerKV | None:
        """The request's KV as blocks of this engine's shared pool (:meth:`KVPort.peer`)."""
        return self.kv.peer(request_id, start_block)

    def resident_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of this chain the cache holds now (in use or cached)."""
        return len(self.blocks.match_prefix(block_hashes))

    def warm_up(self, lengths: Sequence[int] = (1, 7, 16, 33, 130, 257, 1000, 4100)) -> float:
        """Run throwaway prompts of these lengths (together, one at a time, then as follow-up
        turns over their cached prefixes: :func:`~.intake.warmup_batches`) so that the first
        real requests do not pay for kernel compilation of new shapes; returns the seconds it
        took. Leaves no request behind; their blocks stay cached under a
        salt no client sends, evicted first as pages are needed."""
        t0 = time.perf_counter()
        self.runner.warm_kernels()
        prompts = warmup_prompts(
            lengths, self.scheduler_config.max_model_len, self.model_config.vocab_size
        )
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        for batch in warmup_batches(prompts, self.spec.block_size, lambda: self.blocks.num_free):
            for rid, p in batch:
                self.add_request(rid, p, params, cache_salt=b"__warmup")
            while self.group_has_unfinished():
                self.step()
        self.intake.reset_counts()  # served nobody
        return time.perf_counter() - t0

    # -- stepping -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule and launch one step; return the events of the step that finished.
        With EP, always one forward: an empty one when nothing is scheduled here."""
        if self._profile is not None:  # DEEPSERVE_TORCH_PROFILE (libs/engine/step_profile.py)
            running = len(self.scheduler.running)
            return self._profile.step(self._step, lambda: self.last_step_tokens, running)
        return self._step()

    def _step(self) -> list[TokenEvent]:
        if self.speculative is not None:
            return self._step_speculative(self.speculative)
        early: list[TokenEvent] = []
        plan = self.scheduler.schedule()
        self.intake.count_lookups(plan)
        launched = None
        if not plan.empty:
            launched = self._launch(plan, self._inflight, early)
        elif self.ep is not None:
            self.ep.empty_step()
        if self.eplb is not None:  # the forward is queued: a re-placement serves the next one
            self.eplb.after_step()
        events = early + (self._finish(self._inflight) if self._inflight is not None else [])
        if launched is not None:
            self.scheduler.advance(plan)
            self.last_step_tokens = plan.num_tokens
            if self.config.use_overlap:
                self._inflight = launched
                return events
            events += self._finish(launched)
        self._inflight = None
        return events

    def _launch(self, plan: StepPlan, prev: Launched | None, early: list[TokenEvent]) -> Launched:
        """Queue ``plan``. With a constrained request running, its mask needs the token of the
        step in flight: once the forward is queued, that step is finished here (its events go
        to ``early``) and the masks filled, while the device computes; then the sampling."""
        sampling = [s for s in plan.seqs if s.sample]
        params, num_generated, histories = sampling_inputs(self.scheduler.requests, sampling)
        masks_fn = None
        g = self._grammar  # a running request's constraint: its next mask needs its last token
        if g is not None and any(g.has(r.request_id) for r in self.scheduler.running):
            rids = [s.request_id for s in sampling]

            def masks_fn() -> tuple[list[int], torch.Tensor] | None:
                if self._inflight is not None:
                    early.extend(self._finish(self._inflight))
                    self._inflight = None
                return g.masks(rids)

        return self.runner.launch(plan, params, prev, num_generated, histories, masks_fn=masks_fn)

    def _step_speculative(self, spec: SpecDecoder) -> list[TokenEvent]:
        """One synchronous step with speculative decoding (see libs/engine/speculative/):
        verify the drafts chosen for this step beside the rest of the batch, commit, then let
        the MTP layer catch up and draft for the next step."""
        plan = self.scheduler.schedule()
        self.intake.count_lookups(plan)
        if plan.empty:
            return []
        plan = spec.add_drafts(plan, self.scheduler, self._grammar)
        step = spec.verify(plan, self.scheduler.requests, self._grammar)
        self.scheduler.advance(plan)
        events = self.scheduler.commit(plan, step.sampled, step.seconds)
        self.last_step_tokens = plan.num_tokens
        self._count_finished(plan, step.seconds)
        events = spec.with_counts(self._after_commit(events, step.logprobs))
        spec.draft(plan, step, self.scheduler)
        return events

    def _finish(self, launched: Launched) -> list[TokenEvent]:
        sampled, seconds = self.runner.collect(launched)
        self._count_finished(launched.plan, seconds)  # the step those seconds timed
        events = self.scheduler.commit(launched.plan, sampled, seconds)
        lps = self.runner.logprobs(launched) if launched.logprobs is not None else {}
        return self._after_commit(events, {rid: [lp] for rid, lp in lps.items()})

    def _count_finished(self, plan: StepPlan, seconds: float) -> None:
        self.last_step_seconds = seconds
        self.last_finished_tokens = plan.num_tokens
        self.last_finished_seqs = len(plan.seqs)
        self.finished_steps += 1

    def _after_commit(
        self, events: list[TokenEvent], lps: dict[str, list[TokenLogprob]]
    ) -> list[TokenEvent]:
        """Constraints advance over the committed tokens; logprobs join their events."""
        g = self._grammar
        for ev in events:
            if ev.finished:
                self.runner.forget(ev.request_id)
            if g is not None and ev.token_id is not None:
                g.accept(ev.request_id, ev.token_id)
            if g is not None and ev.finished:
                g.drop(ev.request_id)
        return join_logprobs(events, lps)


def _spec_decoder(config: EngineConfig, runner: Any, ep: EPRuntime | None) -> SpecDecoder | None:
    """The speculative half of the engine's steps, if ``config`` asks for drafts."""
    if not config.speculative_tokens:
        return None
    check(config.setup(expert_parallel=ep is not None))  # libs/engine/features.py
    if not isinstance(runner, ModelRunner):
        raise ValueError("speculative decoding needs a model runner")
    return SpecDecoder(runner, config.speculative_tokens, config.speculative_schedule)


def _eplb_driver(ep: EPRuntime | None, eplb: EplbConfig | None) -> EplbDriver | None:
    """EPLB run by the ranks together, with EP and an EPLB config; else None."""
    if ep is None or eplb is None:
        return None
    from .ep.runtime import EplbDriver

    return EplbDriver(ep, eplb)


def _eplb_start(
    config: EngineConfig, loaded: LoadedModel | None, ranks: int, redundant: int
) -> Placement:
    """EPLB's starting placement: contiguous, with its spare slots per rank."""
    from .ep.placement import Placement

    if loaded is not None:
        experts = loaded.model.cfg.n_routed_experts
    else:  # from the config alone: no weight is read
        experts = routed_experts(config.model)
    return Placement.contiguous(experts, ranks, redundant)


def _tokenizer_source(parts: EngineParts, model: str) -> str | None:
    """Where the tokenizer of the model ``parts`` run is read from
    (:func:`~.tokenizer.load_tokenizer`): its checkpoint directory, or None for the bundled one
    (presets, the fake engine)."""
    if parts.loaded is not None:
        return parts.loaded.source
    return model if Path(model).is_dir() else None


def _grammar_backend(tokenizer_source: str | None, cfg: ModelConfig) -> GrammarBackend:
    from .tokenizer import load_tokenizer

    return GrammarBackend(load_tokenizer(tokenizer_source), cfg.vocab_size, cfg.eos_token_ids)
