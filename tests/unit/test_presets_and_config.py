from __future__ import annotations

import json

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.kv.layout import mla_cache_spec
from libs.engine.model.model import DeepseekForCausalLM
from libs.engine.presets import _M32, PRESETS, _hash32, uniform_block

CPU = torch.device("cpu")


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_weight_stream_matches_its_plain_python_definition() -> None:
    key, start = 0xABCDEF, (5 << 32) + 100
    hi = _lowbias32(((start >> 32) * 0x85EBCA6B + key) & 0xFFFFFFFF)
    expect = [
        (_lowbias32(((((start + i) & 0xFFFFFFFF) * 0x9E3779B1) + hi) & 0xFFFFFFFF) >> 8) * 2.0**-23
        - 1.0
        for i in range(5)
    ]
    got = uniform_block(key, start, 5, CPU).tolist()
    assert got == expect


def test_numpy_and_torch_integer_paths_agree() -> None:
    """The CPU path (numpy uint32) and the GPU path (torch int64) are the same function."""
    key, start, n = 77, 3 << 32, 1 << 16
    hi = int(_hash32(torch.tensor([((start >> 32) * 0x85EBCA6B + key) & _M32]))[0])
    i = torch.arange(0, n, dtype=torch.int64)
    via_torch = (_hash32((i * 0x9E3779B1 + hi) & _M32) >> 8).to(torch.float32) * 2.0**-23 - 1.0
    assert torch.equal(uniform_block(key, start, n, CPU), via_torch)


def test_same_seed_same_weights_other_seed_other_weights(tiny_loaded) -> None:
    from libs.engine.loader import load

    again = load("tiny", CPU, torch.float32, seed=0).model.state_dict()
    other = load("tiny", CPU, torch.float32, seed=1).model.state_dict()
    for k, v in tiny_loaded.model.state_dict().items():
        assert torch.equal(v, again[k]), k
        if v.numel() > 16:
            assert not torch.equal(v, other[k]), k
    w = tiny_loaded.model.model.embed_tokens.weight
    assert abs(w.std().item() - 0.02) < 0.001 and tiny_loaded.model_id.startswith("tiny-seed0@")


def _billions(cfg: ModelConfig, with_mtp: bool = False) -> float:
    model = DeepseekForCausalLM(cfg, torch.bfloat16, "meta", with_mtp=with_mtp)
    return sum(p.numel() for p in model.parameters()) / 1e9


@pytest.mark.parametrize(
    "name,cfg,billions",
    [
        # DeepSeek-V2-Lite: 15.7B parameters with its own 102,400-token vocabulary...
        ("v2-lite", PRESETS["v2-lite"].replace(vocab_size=102400), 15.7),
        # ...and the preset, over the bundled tokenizer's 129,280 ids: the embedding and the
        # head grow by 2 x 2048 x 26,880 = 0.110B.
        ("v2-lite", PRESETS["v2-lite"], 15.7 + 2 * 2048 * (129280 - 102400) / 1e9),
        (
            "v3-full",
            PRESETS["v3-slice"].replace(num_hidden_layers=61, first_k_dense_replace=3),
            671.0,
        ),
        ("v3-slice", PRESETS["v3-slice"], 36.96),  # 1 dense + 3 of the full model's MoE layers
    ],
)
def test_large_presets_have_the_published_shapes(
    name: str, cfg: ModelConfig, billions: float
) -> None:
    assert abs(_billions(cfg) - billions) / billions < 0.005, name
    spec = mla_cache_spec(cfg, name)
    assert spec.paged[0].bytes_per_token == 576 * 2  # latent 512 + rope 64, bf16


def test_v3_mtp_layer_adds_about_the_published_14b() -> None:
    full = PRESETS["v3-slice"].replace(num_hidden_layers=61, first_k_dense_replace=3)
    # 685B with the MTP module; its embedding and head duplicate the main model's (2 x 0.93B).
    assert abs(_billions(full, with_mtp=True) - 671.0 - 11.5 - 1.85) < 0.5


def test_tiny_preset_uses_the_bundled_tokenizer_vocabulary() -> None:
    from libs.engine.tokenizer import load_tokenizer

    assert load_tokenizer().get_vocab_size() == PRESETS["tiny"].vocab_size == 129280


