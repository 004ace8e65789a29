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
from .layers import MLP, _silu, invariant_linear, invariant_rows

if TYPE_CHECKING:
    from ..kernels.fp8_gemm import Fp8Weight
    from ..kernels.fused_moe import Fp4Weight


class Router(nn.Module):
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
        self.batch_invariant = False
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
        if self.use_kernels and not self.batch_invariant:
            from ..kernels.router import route, supported

            if supported(cfg):  # scores to weights in one launch, best pick first
                bias = getattr(self, "e_score_correction_bias", None)
                return route(F.linear(xf, w32), cfg, bias)
        logits = (
            invariant_linear(xf, w32, None, self.use_kernels)
            if self.batch_invariant
            else F.linear(xf, w32)
        )
        score: Callable[[torch.Tensor], torch.Tensor] = (
            torch.sigmoid if cfg.scoring_func == "sigmoid" else lambda t: t.softmax(dim=-1)
        )
        scores = invariant_rows(score, logits) if self.batch_invariant else score(logits)
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
        if self.batch_invariant:
            # Unsorted top-k returns a row's picks in an order that depends on the batch;
            # by expert id, their weights are summed in one order.
            idx, order = idx.sort(dim=-1)
            weights = weights.gather(1, order)
        if cfg.scoring_func == "sigmoid":
            if cfg.norm_topk_prob:
                weights = weights / (self._sum(weights) + 1e-20)
            weights = weights * cfg.routed_scaling_factor
        elif cfg.norm_topk_prob and k > 1:
            weights = weights / (self._sum(weights) + 1e-20)
        else:
            weights = weights * cfg.routed_scaling_factor
        return weights, idx

    def _sum(self, weights: torch.Tensor) -> torch.Tensor:
        """Each row's sum ``[T, 1]``; batch-invariant: left to right (a library reduction
        may split a row differently for different ``T``)."""
        if not self.batch_invariant:
            return weights.sum(dim=-1, keepdim=True)
        total = weights[:, :1].clone()
        for j in range(1, weights.shape[1]):
            total += weights[:, j : j + 1]
        return total


def _mask_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, per_group: int, fill: float
) -> torch.Tensor:
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    score_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(scores.shape)
    return scores.masked_fill(~score_mask, fill)


