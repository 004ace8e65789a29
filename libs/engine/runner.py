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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from .kv.cache import PagedKVCache
from .model.attention import AttentionMetadata, SeqAttention
from .model.model import DeepseekForCausalLM
from .sampler import LogprobRows, Sampler, TokenHistory
from .scheduler import PLACEHOLDER, ScheduledSeq, StepPlan

log = logging.getLogger(__name__)

GRAPH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


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


def graph_ladder(max_rows: int) -> list[int]:
    """The padded row counts graphs are captured for: :data:`GRAPH_LADDER` below ``max_rows``
    and the first size that holds ``max_rows`` (past 512, steps of 128: speculative
    verification at batch 256 with K = 3 drafts is 1,024 rows)."""
    sizes = [*GRAPH_LADDER]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] + 128)
    return [b for b in sizes if b < max_rows] + [next(b for b in sizes if b >= max_rows)]


@dataclass
class _Graph:
    """One captured computation over a padded number of rows, and its static buffers.

    ``inputs`` (device; row graphs only) holds, per row, the token id, position, cache slot,
    context length and ``max_blocks`` block-table entries (int64); the graph reads views of
    it. The host fills one of two staging copies (pinned on CUDA) and sends it in one
    transfer. A set may replay several times in one step (the MTP layer: once per draft
    depth), so the copy being refilled may belong to a transfer still queued behind the
    device's work: ``sent`` holds each copy's last transfer (an event), waited on first.
    ``x_in``: a per-row input the caller copies in (the MTP layer's hidden states);
    ``outputs``: what the graph writes, overwritten by its next replay; ``run``: the closure
    the graph was captured from. A CUDA graph keeps no tensor alive: the closure holds the
    buffers only the graph uses (the int32 lengths and block table it converts ``inputs``
    into), and were it dropped their memory would go back to the allocator while every
    replay still writes it -- into whatever tensor was given that memory next.
    """

    graph: Any  # torch.cuda.CUDAGraph, or _EagerReplay under emulate_graphs()
    inputs: torch.Tensor | None
    staging: list[torch.Tensor]
    x_in: torch.Tensor | None
    outputs: tuple[torch.Tensor, ...]
    run: Callable[[], tuple[torch.Tensor, ...]]
    steps: int = 0
    sent: list[torch.cuda.Event | None] = field(default_factory=lambda: [None, None])


@dataclass
class _GraphSet:
    """A computation captured once per ladder size. A row graph's ``body`` takes (ids,
    positions, metadata, x_in) of decode rows; any other's takes (x_in,)."""

    body: Callable[..., tuple[torch.Tensor, ...]]
    ladder: list[int]
    rows: bool
    x_in: tuple[int, torch.dtype] | None
    optional: bool = False  # a capture that fails leaves the set eager instead of raising
    graphs: dict[int, _Graph] = field(default_factory=dict)  # by padded row count


