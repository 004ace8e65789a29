"""Expert parallelism applied to a single-device model, and what an engine step needs of it.

:func:`apply_ep` wraps every decoder MoE layer's routed experts in an :class:`EPExperts` that
keeps only this rank's slots (the rest of the model -- attention, dense layers, shared
experts, embeddings, head -- stays replicated, and the model code stays single-device).
The :class:`EPRuntime` it returns gives the engine:

* :meth:`EPRuntime.begin_step`: before each forward the ranks agree on the step's rows (one
  small all-reduce), which sizes every MoE layer's fixed-shape exchange (:mod:`.fixed`) and
  picks the decode graph every rank replays;
* :meth:`EPRuntime.empty_step`: a rank with nothing scheduled still takes part in every MoE
  layer's exchanges (with 0 rows), so the ranks' collectives always pair up;
* :meth:`EPRuntime.load_counts`: tokens per expert and MoE layer since the last call (EPLB's
  window);
* :meth:`EPRuntime.apply_placement`: a live re-placement between steps, moving expert
  weights between ranks with all-to-all; outputs do not change (a replica is a copy);
* :class:`EplbDriver`: EPLB (:mod:`libs.engine.ep.eplb`) run by the ranks together between
  steps: group load counts, re-placement every ``rebalance_every`` steps, the balance gauge.

MTP layers are not wrapped: the engine does not run them (the loader gives them all experts).
V4 steps in rounds (a prompt chunk is fed up to each block end, one forward each:
:class:`~libs.engine.v4.serving.V4Runner`): its runtime is built with ``rounds=True``, and
a step ends when the group agrees on a round of no tokens (:meth:`EPRuntime.empty_step`
then steps as many rounds as the busiest rank).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from .eplb import Balance, Eplb, EplbConfig, Rebalance
from .fixed import StepBound
from .group import EPGroup
from .moe import EPExperts
from .placement import EMPTY, Placement

log = logging.getLogger(__name__)

_ALL_ROWS = 2**62  # the live-row count outside a step: every row is real


class ShardableModel(Protocol):
    """What :func:`apply_ep` reads of a model: its config (expert counts, widths), its decoder
    ``model.layers`` and its parameters (V2/V3's and V4's causal LMs)."""

    @property
    def cfg(self) -> Any: ...

    @property
    def model(self) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def apply_ep(model: ShardableModel, group: EPGroup, placement: Placement) -> EPRuntime:
    """Shard ``model``'s routed experts over ``group`` by ``placement`` (every layer alike).

    ``model``: a V2/V3 or V4 model; each decoder layer whose ``mlp`` has routed ``experts``
    with slots (:class:`~.moe.SlotExperts`) is wrapped, in forward order. A layer whose
    experts already hold this rank's slots (loaded so) is taken as is; one that holds all
    experts keeps copies of its slots and drops the rest.
    """
    if placement.num_ranks != group.size:
        raise ValueError(
            f"the placement has {placement.num_ranks} ranks, the EP group {group.size}"
        )
    cfg = model.cfg
    if placement.num_experts != cfg.n_routed_experts:
        raise ValueError(
            f"the placement places {placement.num_experts} experts, the model has "
            f"{cfg.n_routed_experts}"
        )
    mine = placement.experts_of(group.rank)
    shape = StepBound()
    layers: list[EPExperts] = []
    for layer in model.model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None or not hasattr(experts, "slots"):  # a dense layer
            continue
        if experts.slots is None:
            experts.keep_slots(mine)
        wrapped = EPExperts(experts, group, placement, shape)
        layer.mlp.add_module("experts", wrapped)
        layers.append(wrapped)
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    return EPRuntime(group, layers, cfg.hidden_size, cfg.num_experts_per_tok, dtype)


@dataclass(frozen=True)
class _Moves:
    """One layer's re-placement as seen by one rank (slot indices; all lists in wire order)."""

    keep_src: list[int]  # local copies: old slot -> new slot
    keep_dst: list[int]
    send_src: list[int]  # old slots sent, grouped by destination rank
    send_splits: list[int]
    recv_dst: list[int]  # new slots filled by received rows, grouped by source rank
    recv_splits: list[int]
    cross: bool  # any rank sends anything (else no collective is needed)


