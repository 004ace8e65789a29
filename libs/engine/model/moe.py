"""DeepSeekMoE: shared experts plus routed experts chosen by the router (V3 and V2 routers).

:class:`Router` scores and picks ``num_experts_per_tok`` experts per token, :class:`Experts`
holds the routed experts fused (bf16, FP8 or FP4; all of them, or one expert-parallel rank's
slots) and runs them grouped by expert, :class:`MoE` adds the shared experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import MLP
from .quant import (
    BF16_EXPERTS,
    ExpertsMethod,
    Ffn,
    Fp4Experts,
    Fp8Experts,
    SummedBy,
)

if TYPE_CHECKING:
    from ..kernels.fp8_gemm import Fp8Weight
    from ..kernels.fused_moe import Fp4Weight


class Router(SummedBy, nn.Module):
    """Chooses ``num_experts_per_tok`` experts per token and their combine weights.

    V3 (``scoring_func='sigmoid'``, ``topk_method='noaux_tc'``): sigmoid scores; selection on
    scores + ``e_score_correction_bias``; groups ranked by the sum of their two best biased
    scores, only the ``topk_group`` best groups are eligible; weights are the unbiased scores
    of the chosen experts, normalized if ``norm_topk_prob``, times ``routed_scaling_factor``.

    V2 (``scoring_func='softmax'``): softmax scores; ``group_limited_greedy`` ranks groups by
    their best expert; ``greedy`` is plain top-k. Weights are normalized if ``norm_topk_prob``
    (as DeepSeek-V2's own code does), else scaled by ``routed_scaling_factor``.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(
            torch.empty(e, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self._weight_fp32: torch.Tensor | None = None
        self.use_kernels = False
        if cfg.topk_method == "noaux_tc":
            # Kept in fp32 whatever the model dtype: it shifts sigmoid scores near 1e-3 apart.
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(e, dtype=torch.float32, device=device), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        w32 = self._weight_fp32
        if w32 is None or w32.device != self.weight.device:
            w32 = self.weight.to(torch.float32)
            if self.weight.dtype != torch.float32:
                self._weight_fp32 = w32  # made once, not every step
        xf = x.to(torch.float32)
        arith = self.arith
        if self.use_kernels and not arith.invariant:
            from ..kernels.router import route, supported

            if supported(cfg):  # scores to weights in one launch, best pick first
                bias = getattr(self, "e_score_correction_bias", None)
                return route(F.linear(xf, w32), cfg, bias)
        logits = arith.linear(xf, w32, None, self.use_kernels)
        score: Callable[[torch.Tensor], torch.Tensor] = (
            torch.sigmoid if cfg.scoring_func == "sigmoid" else lambda t: t.softmax(dim=-1)
        )
        scores = arith.rows(score, logits)
        k = cfg.num_experts_per_tok
        per_group = cfg.n_routed_experts // cfg.n_group
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
            choice = _mask_groups(choice, group_scores, cfg.topk_group, per_group, float("-inf"))
            idx = choice.topk(k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
        elif cfg.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, cfg.n_group, per_group).max(dim=-1).values
            masked = _mask_groups(scores, group_scores, cfg.topk_group, per_group, 0.0)
            weights, idx = masked.topk(k, dim=-1, sorted=False)
        else:
            weights, idx = scores.topk(k, dim=-1, sorted=False)
        if arith.invariant:
            # Unsorted top-k returns a row's picks in an order that depends on the batch;
            # by expert id, their weights are summed in one order.
            idx, order = idx.sort(dim=-1)
            weights = weights.gather(1, order)
        if cfg.scoring_func == "sigmoid":
            if cfg.norm_topk_prob:
                weights = weights / (arith.row_sum(weights) + 1e-20)
            weights = weights * cfg.routed_scaling_factor
        elif cfg.norm_topk_prob and k > 1:
            weights = weights / (arith.row_sum(weights) + 1e-20)
        else:
            weights = weights * cfg.routed_scaling_factor
        return weights, idx


def _mask_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, per_group: int, fill: float
) -> torch.Tensor:
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    score_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(scores.shape)
    return scores.masked_fill(~score_mask, fill)


class Experts(SummedBy, nn.Module):
    """Routed experts stored fused: ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I].

    This is transformers' fused layout (``gate_up_proj``/``down_proj``); the loader stacks the
    original per-expert tensors into it. ``method`` (:mod:`.quant`) says how they are stored
    and run, chosen once at load: bf16 (these parameters), or FP8/FP4 copies that replace them
    (:meth:`quantize_fp8`, :meth:`quantize_fp4`) and that the fused kernel dequantizes inside
    its GEMMs. ``arith``: batch-invariant products or not.

    ``slots``: the expert each row holds when this module keeps only some of them (one rank of
    an expert-parallel group, :mod:`libs.engine.ep`); None: all ``n_routed_experts`` in order.
    Row ``s`` then answers ``idx == s``: the caller maps expert ids to rows.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        slots: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.slots = slots
        e = cfg.n_routed_experts if slots is None else len(slots)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.w13 = nn.Parameter(
            torch.empty(e, 2 * i, h, dtype=dtype, device=device), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(e, h, i, dtype=dtype, device=device), requires_grad=False
        )
        self.use_kernels = False
        self.method: ExpertsMethod = BF16_EXPERTS
        for row, expert in enumerate(slots or ()):
            if expert < 0:  # an empty slot: never loaded, never routed to
                self.w13.data[row].zero_()
                self.w2.data[row].zero_()

    @property
    def fp8(self) -> tuple[Fp8Weight, Fp8Weight] | None:
        m = self.method
        return (m.w13, m.w2) if isinstance(m, Fp8Experts) else None

    @fp8.setter
    def fp8(self, weights: tuple[Fp8Weight, Fp8Weight]) -> None:
        self.method = Fp8Experts(*weights)

    @property
    def fp4(self) -> tuple[Fp4Weight, Fp4Weight] | None:
        m = self.method
        return (m.w13, m.w2) if isinstance(m, Fp4Experts) else None

    def quantize_fp4(self) -> None:
        """Swap the bf16 expert weights for FP4 ones (frees the originals); once."""
        if isinstance(self.method, Fp4Experts):
            return
        if isinstance(self.method, Fp8Experts):
            raise ValueError("experts are already FP8")
        self._replace(Fp4Experts.quantize(self))

    def quantize_fp8(self) -> None:
        """Swap the expert weights for e4m3 ones with 128x128 block scales (frees the
        originals); once."""
        if isinstance(self.method, Fp8Experts):
            return
        if isinstance(self.method, Fp4Experts):
            raise ValueError("experts are already FP4")
        self._replace(Fp8Experts.quantize(self))

    def _replace(self, method: ExpertsMethod) -> None:
        self.method = method
        dev, dt = self.w13.device, self.w13.dtype
        self.w13 = nn.Parameter(torch.empty(0, dtype=dt, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=dt, device=dev), requires_grad=False)

    def keep_slots(self, slots: tuple[int, ...]) -> None:
        """Keep copies of these experts' weights (``-1``: an empty slot, zeros), drop the rest."""
        if self.slots is not None:
            raise ValueError(f"experts already hold slots {self.slots}")
        self.set_slot_state(slot_rows(self.slot_state(), slots), slots)

    def slot_state(self) -> list[torch.Tensor]:
        """The tensors that hold the experts, each with one row per slot (bf16: ``w13``, ``w2``;
        FP8/FP4: codes and scales of each): what moves when a slot changes hands."""
        return self.method.slot_state(self)

    def set_slot_state(self, state: list[torch.Tensor], slots: tuple[int, ...]) -> None:
        """Take ``state`` (laid out as :meth:`slot_state`) as the weights of ``slots``."""
        self.method = self.method.with_slot_state(self, state)
        self.slots = slots

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            from ..kernels.fused_moe import fused_moe

            w13, w2 = self.method.kernel_weights(self)
            out: torch.Tensor = fused_moe(x, w13, w2, weights, idx, invariant=self.arith.invariant)
            return out
        # Reference: tokens sorted by expert, one GEMM pair per expert hit (batch-invariant
        # arithmetic: products in fixed-shape chunks, so a token's rows do not depend on how
        # many others chose its experts).
        ffn, n = self.method.ffn(self, x, self.arith)
        return _route_grouped(x, weights, idx, n, ffn)


def slot_rows(state: list[torch.Tensor], slots: tuple[int, ...]) -> list[torch.Tensor]:
    """Copies of the rows of ``state`` (tensors with one row per expert) that ``slots`` name,
    in slot order; ``-1`` (an empty slot) a row of zeros."""
    out = []
    for t in state:
        rows = torch.tensor([max(e, 0) for e in slots], dtype=torch.int64, device=t.device)
        kept = t.index_select(0, rows)
        for s, e in enumerate(slots):
            if e < 0:
                kept[s].zero_()  # any dtype: FP8 codes and scales too
        out.append(kept)
    return out


def _route_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    num_experts: int,
    ffn: Ffn,
) -> torch.Tensor:
    """Tokens sorted by expert, ``ffn(rows, expert)`` once per expert hit, its output added
    back weighted, in fp32, in ascending expert order (the order EP's combine keeps)."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // k
    w_sorted = weights.reshape(-1)[order]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        ye = ffn(x.index_select(0, rows), expert)
        out.index_add_(0, rows, ye.to(torch.float32) * w_sorted[start : start + n, None])
        start += n
    return out.to(x.dtype)


class MoE(nn.Module):
    """Shared experts plus routed experts chosen by the router.

    ``expert_slots``: the routed experts this module keeps (see :class:`Experts`); a model
    built so is only runnable once :func:`libs.engine.ep.runtime.apply_ep` has wrapped it.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        expert_slots: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.gate = Router(cfg, dtype, device)
        self.experts = Experts(cfg, dtype, device, expert_slots)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, device)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        out = self.experts(x, weights, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out  # type: ignore[no-any-return]
