"""DeepSeek-V4's step cost: the engine's :class:`~libs.engine.cost_model.CostModel` with V4's
attention, which is not linear in the context.

Per query token and layer, every V4 layer attends over the sliding window (``min(pos + 1,
W)`` keys); a CSA layer also scores every closed indexer key (``index_n_heads x
index_head_dim`` each) and attends over the ``index_topk`` it picks; an HCA layer attends over
every closed compressed entry (one per ``hca_rate`` tokens). A decode step reads, per request
and layer, the window's rows, a CSA layer's indexer keys and picked entries, an HCA layer's
entries. The weights' share is counted from the model's own parameters: what every token
multiplies by (all matrices but the embedding, the head and the routed experts), the head once
per sampling request, ``num_experts_per_tok`` routed experts per MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost_model import CostModel, StepShape
from .config import CSA, HCA
from .model import V4ForCausalLM


@dataclass
class V4CostModel(CostModel):
    window: int = 1
    num_layers: int = 0
    csa_layers: int = 0
    hca_layers: int = 0
    csa_rate: int = 4
    hca_rate: int = 128
    topk: int = 0
    pair_flops: float = 0.0  # one (query, key) pair in one layer: q.k and p.v over the heads
    index_flops: float = 0.0  # one indexer key scored for one query
    row_bytes: float = 0.0  # one key/value row (head_dim)
    index_row_bytes: float = 0.0  # one indexer key (index_head_dim)

    def _keys(self, pos: float) -> tuple[float, float, float]:
        """(window keys, closed CSA entries, closed HCA entries) of a query at ``pos``."""
        return min(pos + 1, self.window), (pos + 1) / self.csa_rate, (pos + 1) / self.hca_rate

    def flops(self, shape: StepShape) -> float:
        total = self.flops_per_token * shape.tokens + self.head_flops * len(shape.seqs)
        for q, ctx in shape.seqs:
            window, csa, hca = self._keys(ctx - (q + 1) / 2)  # the chunk's mean position
            per_query = self.num_layers * window * self.pair_flops
            per_query += self.csa_layers * (
                min(self.topk, csa) * self.pair_flops + csa * self.index_flops
            )
            per_query += self.hca_layers * hca * self.pair_flops
            total += q * per_query
        return total

    def seconds_with_counts(self, shape: StepShape, qs: np.ndarray, ctx: int) -> np.ndarray:
        """V4's attention is not a function of the totals: each shape is built."""
        return np.asarray([self.seconds(shape.add(int(q), ctx)) for q in qs], dtype=np.float64)

    def bytes(self, shape: StepShape) -> float:
        if shape.tokens == 0:
            return 0.0
        weights = super().bytes(shape)  # kv_bytes_per_token is 0: the weights alone
        state = 0.0
        for _, ctx in shape.seqs:
            window, csa, hca = self._keys(ctx - 1)
            state += self.num_layers * window * self.row_bytes
            state += self.csa_layers * (
                csa * self.index_row_bytes + min(self.topk, csa) * self.row_bytes
            )
            state += self.hca_layers * hca * self.row_bytes
        return weights + state


def _multiplied_per_token(name: str, dims: int) -> bool:
    """A matrix every token goes through: not the embedding (a lookup), the head (once per
    sampling request), a routed expert (k of them) or a pooling bias (added)."""
    if dims < 2 or name.startswith(("model.embed_tokens.", "lm_head.")):
        return False
    return ".experts." not in name and not name.endswith("position_bias")


def v4_cost_model(
    net: V4ForCausalLM, flop_rate: float, byte_rate: float, weight_bytes: float | None = None
) -> V4CostModel:
    """The cost model of ``net`` (module doc); ``weight_bytes``: per weight value (default:
    the parameters' own dtype)."""
    cfg = net.cfg
    first = next(net.parameters())
    itemsize = float(weight_bytes or first.element_size())
    dense = sum(p.numel() for n, p in net.named_parameters() if _multiplied_per_token(n, p.dim()))
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    head = cfg.hidden_size * cfg.vocab_size
    kinds = cfg.layer_types
    return V4CostModel(
        flops_per_token=2.0 * (dense + cfg.num_hidden_layers * cfg.num_experts_per_tok * expert),
        head_flops=2.0 * head,
        attn_flops_per_pair=0.0,
        dense_weight_bytes=(dense + head) * itemsize,
        expert_bytes=expert * itemsize,
        num_moe_layers=cfg.num_hidden_layers,
        num_experts=cfg.n_routed_experts,
        experts_per_token=cfg.num_experts_per_tok,
        kv_bytes_per_token=0.0,
        flop_rate=flop_rate,
        byte_rate=byte_rate,
        window=cfg.sliding_window,
        num_layers=cfg.num_hidden_layers,
        csa_layers=sum(k == CSA for k in kinds),
        hca_layers=sum(k == HCA for k in kinds),
        csa_rate=cfg.csa_rate,
        hca_rate=cfg.hca_rate,
        topk=cfg.index_topk,
        pair_flops=4.0 * cfg.num_attention_heads * cfg.head_dim,
        index_flops=2.0 * cfg.index_n_heads * cfg.index_head_dim,
        row_bytes=cfg.head_dim * itemsize,
        index_row_bytes=cfg.index_head_dim * itemsize,
    )