def plan_moves(old: Placement, new: Placement, rank: int) -> _Moves:
    """Where each new slot's weights come from: this rank's own old slot holding the expert if
    any, else replica ``(dst rank + dst slot) mod replicas`` of the old placement (spreads the
    sending). Every rank computes the same plan, so the wire order needs no negotiation."""
    if old.num_experts != new.num_experts or old.num_ranks != new.num_ranks:
        raise ValueError(
            f"a re-placement keeps experts and ranks: {old.num_experts} x {old.num_ranks} "
            f"-> {new.num_experts} x {new.num_ranks}"
        )
    n = new.num_ranks
    keep_src: list[int] = []
    keep_dst: list[int] = []
    sends: list[list[int]] = [[] for _ in range(n)]
    recvs: list[list[int]] = [[] for _ in range(n)]
    cross = False
    for d, slots in enumerate(new.rank_slots):
        held = old.experts_of(d)
        for s, e in enumerate(slots):
            if e == EMPTY:
                continue
            if e in held:
                if d == rank:
                    keep_src.append(held.index(e))
                    keep_dst.append(s)
                continue
            cross = True
            reps = old.replicas(e)
            src, src_slot = reps[(d + s) % len(reps)]
            if src == rank:
                sends[d].append(src_slot)
            if d == rank:
                recvs[src].append(s)
    return _Moves(
        keep_src,
        keep_dst,
        [x for per in sends for x in per],
        [len(per) for per in sends],
        [x for per in recvs for x in per],
        [len(per) for per in recvs],
        cross,
    )


