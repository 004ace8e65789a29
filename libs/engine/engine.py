"""The engine: model + paged KV cache + scheduler + sampler behind add/step/abort/export/import.

Single-threaded: the service wrapping it owns the loop and the I/O. Each :meth:`Engine.step`
schedules one batch (prompt chunks and decodes together), launches it and returns token
events. With ``overlap`` (on by default on CUDA) a step returns the events of the step
launched by the previous call: while the device runs step N the host schedules and prepares
step N+1 and turns step N-1's tokens into events, so the device never waits for Python.
Requests that stop on a token are then known one step late and that step's extra token is
dropped; the token stream is the same as without overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libs.common.errors import InvalidArgument
from libs.common.hashchain import chain_hashes
from libs.common.sampling import SamplingParams

from .kv.block_manager import BlockManager, NoFreeBlocks
from .kv.cache import TORCH_DTYPES
from .kv.transfer import KVFormatError, KVHeader, check_compatible, decode_frame, encode_frame
from .loader import LoadedModel
from .model.model import DeepseekForCausalLM
from .parts import EngineParts, build_parts, max_model_len
from .runner import Launched, ModelRunner
from .sampler import Sampler
from .scheduler import Request, Scheduler, SchedulerConfig, Status, TokenEvent

log = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "KVFormatError",
    "NoFreeBlocks",
    "TokenEvent",
]


class InvalidRequest(InvalidArgument):
    """A request the engine refuses as given (recoverable by fixing the request)."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # preset name or checkpoint directory
    device: str = "cpu"
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    seed: int = 0  # preset weights
    block_size: int = 128
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    kv_cache_dtype: str | None = None  # None: the model dtype
    max_tokens_per_step: int = 32768
    time_budget_s: float | None = 1.0
    max_running: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    sampler_seed: int | None = None
    absorb_decode: bool = True
    with_mtp: bool = False
    kernels: str = (
        "auto"  # "triton" (fused attention, Triton decode + MoE), "torch", auto: triton on CUDA
    )
    expert_dtype: str = (
        "auto"  # "fp4": routed experts quantized to e2m1 (converts the loaded model)
    )
    cuda_graphs: bool = True  # decode-only steps replay captured graphs (CUDA with kernels)
    overlap: bool | None = None  # None: on for CUDA

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.kv_cache_dtype == "fp8":
            object.__setattr__(self, "kv_cache_dtype", "float8_e4m3fn")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in TORCH_DTYPES:
            raise ValueError(f"kv_cache_dtype must be fp8 or one of {sorted(TORCH_DTYPES)}")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be auto, triton or torch, got {self.kernels!r}")
        if self.expert_dtype not in ("auto", "fp4"):
            raise ValueError(f"expert_dtype must be auto or fp4, got {self.expert_dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")

    @property
    def use_kernels(self) -> bool:
        return self.kernels == "triton" or (
            self.kernels == "auto" and self.device.startswith("cuda")
        )

    @property
    def use_overlap(self) -> bool:
        return self.overlap if self.overlap is not None else self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return TORCH_DTYPES[self.dtype]


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
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        *,
        parts: EngineParts | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        parts = parts or build_parts(config, loaded)
        self.parts = parts
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
        self.last_step_seconds = 0.0
        self.last_step_tokens = 0

    # -- the model behind a real runner (a fake one has none: AttributeError) ------------------
    @property
    def loaded(self) -> LoadedModel:
        if self.parts.loaded is None:
            raise AttributeError(f"engine {self.model_id!r} runs no model")
        return self.parts.loaded

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
        kv: bytes | Sequence[bytes] | None = None,
        hold_kv: bool = False,
    ) -> None:
        """Queue a request. ``kv``: frames from :meth:`export_kv` covering a prefix of the tokens.

        Raises :class:`InvalidRequest` for bad input, :class:`KVFormatError` for KV that does
        not belong to this model or these tokens, :class:`NoFreeBlocks` if imported KV does
        not fit now.
        """
        params = params or SamplingParams()
        tokens = [int(t) for t in prompt_token_ids]
        self._validate(request_id, tokens, params)
        req = Request(request_id, tokens, len(tokens), params, cache_salt, hold_kv)
        if kv is not None:
            self._import(req, [kv] if isinstance(kv, (bytes, bytearray, memoryview)) else list(kv))
        try:
            self.scheduler.add(req)
        except ValueError as exc:
            self.blocks.release(req.blocks)
            raise InvalidRequest(str(exc)) from None

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
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished request kept with ``hold_kv``."""
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
        self, request_id: str, *, include_partial: bool = False, release: bool = False
    ) -> bytes:
        """One frame with the request's computed KV: its full blocks, plus the tail if asked."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} (finished requests need hold_kv=True)")
        bs = self.spec.block_size
        covered = req.num_computed if include_partial else (req.num_computed // bs) * bs
        hashes = chain_hashes(req.token_ids[:covered], bs, req.cache_salt, include_partial=True)
        blocks = req.blocks[: len(hashes)]
        header = KVHeader(
            self.model_id,
            self.spec.layout_hash(),
            bs,
            self.spec.dtype,
            self.spec.bytes_per_block,
            covered,
            0,
            tuple(h.hex() for h in hashes),
        )
        frame = encode_frame(header, self.cache.read_blocks(blocks))
        if release:
            self.release(request_id)
        return frame

    def export_blocks(
        self, request_id: str, start_block: int = 0
    ) -> list[tuple[bytes, bytes, bytes]]:
        """The request's full blocks from ``start_block`` on, one single-block frame each.

        Returns (chain digest, parent digest or b"", frame) per block: the kvstore's unit.
        Frames for blocks ``0..k`` passed together to :meth:`add_request` import as one prefix.
        """
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} (finished requests need hold_kv=True)")
        bs = self.spec.block_size
        hashes = req.full_block_hashes(bs, req.num_computed)
        out = []
        for i in range(start_block, len(hashes)):
            header = KVHeader(
                self.model_id,
                self.spec.layout_hash(),
                bs,
                self.spec.dtype,
                self.spec.bytes_per_block,
                (i + 1) * bs,
                i,
                (hashes[i].hex(),),
            )
            frame = encode_frame(header, self.cache.read_blocks([req.blocks[i]]))
            out.append((hashes[i], hashes[i - 1] if i else b"", frame))
        return out

    def _import(self, req: Request, frames: list[bytes | bytearray | memoryview]) -> None:
        bs = self.spec.block_size
        headers: list[KVHeader] = []
        payloads: list[memoryview] = []
        for data in frames:
            header, payload = decode_frame(bytes(data) if isinstance(data, bytearray) else data)
            check_compatible(header, self.spec)
            expected_first = sum(h.num_blocks for h in headers)
            if header.first_block != expected_first:
                raise KVFormatError(
                    f"KV frames are not contiguous: block {header.first_block} "
                    f"follows {expected_first} blocks"
                )
            headers.append(header)
            payloads.append(payload)
        covered = headers[-1].num_tokens if headers else 0
        if covered > len(req.token_ids):
            raise KVFormatError(f"KV covers {covered} tokens, the request has {len(req.token_ids)}")
        given = [h for header in headers for h in header.block_hashes]
        want = [
            h.hex()
            for h in chain_hashes(req.token_ids[:covered], bs, req.cache_salt, include_partial=True)
        ]
        if given != want:
            raise KVFormatError("KV does not belong to these tokens (chain hash mismatch)")
        usable = min(covered, len(req.token_ids) - 1)  # the last token is computed to sample
        n_blocks = -(-usable // bs)
        n_full = usable // bs
        names = chain_hashes(req.token_ids[: n_full * bs], bs, req.cache_salt)
        hits = self.blocks.match_prefix(names)
        fresh_needed = n_blocks - len(hits)
        # Cached hits that sit in the free queue stop being free once acquired.
        available = self.blocks.num_free - sum(1 for b in hits if self.blocks.ref_count(b) == 0)
        if fresh_needed > available:
            raise NoFreeBlocks(
                f"importing {n_blocks} blocks needs {fresh_needed} free, {available} available"
            )
        self.blocks.acquire(hits)
        fresh: list[int] = []
        try:
            fresh = self.blocks.allocate(fresh_needed)
            joined = b"".join(bytes(p) for p in payloads)
            bpb = self.spec.bytes_per_block
            self.cache.write_blocks(fresh, joined[len(hits) * bpb : n_blocks * bpb])
        except BaseException:
            self.blocks.release(hits + fresh)
            raise
        self.scheduler.admit_imported(req, hits + fresh, names, len(hits), usable)

    # -- stepping -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule and launch one step; return the events of the step that finished."""
        plan = self.scheduler.schedule()
        launched = None
        if not plan.empty:
            params = [self.scheduler.requests[s.request_id].params for s in plan.seqs if s.sample]
            launched = self.runner.launch(plan, params, self._inflight)
        events = self._finish(self._inflight) if self._inflight is not None else []
        if launched is not None:
            self.scheduler.advance(plan)
            self.last_step_tokens = plan.num_tokens
            if self.config.use_overlap:
                self._inflight = launched
                return events
            events += self._finish(launched)
        self._inflight = None
        return events

    def _finish(self, launched: Launched) -> list[TokenEvent]:
        sampled, seconds = self.runner.collect(launched)
        self.last_step_seconds = seconds
        return self.scheduler.commit(launched.plan, sampled, seconds)
