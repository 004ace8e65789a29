"""Step-time cost model: FLOPs and bytes a step must move, calibrated from measured steps.

A step's time is estimated as ``overhead + max(flops / flop_rate, bytes / byte_rate)`` scaled
by a factor learned online (exponential moving average of measured / predicted). The
scheduler asks it how many prefill tokens fit a step's time budget; DeepInfer only logs
MFU from a similar estimator, here it decides the chunk size.

No torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

import numpy as np

from .config import ModelConfig

Num = TypeVar("Num", float, np.ndarray)


@dataclass(frozen=True)
class StepShape:
    """What a step computes, per scheduled sequence: (new tokens, context length after).
    Its totals are summed once per shape (:meth:`CostModel.seconds_with_counts` then prices one
    more sequence in constant time)."""

    seqs: tuple[tuple[int, int], ...] = ()

    def add(self, q: int, ctx: int) -> StepShape:
        return StepShape(self.seqs + ((q, ctx),))

    @cached_property
    def tokens(self) -> int:
        return sum(q for q, _ in self.seqs)

    @cached_property
    def pairs(self) -> float:
        """(query, key) pairs the step's attention computes (causal within a chunk)."""
        return sum(_pairs(float(q), ctx) for q, ctx in self.seqs)

    @cached_property
    def context(self) -> int:
        """Context tokens the step's attention reads, summed over its sequences."""
        return sum(ctx for _, ctx in self.seqs)


def _pairs(q: Num, ctx: int) -> Num:
    """(query, key) pairs of ``q`` new tokens ending at context ``ctx`` (causal among them)."""
    out: Num = q * ctx - q * (q - 1) / 2
    return out