class EPRuntime:
    """The EP side of one rank's model: its wrapped layers (in forward order) and group."""

    def __init__(
        self,
        group: EPGroup,
        layers: list[EPExperts],
        hidden: int,
        top_k: int,
        dtype: torch.dtype,
    ) -> None:
        self.group = group
        self.layers = layers
        self._hidden = hidden
        self._top_k = top_k
        self._dtype = dtype
        # One bound for every layer (apply_ep shares it; layers built apart are joined here).
        self.shape = layers[0].shape if layers else StepBound()
        for layer in layers:
            layer.shape = self.shape
        self.ladder: tuple[int, ...] = ()  # the decode graphs' row counts (the runner's)
        if layers and self.shape.live is None:  # every row real until a step says otherwise
            device = layers[0].load.device
            self.shape.live = torch.full((1,), _ALL_ROWS, dtype=torch.int64, device=device)
        # Replays the decode graph of the agreed rows with none of this rank's (the runner's
        # ModelRunner.replay_idle): an idle rank then steps through the graph like the others.
        self.idle: Callable[[int], bool] | None = None
        # A step is rounds of forwards, ended by a round the group agrees has no tokens (V4's
        # runner, module doc); False: one forward per step.
        self.rounds = False

    def use_ladder(self, ladder: Sequence[int]) -> None:
        """Pad each step's rows to these sizes; up to the largest the exchange is fixed-shape
        (set before the graphs are captured, so each captures that path)."""
        self.ladder = tuple(ladder)
        if self.ladder:
            self.shape.fixed_max_tokens = self.ladder[-1]

    @property
    def placements(self) -> list[Placement]:
        return [layer.placement for layer in self.layers]

    def begin_step(self, tokens: int, ladder: Sequence[int]) -> int:
        """Agree with the group on this step's token bound; a collective, once per step, before
        the forward (the only host round trip of an EP step). ``tokens``: this rank's;
        ``ladder``: the decode graphs' row counts. Returns the rows every rank runs: the
        smallest ladder size holding the group's largest step (so every rank replays the
        same graph, or runs eagerly with the same buffers), or that step itself past the
        ladder -- then the layers take the variable-size exchange."""
        most = self.group.all_max([tokens])[0] if self.group.size > 1 else tokens
        self.use_ladder(ladder)
        rows = next((b for b in self.ladder if b >= most), most)
        self.shape.tokens = rows
        if self.shape.live is not None:
            self.shape.live.fill_(tokens)  # queued before the forward, no sync
        return rows

    def end_step(self) -> None:
        """The forward is queued: no bound is agreed until the next :meth:`begin_step` (a
        graph captured in between sizes its buffers by its own rows, a forward outside a step
        takes every row as real; the queued forward has read the step's count by then)."""
        self.shape.tokens = 0
        if self.shape.live is not None:
            self.shape.live.fill_(_ALL_ROWS)

    def empty_step(self) -> None:
        """This rank's part of one step with no tokens: the step's agreement, then every MoE
        layer's exchanges with the buffers the other ranks use (:meth:`empty_forward`); with
        :attr:`rounds`, as many such rounds as the group's busiest rank takes, and the round
        of no tokens that ends the step."""
        if not self.layers:
            return
        while True:
            rows = self.begin_step(0, self.ladder)
            try:
                self.empty_forward(rows)
            finally:
                self.end_step()
            if not self.rounds or rows == 0:
                return

    def empty_forward(self, rows: int) -> None:
        """Every MoE layer's exchanges in the order the model runs them, with no row of this
        rank's, inside a step begun with ``rows`` agreed (this rank may still compute experts
        for the others): a replay of the decode graph of those rows, all padding, where
        :attr:`idle` has one; else only the MoE layers, eagerly."""
        if self.idle is not None and self.idle(rows):
            return
        device = self.layers[0].load.device
        x = torch.empty(0, self._hidden, dtype=self._dtype, device=device)
        weights = torch.empty(0, self._top_k, dtype=torch.float32, device=device)
        idx = torch.empty(0, self._top_k, dtype=torch.int64, device=device)
        with torch.inference_mode():
            for layer in self.layers:
                layer(x, weights, idx)

    def load_totals(self) -> torch.Tensor:
        """[MoE layers, experts] int64 on the layers' device: tokens this rank's routers sent
        to each expert since the layers were built (a copy; readers difference it)."""
        return torch.stack([layer.load for layer in self.layers])

    def load_counts(self) -> torch.Tensor:
        """[MoE layers, experts] int64 on the CPU: tokens this rank's routers sent to each
        expert since the last call (each call starts a new count; sum over ranks for the
        group's load). Not a collective."""
        if not self.layers:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([layer.take_load() for layer in self.layers]).cpu()

    def apply_placement(self, new: Placement | Sequence[Placement]) -> None:
        """Re-place the experts between steps: ``new`` for every layer, or one per MoE layer.
        A collective: every rank calls it between the same two steps with the same ``new``."""
        news = [new] * len(self.layers) if isinstance(new, Placement) else list(new)
        if len(news) != len(self.layers):
            raise ValueError(f"{len(news)} placements for {len(self.layers)} MoE layers")
        moved = 0
        with torch.inference_mode():
            for layer, placement in zip(self.layers, news):
                moved += self._replace_layer(layer, placement)
        log.info("ep: rank %d re-placed experts, %d slots received", self.group.rank, moved)

    def _replace_layer(self, layer: EPExperts, new: Placement) -> int:
        if new.num_ranks != self.group.size:
            raise ValueError(
                f"the placement has {new.num_ranks} ranks, the group {self.group.size}"
            )
        rank = self.group.rank
        moves = plan_moves(layer.placement, new, rank)
        local = layer.local
        slots = new.experts_of(rank)
        state = []
        for t in local.slot_state():
            out = torch.zeros((len(slots), *t.shape[1:]), dtype=t.dtype, device=t.device)
            if moves.keep_dst:
                out[_ix(moves.keep_dst, t)] = t[_ix(moves.keep_src, t)]
            if moves.cross:
                sent = t[_ix(moves.send_src, t)] if moves.send_src else t[:0]
                got = self._exchange(sent, moves.send_splits, moves.recv_splits)
                if moves.recv_dst:
                    out[_ix(moves.recv_dst, t)] = got
            state.append(out)
        mine = local.slot_state()
        if all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(mine, state)):
            for a, b in zip(mine, state):  # in place: a captured graph reads these tensors
                a.copy_(b)
            local.slots = slots
        else:
            local.set_slot_state(state, slots)
        layer.set_placement(new)
        return len(moves.recv_dst)

    def _exchange(
        self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        """Whole slots as bytes (any dtype: bf16, FP4 codes, scales travel alike)."""
        shape = rows.shape[1:]
        raw = rows.contiguous().reshape(rows.shape[0], math.prod(shape)).view(torch.uint8)
        got = self.group.all_to_all(raw, send_splits, recv_splits)
        return got.view(rows.dtype).reshape(got.shape[0], *shape)


class EplbDriver:
    """EPLB inside one rank's engine; :meth:`after_step` is a collective that every rank calls
    after every forward (each engine step is one forward on every rank, in lockstep).

    Counts are summed locally on the device (the layers' counters) and all-reduced once every
    ``sync_every`` steps (:meth:`EplbConfig.sync_interval`: 25 for the decode and prefill
    defaults), then recorded as one chunk of the window. Per-step all-reduces would buy
    nothing: the window (100-1,000 steps) is a whole number of chunks and re-placements fall
    on the same steps, and each sync costs an all-reduce of layers x experts int64 (V3: 58 x
    256, 119 KB) plus a device-to-host read, which also stalls the CUDA stream the engine
    overlaps with the host. Every rank then holds the same group counts, so every rank's
    :class:`~libs.engine.ep.eplb.Eplb` (deterministic numpy) computes the same placements and
    :meth:`EPRuntime.apply_placement` pairs up without negotiation.
    """

    def __init__(self, runtime: EPRuntime, config: EplbConfig, sync_every: int | None = None):
        if not runtime.layers:
            raise ValueError("EPLB needs a model with MoE layers")
        self.runtime = runtime
        self.sync_every = sync_every or config.sync_interval()
        placements = runtime.placements
        self.policy = Eplb(
            config.in_chunks(self.sync_every),
            len(placements),
            placements[0].num_experts,
            runtime.group.size,
            initial=placements,
            steps_per_record=self.sync_every,
        )
        self.steps = 0
        self._mark = runtime.load_totals()
        self._balance: Balance | None = None

    def after_step(self) -> Rebalance | None:
        """Count one step; every ``sync_every`` steps sum the chunk over the ranks and feed
        the policy; apply a re-placement that moves slots (returned), else None."""
        self.steps += 1
        if self.steps % self.sync_every:
            return None
        totals = self.runtime.load_totals()
        chunk = self.runtime.group.all_sum(totals - self._mark)
        self._mark = totals
        self._balance = None
        rebalance = self.policy.step(chunk.cpu().numpy().astype(np.int64))
        if rebalance is None or rebalance.placements == tuple(self.runtime.placements):
            return None
        self.runtime.apply_placement(rebalance.placements)
        log.info(
            "eplb: step %d: moved %d slots, max/mean %.3f -> %.3f",
            self.steps,
            sum(rebalance.moved_slots),
            rebalance.before,
            rebalance.after,
        )
        return rebalance

    def balance(self) -> Balance:
        """The window's max/mean under the placements in force (cached until the next chunk)."""
        if self._balance is None:
            self._balance = self.policy.balance()
        return self._balance


def _ix(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)
