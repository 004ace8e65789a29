"""Runs scheduled steps on the device: input preparation, CUDA graphs, asynchronous launch.

:class:`ModelRunner` turns a :class:`StepPlan` into device tensors, runs the model and the
sampler, and starts copying the sampled ids back to pinned host memory; it returns a
:class:`Launched` step whose tokens :meth:`ModelRunner.collect` reads once the device is done.
Nothing here waits for the device except ``collect``, so the engine can schedule and prepare
step N+1 and process step N-1's tokens while step N runs.

Inputs that are not known on the host yet (a :data:`PLACEHOLDER` sampled by the step still in
flight) are gathered on the device from that step's sampled-id tensor.

Decode-only steps on CUDA replay CUDA graphs captured per padded batch size (a ladder up to
``max_graph_batch``); padding rows have context length 0 and write to the cache's scratch
slot, so they change nothing. A step that carries prompt chunks replays the same graphs when
all its tokens fit ``mixed_graph_rows`` (512): each prompt token is a decode row at its own
position, reading the context its chunk has written before it (a layer writes every row's
latents before its attention reads them), so the small chunks of steady arrivals do not pay
an eager forward's host work (~40 ms a step for v2-lite on an H100, against 9-16 ms for the
graph). Bigger chunks run eagerly: there the prompt's compute dominates. Other computations
over decode rows (speculative decoding's MTP passes) add their own graph sets
(:meth:`ModelRunner.add_graphs`, :meth:`ModelRunner.replay`).

An eager step's inputs are laid out by :mod:`.step_inputs`; the graph sets are managed by
:class:`~.graph_replay.GraphReplay` (a base of :class:`ModelRunner`), their buffers, staging
and capture are :mod:`.graphs`'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from .graph_replay import GraphReplay
from .graphs import (
    GRAPH_LADDER,
    GraphSet,
    StepGroup,
    graph_ladder,
    staged_rows,
    timing_event,
)
from .kv.cache import PagedKVCache
from .kv.pinned import to_device
from .model.attention import AttentionMetadata
from .model.model import DeepseekForCausalLM
from .sampler import LogprobRows, Sampler, TokenHistory
from .scheduler import PLACEHOLDER, ScheduledSeq, StepPlan
from .step_inputs import EagerInputs, fill_placeholders

# Importable from here as before: the ladder and the staged-input layout (scripts, tests).
__all__ = ["GRAPH_LADDER", "Launched", "ModelRunner", "graph_ladder", "staged_rows"]


@dataclass
class Launched:
    """A step handed to the device; ``collect`` turns it into sampled ids."""

    plan: StepPlan
    sampling: list[ScheduledSeq]
    tokens: torch.Tensor | None  # [n] int64 on the device
    host: torch.Tensor | None  # [n] int64, pinned on CUDA; valid once ``done`` has passed
    done: torch.cuda.Event | None
    started: torch.cuda.Event | None
    wall_s: float = 0.0
    index: dict[str, int] = field(default_factory=dict)  # request id -> row of ``tokens``
    # Rows that asked for logprobs (Sampler.last_logprobs) and host copies of its tensors,
    # valid once ``done`` has passed; read by :meth:`ModelRunner.logprobs`.
    logprobs: tuple[LogprobRows, torch.Tensor, torch.Tensor] | None = None


class ModelRunner(GraphReplay):
    """Launches steps on the device and reads them back; its CUDA graphs are
    :class:`~.graph_replay.GraphReplay`'s."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        cache: PagedKVCache,
        sampler: Sampler,
        use_kernels: bool,
        cuda_graphs: bool,
        max_model_len: int,
        max_graph_batch: int = 256,
        batch_invariant: bool = False,
        mixed_graph_rows: int = 512,
    ) -> None:
        self.model = model
        # Every row described by its own table and length (AttentionMetadata), one split.
        self.batch_invariant = batch_invariant
        self.cache = cache
        self.sampler = sampler
        self.device = cache.device
        self.block_size = cache.spec.block_size
        self.use_kernels = use_kernels
        # Whether the graph paths run (captured CUDA graphs; see emulate_graphs for the CPU).
        self.cuda_graphs = cuda_graphs and use_kernels and self.device.type == "cuda"
        self._emulated = False
        self._captured = False  # capture_all() has run: graph sets added later capture at once
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_graph_batch = max_graph_batch
        # Steps with prompt chunks of at most this many tokens in all replay the decode graphs
        # (0: only decode-only steps do).
        self.mixed_graph_rows = mixed_graph_rows
        self._pool: Any = None  # torch.cuda.graph_pool_handle(), shared by every graph
        self.num_heads = model.cfg.num_attention_heads
        self.graph_sets: dict[str, GraphSet] = {}
        self.inputs = EagerInputs(
            self.block_size, self.device, use_kernels, batch_invariant, self.num_heads
        )
        self.add_graphs("decode", self._decode_body, max(max_graph_batch, mixed_graph_rows))
        self.group: StepGroup | None = None  # an EP rank's group (set by the builder)
        self.group_rows = 0  # the rows the group agreed on for this step: the graph's least

    # -- public ------------------------------------------------------------------------------
    def launch(
        self,
        plan: StepPlan,
        params: Sequence[SamplingParams],
        prev: Launched | None,
        num_generated: Sequence[int] | None = None,
        histories: Sequence[tuple[int, list[int], int]] | None = None,
        *,
        masks_fn: Callable[[], tuple[list[int], torch.Tensor] | None] | None = None,
    ) -> Launched:
        """Queue the step on the device. ``masks_fn``: gives the constrained sampling rows and
        their token bitmask (:meth:`GrammarBackend.masks`), called once the forward
        is queued, so the host fills them while the device computes. ``params``: per sampling
        seq, in plan order;
        ``num_generated``: output tokens so far, per sampling seq (for min_tokens);
        ``histories``: (sampling row, prompt + output token ids so far, prompt length) of the
        seqs that use a penalty; a :data:`PLACEHOLDER` among them is read from ``prev``."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        started = timing_event() if cuda else None
        if started is not None:
            started.record(torch.cuda.current_stream(self.device))
        sampling = [s for s in plan.seqs if s.sample]
        logits = self._forward(plan, prev)
        masks = masks_fn() if masks_fn is not None else None
        tokens = host = done = None
        logprobs = None
        if sampling:
            history = self._history(sampling, histories, prev) if histories else None
            self.sampler.last_logprobs = None
            tokens = self.sampler.sample_device(
                logits,
                params,
                [s.sample_position for s in sampling],
                num_generated,
                history,
                masks=masks,
            )
            host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=cuda)
            host.copy_(tokens, non_blocking=cuda)
            lp = self.sampler.last_logprobs
            if lp is not None:
                vals = torch.empty(lp.values.shape, dtype=torch.float32, pin_memory=cuda)
                ids = torch.empty(lp.ids.shape, dtype=torch.int64, pin_memory=cuda)
                vals.copy_(lp.values, non_blocking=cuda)
                ids.copy_(lp.ids, non_blocking=cuda)
                logprobs = (lp, vals, ids)
        if cuda:
            done = timing_event()
            done.record(torch.cuda.current_stream(self.device))
        return Launched(
            plan,
            sampling,
            tokens,
            host,
            done,
            started,
            time.perf_counter() - t0,
            {s.request_id: i for i, s in enumerate(sampling)},
            logprobs,
        )

    @staticmethod
    def collect(launched: Launched) -> tuple[dict[str, int], float]:
        """Wait for the step; (sampled id per request, device seconds of the step)."""
        if launched.done is not None:
            launched.done.synchronize()
            assert launched.started is not None
            seconds = launched.started.elapsed_time(launched.done) / 1e3
        else:
            seconds = launched.wall_s
        if launched.host is None:
            return {}, seconds
        ids: list[int] = launched.host.tolist()
        return {s.request_id: t for s, t in zip(launched.sampling, ids)}, seconds

    @staticmethod
    def logprobs(launched: Launched) -> dict[str, TokenLogprob]:
        """After :meth:`collect`: the logprobs of the requests that asked, by request id."""
        if launched.logprobs is None:
            return {}
        rows, vals, ids = launched.logprobs
        out = rows.unpack(vals.tolist(), ids.tolist())
        return {launched.sampling[r].request_id: lp for r, lp in zip(rows.rows, out, strict=True)}

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request here: its KV lives in the paged cache."""

    def warm_kernels(self) -> None:
        """With the Triton kernels: the decode kernel once per split count an eager step can
        choose (:func:`~.kernels.mla_decode.warm`), over this cache, read only."""
        if not self.use_kernels:
            return
        from .kernels.mla_decode import warm

        layer = self.cache.layers[0]
        dtype = self.model.dtype  # the activations (q)
        warm(layer.latent, layer.rope, layer.scale, self.num_heads, self.block_size, dtype)

    def _history(
        self,
        sampling: list[ScheduledSeq],
        histories: Sequence[tuple[int, list[int], int]],
        prev: Launched | None,
    ) -> TokenHistory:
        rows = [h[0] for h in histories]
        history = TokenHistory.build(
            rows, [h[1] for h in histories], [h[2] for h in histories], self.device
        )
        # With overlap the step in flight has not sent its token back yet: read it there. Only
        # the newest token can be one (one step in flight), so the scan stays O(1) per row.
        fix_at: list[int] = []
        fix_src: list[int] = []
        width = history.tokens.shape[1]
        for j, (row, toks, _) in enumerate(histories):
            if toks and toks[-1] == PLACEHOLDER:
                assert prev is not None, "a placeholder token without the step that samples it"
                fix_at.append(j * width + len(toks) - 1)
                fix_src.append(prev.index[sampling[row].request_id])
        if fix_at:
            flat = history.tokens.view(-1)
            self._fill_placeholders(flat, fix_at, fix_src, prev)
        return history

    # -- forward -----------------------------------------------------------------------------
    def _forward(self, plan: StepPlan, prev: Launched | None) -> torch.Tensor:
        """fp32 logits of the sampling seqs, in plan order (EP: the group agrees on rows first)."""
        if self.group is None:
            return self._forward_rows(plan, prev)
        self.group_rows = self.group.begin_step(plan.num_tokens, self.graph_sets["decode"].ladder)
        logits = self._forward_rows(plan, prev)
        self.group.end_step()
        return logits

    def _forward_rows(self, plan: StepPlan, prev: Launched | None) -> torch.Tensor:
        if self._graphable(plan):
            return self._replay("decode", plan.seqs, prev)[1]
        mixed = self._mixed_rows(plan)
        if mixed is not None:
            rows, wanted = mixed
            every = self._replay("decode", rows, prev)[1]
            return every[self._to_device(np.asarray(wanted, dtype=np.int64))]
        ids, positions, meta, ordered, sample_rows = self.prepare(plan, prev)
        hidden = self.model(ids, positions, meta, self.cache.layers)
        row_of = dict(zip([s.request_id for s in ordered if s.sample], sample_rows))
        wanted = [row_of[s.request_id] for s in plan.seqs if s.sample]
        if not wanted:
            return hidden.new_empty(0, self.model.cfg.vocab_size, dtype=torch.float32)  # type: ignore[no-any-return]
        logits: torch.Tensor = self.model.logits(
            hidden[self._to_device(np.asarray(wanted, dtype=np.int64))]
        )
        return logits

    def prepare(
        self, plan: StepPlan, prev: Launched | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[ScheduledSeq], list[int]]:
        """Device inputs of an eager step: (ids, positions, metadata, seqs in row order,
        last row of each sampling seq in that order)."""
        seqs = list(plan.seqs)
        if self.use_kernels:
            # Prompt chunks first, decodes as the contiguous tail the decode kernel reads.
            seqs.sort(key=lambda s: s.num_tokens == 1)
        ids, positions, meta, sample_rows = self._prepare(seqs, prev)
        return ids, positions, meta, seqs, sample_rows

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        return to_device(arr, self.device)

    def _fill_placeholders(
        self, ids: torch.Tensor, rows: list[int], srcs: list[int], prev: Launched | None
    ) -> None:
        fill_placeholders(ids, rows, srcs, prev, self.device)

    def _prepare(
        self, seqs: list[ScheduledSeq], prev: Launched | None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(ids, positions, metadata, last row of each sampling seq) of ``seqs`` in this order
        (:meth:`EagerInputs.prepare`)."""
        return self.inputs.prepare(seqs, prev)

    def _decode_body(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, _: None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(ids, positions, meta, self.cache.layers)
        return hidden, self.model.logits(hidden)
