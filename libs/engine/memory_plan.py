"""What a model needs per GPU, from its config alone, before any weight is read.

:func:`weight_bytes` counts the bytes the loaded model holds (parameter by parameter, as
:class:`~libs.engine.model.model.DeepseekForCausalLM` allocates them at the chosen precision:
model-dtype, FP8 linears and experts with 128x128 fp32 block scales, or FP4 experts with a
bf16 scale per 32 weights), the copies its first step derives (decode's absorbed ``kv_b``
halves, the router's fp32 weight), and the most it holds while loading (routed experts are
read in the model dtype and quantized afterwards; a preset is built whole, then cut to its EP
slots). :func:`plan_memory` adds a step's activation reserve and at least one step's KV blocks
and sets the sum against the GPU's budget; :class:`MemoryPlan` says it in one line, or refuses
with the arithmetic. Pure arithmetic: no torch, no device.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

_GIB = float(1 << 30)
_FP8_TILE = 128  # FP8 weights: one fp32 scale per 128x128 tile
_FP4_SCALE_BLOCK = 32  # FP4 experts: one bf16 scale per 32 weights


def _tiles(n: int) -> int:
    return -(-n // _FP8_TILE)


@dataclass(frozen=True)
class WeightBytes:
    params: int  # what the loaded (and quantized) model holds
    derived: int  # copies the first step makes: absorbed kv_b halves, fp32 router weights
    load_peak: int  # the most held while loading

    @property
    def serving(self) -> int:
        return self.params + self.derived


def weight_bytes(
    cfg: ModelConfig,
    *,
    dtype_bytes: int,
    weights: str = "bf16",
    experts: str = "model",
    expert_slots: int | None = None,
    with_mtp: bool = False,
    preset: bool = False,
) -> WeightBytes:
    """Bytes of ``cfg``'s weights on one device.

    ``weights``: ``"bf16"`` (the model dtype, ``dtype_bytes`` per weight) or ``"fp8"`` (the
    attention and MLP linears and the routed experts of every decoder and MTP layer in e4m3
    with block scales; embeddings, router, norms, ``eh_proj`` and heads in the model dtype);
    ``experts``: ``"model"`` (as ``weights`` says) or ``"fp4"``; ``expert_slots``: routed-expert
    rows one rank of an expert-parallel group keeps in each decoder layer (None: all; MTP
    layers keep all); ``preset``: weights made on the device (built whole before any cut or
    quantization) rather than read from a checkpoint.
    """
    if weights not in ("bf16", "fp8"):
        raise ValueError(f"weights must be bf16 or fp8, got {weights!r}")
    if experts not in ("model", "fp4"):
        raise ValueError(f"experts must be model or fp4, got {experts!r}")
    b = dtype_bytes
    fp8 = weights == "fp8"
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    count = _Counter(cfg, b, with_mtp)
    rows = cfg.n_routed_experts if expert_slots is None else expert_slots
    stored = "fp4" if experts == "fp4" else "fp8" if fp8 else "model"
    params = count.model(rows, stored, fp8)
    # Loading: experts arrive in the model dtype and are quantized once all are read; a preset
    # is made whole (every expert, linears in the model dtype) and then cut and quantized.
    peak = count.model(cfg.n_routed_experts if preset else rows, "model", fp8 and not preset)
    attention_layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    moe_layers = attention_layers - cfg.first_k_dense_replace
    derived = attention_layers * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * b
    if b != 4:
        derived += moe_layers * cfg.n_routed_experts * h * 4
    return WeightBytes(params, derived, max(params, peak))


class _Counter:
    """Bytes of the parts of ``cfg``'s model, ``b`` per weight in the model dtype; a quantized
    linear is e4m3 with an fp32 scale per 128x128 tile (:func:`weight_bytes`)."""

    def __init__(self, cfg: ModelConfig, b: int, with_mtp: bool) -> None:
        self.cfg, self.b, self.with_mtp = cfg, b, with_mtp

    def linear(self, out_f: int, in_f: int, bias: bool = False, quantized: bool = False) -> int:
        b = self.b
        w = out_f * in_f + _tiles(out_f) * _tiles(in_f) * 4 if quantized else out_f * in_f * b
        return w + (out_f * b if bias else 0)

    def attention(self, quantized: bool) -> int:
        cfg, b, linear = self.cfg, self.b, self.linear
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            q = linear(nh * cfg.qk_head_dim, h, quantized=quantized)
        else:
            r = cfg.q_lora_rank
            q = (
                linear(r, h, bias, quantized)
                + r * b
                + linear(nh * cfg.qk_head_dim, r, False, quantized)
            )
        return (
            2 * h * b  # input and post-attention norms
            + q
            + linear(cfg.kv_cache_dim, h, bias, quantized)
            + cfg.kv_lora_rank * b
            + linear(
                nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, False, quantized
            )
            + linear(h, nh * cfg.v_head_dim, bias, quantized)
        )

    def mlp(self, inter: int, quantized: bool) -> int:
        h, linear = self.cfg.hidden_size, self.linear
        return 2 * linear(inter, h, quantized=quantized) + linear(h, inter, quantized=quantized)

    def routed(self, rows: int, how: str) -> int:
        h, i_moe = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        if how == "fp4":
            packed = 3 * h * i_moe // 2
            scales = (2 * i_moe * (h // _FP4_SCALE_BLOCK) + h * (i_moe // _FP4_SCALE_BLOCK)) * 2
            return rows * (packed + scales)
        if how == "fp8":
            scales = (_tiles(2 * i_moe) * _tiles(h) + _tiles(h) * _tiles(i_moe)) * 4
            return rows * (3 * h * i_moe + scales)
        return rows * 3 * h * i_moe * self.b

    def moe(self, rows: int, how: str, quantized: bool) -> int:
        cfg = self.cfg
        router = cfg.n_routed_experts * cfg.hidden_size * self.b
        if cfg.topk_method == "noaux_tc":
            router += cfg.n_routed_experts * 4
        i_moe = cfg.moe_intermediate_size
        shared = self.mlp(i_moe * cfg.n_shared_experts, quantized) if cfg.n_shared_experts else 0
        return router + shared + self.routed(rows, how)

    def model(self, rows: int, how: str, quantized: bool) -> int:
        """The whole model with decoder layers keeping ``rows`` experts stored ``how``."""
        cfg, b = self.cfg, self.b
        h = cfg.hidden_size
        dense = cfg.first_k_dense_replace
        total = 2 * cfg.vocab_size * h * b + h * b  # embedding, lm_head, final norm
        total += cfg.num_hidden_layers * self.attention(quantized)
        total += dense * self.mlp(cfg.intermediate_size, quantized)
        total += (cfg.num_hidden_layers - dense) * self.moe(rows, how, quantized)
        n_mtp = cfg.num_nextn_predict_layers if self.with_mtp else 0
        mtp_layer = (
            self.attention(quantized)
            + self.moe(cfg.n_routed_experts, how, quantized)
            + 2 * cfg.vocab_size * h * b  # its embedding and shared head
            + 3 * h * b  # enorm, hnorm, the shared head's norm
            + 2 * h * h * b  # eh_proj
        )
        return total + n_mtp * mtp_layer


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's memory for one engine (rank): need against budget."""

    model: str  # how the model is named in the line
    precision: str  # "bf16", "fp8", "bf16 + fp4 experts", ...
    weights: WeightBytes
    activation_bytes: int
    kv_bytes: int
    kv_is_minimum: bool  # one step's blocks (the cache then takes what is left)
    gpu_bytes: int  # the device's total memory, or its free memory when fraction is None
    fraction: float | None  # the engine's share of gpu_bytes; None: gpu_bytes is what is free
    ep: int = 1
    experts_per_rank: int | None = None
    n_experts: int = 0

    @property
    def steady_bytes(self) -> int:
        return self.weights.serving + self.activation_bytes + self.kv_bytes

    @property
    def need_bytes(self) -> int:
        return max(self.steady_bytes, self.weights.load_peak)

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_bytes * (1.0 if self.fraction is None else self.fraction))

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.budget_bytes

    def _where(self) -> str:
        if self.ep <= 1:
            return "per GPU"
        return f"per GPU at EP {self.ep} ({self.experts_per_rank} of {self.n_experts} experts)"

    def _gpu(self) -> str:
        if self.fraction is None:
            return f"this GPU has {_gib(self.gpu_bytes)} free"
        return (
            f"this GPU has {_gib(self.gpu_bytes)} x {self.fraction:.2f} = {_gib(self.budget_bytes)}"
        )

    def _parts(self) -> str:
        kv = f"KV {'>= ' if self.kv_is_minimum else ''}{_gib(self.kv_bytes)}"
        return (
            f"weights {_gib(self.weights.serving)} + activations "
            f"{_gib(self.activation_bytes)} + {kv}"
        )

    def _loading(self) -> str:
        """Why loading holds more than serving, or ""."""
        if self.weights.load_peak <= self.steady_bytes:
            return ""
        return (
            f"loading holds {_gib(self.weights.load_peak)} (routed experts are read in the "
            "model dtype, then quantized)"
        )

    def line(self) -> str:
        """``v2-lite bf16: weights 29.6 GiB + activations 2.2 GiB + KV >= 0.1 GiB per GPU
        = 31.9 GiB; this GPU has 79.1 GiB x 0.90 = 71.2 GiB``."""
        loading = self._loading()
        if loading:
            return (
                f"{self.model} {self.precision}: {self._parts()} = {_gib(self.steady_bytes)} "
                f"{self._where()}, but {loading}; {self._gpu()}"
            )
        return (
            f"{self.model} {self.precision}: {self._parts()} {self._where()} = "
            f"{_gib(self.need_bytes)}; {self._gpu()}"
        )

    def refusal(self) -> str:
        """Why it cannot fit, with the arithmetic and what would help."""
        helps = []
        if "fp8" not in self.precision and "fp4" not in self.precision:
            helps.append("--weights fp8 or --experts fp4")
        if self.n_experts > 1:
            helps.append("more expert-parallel ranks (--ep)")
        if self.fraction is not None and self.fraction < 0.95 and self.need_bytes < self.gpu_bytes:
            helps.append("a larger --gpu-memory-fraction")
        if not self.kv_is_minimum:
            helps.append("fewer KV blocks (--num-kv-blocks)")
        helps.append("a smaller --max-tokens-per-step or --max-model-len")
        loading = self._loading()
        return (
            f"{self.model} in {self.precision} needs {_gib(self.need_bytes)} {self._where()}: "
            f"{self._parts()}{'; ' + loading if loading else ''}; {self._gpu()}. "
            f"Try {', '.join(helps)}"
        )


