"""Random small DeepSeek configs built and saved with transformers, the reference in parity tests.

transformers is a test dependency only: the engine never imports it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from libs.engine.v4.config import V4Config
from libs.engine.v4.model import V4ForCausalLM


def require_reference(module: str) -> ModuleType:
    """Import a test-only dependency that tests compare against (transformers, matplotlib).

    Missing in CI (``CI`` set, as every CI service sets it) is a failure that says what to
    install: a parity test that skipped there would pass a build nobody checked. Elsewhere it
    skips, naming the missing module. Call it at module level or in a test."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        error = exc
    why = f"{module} is not installed ({error}); these tests compare against it: "
    why += "pip install -e '.[test]'"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI must run the reference tests: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


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


# -- DeepSeek-V4 (transformers' DeepseekV4ForCausalLM) --------------------------------------------

V4_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    qk_rope_head_dim=8,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    hc_mult=2,
    hc_sinkhorn_iters=5,
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    max_position_embeddings=512,
    initializer_range=0.1,
    eos_token_id=1,
    bos_token_id=0,
)
_S, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Layer schedules, windows, compression rates and routing differ from the defaults and each other.
V4_CONFIGS: dict[str, dict[str, Any]] = {
    "v4-mixed": dict(
        num_hidden_layers=4,
        layer_types=[_S, _C, _H, _C],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    ),
    "v4-default-schedule-yarn": dict(
        num_hidden_layers=4,  # transformers' default schedule: HCA, HCA, then CSA/HCA
        sliding_window=16,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_topk=4,
        scoring_func="sigmoid",
        rope_parameters=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    "v4-wide-streams": dict(
        num_hidden_layers=3,
        layer_types=[_C, _S, _H],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        hc_mult=3,
        o_groups=4,
        sliding_window=5,
        compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 6},
        index_topk=2,
    ),
}


# Where CSA's indexer chooses among exact ties (tests/unit/test_v4_indexer_parity.py): with 2
# indexer heads a quarter of the entries score exactly 0 (ReLU zeroes both heads' products),
# so several entries tie at the k-th pick in most rows that hold more than index_topk entries.
# Not in V4_CONFIGS: transformers breaks those ties by torch.topk's algorithm (see
# index_ties_to_lower_entry), so the tests that compare against it unpinned must not see them.
V4_INDEXER_CONFIGS: dict[str, dict[str, Any]] = {
    "v4-indexer-ties": dict(
        num_hidden_layers=3,
        layer_types=[_C, _H, _C],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        index_n_heads=2,
        index_topk=4,
    ),
}


def _stable_topk(
    x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> Any:
    s = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((s.values.narrow(dim, 0, k), s.indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def index_ties_to_lower_entry() -> Iterator[None]:
    """transformers' CSA indexer with exactly tied scores going to the lower entry, as ours.

    Its ``DeepseekV4Indexer`` keeps ``index_scores.topk(k)``; torch.topk leaves the order of
    equal values to its algorithm, which on the CPU changes with the row's length (zeros at
    entries 5 and 6 of a row: it keeps 6 in rows of 9, 20, 40 or 200 entries, 5 in rows of 80),
    and a one-pass row holds every entry of the prompt, the not-yet-closed ones masked. So there
    a position's picks, and logits, change with how many tokens follow it in the same call
    (v4-tiny, 320-token prompt: the first 100 positions alone vs within the 320, up to 0.099
    apart at 62 of them), and no cache can reproduce them. With this rule (a stable sort: the
    top ``k`` by score, ties to the lower entry) it is the top-k the indexer defines, the same
    for every chunking. Only torch.topk inside the indexer's forward changes (the routers'
    top-k, on scores that do not tie, stays transformers' own)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

    original = hf_v4.DeepseekV4Indexer.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        topk = torch.Tensor.topk
        torch.Tensor.topk = _stable_topk  # type: ignore[method-assign,assignment]
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = topk  # type: ignore[method-assign]

    hf_v4.DeepseekV4Indexer.forward = forward
    try:
        yield
    finally:
        hf_v4.DeepseekV4Indexer.forward = original


def build_hf_v4(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A transformers DeepSeek-V4 model of the named config (``overrides``: fields changed),
    seeded random weights (fp32, eager), with the parameters transformers initializes to
    constants (sinks, pooling position biases, hyper-connection biases, norms) and the buffers a
    checkpoint supplies (hash routing table, score correction bias) randomized too, so a
    swapped one must show."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kwargs = {**V4_BASE, **{**V4_CONFIGS, **V4_INDEXER_CONFIGS}[name], **overrides}
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kwargs, attn_implementation="eager"))
    gen = torch.Generator().manual_seed(seed + 1)
    e, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(("scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.rand(p.shape, generator=gen) - 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                rows = [torch.randperm(e, generator=gen)[:k] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))
            elif bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


def ours_of(hf: torch.nn.Module) -> V4ForCausalLM:
    """Our V4 model of a transformers DeepSeek-V4 model: its config, its weights."""
    ours = V4ForCausalLM(V4Config.from_hf(hf.config.to_dict()))
    ours.load_hf_state(hf.state_dict())
    return ours
