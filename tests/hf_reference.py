"""Random small DeepSeek configs built and saved with transformers, the reference in parity tests.

transformers is a test dependency only: the engine never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Each config exercises a different corner of the family; vocab is small to keep CPU runs fast.
V3_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=2048,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=8.0,
        original_max_position_embeddings=256,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=0.8,
    ),
    rope_interleave=True,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    initializer_range=0.08,
    eos_token_id=1,
    bos_token_id=0,
)

V2_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=3,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    max_position_embeddings=2048,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=512,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    tie_word_embeddings=False,
    initializer_range=0.08,
    eos_token_id=1,
    bos_token_id=0,
)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "v3-yarn-grouped": ("deepseek_v3", {}),
    "v3-no-interleave-2dense": (
        "deepseek_v3",
        dict(
            rope_interleave=False,
            first_k_dense_replace=2,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            q_lora_rank=24,
            hidden_size=96,
        ),
    ),
    "v3-default-rope-no-qlora": (
        "deepseek_v3",
        dict(
            q_lora_rank=None,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0),
            norm_topk_prob=False,
            n_shared_experts=2,
        ),
    ),
    "v2-softmax-greedy": ("deepseek_v2", {}),
    "v2-group-limited": (
        "deepseek_v2",
        dict(
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            n_routed_experts=16,
            routed_scaling_factor=1.5,
        ),
    ),
}


def build_hf(name: str, seed: int = 0) -> torch.nn.Module:
    """A transformers model of the named config with seeded random weights (fp32, eager)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    model_type, overrides = CONFIGS[name]
    base = V3_BASE if model_type == "deepseek_v3" else V2_BASE
    kwargs = {**base, **overrides}
    torch.manual_seed(seed)
    if model_type == "deepseek_v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs, attn_implementation="eager"))
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**kwargs, attn_implementation="eager"))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for pname, p in model.named_parameters():
            if "norm" in pname:  # not all ones: a swapped norm must show
                p.copy_(1.0 + 0.2 * torch.rand(p.shape, generator=gen) - 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # exercise the biased selection
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


def save_hf(model: torch.nn.Module, out: Path, layout: str = "per-expert") -> Path:
    """Save as transformers does (per-expert names), sharded with an index, or fused experts."""
    out.mkdir(parents=True, exist_ok=True)
    if layout == "per-expert":
        model.save_pretrained(out)
    elif layout == "sharded":
        model.save_pretrained(out, max_shard_size="200KB")
    elif layout == "fused":
        from safetensors.torch import save_file

        model.config.save_pretrained(out)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state), "expected fused experts"
        save_file(state, str(out / "model.safetensors"))
    else:
        raise ValueError(layout)
    return out


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt], device=_device(model))).logits[0].float()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=_device(model)), max_new_tokens=n, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


def config_json(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())