@dataclass
class CostModel:
    flops_per_token: float  # non-attention matmul FLOPs per token, vocabulary head excluded
    head_flops: float  # vocabulary projection, paid once per sequence that samples
    attn_flops_per_pair: float  # FLOPs per (query, key) pair over all layers
    dense_weight_bytes: (
        float  # weights every step reads (attention, dense MLPs, shared experts, head)
    )
    expert_bytes: float  # bytes of one routed expert in one layer
    num_moe_layers: int
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token: float  # cache bytes read per context token (all layers)
    flop_rate: float = 1e11
    byte_rate: float = 2e10
    overhead_s: float = 2e-3
    scale: float = 1.0
    alpha: float = 0.3
    samples: int = field(default=0)
    # Measured decode steps (set_rows_table): the seconds of a step of r single-token rows,
    # by the padded row counts the CUDA graphs run at, without attention over context; and
    # its own calibration factor, learnt from measured steps of decode rows.
    rows_sizes: np.ndarray | None = None
    rows_seconds: np.ndarray | None = None
    rows_scale: float = 1.0
    rows_samples: int = 0
    max_rows_q: int = 1  # the most tokens a sequence of a "decode rows" step has (1 + K)

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        weight_dtype_bytes: float,
        kv_dtype_bytes: float,
        flop_rate: float,
        byte_rate: float,
        *,
        expert_param_bytes: float | None = None,
        kv_token_layer_bytes: float | None = None,
    ) -> CostModel:
        """``expert_param_bytes``: bytes per routed-expert weight (FP4 with scales: 0.5 + scale/32);
        ``kv_token_layer_bytes``: cache bytes per token and layer (default: dim x dtype bytes)."""
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        q_params = (
            h * nh * cfg.qk_head_dim
            if cfg.q_lora_rank is None
            else h * cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.qk_head_dim
        )
        attn_params = (
            q_params
            + h * cfg.kv_cache_dim
            + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            + nh * cfg.v_head_dim * h
        )
        n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
        dense_mlp = 3 * h * cfg.intermediate_size
        shared = 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts
        expert = 3 * h * cfg.moe_intermediate_size
        router = h * cfg.n_routed_experts
        active = (
            cfg.num_hidden_layers * attn_params
            + cfg.first_k_dense_replace * dense_mlp
            + n_moe * (shared + router + cfg.num_experts_per_tok * expert)
        )
        dense_weights = (
            cfg.num_hidden_layers * attn_params
            + cfg.first_k_dense_replace * dense_mlp
            + n_moe * (shared + router)
            + h * cfg.vocab_size
        )
        return cls(
            flops_per_token=2.0 * active,
            head_flops=2.0 * h * cfg.vocab_size,
            attn_flops_per_pair=2.0
            * cfg.num_hidden_layers
            * nh
            * (cfg.qk_head_dim + cfg.v_head_dim),
            dense_weight_bytes=float(dense_weights * weight_dtype_bytes),
            expert_bytes=float(expert * (expert_param_bytes or weight_dtype_bytes)),
            num_moe_layers=n_moe,
            num_experts=cfg.n_routed_experts,
            experts_per_token=cfg.num_experts_per_tok,
            kv_bytes_per_token=float(
                cfg.num_hidden_layers * (kv_token_layer_bytes or cfg.kv_cache_dim * kv_dtype_bytes)
            ),
            flop_rate=flop_rate,
            byte_rate=byte_rate,
        )

    # -- estimates ---------------------------------------------------------------------------
    def flops(self, shape: StepShape) -> float:
        return float(self._flops(len(shape.seqs), shape.tokens, shape.pairs))

    def bytes(self, shape: StepShape) -> float:
        if shape.tokens == 0:
            return 0.0
        return float(self._bytes(shape.tokens, shape.context))

    # The formulas take numbers or arrays of them (seconds_with_counts prices many at once).
    def _flops(self, seqs: int, tokens: Num, pairs: Num) -> Num:
        return (
            self.flops_per_token * tokens
            + self.head_flops * seqs
            + self.attn_flops_per_pair * pairs
        )

    def _bytes(self, tokens: Num, context: int) -> Num:
        e, k = self.num_experts, self.experts_per_token
        # Expected distinct experts a layer touches when t tokens each pick k of e.
        touched = e * (1.0 - (1.0 - k / e) ** tokens) if self.num_moe_layers else 0.0 * tokens
        kv = context * self.kv_bytes_per_token
        return self.dense_weight_bytes + self.num_moe_layers * touched * self.expert_bytes + kv

    def _time(self, flops: Num, moved: Num) -> Num:
        out: Num = self.overhead_s + np.maximum(flops / self.flop_rate, moved / self.byte_rate)
        return out

    def raw_seconds(self, shape: StepShape) -> float:
        if not shape.seqs:
            return 0.0
        return float(self._time(self.flops(shape), self.bytes(shape)))

    def seconds(self, shape: StepShape) -> float:
        return self.scale * self.raw_seconds(shape)

    def seconds_with_counts(self, shape: StepShape, qs: np.ndarray, ctx: int) -> np.ndarray:
        """``seconds(shape.add(q, ctx))`` for each ``q`` of ``qs`` (all > 0), from ``shape``'s
        totals in one pass: speculative decoding prices every count of drafts it might add to
        a step this way."""
        q = qs.astype(np.float64)
        tokens, pairs = shape.tokens + q, shape.pairs + _pairs(q, ctx)
        flops = self._flops(len(shape.seqs) + 1, tokens, pairs)
        out: np.ndarray = self.scale * self._time(flops, self._bytes(tokens, shape.context + ctx))
        return out

    # -- measured decode rows ----------------------------------------------------------------------
    def set_rows_table(self, seconds_by_rows: dict[int, float], max_q: int) -> None:
        """A step of ``r`` decode rows takes ``seconds_by_rows[r']`` for the smallest measured
        ``r' >= r`` (the graph it replays), plus its attention over context. ``max_q``: the
        most rows one sequence of such a step has (1 + K with speculative verification)."""
        if not seconds_by_rows:
            return
        self.max_rows_q = max_q
        sizes = sorted(seconds_by_rows)
        self.rows_sizes = np.asarray(sizes, dtype=np.int64)
        self.rows_seconds = np.asarray([seconds_by_rows[r] for r in sizes], dtype=np.float64)

    def _rows_raw(self, rows: np.ndarray, context: np.ndarray) -> np.ndarray | None:
        """Measured-table time of ``rows`` decode rows reading ``context`` cached tokens in all
        (each row its own: a step's ``pairs``; None where the table does not reach)."""
        if self.rows_sizes is None or self.rows_seconds is None:
            return None
        if rows.size == 0 or int(rows.max()) > int(self.rows_sizes[-1]):
            return None
        graph = self.rows_seconds[np.searchsorted(self.rows_sizes, rows)]
        out: np.ndarray = graph + context * (self.kv_bytes_per_token / self.byte_rate)
        return out

    def rows_seconds_for(self, rows: np.ndarray, context: np.ndarray) -> np.ndarray | None:
        """Estimated seconds of steps of only decode rows (``rows[i]`` rows reading
        ``context[i]`` cached tokens) from the measured table, calibrated by the decode steps
        observed since; None without a table that reaches every count."""
        raw = self._rows_raw(np.asarray(rows), np.asarray(context, dtype=np.float64))
        if raw is None:
            return None
        return np.asarray(self.rows_scale * raw, dtype=np.float64)

    def observe(self, shape: StepShape, measured_s: float) -> None:
        """Fold one measured step time into the calibration factor (and, for a step of decode
        rows only -- single tokens and speculative verification, ``q <= max_rows_q`` -- into
        the measured table's)."""
        raw = self.raw_seconds(shape)
        if raw <= 0 or measured_s <= 0:
            return
        if shape.seqs and max(q for q, _ in shape.seqs) <= self.max_rows_q:
            rows_raw = self._rows_raw(np.array([shape.tokens]), np.array([shape.pairs]))
            if rows_raw is not None and rows_raw[0] > 0:
                self.rows_scale = self._fold(
                    self.rows_scale, self.rows_samples, measured_s / float(rows_raw[0])
                )
                self.rows_samples += 1
        self.scale = self._fold(self.scale, self.samples, measured_s / raw)
        self.samples += 1

    def _fold(self, factor: float, samples: int, ratio: float) -> float:
        """A calibration factor after one more measured / estimated ``ratio`` (clamped): the
        first sample as it is, then an exponential moving average."""
        ratio = min(max(ratio, 1e-3), 1e3)
        return ratio if samples == 0 else (1 - self.alpha) * factor + self.alpha * ratio

    def max_chunk(self, shape: StepShape, ctx_before: int, remaining: int, budget_s: float) -> int:
        """Largest q <= remaining such that adding (q, ctx_before + q) keeps the step in budget."""
        if self.seconds(shape.add(remaining, ctx_before + remaining)) <= budget_s:
            return remaining
        lo, hi = 0, remaining
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.seconds(shape.add(mid, ctx_before + mid)) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
