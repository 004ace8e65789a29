"""CUDA graphs of computations over decode rows: what is captured, staged and replayed.

A :class:`GraphSet` is one computation captured once per padded row count of a ladder
(:func:`graph_ladder`); each :class:`Graph` holds its static buffers. A row graph reads one
flat int64 input per replay -- per row the token id, position, cache slot, context length and
``max_blocks`` block-table entries -- that :func:`stage` fills on the host and sends in one
transfer; padding rows have length 0 and write the cache's scratch slot, so they change
nothing. :class:`~libs.engine.graph_replay.GraphReplay` owns the sets, records and replays them;
:class:`EagerReplay` stands in for a CUDA graph on the CPU (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from .model.attention import AttentionMetadata
from .scheduler import PLACEHOLDER, ScheduledSeq, StepPlan
from .step_inputs import InFlight, fill_page_tables, fill_placeholders

GRAPH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class StepGroup(Protocol):
    """The ranks a step runs with (an expert-parallel group, :mod:`libs.engine.ep.runtime`):
    before each forward they agree on its rows -- every rank replays the decode graph of that
    size, or runs eagerly with the same exchange buffers -- and forget them once it is queued."""

    def begin_step(self, tokens: int, ladder: Sequence[int]) -> int: ...

    def end_step(self) -> None: ...


def graph_ladder(max_rows: int) -> list[int]:
    """The padded row counts graphs are captured for: :data:`GRAPH_LADDER` below ``max_rows``
    and the first size that holds ``max_rows`` (past 512, steps of 128: speculative
    verification at batch 256 with K = 3 drafts is 1,024 rows)."""
    sizes = [*GRAPH_LADDER]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] + 128)
    return [b for b in sizes if b < max_rows] + [next(b for b in sizes if b >= max_rows)]


@dataclass
class Graph:
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

    graph: Any  # torch.cuda.CUDAGraph, or EagerReplay under emulate_graphs()
    inputs: torch.Tensor | None
    staging: list[torch.Tensor]
    x_in: torch.Tensor | None
    outputs: tuple[torch.Tensor, ...]
    run: Callable[[], tuple[torch.Tensor, ...]]
    steps: int = 0
    sent: list[torch.cuda.Event | None] = field(default_factory=lambda: [None, None])


@dataclass
class GraphSet:
    """A computation captured once per ladder size. A row graph's ``body`` takes (ids,
    positions, metadata, x_in) of decode rows; any other's takes (x_in,)."""

    body: Callable[..., tuple[torch.Tensor, ...]]
    ladder: list[int]
    rows: bool
    x_in: tuple[int, torch.dtype] | None
    optional: bool = False  # a capture that fails leaves the set eager instead of raising
    graphs: dict[int, Graph] = field(default_factory=dict)  # by padded row count


