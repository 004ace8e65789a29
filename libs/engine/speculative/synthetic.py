"""An MTP head that predicts what the main model will, for measuring without trained weights.

:func:`make_mtp_test_model` rewrites a model in place so that its MTP head reproduces the main
model's next-token function exactly, then perturbs it to a chosen acceptance (and, with
``confident``, makes its confidence separate right drafts from wrong ones as a trained head's
does), so acceptance and speed-up can be measured on presets with random weights.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from ..model.layers import Fp8Linear
from ..model.model import DeepseekForCausalLM, MTPLayer
from ..model.moe import Experts


@torch.inference_mode()
def make_mtp_test_model(
    model: DeepseekForCausalLM,
    layer_scale: float = 0.0,
    wrong_fraction: float = 0.0,
    seed: int = 0,
    confident: bool = False,
) -> None:
    """Rewrite ``model`` (a :class:`~.model.model.DeepseekForCausalLM` with an MTP layer,
    unquantized weights) in place so that its MTP head predicts what the main model will:

    * every main decoder layer's output projections (attention ``o_proj``, the MLP's or the
      experts' down projections) are scaled by ``layer_scale``: at 0 the main model's next
      token depends only on the current one (``lm_head(norm(emb(t)))``); above 0 attention
      and context matter again and acceptance falls;
    * the MTP layer passes the next token's embedding through (``eh_proj = [I 0]``, its own
      block's output projections zeroed) into the main model's norm and head, so it computes
      that same function of the token: with ``layer_scale`` 0 every greedy draft is accepted
      (up to float rounding, a positive rescaling of the logits);
    * ``wrong_fraction`` of the vocabulary is then given another token's embedding in the MTP
      layer (a random cycle over that subset): drafts made from those tokens are wrong, so
      acceptance per draft is about ``1 - wrong_fraction``;
    * ``confident``: the head's confidence says something about acceptance, as a trained
      head's does. With random weights every token's logits look alike (nearly flat: a
      confidence of ~2e-5 over a 129K vocabulary, the same for right and wrong drafts), so the
      confidence schedule would see one acceptance rate for every draft. Here the vocabulary
      projection is replaced by a planted one: a random permutation ``pi`` of the vocabulary,
      and row ``pi(t)`` the direction of token ``t``'s final hidden state (at the original
      rows' mean norm), so the main model's next token after ``t`` is ``pi(t)`` by a wide
      margin (other rows meet that hidden state at random angles). The MTP head's norm is then
      scaled (every argmax kept) until the median right draft has confidence 0.9, and a
      remapped token gets the sum of the next two tokens' embeddings in the cycle (so at least
      three are remapped): two wrong successors of about equal weight, each at ~0.7 of a
      right draft's logit, so a wrong draft's confidence is well under a half. Acceptance
      stays about ``1 - wrong_fraction``."""
    mtp = [cast(MTPLayer, m) for m in model.mtp]
    if not mtp:
        raise ValueError("the model has no MTP layer (load it with with_mtp=True)")
    if any(isinstance(m, Fp8Linear) for m in model.modules()) or any(
        isinstance(m, Experts) and (m.fp8 is not None or m.fp4 is not None) for m in model.modules()
    ):
        raise ValueError("make_mtp_test_model needs unquantized weights")
    if not 0.0 <= wrong_fraction <= 1.0:
        raise ValueError(f"wrong_fraction must lie in [0, 1], got {wrong_fraction}")

    def scale_outputs(layer: torch.nn.Module, factor: float) -> None:
        for name, p in layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                p.mul_(factor)

    for layer in model.model.layers:
        scale_outputs(layer, layer_scale)
    embed = model.model.embed_tokens.weight
    vocab, hidden = embed.shape
    if confident:
        _plant_successors(model, seed)
    for m in mtp:
        scale_outputs(m, 0.0)
        table = embed.clone()
        n_wrong = int(round(wrong_fraction * vocab))
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(vocab, generator=g).to(embed.device)
        subset = order[:n_wrong]
        if n_wrong >= 2:
            table[subset] = embed[subset.roll(1)]  # each takes the next one's: no fixed point
            if confident and n_wrong >= 3:
                table[subset] += embed[subset.roll(2)]  # and the one after: two peaks
        m.embed_tokens.weight.copy_(table)
        m.enorm.weight.fill_(1.0)
        m.hnorm.weight.fill_(1.0)
        m.eh_proj.weight.zero_()
        m.eh_proj.weight[:, :hidden].copy_(torch.eye(hidden, dtype=embed.dtype))
        m.shared_head.norm.weight.copy_(model.model.norm.weight)
        m.shared_head.head.weight.copy_(model.lm_head.weight)
        if confident:
            right = order[n_wrong : n_wrong + 64]  # tokens whose drafts are right
            sharpness = _sharpness(m.head(m.enorm(m.embed_tokens(right))), 0.9)
            m.shared_head.norm.weight.mul_(sharpness)


def _plant_successors(model: DeepseekForCausalLM, seed: int) -> None:
    """Replace ``model.lm_head`` so that, with the decoder layers' outputs at zero, the next
    token after ``t`` is ``pi(t)`` for a random permutation ``pi``: row ``pi(t)`` is ``t``'s
    final hidden state's direction at the original rows' mean norm (see make_mtp_test_model,
    whose inference mode this runs under)."""
    w = model.lm_head.weight
    vocab = w.shape[0]
    scale = float(w.float().norm(dim=-1).mean())
    g = torch.Generator().manual_seed(seed + 7919)
    pi = torch.randperm(vocab, generator=g).to(w.device)
    chunk = 8192  # the final hidden states of the whole vocabulary, a slice at a time
    for start in range(0, vocab, chunk):
        ids = torch.arange(start, min(start + chunk, vocab), device=w.device)
        h = model.model.norm(model.model.embed_tokens(ids)).float()
        w[pi[ids]] = (h * (scale / h.norm(dim=-1, keepdim=True))).to(w.dtype)


def _sharpness(logits: torch.Tensor, target: float) -> float:
    """The factor that scales ``logits`` (rows of a head's output) so that the median row's
    largest probability is ``target`` (bisection over its logarithm)."""
    lo, hi = 0.0, math.log(1e4)

    def median_top(log_factor: float) -> float:
        p = (logits * math.exp(log_factor)).softmax(-1).amax(-1)
        return float(p.median())

    for _ in range(40):
        mid = (lo + hi) / 2
        if median_top(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)
