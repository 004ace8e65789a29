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

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from libs.common.errors import InvalidArgument
from libs.common.hashchain import chain_hashes
from libs.common.sampling import SamplingParams, TokenLogprob

from .engine_config import EngineConfig
from .ep.eplb import Balance
from .grammar import GrammarBackend, GrammarError
from .kv.block_manager import BlockManager, NoFreeBlocks
from .kv.transfer import (
    KVFormatError,
    KVHeader,
    KVIntegrityError,
    PeerKV,
    check_compatible,
    decode_frame,
    encode_frame,
    verify,
)
from .loader import LoadedModel
from .model.model import DeepseekForCausalLM
from .parts import EngineParts, build_parts, max_model_len
from .runner import Launched, ModelRunner
from .sampler import Sampler
from .scheduler import (
    Request,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    Status,
    StepPlan,
    TokenEvent,
)
from .speculative import SpecDecoder

if TYPE_CHECKING:
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
    "TokenEvent",
]


class InvalidRequest(InvalidArgument):
    """A request the engine refuses as given (recoverable by fixing the request)."""


class MissingPrefix(KVFormatError):
    """KV that starts past block 0 whose leading blocks this engine no longer holds.

    ``have``: how many leading blocks it does hold; a sender retries from there.
    """

    def __init__(self, message: str, have: int) -> None:
        super().__init__(message)
        self.have = have


@dataclass(frozen=True)
class PreparedKV:
    """KV frames parsed and uploaded off the engine thread (:meth:`Engine.prepare_kv`).

    Covers blocks ``first_block ..`` of a request: ``num_tokens`` tokens counted from 0.
    """

    first_block: int
    num_tokens: int
    block_hashes: tuple[str, ...]  # hex chain digests, one per block held
    staged: Any  # the cache's staged upload


KVInput = bytes | Sequence[bytes] | PreparedKV | PeerKV


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    finished: bool
    finish_reason: str | None
    num_preemptions: int