class _EagerReplay:
    """A "graph" that runs its closure again on replay and copies what it returns into the
    tensors its first run returned: the static-buffer contract of a CUDA graph, on the CPU."""

    def __init__(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.run = run
        with torch.inference_mode():  # the model's outputs are inference tensors
            self.outputs = run()

    def replay(self) -> None:
        with torch.inference_mode():
            for out, new in zip(self.outputs, self.run(), strict=True):
                out.copy_(new)


def staged_rows(arr: np.ndarray, max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of a row graph's flat inputs (staging copy or read back): the [4, rows] columns
    (ids, positions, slots, lengths) and the [rows, max_blocks] block table."""
    bg = arr.shape[0] // (4 + max_blocks)
    return arr[: bg * 4].reshape(4, bg), arr[bg * 4 :].reshape(bg, max_blocks)


def _fill_page_tables(
    table: np.ndarray, seqs: Sequence[ScheduledSeq], pages: np.ndarray
) -> np.ndarray:
    """Row ``i`` of ``table`` gets the first ``pages[i]`` entries of ``seqs[i]``'s block table
    (entries past them are left as they are), with whole-array operations (a Python loop of
    per-row writes took twice as long for 1,024 rows); returns each row's last page."""
    flat = np.fromiter(
        chain.from_iterable(s.block_table[:k] for s, k in zip(seqs, pages.tolist(), strict=True)),
        np.int64,
        int(pages.sum()),
    )
    ends = np.cumsum(pages)
    rows = np.repeat(np.arange(len(seqs)), pages)
    table[rows, np.arange(len(flat)) - np.repeat(ends - pages, pages)] = flat
    last: np.ndarray = flat[ends - 1]
    return last


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class ModelRunner:
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
        self.graph_sets: dict[str, _GraphSet] = {}
        self.add_graphs("decode", self._decode_body, max(max_graph_batch, mixed_graph_rows))

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
        started = _timing_event() if cuda else None
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
            done = _timing_event()
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
        """fp32 logits of the sampling seqs, in plan order."""
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
        t = torch.from_numpy(arr)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _fill_placeholders(
        self, ids: torch.Tensor, rows: list[int], srcs: list[int], prev: Launched | None
    ) -> None:
        if not rows:
            return
        if prev is None or prev.tokens is None:
            raise RuntimeError("a placeholder token without the step that samples it")
        # Pinned + non_blocking: a plain .to() would wait for the step in flight.
        dst = self._to_device(np.asarray(rows, dtype=np.int64))
        src = self._to_device(np.asarray(srcs, dtype=np.int64))
        ids.index_copy_(0, dst, prev.tokens.index_select(0, src))

    def _prepare(
        self, seqs: list[ScheduledSeq], prev: Launched | None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs, dev = self.block_size, self.device
        n = sum(s.num_tokens for s in seqs)
        ids = np.empty(n, dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.int64)
        fix_rows: list[int] = []
        fix_srcs: list[int] = []
        sample_rows: list[int] = []
        prompt_seqs: list[tuple[int, ScheduledSeq]] = []
        decodes: list[ScheduledSeq] = []
        decode_rows: list[int] = []
        row = 0
        for s in seqs:
            k = s.num_tokens
            ids[row : row + k] = s.token_ids
            p = np.arange(s.start, s.start + k)
            pos[row : row + k] = p
            table = np.asarray(s.block_table, dtype=np.int64)
            slots[row : row + k] = table[p // bs] * bs + p % bs
            if s.token_ids[0] == PLACEHOLDER:
                assert k == 1 and prev is not None, "placeholders are single decode tokens"
                fix_rows.append(row)
                fix_srcs.append(prev.index[s.request_id])
            if k == 1:
                decodes.append(s)
                decode_rows.append(row)
            else:
                prompt_seqs.append((row, s))
            row += k
            if s.sample:
                sample_rows.append(row - 1)
        ids_d = self._to_device(ids)
        self._fill_placeholders(ids_d, fix_rows, fix_srcs, prev)
        meta = AttentionMetadata(self._to_device(slots), [], block_size=bs)
        if self.batch_invariant:
            self._describe_rows(meta, seqs, pos + 1)
            return ids_d, self._to_device(pos), meta, sample_rows
        for r0, s in prompt_seqs:
            ctx = s.start + s.num_tokens
            meta.seqs.append(
                SeqAttention(
                    r0,
                    s.num_tokens,
                    self._ctx_slots(s.block_table, ctx),
                    self._to_device(np.arange(s.start, ctx, dtype=np.int64)),
                )
            )
        if decodes:
            lens = np.array([s.start + 1 for s in decodes], dtype=np.int32)
            if self.use_kernels:
                from .kernels.mla_decode import choose_num_splits

                pages = -(-lens.astype(np.int64) // bs)
                table = np.zeros((len(decodes), int(pages.max())), dtype=np.int32)
                _fill_page_tables(table, decodes, pages)
                meta.decode_start = n - len(decodes)
                meta.block_table = self._to_device(table)
                meta.seq_lens = self._to_device(lens)
                meta.num_splits = choose_num_splits(len(decodes), self.num_heads, int(lens.max()))
            else:
                width = int(lens.max())
                padded = torch.zeros(len(decodes), width, dtype=torch.int64)
                for i, s in enumerate(decodes):
                    padded[i, : lens[i]] = self._ctx_slots(s.block_table, int(lens[i]), "cpu")
                meta.decode_rows = torch.tensor(decode_rows, dtype=torch.int64, device=dev)
                meta.decode_slots = padded.to(dev)
                meta.decode_mask = (
                    torch.arange(width)[None, :] < torch.from_numpy(lens)[:, None]
                ).to(dev)
        return ids_d, self._to_device(pos), meta, sample_rows

    def _describe_rows(
        self, meta: AttentionMetadata, seqs: list[ScheduledSeq], lens: np.ndarray
    ) -> None:
        """Batch-invariant steps: every row, prompt or decode, as a decode row of the kernel's
        layout (its sequence's block table, context length ``position + 1``), one split."""
        bs = self.block_size
        width = int(-(-int(lens.max()) // bs))
        table = np.zeros((len(lens), width), dtype=np.int32)
        row = 0
        for s in seqs:
            nb = min(width, len(s.block_table))
            table[row : row + s.num_tokens, :nb] = np.asarray(s.block_table[:nb], dtype=np.int32)
            row += s.num_tokens
        meta.decode_start = 0
        meta.block_table = self._to_device(table)
        meta.seq_lens = self._to_device(lens.astype(np.int32))
        meta.num_splits = 1

    def _ctx_slots(
        self, table: tuple[int, ...], n: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        bs = self.block_size
        nb = -(-n // bs)
        t = np.asarray(table[:nb], dtype=np.int64)
        slots = (t[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)[:n]
        if device is not None and torch.device(device).type == "cpu":
            return torch.from_numpy(slots)
        return self._to_device(slots)

    # -- CUDA graphs -------------------------------------------------------------------------
    def add_graphs(
        self,
        name: str,
        body: Callable[..., tuple[torch.Tensor, ...]],
        max_rows: int,
        *,
        rows: bool = True,
        x_in: tuple[int, torch.dtype] | None = None,
        optional: bool = False,
    ) -> None:
        """Graphs of ``body`` for 1 to ``max_rows`` rows (a ladder), replayed by
        :meth:`replay`. Captured by :meth:`capture_all`, or at once if that has run.
        ``rows``: ``body(ids, positions, meta, x_in)`` over single-token decode rows, else
        ``body(x_in)``; ``x_in``: (width, dtype) of a per-row input the caller copies in;
        ``optional``: if a capture fails, log it and leave the computation eager (replay gives
        None) rather than fail the engine's start."""
        gs = _GraphSet(body, graph_ladder(max_rows), rows, x_in, optional)
        self.graph_sets[name] = gs
        if self.cuda_graphs and self._captured:
            self._capture_set(gs)

    def capture_all(self) -> None:
        """Capture every graph of every ladder now, so no request waits for a capture."""
        self._captured = True
        if self.cuda_graphs:
            for gs in self.graph_sets.values():
                self._capture_set(gs)

    def time_decode_graphs(self, replays: int = 3) -> dict[int, float] | None:
        """Seconds of one replay of each captured decode graph, by its rows, measured now on
        the device (None without captured CUDA graphs). The rows are padding rows (length 0,
        the scratch slot) with random token ids, so the experts are routed to as by a real
        batch; the attention over context is not in these times (the cost model adds it)."""
        gs = self.graph_sets.get("decode")
        if not self.cuda_graphs or self._emulated or gs is None or not gs.graphs:
            return None
        g0 = torch.Generator(device=self.device)
        g0.manual_seed(0)
        vocab = self.model.cfg.vocab_size
        out: dict[int, float] = {}
        for bg, g in sorted(gs.graphs.items()):
            assert g.inputs is not None
            ids = torch.randint(3, vocab, (bg,), generator=g0, device=self.device)
            g.inputs[:bg].copy_(ids)
            g.graph.replay()  # warm
            start, end = _timing_event(), _timing_event()
            start.record(torch.cuda.current_stream(self.device))
            for _ in range(replays):
                g.graph.replay()
            end.record(torch.cuda.current_stream(self.device))
            end.synchronize()
            out[bg] = start.elapsed_time(end) / 1e3 / replays
        return out

    def emulate_graphs(self, mixed_rows: int = 0) -> None:
        """For tests on the CPU: the graph paths on, each graph a closure that a replay runs
        eagerly over the same static buffers (inputs staged, padding rows, outputs read back
        from the captured tensors), so everything around the capture itself is exercised.
        ``mixed_rows``: steps with prompt chunks of up to that many tokens replay the decode
        graphs too (0: only decode-only steps; each emulated graph is a Triton-interpreted
        forward, so tests keep the ladder short)."""
        if not self.use_kernels:
            raise ValueError("graphs run the kernel path (kernels='triton')")
        self.cuda_graphs = self._emulated = True
        self.mixed_graph_rows = mixed_rows
        decode = self.graph_sets["decode"]
        decode.ladder = graph_ladder(max(self.max_graph_batch, mixed_rows))
        self.capture_all()

    def _capture_set(self, gs: _GraphSet) -> None:
        try:
            for bg in reversed(gs.ladder):  # largest first: smaller graphs reuse its pool
                gs.graphs[bg] = self._capture(gs, bg)
        except Exception:
            if not gs.optional:
                raise
            name = next(k for k, v in self.graph_sets.items() if v is gs)
            log.exception("runner: capturing the %r graphs failed; they run eagerly", name)
            gs.graphs.clear()

    def _graph_splits(self, bg: int) -> int:
        from .kernels.mla_decode import choose_num_splits

        if self.batch_invariant:
            return 1
        # Fixed per batch size: sized for the longest context; shorter ones leave splits empty.
        return choose_num_splits(bg, self.num_heads, self.max_blocks * self.block_size)

    def _graphable(self, plan: StepPlan) -> bool:
        """Whether a captured graph runs ``plan``: one sampled token per seq, few enough."""
        return (
            self.cuda_graphs
            and len(plan.seqs) <= self.graph_sets["decode"].ladder[-1]
            and all(s.num_tokens == 1 and s.sample for s in plan.seqs)
        )

    def _mixed_rows(self, plan: StepPlan) -> tuple[list[ScheduledSeq], list[int]] | None:
        """A step with prompt chunks as decode rows for the decode graphs: (rows, the row of
        each sampling seq in plan order), or None when it does not fit them. A chunk of k
        tokens from position p becomes k rows at p .. p+k-1 with lengths p+1 .. p+k."""
        if not self.cuda_graphs or self.batch_invariant or not self.mixed_graph_rows:
            return None
        if not plan.seqs or plan.num_tokens > min(
            self.mixed_graph_rows, self.graph_sets["decode"].ladder[-1]
        ):
            return None
        if any(s.num_drafts for s in plan.seqs):
            return None
        rows: list[ScheduledSeq] = []
        wanted: list[int] = []
        for s in plan.seqs:
            if s.num_tokens == 1:
                rows.append(s)
            else:
                rows.extend(
                    ScheduledSeq(s.request_id, s.start + i, 1, (t,), s.block_table, False, 0)
                    for i, t in enumerate(s.token_ids)
                )
            if s.sample:
                wanted.append(len(rows) - 1)
        return rows, wanted

    def decode_rows(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden states, fp32 logits) of every row of ``plan``, in plan order, from a captured
        graph; None when no graph runs it (then the caller runs it eagerly). Valid until the
        next replay. Speculative decoding verifies its drafts this way: each draft is a decode
        row at its own position."""
        if not self._graphable(plan):
            return None
        hidden, logits = self._replay("decode", plan.seqs, None)
        return hidden, logits

    def replay(
        self,
        name: str,
        seqs: Sequence[ScheduledSeq] | int,
        *,
        x: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...] | None:
        """The outputs of graph set ``name`` over ``seqs`` (decode rows; a row count for a
        set without rows), one per row, valid until its next replay; None when no graph runs
        them (graphs off, too many rows, a row of more than one token): run them eagerly.
        ``x``: the rows' ``x_in``; ``ids``: token ids on the device, replacing the seqs'."""
        n = seqs if isinstance(seqs, int) else len(seqs)
        gs = self.graph_sets[name]
        if not self.cuda_graphs or not gs.graphs or not 0 < n <= gs.ladder[-1]:
            return None
        if not isinstance(seqs, int) and any(s.num_tokens != 1 for s in seqs):
            return None
        return self._replay(name, seqs, None, x=x, ids=ids)

    def _replay(
        self,
        name: str,
        seqs: Sequence[ScheduledSeq] | int,
        prev: Launched | None,
        *,
        x: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Replay the smallest graph of set ``name`` that holds the rows; its outputs' rows."""
        gs = self.graph_sets[name]
        n = seqs if isinstance(seqs, int) else len(seqs)
        g = gs.graphs[next(b for b in gs.ladder if b >= n)]  # every size is captured
        if not isinstance(seqs, int):
            self._stage(g, seqs, prev)
        if ids is not None:
            assert g.inputs is not None
            g.inputs[:n].copy_(ids)
        if x is not None:
            assert g.x_in is not None
            g.x_in[:n].copy_(x)
        g.graph.replay()
        g.steps += 1
        return tuple(o[:n] for o in g.outputs)

    def _stage(self, g: _Graph, seqs: Sequence[ScheduledSeq], prev: Launched | None) -> None:
        """Send the decode rows' ids, positions, slots, lengths and tables to ``g.inputs``;
        padding rows: length 0, the cache's scratch slot. A row's table entries past its own
        pages keep stale values: the kernel reads only the pages its length covers."""
        assert g.inputs is not None
        bs = self.block_size
        n = len(seqs)
        copy = g.steps % 2
        if (sent := g.sent[copy]) is not None:
            sent.synchronize()  # its last transfer has read it
        host = g.staging[copy]
        cols, table = staged_rows(host.numpy(), self.max_blocks)
        cols[:, n:] = 0
        cols[2, n:] = self.cache.scratch_slot
        starts = np.fromiter((s.start for s in seqs), np.int64, n)
        ids = np.fromiter((s.token_ids[0] for s in seqs), np.int64, n)
        last_page = _fill_page_tables(table, seqs, starts // bs + 1)
        cols[0, :n] = ids
        cols[1, :n] = starts
        cols[2, :n] = last_page * bs + starts % bs  # the last page read holds the row
        cols[3, :n] = starts + 1
        g.inputs.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(torch.cuda.current_stream(self.device))  # where the copy went
            g.sent[copy] = done
        fix = np.flatnonzero(ids == PLACEHOLDER).tolist()
        if fix:
            assert prev is not None
            srcs = [prev.index[seqs[i].request_id] for i in fix]
            self._fill_placeholders(g.inputs[: cols.shape[1]], fix, srcs, prev)

    def _decode_body(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, _: None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(ids, positions, meta, self.cache.layers)
        return hidden, self.model.logits(hidden)

    def _capture(self, gs: _GraphSet, bg: int) -> _Graph:
        dev = self.device
        x_in = None
        if gs.x_in is not None:
            x_in = torch.zeros(bg, gs.x_in[0], dtype=gs.x_in[1], device=dev)
        if not gs.rows:

            def run_x() -> tuple[torch.Tensor, ...]:
                return gs.body(x_in)

            graph, outputs = self._record(run_x)
            return _Graph(graph, None, [], x_in, outputs, run_x)
        mb = self.max_blocks
        inputs = torch.zeros(bg * (4 + mb), dtype=torch.int64, device=dev)
        inputs[2 * bg : 3 * bg] = self.cache.scratch_slot
        pin = dev.type == "cuda"
        staging = [torch.zeros(inputs.shape, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        ids, positions, slots = inputs[:bg], inputs[bg : 2 * bg], inputs[2 * bg : 3 * bg]
        seq_lens32 = torch.zeros(bg, dtype=torch.int32, device=dev)
        table32 = torch.zeros(bg, mb, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slots,
            [],
            decode_start=0,
            block_table=table32,
            seq_lens=seq_lens32,
            block_size=self.block_size,
            num_splits=self._graph_splits(bg),
        )

        def run() -> tuple[torch.Tensor, ...]:
            # The kernel takes int32 lengths and tables: converted inside the graph.
            seq_lens32.copy_(inputs[3 * bg : 4 * bg])
            table32.copy_(inputs[4 * bg :].view(bg, mb))
            return gs.body(ids, positions, meta, x_in)

        graph, outputs = self._record(run)
        return _Graph(graph, inputs, staging, x_in, outputs, run)

    def _record(
        self, run: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """Capture ``run`` (a CUDA graph; an _EagerReplay when emulated): (graph, outputs)."""
        if self._emulated:
            eager = _EagerReplay(run)
            return eager, eager.outputs
        dev = self.device
        # Warm up on a side stream (compiles Triton kernels, sets up cuBLAS) before capturing.
        side = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = run()
        return graph, outputs
