"""DeepSeekMoE's router after its GEMM in one launch: scores, group-limited selection, top-k,
weights.

As PyTorch ops the V3 router is a dozen small launches per layer (sigmoid, bias add, the
per-group top-2 and its sum, the group top-k, a scatter and a mask, the expert top-k, a
gather, the normalization and the scaling); in a decode step each is latency-bound. Here one
program takes one token's ``E`` router logits and does all of it in registers, following
:class:`libs.engine.model.layers.Router` step by step:

* scores: ``sigmoid(logits)`` (V3) or ``softmax(logits)`` (V2);
* groups (``n_group > 1``): V3's ``noaux_tc`` ranks a group by the sum of its two best biased
  scores (``scores + e_score_correction_bias``), V2's ``group_limited_greedy`` by its best
  score; the ``topk_group`` best groups stay eligible;
* the ``k`` best eligible experts by biased score (V3) or score (V2), best first; their
  weights are the unbiased scores, normalized if ``norm_topk_prob``, times
  ``routed_scaling_factor`` where the reference applies it.

Ties go to the lower index (``tl.argmax``); among float scores they do not occur in practice.
The picks come out best first rather than in ``torch.topk``'s unsorted order, so the fused
MoE adds a token's ``k`` expert outputs in another order than the reference path: the same
experts and weights, sums that differ in the last bits. Needs ``E`` and ``E / n_group``
powers of two (every DeepSeek V3/V2-Lite layout; :func:`supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import ModelConfig


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    idx_ptr,
    stride_l,
    scale,
    E: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TOP2_GROUPS: tl.constexpr,  # noaux_tc: a group's score is its two best; else its best
    NORMALIZE: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
):
    row = tl.program_id(0)
    e = tl.arange(0, E)
    logits = tl.load(logits_ptr + row * stride_l + e).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        z = tl.exp(logits - tl.max(logits, axis=0))
        scores = z / tl.sum(z, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e)
    if N_GROUP > 1:
        PER: tl.constexpr = E // N_GROUP
        c2 = tl.reshape(choice, (N_GROUP, PER))
        best = tl.max(c2, axis=1)
        if TOP2_GROUPS:
            at = tl.argmax(c2, axis=1)
            inner = tl.arange(0, PER)
            second = tl.max(tl.where(inner[None, :] == at[:, None], float("-inf"), c2), axis=1)
            group_score = best + second
        else:
            group_score = best
        g = tl.arange(0, N_GROUP)
        keep = g < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_score, axis=0)
            keep = keep | (g == pick)
            group_score = tl.where(g == pick, float("-inf"), group_score)
        c2 = tl.where(keep[:, None], c2, float("-inf"))
        choice = tl.reshape(c2, (E,))
    ks = tl.arange(0, K_P2)
    ws = tl.zeros([K_P2], dtype=tl.float32)
    ids = tl.zeros([K_P2], dtype=tl.int64)
    for j in tl.static_range(K):
        pick = tl.argmax(choice, axis=0)
        ws = tl.where(ks == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), ws)
        ids = tl.where(ks == j, pick.to(tl.int64), ids)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORMALIZE:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    if SCALE_AFTER:
        ws = ws * scale
    tl.store(w_ptr + row * K + ks, ws, mask=ks < K)
    tl.store(idx_ptr + row * K + ks, ids, mask=ks < K)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supported(cfg: ModelConfig) -> bool:
    """Whether :func:`route` takes this router's layout."""
    e = cfg.n_routed_experts
    groups = cfg.n_group if cfg.topk_method in ("noaux_tc", "group_limited_greedy") else 1
    return (
        _pow2(e)
        and e % groups == 0
        and _pow2(e // groups)
        and _pow2(groups)
        and cfg.scoring_func in ("sigmoid", "softmax")
    )


def route(
    logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, expert ids [T, k] int64)`` for fp32 router ``logits [T, E]``
    (contiguous last dim), as :class:`~libs.engine.model.layers.Router` computes them, best
    pick first. ``bias``: V3's ``e_score_correction_bias`` (fp32 [E])."""
    t, e = logits.shape
    k = cfg.num_experts_per_tok
    grouped = cfg.topk_method in ("noaux_tc", "group_limited_greedy") and cfg.n_group > 1
    sigmoid = cfg.scoring_func == "sigmoid"
    if sigmoid:
        normalize, scale_after = cfg.norm_topk_prob, True
    else:
        normalize = cfg.norm_topk_prob and k > 1
        scale_after = not normalize
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits,
            bias if bias is not None else logits,
            weights,
            idx,
            logits.stride(0),
            float(cfg.routed_scaling_factor),
            E=e,
            K=k,
            K_P2=triton.next_power_of_2(k),
            N_GROUP=cfg.n_group if grouped else 1,
            TOPK_GROUP=cfg.topk_group if grouped else 1,
            SIGMOID=sigmoid,
            HAS_BIAS=bias is not None,
            TOP2_GROUPS=cfg.topk_method == "noaux_tc",
            NORMALIZE=normalize,
            SCALE_AFTER=scale_after,
            num_warps=1 if e <= 64 else 4,
        )
    return weights, idx
