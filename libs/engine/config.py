"""Model configuration for the DeepSeek-V3 family (model types ``deepseek_v3``, ``deepseek_v2``).

Frozen and validated on creation; built from a Hugging Face ``config.json`` dict by
:meth:`ModelConfig.from_hf`, which accepts both the legacy ``rope_scaling`` + ``rope_theta``
keys of the original checkpoints and the ``rope_parameters`` dict transformers 5 writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE with optional YaRN scaling (the DeepSeek variant: mscale / mscale_all_dim)."""

    theta: float = 10000.0
    type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # 0 means "not given": transformers then uses the plain YaRN attention factor.
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in ("default", "yarn"):
            raise ValueError(f"rope type {self.type!r} is not supported; use 'default' or 'yarn'")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.type == "yarn" and self.factor < 1.0:
            raise ValueError(f"yarn factor must be >= 1, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; expected one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; only 'silu'")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError("first_k_dense_replace must lie in [0, num_hidden_layers]")
        if self.has_moe:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError("num_experts_per_tok must lie in [1, n_routed_experts]")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                raise ValueError(
                    f"n_routed_experts ({self.n_routed_experts}) must divide into n_group "
                    f"({self.n_group}) equal groups"
                )
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError("topk_group must lie in [1, n_group]")
            if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
                raise ValueError(
                    "noaux_tc routing scores groups by their top-2 experts; "
                    "each group needs at least 2 experts"
                )
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def has_moe(self) -> bool:
        return (
            self.first_k_dense_replace < self.num_hidden_layers or self.num_nextn_predict_layers > 0
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one token's cache entry per layer: normalized latent + RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def config_hash(self) -> str:
        """Stable digest of the architecture (part of a KV layout's identity)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ----------------------------------------------------------
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type {model_type!r}; deepserve loads "
                f"{' and '.join(SUPPORTED_MODEL_TYPES)}"
            )
        v3 = model_type == "deepseek_v3"
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        topk_method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        n_group = raw.get("n_group") or 1
        kwargs: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            moe_intermediate_size=raw.get("moe_intermediate_size", raw["intermediate_size"]),
            num_hidden_layers=raw["num_hidden_layers"],
            first_k_dense_replace=raw.get("first_k_dense_replace", 0),
            num_attention_heads=raw["num_attention_heads"],
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            n_routed_experts=raw.get("n_routed_experts") or 1,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 1,
            n_group=n_group,
            topk_group=raw.get("topk_group") or n_group,
            scoring_func=raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            topk_method=topk_method,
            norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=_rope_from_hf(raw),
            # transformers' V2 always rotates interleaved pairs; V3 makes it a flag.
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=raw.get("hidden_act", "silu"),
        )
        if raw.get("moe_layer_freq", 1) != 1:
            raise ValueError("moe_layer_freq other than 1 is not supported")
        return cls(**kwargs)


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    merged = {**legacy, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
        ),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
        truncate=bool(merged.get("truncate", True)),
    )