def _gib(n: int | float) -> str:
    return f"{n / _GIB:.1f} GiB"


def plan_memory(
    cfg: ModelConfig,
    *,
    model: str,
    dtype_bytes: int,
    weights: str,
    experts: str,
    activation_bytes: int,
    kv_bytes_per_block: int,
    kv_blocks: int,
    kv_is_minimum: bool,
    gpu_bytes: int,
    fraction: float | None,
    ep: int = 1,
    expert_slots: int | None = None,
    with_mtp: bool = False,
    preset: bool = False,
) -> MemoryPlan:
    """The plan for one engine (one rank with ``ep`` > 1) on a GPU of ``gpu_bytes``.

    ``kv_blocks``: the KV blocks it will allocate (``kv_is_minimum``: the fewest one step
    needs, the cache then taking what is left); the cache's scratch block is added here.
    """
    wb = weight_bytes(
        cfg,
        dtype_bytes=dtype_bytes,
        weights=weights,
        experts=experts,
        expert_slots=expert_slots,
        with_mtp=with_mtp,
        preset=preset,
    )
    model_dtype = {2: "bf16", 4: "fp32", 1: "fp8"}.get(dtype_bytes, f"{8 * dtype_bytes}-bit")
    precision = "fp8" if weights == "fp8" else model_dtype
    if experts == "fp4":
        precision += " + fp4 experts"
    return MemoryPlan(
        model=model,
        precision=precision,
        weights=wb,
        activation_bytes=activation_bytes,
        kv_bytes=(kv_blocks + 1) * kv_bytes_per_block,
        kv_is_minimum=kv_is_minimum,
        gpu_bytes=gpu_bytes,
        fraction=fraction,
        ep=ep,
        experts_per_rank=expert_slots if expert_slots is not None else cfg.n_routed_experts,
        n_experts=cfg.n_routed_experts,
    )
