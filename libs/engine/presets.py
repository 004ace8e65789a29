"""Model presets with seeded random weights (no files needed).

* ``tiny``: a few small layers over the bundled DeepSeek tokenizer's 129,280-token
  vocabulary -- CPU tests and ``make up``.
* ``v2-lite``: DeepSeek-V2-Lite's shapes (27 layers, 64 experts top-6, no q-LoRA) over the
  bundled DeepSeek tokenizer's vocabulary (129,280 ids; BOS 0, EOS 1) instead of V2-Lite's own
  102,400: random weights have no tokenizer of their own, so the preset takes the one we ship,
  which the recipe renders with deepseek-recipe's encoding (V2-Lite's 102,400-row embedding
  could not hold the bundled tokenizer's ids). The real V2-Lite is served from its checkpoint
  directory, with the tokenizer and chat template that come with it. The larger embedding and
  head add 2 x 2048 x 26,880 = 0.11B parameters to V2-Lite's 15.7B.
* ``v3-slice``: DeepSeek-V3's widths (7168 hidden, 128 heads, 256 experts top-8, group-limited
  sigmoid routing) over 1 dense + 3 MoE layers.

Weights come from a counter-based hash of (seed, parameter name, element index) computed
with integer tensor ops, so the same seed gives bit-identical weights on CPU and GPU, and a
GPU fills a 70 GB preset in seconds without a host round trip.

Each preset names the tokenizer it is served with in ``libs/engine/tokenizer.py:
PRESET_TOKENIZERS`` (torch-free, for the recipe and the supervisor); a unit test holds the two
tables equal.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from .config import ModelConfig, RopeConfig

_V3_YARN = RopeConfig(
    theta=10000.0,
    type="yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)
_V2_YARN = RopeConfig(
    theta=10000.0,
    type="yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=0.707,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        max_position_embeddings=163840,
        rope=_V3_YARN,
        num_nextn_predict_layers=1,
    ),
    "v2-lite": ModelConfig(
        model_type="deepseek_v2",
        vocab_size=129280,  # the bundled tokenizer's (V2-Lite's own: 102400), see above
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        first_k_dense_replace=1,
        num_attention_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        scoring_func="softmax",
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rope=_V2_YARN,
        bos_token_id=0,  # the bundled tokenizer's <｜begin▁of▁sentence｜> (V2-Lite's: 100000)
        eos_token_ids=(1,),  # and <｜end▁of▁sentence｜> (V2-Lite's: 100001)
    ),
    "v3-slice": ModelConfig(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        max_position_embeddings=163840,
        rope=_V3_YARN,
        num_nextn_predict_layers=1,
    ),
}

_M32 = 0xFFFFFFFF
_CHUNK = 1 << 24  # elements per generation chunk (aligned, so a chunk never crosses 2**32)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap; low 32 bits exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _hash32_np(x: np.ndarray) -> np.ndarray:
    """The same function on numpy uint32 (native wrapping): about 5x faster on a CPU."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _name_key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little")


def _chunk_key(key: int, start: int) -> int:
    """Per-2**32-span key: mixes the high half of the element index into the stream key."""
    return int(_hash32(torch.tensor([((start >> 32) * 0x85EBCA6B + key) & _M32]))[0])


def uniform_block(key: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """Elements ``start .. start+n`` of the stream ``key`` as fp32 in [-1, 1), device-independent.

    ``start`` and ``start + n - 1`` must lie in one 2**32-element span. Every step is exact
    integer arithmetic followed by an exact conversion, so CPU (numpy) and GPU (torch) agree
    bit for bit.
    """
    if start >> 32 != (start + n - 1) >> 32:
        raise ValueError("a block must not cross a 2**32-element boundary")
    hi = _chunk_key(key, start)
    lo = start & _M32
    if device.type == "cpu":
        x = np.arange(lo, lo + n, dtype=np.uint32)
        x *= np.uint32(0x9E3779B1)
        x += np.uint32(hi)
        top = _hash32_np(x) >> np.uint32(8)
        return torch.from_numpy(top.astype(np.float32)) * (2.0**-23) - 1.0
    i = torch.arange(lo, lo + n, dtype=torch.int64, device=device)
    h = _hash32((i * 0x9E3779B1 + hi) & _M32)
    return (h >> 8).to(torch.float32) * (2.0**-23) - 1.0


def _fill(param: torch.Tensor, key: int, scale: float, offset: float = 0.0) -> None:
    flat = param.view(-1)
    for s in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - s)
        vals = uniform_block(key, s, n, param.device) * scale
        if offset:
            vals = vals + offset
        flat[s : s + n].copy_(vals)


def init_random_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter from the seeded stream of its name.

    Matrices get a uniform distribution with standard deviation ``std``; norm weights are
    near 1; the V3 routing bias gets small values so the biased selection path is exercised.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = _name_key(seed, name)
            if name.endswith("norm.weight"):
                _fill(p, key, 0.1, offset=1.0)
            elif name.endswith("e_score_correction_bias"):
                _fill(p, key, 0.01)
            else:
                _fill(p, key, std * math.sqrt(3.0))
