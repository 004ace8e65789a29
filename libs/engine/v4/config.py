"""DeepSeek-V4's configuration, read from a Hugging Face ``config.json`` (transformers'
``DeepseekV4Config``; the same defaults where a key is absent).

V4 differs from V2/V3 in every block: shared-KV multi-query attention over a sliding window
(``sliding_attention``), plus per-layer compressed long-range entries -- every
``compress_rates[csa]`` tokens with a lightning indexer that picks the top ``index_topk`` of them
per query (``compressed_sparse_attention``), or every ``compress_rates[hca]`` tokens, all visible
(``heavily_compressed_attention``); ``hc_mult`` residual streams mixed by hyper-connections;
a grouped low-rank output projection; sqrt-softplus routing, hash-routed MoE in the first layers
(``mlp_layer_types``), SwiGLU clamped at ``swiglu_limit``; per-head attention sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import RopeConfig, _rope_from_hf

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
SCORING = ("sqrtsoftplus", "sigmoid")  # what transformers' V4 router can build


@dataclass(frozen=True)
class V4Rope:
    """One of V4's two rotary tables (``main`` for sliding layers, ``compress`` for CSA/HCA and
    their compressors); ``attention_factor`` scales cos/sin (YaRN's, unless the config fixes
    it; V4's compress table fixes 1.0)."""

    rope: RopeConfig
    attention_factor: float | None = None


@dataclass(frozen=True)
class V4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    csa_rate: int = 4
    hca_rate: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    eos_token_ids: tuple[int, ...] = (1,)
    rope_main: V4Rope = field(default_factory=lambda: V4Rope(RopeConfig(theta=10000.0)))
    rope_compress: V4Rope = field(
        default_factory=lambda: V4Rope(RopeConfig(theta=160000.0), attention_factor=1.0)
    )

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ValueError(
                f"layer_types ({len(self.layer_types)}) and mlp_layer_types "
                f"({len(self.mlp_layer_types)}) must have num_hidden_layers ({n}) entries"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        bad += [t for t in self.mlp_layer_types if t not in MLP_TYPES]
        if bad:
            raise ValueError(f"unknown V4 layer types {bad}; known: {LAYER_TYPES + MLP_TYPES}")
        if self.scoring_func not in SCORING:
            raise ValueError(f"scoring_func must be one of {SCORING}, got {self.scoring_func!r}")
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise ValueError("num_attention_heads * head_dim must divide into o_groups")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise ValueError(
                f"qk_rope_head_dim must be even and <= head_dim, got {self.qk_rope_head_dim}"
            )
        if self.sliding_window < 1 or self.csa_rate < 1 or self.hca_rate < 1:
            raise ValueError("sliding_window and the compress rates must be >= 1")

    def rate(self, layer_type: str) -> int:
        return self.csa_rate if layer_type == CSA else self.hca_rate

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> V4Config:
        """From a transformers ``config.json`` dict (or ``DeepseekV4Config.to_dict()``)."""
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"not a DeepSeek-V4 config (model_type {d.get('model_type')!r})")
        n = int(d.get("num_hidden_layers", 43))
        rates = {CSA: 4, HCA: 128, **(d.get("compress_rates") or {})}
        if "compress_rate_csa" in d:
            rates[CSA] = d["compress_rate_csa"]
        if "compress_rate_hca" in d:
            rates[HCA] = d["compress_rate_hca"]
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            layer_types = [_RATIO_TO_TYPE[r] for r in d["compress_ratios"]]
        if layer_types is None:
            rest = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + rest
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(d.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = int(d.get("head_dim", 512))
        factor = d.get("partial_rotary_factor")
        if factor is None:
            factor = d["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in d else 64 / 512
        rope_dim = int(head_dim * factor)
        rp = d.get("rope_parameters") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main_p, comp_p = rp["main"], rp["compress"]
        else:
            main_p = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
            yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            comp_p = {**yarn, "rope_theta": d.get("compress_rope_theta", 160000.0)}
            comp_p.setdefault("rope_type", "default")
            if comp_p["rope_type"] == "yarn":
                comp_p.setdefault("attention_factor", 1.0)
        eos = d.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (int(eos),)
        return cls(
            vocab_size=int(d.get("vocab_size", 129280)),
            hidden_size=int(d.get("hidden_size", 4096)),
            moe_intermediate_size=int(
                d.get("moe_intermediate_size", d.get("intermediate_size", 2048))
            ),
            num_hidden_layers=n,
            num_attention_heads=int(d.get("num_attention_heads", 64)),
            head_dim=head_dim,
            q_lora_rank=int(d.get("q_lora_rank", 1024)),
            qk_rope_head_dim=rope_dim,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 6)),
            n_routed_experts=int(d.get("n_routed_experts", 256)),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            csa_rate=int(rates[CSA]),
            hca_rate=int(rates[HCA]),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            sliding_window=int(d.get("sliding_window", 128)),
            o_groups=int(d.get("o_groups", 8)),
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 512)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 1)),
            eos_token_ids=eos_ids,
            rope_main=_rope(main_p),
            rope_compress=_rope(comp_p),
        )


def _rope(p: dict[str, Any]) -> V4Rope:
    """One of the two tables, read as V2/V3's ``rope_parameters`` are (``_rope_from_hf``)."""
    rope = _rope_from_hf({"rope_parameters": p})
    af = p.get("attention_factor")
    return V4Rope(rope, None if af is None else float(af))
