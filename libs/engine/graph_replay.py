"""The model runner's CUDA graphs: graph sets added, captured, timed and replayed.

:class:`GraphReplay` is the half of :class:`~libs.engine.runner.ModelRunner` that owns its
:class:`~.graphs.GraphSet` s (the decode rows' graphs, and those speculative decoding adds for
its MTP passes): which step a captured graph can run (decode-only, or prompt chunks as decode
rows up to ``mixed_graph_rows``), staging its inputs, capturing (on a side-stream warm-up, one
memory pool for every graph) and replaying. On the CPU, :meth:`GraphReplay.emulate_graphs`
runs every path around the capture itself with :class:`~.graphs.EagerReplay` stand-ins. The
buffers, staging and capture functions are :mod:`.graphs`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .graphs import (
    EagerReplay,
    Graph,
    GraphSet,
    capture,
    graph_ladder,
    mixed_rows,
    stage,
    time_graphs,
)
from .kv.cache import PagedKVCache
from .model.model import DeepseekForCausalLM
from .scheduler import ScheduledSeq, StepPlan
from .step_inputs import InFlight

log = logging.getLogger(__name__)


class GraphReplay:
    """CUDA graphs of computations over decode rows, for :class:`ModelRunner`, which sets
    these attributes in its constructor."""

    model: DeepseekForCausalLM
    cache: PagedKVCache
    device: torch.device
    block_size: int
    max_blocks: int
    num_heads: int
    use_kernels: bool
    batch_invariant: bool
    cuda_graphs: bool  # whether the graph paths run (captured, or emulated on the CPU)
    max_graph_batch: int
    mixed_graph_rows: int
    group_rows: int  # EP: the rows the group agreed on for this step (the graph's least)
    graph_sets: dict[str, GraphSet]
    _emulated: bool
    _captured: bool  # capture_all() has run: graph sets added later capture at once
    _pool: Any  # torch.cuda.graph_pool_handle(), shared by every graph

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
        gs = GraphSet(body, graph_ladder(max_rows), rows, x_in, optional)
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
        return time_graphs(gs, self.device, self.model.cfg.vocab_size, replays)

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

    def _capture_set(self, gs: GraphSet) -> None:
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
            and max(len(plan.seqs), self.group_rows) <= self.graph_sets["decode"].ladder[-1]
            and all(s.num_tokens == 1 and s.sample for s in plan.seqs)
        )

    def _mixed_rows(self, plan: StepPlan) -> tuple[list[ScheduledSeq], list[int]] | None:
        """A step with prompt chunks as decode rows for the decode graphs: (rows, the row of
        each sampling seq in plan order), or None when it does not fit them. A chunk of k
        tokens from position p becomes k rows at p .. p+k-1 with lengths p+1 .. p+k."""
        top = self.graph_sets["decode"].ladder[-1]  # EP: a group's step past it runs eagerly
        if not self.cuda_graphs or self.batch_invariant or not self.mixed_graph_rows:
            return None
        return None if self.group_rows > top else mixed_rows(plan, min(self.mixed_graph_rows, top))

    def replay_idle(self, rows: int) -> bool:
        """An idle EP rank replays the graph of the group's ``rows``, all padding (False: none)."""
        gs = self.graph_sets["decode"]
        if not self.cuda_graphs or not gs.graphs or not 0 < rows <= gs.ladder[-1]:
            return False
        self.group_rows = rows
        self._replay("decode", [], None)
        return True

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
        prev: InFlight | None,
        *,
        x: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Replay the smallest graph of set ``name`` that holds the rows; its outputs' rows."""
        gs = self.graph_sets[name]
        n = seqs if isinstance(seqs, int) else len(seqs)
        least = max(n, self.group_rows) if name == "decode" else n  # EP: the group's size
        g = gs.graphs[next(b for b in gs.ladder if b >= least)]  # every size is captured
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

    def _stage(self, g: Graph, seqs: Sequence[ScheduledSeq], prev: InFlight | None) -> None:
        """Send the decode rows' inputs to ``g.inputs`` (:func:`~.graphs.stage`)."""
        stage(
            g,
            seqs,
            prev,
            block_size=self.block_size,
            max_blocks=self.max_blocks,
            scratch_slot=self.cache.scratch_slot,
            device=self.device,
        )

    def _capture(self, gs: GraphSet, bg: int) -> Graph:
        return capture(
            gs,
            bg,
            self._record,
            device=self.device,
            max_blocks=self.max_blocks,
            block_size=self.block_size,
            scratch_slot=self.cache.scratch_slot,
            num_splits=self._graph_splits(bg),
        )

    def _record(
        self, run: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """Capture ``run`` (a CUDA graph; an EagerReplay when emulated): (graph, outputs)."""
        if self._emulated:
            eager = EagerReplay(run)
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