def test_the_torch_free_tokenizer_table_agrees_with_the_presets_and_the_fake_engine() -> None:
    """The recipe and the supervisor read PRESET_TOKENIZERS (no torch); the engines PRESETS."""
    from libs.engine.tokenizer import PRESET_TOKENIZERS, load_tokenizer
    from libs.engine.v4.config import V4Config
    from libs.engine.v4.load import V4_PRESETS
    from libs.engine.v4.serving import engine_view
    from libs.serving.fake_engine import FAKE_CONFIG, FAKE_MODEL

    v4 = {name: engine_view(V4Config.from_hf(raw)) for name, raw in V4_PRESETS.items()}
    configs = {**PRESETS, **v4, FAKE_MODEL: FAKE_CONFIG}
    assert set(PRESET_TOKENIZERS) == set(configs)
    bundled = load_tokenizer()
    for name, cfg in configs.items():
        t = PRESET_TOKENIZERS[name]
        assert (t.vocab_size, t.bos_token_id, t.eos_token_ids) == (
            cfg.vocab_size,
            cfg.bos_token_id,
            cfg.eos_token_ids,
        ), name
        # every preset is served with the bundled tokenizer: its BOS and EOS are the model's
        assert bundled.id_to_token(cfg.eos_token_ids[0]) == "<｜end▁of▁sentence｜>", name
        assert bundled.id_to_token(cfg.bos_token_id or 0) == "<｜begin▁of▁sentence｜>", name


def test_config_from_original_deepseek_v3_json() -> None:
    raw = {  # as in DeepSeek-V3's own config.json (legacy rope_scaling, fp8 quantization)
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    cfg = ModelConfig.from_hf(raw)
    assert cfg.rope.type == "yarn" and cfg.rope.factor == 40 and cfg.rope.mscale_all_dim == 1.0
    assert cfg.topk_method == "noaux_tc" and cfg.num_nextn_predict_layers == 1
    assert cfg.kv_cache_dim == 576 and cfg.rope_interleave


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(model_type="llama"), "model_type"),
        (dict(n_routed_experts=10, n_group=4), "equal groups"),
        (dict(topk_group=9), "topk_group"),
        (dict(num_experts_per_tok=300), "num_experts_per_tok"),
        (dict(qk_rope_head_dim=7), "even"),
    ],
)
def test_bad_configs_are_refused_with_a_reason(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        PRESETS["tiny"].replace(**bad)


def test_layout_hash_names_everything_that_shapes_block_bytes() -> None:
    cfg = PRESETS["tiny"]
    base = mla_cache_spec(cfg, "m", 128, "bfloat16")
    assert base.bytes_per_block == cfg.num_hidden_layers * 128 * cfg.kv_cache_dim * 2
    assert base.layout_hash() == mla_cache_spec(cfg, "m", 128, "bfloat16").layout_hash()
    for other in (
        mla_cache_spec(cfg, "m", 64, "bfloat16"),
        mla_cache_spec(cfg, "m", 128, "float32"),
        mla_cache_spec(cfg, "m2", 128, "bfloat16"),
        mla_cache_spec(cfg, "m", 128, "bfloat16", 4),
    ):
        assert other.layout_hash() != base.layout_hash()
    json.dumps(base.layout_hash())


def test_service_flags_pass_fp8_kv_and_fp4_experts_to_the_engine() -> None:
    import argparse

    from libs.serving.model_flags import add_model_flags, model_flags_from

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    cfg = model_flags_from(
        parser.parse_args(["--kv-cache-dtype", "fp8", "--experts", "fp4"])
    ).engine_config()
    assert (cfg.kv_cache_dtype, cfg.expert_dtype) == ("float8_e4m3fn", "fp4")
    default = model_flags_from(parser.parse_args([])).engine_config()
    assert (default.kv_cache_dtype, default.expert_dtype) == (None, "auto")
    with pytest.raises(ValueError, match="--experts must be bf16 or fp4"):
        model_flags_from(parser.parse_args(["--experts", "int4"]))