class Engine:
    """Policy around a runner and a KV cache: requests, scheduling, KV export/import.

    ``parts``: what it runs on (model runner, KV cache, cost model...); without them they are
    built from ``config`` by :func:`~libs.engine.parts.build_parts`, which loads the model
    (``loaded``: an already loaded one). The fake engine passes its own.

    ``ep``: this engine is one rank of that expert-parallel group (routed experts sharded by
    ``placement``, default contiguous); see the module doc for the lockstep it then keeps.
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
        self.eplb: EplbDriver | None = None
        if self.ep is not None and eplb is not None:
            from .ep.runtime import EplbDriver

            self.eplb = EplbDriver(self.ep, eplb)
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
        self.scheduler = Scheduler(self.scheduler_config, self.blocks, self.cost, cfg.eos_token_ids)
        self._inflight: Launched | None = None
        self._peer_pools: dict[bytes, Any] = {}  # share handle -> another engine's pool, mapped
        self.last_step_seconds = 0.0  # of the step that finished last
        self.last_step_tokens = 0  # of the step launched last
        self.last_finished_tokens = 0
        self.last_finished_seqs = 0  # requests in the step that finished last (its batch)
        self.finished_steps = 0  # steps whose results came back, since start
        # Prefix cache, in prompt tokens, counted once per request when its prompt is first
        # looked up in this engine's own cache (first admission, or a KV import's local
        # hits); what was imported from elsewhere is not a hit. Read by the metrics.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._unqueried: set[str] = set()  # added without KV, not yet admitted
        self._grammar: GrammarBackend | None = None  # built for the first constrained request
        self._grammar_lock = threading.Lock()  # built by a service's worker thread or this one
        self.speculative: SpecDecoder | None = None
        if config.speculative_tokens:
            if self.ep is not None:
                raise ValueError("speculative decoding does not run with expert parallelism yet")
            if not isinstance(self.runner, ModelRunner):
                raise ValueError("speculative decoding needs a model runner")
            self.speculative = SpecDecoder(
                self.runner, config.speculative_tokens, config.speculative_schedule
            )

    # -- the model behind a real runner (a fake one has none: AttributeError) ------------------
    @property
    def loaded(self) -> LoadedModel:
        if self.parts.loaded is None:
            raise AttributeError(f"engine {self.model_id!r} runs no model")
        return self.parts.loaded

    @property
    def tokenizer_source(self) -> str | None:
        """Where this model's tokenizer is read from (:func:`~.tokenizer.load_tokenizer`): its
        checkpoint directory, or None for the bundled one (presets, the fake engine)."""
        if self.parts.loaded is not None:
            return self.parts.loaded.source
        model = self.config.model
        return model if Path(model).is_dir() else None

    @property
    def model(self) -> DeepseekForCausalLM:
        return self.loaded.model

    @property
    def sampler(self) -> Sampler:
        if not isinstance(self.runner, ModelRunner):
            raise AttributeError(f"engine {self.model_id!r} runs no sampler")
        return self.runner.sampler

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
    ) -> Any:
        """Queue a request. ``kv``: frames from :meth:`export_kv` covering a prefix of the
        tokens (or blocks ``first_block ..`` of it when this engine holds the blocks before),
        the same already :meth:`prepare_kv`-ed, or a :class:`PeerKV`.

        Returns an event (None when there is nothing to wait for) that completes once a
        :class:`PeerKV` source has been copied; its owner may reuse the blocks after it.
        Raises :class:`InvalidRequest` for bad input, :class:`KVFormatError` for KV that does
        not belong to this model or these tokens (:class:`MissingPrefix` when the blocks it
        builds on are gone), :class:`NoFreeBlocks` if imported KV does not fit now.
        ``prior_outputs``: how many of the last prompt tokens were generated already (the
        first token, for a decode after prefill): the penalties count them as output.
        ``drafts``: (token ids, confidences) another engine drafted for the request's next
        step (:meth:`take_drafts`); verified here when this engine speculates, else unused.
        """
        params = params or SamplingParams()
        tokens = [int(t) for t in prompt_token_ids]
        self._validate(request_id, tokens, params)
        if not 0 <= prior_outputs < len(tokens):
            raise InvalidRequest(
                f"prior_outputs must lie in [0, {len(tokens)}), got {prior_outputs}"
            )
        offered = None
        if drafts is not None and self.speculative is not None:
            try:
                offered = self.speculative.checked(*drafts)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        req = Request(request_id, tokens, len(tokens), params, cache_salt, hold_kv)
        req.num_prior_outputs = prior_outputs
        if params.constraint is not None:
            try:  # compiled (cached) and advanced past the outputs the request already has
                self.grammar.start(
                    request_id, params.constraint, tokens[len(tokens) - prior_outputs :]
                )
            except GrammarError as exc:
                raise InvalidRequest(str(exc)) from None
        done, local_hits = None, 0
        if kv is not None:
            if not isinstance(kv, (PreparedKV, PeerKV)):
                kv = self.prepare_kv(
                    [kv] if isinstance(kv, (bytes, bytearray, memoryview)) else list(kv)
                )
            try:
                done, local_hits = self._import(req, kv)
            except BaseException:
                self._forget_grammar(request_id)
                raise
        try:
            self.scheduler.add(req)
        except ValueError as exc:
            self.blocks.release(req.blocks)
            self._forget_grammar(request_id)
            raise InvalidRequest(str(exc)) from None
        if offered is not None and offered[0]:
            assert self.speculative is not None
            self.speculative.drafts[request_id] = offered  # verified by its first step
        if kv is None:
            self._unqueried.add(request_id)  # looked up when first scheduled (step)
        else:
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += min(local_hits, req.num_prompt_tokens)
        return done

    def _validate(self, request_id: str, tokens: list[int], params: SamplingParams) -> None:
        if not request_id:
            raise InvalidRequest("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if not tokens:
            raise InvalidRequest("prompt_token_ids must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt_token_ids holds {bad}, outside the vocabulary [0, {vocab})"
            )
        limit = self.scheduler_config.max_model_len
        if len(tokens) >= limit:
            raise InvalidRequest(f"prompt has {len(tokens)} tokens; the context limit is {limit}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must lie in [0, {vocab})")

    def abort(self, request_id: str) -> TokenEvent | None:
        self.runner.forget(request_id)
        self._unqueried.discard(request_id)
        self._forget_grammar(request_id)
        if self.speculative is not None:
            self.speculative.forget(request_id)
        return self.scheduler.abort(request_id)

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-output backend over this model's tokenizer (built on first use; a
        service builds it at start-up: :func:`libs.serving.engines.warm_grammar`)."""
        with self._grammar_lock:
            if self._grammar is None:
                from .tokenizer import load_tokenizer

                source = self.tokenizer_source
                cfg = self.model_config
                self._grammar = GrammarBackend(
                    load_tokenizer(source), cfg.vocab_size, cfg.eos_token_ids
                )
            return self._grammar

    def _forget_grammar(self, request_id: str) -> None:
        if self._grammar is not None:
            self._grammar.drop(request_id)

    def take_drafts(self, request_id: str) -> tuple[list[int], list[float]] | None:
        """The drafts made for a held request's next step (speculative decoding), for the
        engine it is handed to (``add_request(drafts=...)``); None when there are none."""
        if self.speculative is None:
            return None
        return self.speculative.drafts.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """Free a finished request kept with ``hold_kv``."""
        if self.speculative is not None:
            self.speculative.drafts.pop(request_id, None)
        req = self.scheduler.requests.get(request_id)
        if req is not None and req.status is Status.FINISHED:
            self.scheduler.free(req)

    def has_unfinished(self) -> bool:
        """Requests are waiting or running, or the step in flight still owes one a token."""
        if self.scheduler.has_unfinished():
            return True
        reqs = self.scheduler.requests
        return self._inflight is not None and any(
            s.request_id in reqs and reqs[s.request_id].status is not Status.FINISHED
            for s in self._inflight.sampling
        )

    def group_has_unfinished(self) -> bool:
        """:meth:`has_unfinished` for this engine alone; with EP, whether any rank of the group
        has (a collective: every rank asks before every lockstep step)."""
        local = self.has_unfinished()
        if self.ep is None:
            return local
        return bool(self.ep.group.all_max([int(local)])[0])

    def load_counts(self) -> Any:
        """With EP: tokens per (MoE layer, expert) this rank routed since the last call."""
        if self.ep is None:
            raise AttributeError("load counts are kept by expert-parallel engines")
        return self.ep.load_counts()

    def apply_placement(self, new: Placement | Sequence[Placement]) -> None:
        """With EP: move the experts to ``new`` (every rank, between the same two steps)."""
        if self.ep is None:
            raise AttributeError("this engine is not expert-parallel")
        self.ep.apply_placement(new)

    def ep_balance(self) -> Balance | None:
        """With EPLB: the routed experts' busiest-rank load over the mean (``.max_mean``,
        1.0 = even) over the current window under the placements in force, per layer, and the
        re-placements so far; a gauge to publish. None without EP or EPLB. Not a collective
        (every rank holds the same group counts, so every rank reports the same figure)."""
        return self.eplb.balance() if self.eplb is not None else None

    def info(self, request_id: str) -> RequestInfo:
        req = self.scheduler.requests[request_id]
        return RequestInfo(
            req.request_id,
            tuple(req.token_ids),
            req.num_prompt_tokens,
            req.num_cached_tokens,
            req.num_computed,
            req.status is Status.FINISHED,
            req.finish_reason,
            req.num_preemptions,
        )

    # -- KV export / import -------------------------------------------------------------------
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
        frame = self.export_kv_async(
            request_id, include_partial=include_partial, start_block=start_block
        )()
        if release:
            self.release(request_id)
        return frame

    def export_kv_async(
        self, request_id: str, *, include_partial: bool = False, start_block: int = 0
    ) -> Callable[[], bytes]:
        """:meth:`export_kv` in two halves: this call (engine thread) starts copying the
        blocks out; the function it returns (any thread) waits for them and builds the frame.
        The request's blocks may be released or reused as soon as this returns."""
        req = self._held(request_id)
        bs = self.spec.block_size
        covered = req.num_computed if include_partial else (req.num_computed // bs) * bs
        start, blocks, names = self._kv_span(req, covered, start_block)
        header = KVHeader(
            self.model_id,
            self.spec.layout_hash(),
            bs,
            self.spec.dtype,
            self.spec.bytes_per_block,
            covered,
            start,
            names,
        )
        pending = self.cache.gather_async(blocks)
        key = self.config.kv_mac_key
        return lambda: encode_frame(header, pending.result(), key)

    def export_blocks(
        self, request_id: str, start_block: int = 0
    ) -> list[tuple[bytes, bytes, bytes]]:
        """The request's full blocks from ``start_block`` on, one single-block frame each.

        Returns (chain digest, parent digest or b"", frame) per block: the kvstore's unit.
        Frames for blocks ``0..k`` passed together to :meth:`add_request` import as one prefix.
        """
        return self.export_blocks_async(request_id, start_block)()

    def export_blocks_async(
        self, request_id: str, start_block: int = 0
    ) -> Callable[[], list[tuple[bytes, bytes, bytes]]]:
        """:meth:`export_blocks` in two halves, like :meth:`export_kv_async`."""
        req = self._held(request_id)
        bs = self.spec.block_size
        hashes = req.full_block_hashes(bs, req.num_computed)
        start = min(max(start_block, 0), len(hashes))
        pending = self.cache.gather_async(req.blocks[start : len(hashes)])
        key = self.config.kv_mac_key
        model_id, layout, bpb, dtype = (
            self.model_id,
            self.spec.layout_hash(),
            self.spec.bytes_per_block,
            self.spec.dtype,
        )

        def finish() -> list[tuple[bytes, bytes, bytes]]:
            raw = pending.result()
            out = []
            for i in range(start, len(hashes)):
                header = KVHeader(
                    model_id, layout, bs, dtype, bpb, (i + 1) * bs, i, (hashes[i].hex(),)
                )
                k = i - start
                frame = encode_frame(header, raw[k * bpb : (k + 1) * bpb], key)
                out.append((hashes[i], hashes[i - 1] if i else b"", frame))
            return out

        return finish

    def peer_kv(self, request_id: str, start_block: int = 0) -> PeerKV | None:
        """The request's computed KV (tail included) from ``start_block`` on, as blocks of this
        engine's shared pool, for an engine in another process on this host; None when the
        pool cannot be shared. The caller keeps the request (``hold_kv``) until the importer
        is done with the blocks."""
        handle = self.cache.share()
        if handle is None:
            return None
        req = self._held(request_id)
        start, blocks, names = self._kv_span(req, req.num_computed, start_block)
        return PeerKV(handle, tuple(blocks), start, req.num_computed, names)

    def _kv_span(
        self, req: Request, covered: int, start_block: int
    ) -> tuple[int, list[int], tuple[str, ...]]:
        """The blocks holding tokens ``0..covered`` (a partial tail included) from
        ``start_block`` on: (first block, their ids, their hex chain digests)."""
        hashes = chain_hashes(
            req.token_ids[:covered], self.spec.block_size, req.cache_salt, include_partial=True
        )
        start = min(max(start_block, 0), len(hashes))
        return start, req.blocks[start : len(hashes)], tuple(h.hex() for h in hashes[start:])

    def resident_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of this chain the cache holds now (in use or cached)."""
        return len(self.blocks.match_prefix(block_hashes))

    def _held(self, request_id: str) -> Request:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} (finished requests need hold_kv=True)")
        return req

    def prepare_kv(self, frames: Sequence[bytes | bytearray | memoryview]) -> PreparedKV:
        """Parse, check and upload KV frames; touches no engine state, so it may run on any
        thread while the engine steps (then pass the result to :meth:`add_request`)."""
        headers: list[KVHeader] = []
        payloads: list[memoryview] = []
        for data in frames:
            header, payload = decode_frame(bytes(data) if isinstance(data, bytearray) else data)
            check_compatible(header, self.spec)
            verify(self.config.kv_mac_key, header, payload)
            if headers:
                expected = headers[-1].first_block + headers[-1].num_blocks
                if header.first_block != expected:
                    raise KVFormatError(
                        f"KV frames are not contiguous: block {header.first_block} "
                        f"follows block {expected - 1}"
                    )
            headers.append(header)
            payloads.append(payload)
        if not headers:
            raise KVFormatError("no KV frames given")
        return PreparedKV(
            headers[0].first_block,
            headers[-1].num_tokens,
            tuple(h for header in headers for h in header.block_hashes),
            self.cache.stage(payloads),
        )

    def _import(self, req: Request, src: PreparedKV | PeerKV) -> tuple[Any, int]:
        """Import ``src`` for ``req``: (what :meth:`add_request` returns, tokens of it this
        engine's own cache already held)."""
        bs = self.spec.block_size
        covered = src.num_tokens
        if covered > len(req.token_ids):
            raise KVFormatError(f"KV covers {covered} tokens, the request has {len(req.token_ids)}")
        want = [
            h.hex()
            for h in chain_hashes(req.token_ids[:covered], bs, req.cache_salt, include_partial=True)
        ]
        first = src.first_block
        if list(src.block_hashes) != want[first:] or first < 0:
            raise KVFormatError("KV does not belong to these tokens (chain hash mismatch)")
        usable = min(covered, len(req.token_ids) - 1)  # the last token is computed to sample
        n_blocks = -(-usable // bs)
        n_full = usable // bs
        names = chain_hashes(req.token_ids[: n_full * bs], bs, req.cache_salt)
        hits = self.blocks.match_prefix(names)
        if len(hits) < first:
            raise MissingPrefix(
                f"KV starts at block {first} but this engine holds only the first "
                f"{len(hits)} blocks of the prompt",
                len(hits),
            )
        fresh_needed = n_blocks - len(hits)
        # Cached hits that sit in the free queue stop being free once acquired.
        available = self.blocks.num_free - sum(1 for b in hits if self.blocks.ref_count(b) == 0)
        if fresh_needed > available:
            raise NoFreeBlocks(
                f"importing {n_blocks} blocks needs {fresh_needed} free, {available} available"
            )
        self.blocks.acquire(hits)
        fresh: list[int] = []
        done = None
        try:
            fresh = self.blocks.allocate(fresh_needed)
            start = len(hits) - first  # index in the source of the first block we lack
            if isinstance(src, PeerKV):
                pool = self._peer_pool(src.pool)
                done = self.cache.copy_from_peer(
                    pool, src.block_ids[start : start + len(fresh)], fresh
                )
            else:
                self.cache.write_staged(fresh, src.staged, start)
        except BaseException:
            self.blocks.release(hits + fresh)
            raise
        self.scheduler.admit_imported(req, hits + fresh, names, len(hits), usable)
        return done, len(hits) * bs

    def _peer_pool(self, handle: bytes) -> Any:
        pool = self._peer_pools.get(handle)
        if pool is None:
            pool = self._peer_pools[handle] = self.cache.open_peer(handle)
        return pool

    def warm_up(self, lengths: Sequence[int] = (1, 7, 16, 33, 130, 257, 1000, 4100)) -> float:
        """Run throwaway prompts of these lengths (together, then one at a time) so that the
        first real requests do not pay for kernel compilation and autotuning of new shapes;
        returns the seconds it took. Leaves no request behind; their blocks stay cached under a
        salt no client sends, evicted first as pages are needed."""
        import time

        t0 = time.perf_counter()
        limit = self.scheduler_config.max_model_len - 2
        vocab = self.model_config.vocab_size
        prompts = [
            [(i * 7919 + n) % (vocab - 3) + 3 for i in range(min(n, limit))] for n in lengths
        ]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        for batch in ([*enumerate(prompts)], *([(i, p)] for i, p in enumerate(prompts))):
            fitting = [
                (i, p)
                for i, p in batch
                if -(-len(p) // self.spec.block_size) + 1 < self.blocks.num_free
            ]
            for i, p in fitting:
                self.add_request(f"__warmup-{i}", p, params, cache_salt=b"__warmup")
            while self.group_has_unfinished():
                self.step()
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # served nobody
        return time.perf_counter() - t0

    # -- stepping -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule and launch one step; return the events of the step that finished.
        With EP, always one forward: an empty one when nothing is scheduled here."""
        if self.speculative is not None:
            return self._step_speculative(self.speculative)
        early: list[TokenEvent] = []
        plan = self.scheduler.schedule()
        if self._unqueried:
            self._count_prefix_lookups(plan)
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

    def _count_prefix_lookups(self, plan: StepPlan) -> None:
        """Requests admitted for the first time in ``plan`` had their prompt looked up in the
        prefix cache (:meth:`Scheduler._admit_prefix` set ``num_cached_tokens``)."""
        for seq in plan.seqs:
            if seq.request_id in self._unqueried:
                self._unqueried.discard(seq.request_id)
                req = self.scheduler.requests[seq.request_id]
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += req.num_cached_tokens

    def _constrained(self) -> bool:
        """Whether a running request has a constraint (its next mask needs its last token)."""
        g = self._grammar
        return g is not None and any(g.has(r.request_id) for r in self.scheduler.running)

    def _launch(self, plan: StepPlan, prev: Launched | None, early: list[TokenEvent]) -> Launched:
        """Queue ``plan``. With a constrained request running, its mask needs the token of the
        step in flight: once the forward is queued, that step is finished here (its events go
        to ``early``) and the masks filled, while the device computes; then the sampling."""
        sampling = [s for s in plan.seqs if s.sample]
        params, num_generated, histories = self._sampling_inputs(sampling)
        masks_fn = None
        g = self._grammar
        if g is not None and self._constrained():
            rids = [s.request_id for s in sampling]

            def masks_fn() -> tuple[list[int], torch.Tensor] | None:
                if self._inflight is not None:
                    early.extend(self._finish(self._inflight))
                    self._inflight = None
                return g.masks(rids)

        return self.runner.launch(plan, params, prev, num_generated, histories, masks_fn=masks_fn)

    def _sampling_inputs(
        self, sampling: Sequence[ScheduledSeq]
    ) -> tuple[list[SamplingParams], list[int] | None, list[tuple[int, list[int], int]] | None]:
        """For the sampler, per sampling seq: params; output tokens so far (when one sets
        min_tokens); (row, prompt + output tokens, prompt length) of those using penalties."""
        reqs = [(s, self.scheduler.requests[s.request_id]) for s in sampling]
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

    def _step_speculative(self, spec: SpecDecoder) -> list[TokenEvent]:
        """One synchronous step with speculative decoding (see libs/engine/speculative.py):
        verify the drafts chosen for this step beside the rest of the batch, commit, then let
        the MTP layer catch up and draft for the next step."""
        plan = self.scheduler.schedule()
        if self._unqueried:
            self._count_prefix_lookups(plan)
        if plan.empty:
            return []
        plan = spec.add_drafts(plan, self.scheduler, self._grammar)
        reqs = self.scheduler.requests
        lps: dict[str, list[TokenLogprob]] = {}

        def sample_plain(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> list[int]:
            params, num_generated, histories = self._sampling_inputs(seqs)
            runner = self.runner
            assert isinstance(runner, ModelRunner)
            history = runner._history(seqs, histories, None) if histories else None
            masks = None
            g = self._grammar
            if g is not None and any(g.has(s.request_id) for s in seqs):
                masks = g.masks([s.request_id for s in seqs])
            sampler = self.sampler
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
                lps.update({seqs[r].request_id: [lp] for r, lp in zip(rows.rows, unpacked)})
            tokens: list[int] = out.tolist()
            return tokens

        params = {s.request_id: reqs[s.request_id].params for s in plan.seqs}
        # The verified seqs' min_tokens counts and penalty histories, by the sampler's rules.
        verify = [s for s in plan.seqs if s.num_drafts]
        _, outputs, penalized = self._sampling_inputs(verify)
        generated = (
            {}
            if outputs is None
            else dict(zip([s.request_id for s in verify], outputs, strict=True))
        )
        histories = {verify[r].request_id: (toks, n) for r, toks, n in penalized or []}
        step = spec.run(plan, params, sample_plain, generated, histories, self._grammar)
        self.scheduler.advance(plan)
        events = self.scheduler.commit(plan, step.sampled, step.seconds)
        lps.update(step.logprobs)
        self.last_step_seconds = step.seconds
        self.last_step_tokens = self.last_finished_tokens = plan.num_tokens
        self.last_finished_seqs = len(plan.seqs)
        self.finished_steps += 1
        events = self._after_commit(events, lps)
        for i, ev in enumerate(events):
            if ev.finished:
                counts = spec.forget(ev.request_id)
                if counts is not None:
                    events[i] = dataclasses.replace(
                        ev, speculative=(counts.drafted, counts.verified, counts.accepted)
                    )
        spec.draft(plan, step, self.scheduler)
        return events

    def _finish(self, launched: Launched) -> list[TokenEvent]:
        sampled, seconds = self.runner.collect(launched)
        self.last_step_seconds = seconds
        self.last_finished_tokens = launched.plan.num_tokens  # the step those seconds timed
        self.last_finished_seqs = len(launched.plan.seqs)
        self.finished_steps += 1
        events = self.scheduler.commit(launched.plan, sampled, seconds)
        lps = self.runner.logprobs(launched) if launched.logprobs is not None else {}
        return self._after_commit(events, {rid: [lp] for rid, lp in lps.items()})

    def _after_commit(
        self, events: list[TokenEvent], lps: dict[str, list[TokenLogprob]]
    ) -> list[TokenEvent]:
        """Constraints advance over the committed tokens; logprobs join their events (a
        request's in the order of its events: a verified run gives several)."""
        for ev in events:
            if ev.finished:
                self.runner.forget(ev.request_id)
        g = self._grammar
        if g is not None:
            for ev in events:
                if ev.token_id is not None:
                    g.accept(ev.request_id, ev.token_id)
                if ev.finished:
                    g.drop(ev.request_id)
        if lps:
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


def _eplb_start(
    config: EngineConfig, loaded: LoadedModel | None, ranks: int, redundant: int
) -> Placement:
    """EPLB's starting placement: contiguous, with its spare slots per rank."""
    from .ep.placement import Placement
    from .loader import model_config

    cfg = loaded.model.cfg if loaded is not None else model_config(config.model)
    return Placement.contiguous(cfg.n_routed_experts, ranks, redundant)