class EagerReplay:
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


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def staged_rows(arr: np.ndarray, max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of a row graph's flat inputs (staging copy or read back): the [4, rows] columns
    (ids, positions, slots, lengths) and the [rows, max_blocks] block table."""
    bg = arr.shape[0] // (4 + max_blocks)
    return arr[: bg * 4].reshape(4, bg), arr[bg * 4 :].reshape(bg, max_blocks)


def stage(
    g: Graph,
    seqs: Sequence[ScheduledSeq],
    prev: InFlight | None,
    *,
    block_size: int,
    max_blocks: int,
    scratch_slot: int,
    device: torch.device,
) -> None:
    """Send the decode rows' ids, positions, slots, lengths and tables to ``g.inputs``;
    padding rows: length 0, the cache's scratch slot. A row's table entries past its own
    pages keep stale values: the kernel reads only the pages its length covers."""
    assert g.inputs is not None
    bs = block_size
    n = len(seqs)
    copy = g.steps % 2
    if (sent := g.sent[copy]) is not None:
        sent.synchronize()  # its last transfer has read it
    host = g.staging[copy]
    cols, table = staged_rows(host.numpy(), max_blocks)
    cols[:, n:] = 0
    cols[2, n:] = scratch_slot
    starts = np.fromiter((s.start for s in seqs), np.int64, n)
    ids = np.fromiter((s.token_ids[0] for s in seqs), np.int64, n)
    last_page = fill_page_tables(table, seqs, starts // bs + 1)
    cols[0, :n] = ids
    cols[1, :n] = starts
    cols[2, :n] = last_page * bs + starts % bs  # the last page read holds the row
    cols[3, :n] = starts + 1
    g.inputs.copy_(host, non_blocking=True)
    if device.type == "cuda":
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(device))  # where the copy went
        g.sent[copy] = done
    fix = np.flatnonzero(ids == PLACEHOLDER).tolist()
    if fix:
        assert prev is not None
        srcs = [prev.index[seqs[i].request_id] for i in fix]
        fill_placeholders(g.inputs[: cols.shape[1]], fix, srcs, prev, device)


Record = Callable[[Callable[[], tuple[torch.Tensor, ...]]], tuple[Any, tuple[torch.Tensor, ...]]]


def capture(
    gs: GraphSet,
    bg: int,
    record: Record,
    *,
    device: torch.device,
    max_blocks: int,
    block_size: int,
    scratch_slot: int,
    num_splits: int,
) -> Graph:
    """``gs``'s graph for ``bg`` rows, with its buffers, captured by ``record`` (the runner's:
    a CUDA graph, or an :class:`EagerReplay` when emulated)."""
    x_in = None
    if gs.x_in is not None:
        x_in = torch.zeros(bg, gs.x_in[0], dtype=gs.x_in[1], device=device)
    if not gs.rows:

        def run_x() -> tuple[torch.Tensor, ...]:
            return gs.body(x_in)

        graph, outputs = record(run_x)
        return Graph(graph, None, [], x_in, outputs, run_x)
    mb = max_blocks
    inputs = torch.zeros(bg * (4 + mb), dtype=torch.int64, device=device)
    inputs[2 * bg : 3 * bg] = scratch_slot
    pin = device.type == "cuda"
    staging = [torch.zeros(inputs.shape, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
    ids, positions, slots = inputs[:bg], inputs[bg : 2 * bg], inputs[2 * bg : 3 * bg]
    seq_lens32 = torch.zeros(bg, dtype=torch.int32, device=device)
    table32 = torch.zeros(bg, mb, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slots,
        [],
        decode_start=0,
        block_table=table32,
        seq_lens=seq_lens32,
        block_size=block_size,
        num_splits=num_splits,
    )

    def run() -> tuple[torch.Tensor, ...]:
        # The kernel takes int32 lengths and tables: converted inside the graph.
        seq_lens32.copy_(inputs[3 * bg : 4 * bg])
        table32.copy_(inputs[4 * bg :].view(bg, mb))
        return gs.body(ids, positions, meta, x_in)

    graph, outputs = record(run)
    return Graph(graph, inputs, staging, x_in, outputs, run)


def mixed_rows(plan: StepPlan, limit: int) -> tuple[list[ScheduledSeq], list[int]] | None:
    """A step with prompt chunks as decode rows for the decode graphs: (rows, the row of
    each sampling seq in plan order), or None when its tokens exceed ``limit``. A chunk of k
    tokens from position p becomes k rows at p .. p+k-1 with lengths p+1 .. p+k."""
    if not plan.seqs or plan.num_tokens > limit:
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


def time_graphs(
    gs: GraphSet, device: torch.device, vocab_size: int, replays: int
) -> dict[int, float]:
    """Seconds of one replay of each captured graph of the row set ``gs``, by its rows: padding
    rows (length 0, the scratch slot) with random token ids, so the experts are routed to as
    by a real batch; the attention over context is not in these times."""
    g0 = torch.Generator(device=device)
    g0.manual_seed(0)
    out: dict[int, float] = {}
    for bg, g in sorted(gs.graphs.items()):
        assert g.inputs is not None
        ids = torch.randint(3, vocab_size, (bg,), generator=g0, device=device)
        g.inputs[:bg].copy_(ids)
        g.graph.replay()  # warm
        start, end = timing_event(), timing_event()
        start.record(torch.cuda.current_stream(device))
        for _ in range(replays):
            g.graph.replay()
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        out[bg] = start.elapsed_time(end) / 1e3 / replays
    return out