class Experts(nn.Module):
    """Routed experts stored fused: ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I].

    This is transformers' fused layout (``gate_up_proj``/``down_proj``); the loader stacks the
    original per-expert tensors into it. :meth:`quantize_fp4` replaces both with FP4 (e2m1,
    one scale per 32 weights) copies that the fused kernel dequantizes inside its GEMMs.

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
        self.batch_invariant = False
        self.fp4: tuple[Fp4Weight, Fp4Weight] | None = None
        self.fp8: tuple[Fp8Weight, Fp8Weight] | None = None
        for row, expert in enumerate(slots or ()):
            if expert < 0:  # an empty slot: never loaded, never routed to
                self.w13.data[row].zero_()
                self.w2.data[row].zero_()

    def quantize_fp4(self) -> None:
        """Swap the bf16 expert weights for FP4 ones (frees the originals); once."""
        from ..kernels.fused_moe import quantize_fp4

        if self.fp4 is not None:
            return

        self.fp4 = (quantize_fp4(self.w13.data), quantize_fp4(self.w2.data))
        dev, dt = self.w13.device, self.w13.dtype
        self.w13 = nn.Parameter(torch.empty(0, dtype=dt, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=dt, device=dev), requires_grad=False)

    def quantize_fp8(self) -> None:
        """Swap the expert weights for e4m3 ones with 128x128 block scales (frees the
        originals); once."""
        from ..kernels.fp8_gemm import quantize_fp8_blocks

        if self.fp8 is not None:
            return
        if self.fp4 is not None:
            raise ValueError("experts are already FP4")
        self.fp8 = (quantize_fp8_blocks(self.w13.data), quantize_fp8_blocks(self.w2.data))
        dev, dt = self.w13.device, self.w13.dtype
        self.w13 = nn.Parameter(torch.empty(0, dtype=dt, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=dt, device=dev), requires_grad=False)

    def keep_slots(self, slots: tuple[int, ...]) -> None:
        """Keep copies of these experts' weights (``-1``: an empty slot, zeros), drop the rest."""
        if self.slots is not None:
            raise ValueError(f"experts already hold slots {self.slots}")
        state = []
        for t in self.slot_state():
            rows = torch.tensor([max(e, 0) for e in slots], dtype=torch.int64, device=t.device)
            kept = t.index_select(0, rows)
            for s, e in enumerate(slots):
                if e < 0:
                    kept[s].zero_()
            state.append(kept)
        self.set_slot_state(state, slots)

    def slot_state(self) -> list[torch.Tensor]:
        """The tensors that hold the experts, each with one row per slot (bf16: ``w13``, ``w2``;
        FP4: packed codes and scales of each): what moves when a slot changes hands."""
        if self.fp4 is not None:
            a, b = self.fp4
            return [a.packed, a.scales, b.packed, b.scales]
        if self.fp8 is not None:
            c, d = self.fp8
            return [c.q, c.scale, d.q, d.scale]
        return [self.w13.data, self.w2.data]

    def set_slot_state(self, state: list[torch.Tensor], slots: tuple[int, ...]) -> None:
        """Take ``state`` (laid out as :meth:`slot_state`) as the weights of ``slots``."""
        if self.fp4 is not None:
            from ..kernels.fused_moe import Fp4Weight

            self.fp4 = (Fp4Weight(state[0], state[1]), Fp4Weight(state[2], state[3]))
        elif self.fp8 is not None:
            from ..kernels.fp8_gemm import Fp8Weight

            self.fp8 = (Fp8Weight(state[0], state[1]), Fp8Weight(state[2], state[3]))
        else:
            self.w13 = nn.Parameter(state[0], requires_grad=False)
            self.w2 = nn.Parameter(state[1], requires_grad=False)
        self.slots = slots

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            from ..kernels.fused_moe import fused_moe

            w13, w2 = (
                self.fp8
                if self.fp8 is not None
                else self.fp4
                if self.fp4 is not None
                else (self.w13, self.w2)
            )
            out: torch.Tensor = fused_moe(x, w13, w2, weights, idx, invariant=self.batch_invariant)
            return out
        if self.fp8 is not None:
            return self._grouped_fp8(x, weights, idx, self.fp8[0], self.fp8[1])
        if self.fp4 is not None:
            from ..kernels.fused_moe import dequantize_fp4

            return self._grouped(
                x,
                weights,
                idx,
                dequantize_fp4(self.fp4[0], x.dtype),
                dequantize_fp4(self.fp4[1], x.dtype),
            )
        return self._grouped(x, weights, idx, self.w13, self.w2, self.batch_invariant)

    def _grouped_fp8(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        idx: torch.Tensor,
        w13: Fp8Weight,
        w2: Fp8Weight,
    ) -> torch.Tensor:
        """Reference FP8 experts (no kernels): one block-scaled FP8 linear pair per expert
        hit in plain PyTorch, activations quantized as the fused kernels do."""
        from ..kernels.fp8_gemm import Fp8Weight, fp8_linear

        def ffn(xe: torch.Tensor, e: int) -> torch.Tensor:
            a = Fp8Weight(w13.q[e], w13.scale[e])
            gate, up = fp8_linear(xe, a, kernel=False).chunk(2, dim=-1)
            return fp8_linear(F.silu(gate) * up, Fp8Weight(w2.q[e], w2.scale[e]), kernel=False)

        return _route_grouped(x, weights, idx, w13.q.shape[0], ffn)

    @staticmethod
    def _grouped(
        x: torch.Tensor,
        weights: torch.Tensor,
        idx: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """Reference grouped path: tokens sorted by expert, one GEMM pair per expert hit
        (``batch_invariant``: products in fixed-shape chunks, so a token's rows do not depend
        on how many others chose its experts)."""

        def lin(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return invariant_linear(a, w, None, False) if batch_invariant else F.linear(a, w)

        def ffn(xe: torch.Tensor, e: int) -> torch.Tensor:
            gate, up = lin(xe, w13[e]).chunk(2, dim=-1)
            return lin(_silu(gate, batch_invariant) * up, w2[e])

        return _route_grouped(x, weights, idx, w13.shape[0], ffn)


def _route_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    num_experts: int,
    ffn: Callable[[torch.Tensor, int], torch.Tensor],
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
