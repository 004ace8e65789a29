"""DeepSeek's release layouts load exactly (issue 37 item 2): synthetic checkpoints written as
DeepSeek-V2-Lite (bf16) and DeepSeek-V3 / R1 (e4m3 projections with 128x128
``weight_scale_inv``, the MTP module as the layer after the last) are published -- names, dtypes,
shapes, shard names, ``model.safetensors.index.json`` -- at small widths, and the engine's greedy
tokens equal transformers' on the same tensors.

transformers loads the V2-Lite release itself. It loads V3's FP8 layout only through
``accelerate`` and then dequantizes to bf16, so its reference is the same e4m3 tensors times
their tile scales, in fp32 -- the values the engine loads with ``weight_dtype=bf16`` (fp32
here). Widths are multiples of 128 where the release's are (hidden, intermediate sizes), with a
partial tile where the release has one too (``kv_a_proj_with_mqa``: 576 rows in V3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepserve.bench.release import (
    V2_LITE,
    V3,
    is_fp8_in_release,
    release_shapes,
    scale_shape,
    shard_name,
    with_mtp_layer,
    write_release,
)
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kernels.fp8_gemm import FP8_DTYPE
from libs.engine.loader import load
from tests.hf_reference import hf_greedy, require_reference

require_reference("transformers")

LAYERS = 3
SMALL = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=384,
    moe_intermediate_size=128,
    num_hidden_layers=LAYERS,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    initializer_range=0.05,
    bos_token_id=0,
    eos_token_id=1,
)
CONFIGS: dict[str, dict[str, Any]] = {
    # V2-Lite: no q_lora, softmax greedy routing over 64 experts (here 8), 2 shared.
    V2_LITE: dict(
        SMALL,
        q_lora_rank=None,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=128,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
    # V3/R1: q_lora, sigmoid routing with correction bias, groups, one MTP module.
    V3: dict(
        SMALL,
        q_lora_rank=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=128,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}
PROMPTS = [[5, 17, 99, 3, 250, 77, 8], [400, 2, 2, 31], list(range(40, 80))]
STEPS = 8


def _hf_model(layout: str, seed: int) -> Any:
    import transformers

    arch = "DeepseekV2" if layout == V2_LITE else "DeepseekV3"
    cfg = getattr(transformers, arch + "Config")(**CONFIGS[layout], attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, arch + "ForCausalLM")(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.rand(p.shape, generator=g) - 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module", params=[V2_LITE, V3])
def release(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path]:
    """(layout, the release directory, a directory transformers loads as the reference)."""
    layout = request.param
    root = tmp_path_factory.mktemp(layout)
    model = _hf_model(layout, seed=3)
    model.save_pretrained(root / "hf")  # per-expert names, as the releases have them
    state = load_file(str(root / "hf" / "model.safetensors"))
    if layout == V3:
        state = with_mtp_layer(state, LAYERS, seed=4)
    path = write_release(root / "release", layout, model.config.to_dict(), state, shards=5)
    if layout == V2_LITE:
        return layout, path, path  # transformers reads the release itself
    ref = root / "reference"
    ref.mkdir()
    full = {
        k: v for k, v in _dequantized(path).items() if not k.startswith(f"model.layers.{LAYERS}.")
    }
    save_file(full, str(ref / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (ref / "config.json").write_text(json.dumps(config))
    return layout, path, ref


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(path / shard)))
    return out


def _dequantized(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in fp32: e4m3 ones times their tile's scale (the format's definition)."""
    out = {}
    tensors = _tensors(path)
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == FP8_DTYPE:
            s = tensors[name + "_scale_inv"]
            rows, cols = t.shape
            tile = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            out[name] = t.float() * tile
        else:
            out[name] = t.float()
    return out


def test_the_files_are_laid_out_as_released(release: tuple[str, Path, Path]) -> None:
    layout, path, _ = release
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert (
        shards == [shard_name(i, 5) for i in range(1, 6)]
        and shards[0] == "model-00001-of-000005.safetensors"
    )
    tensors = _tensors(path)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert set(index["weight_map"]) == set(tensors)
    with safe_open(str(path / shards[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["rope_scaling"]["type"] == "yarn"
    shapes = {k: tuple(t.shape) for k, t in tensors.items() if not k.endswith("_scale_inv")}
    assert shapes == release_shapes(config)  # the synthetic writer's names and shapes: these
    experts = [k for k in tensors if ".mlp.experts." in k]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in experts
    if layout == V2_LITE:
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
        assert "model.layers.0.self_attn.q_proj.weight" in tensors
        assert not any("scale_inv" in k or "correction_bias" in k for k in tensors)
        return
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    for name, t in tensors.items():
        if is_fp8_in_release(name):
            assert t.dtype == FP8_DTYPE, name
            scale = tensors[name + "_scale_inv"]
            assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(t.shape)
        elif name.endswith("e_score_correction_bias") or name.endswith("_scale_inv"):
            assert tensors[name].dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
    kv_a = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert tuple(kv_a.shape) == (160, 256)  # kv_lora 128 + rope 32: a partial row tile
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)
    mtp = {k.split(".", 3)[3] for k in tensors if k.startswith(f"model.layers.{LAYERS}.")}
    assert {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight"} <= mtp
    assert {"shared_head.norm.weight", "shared_head.head.weight", "mlp.gate.weight"} <= mtp
    assert tensors[f"model.layers.{LAYERS}.eh_proj.weight"].dtype == torch.bfloat16


def _engine(path: Path, **kw: Any) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            block_size=16,
            num_kv_blocks=64,
            time_budget_s=None,
            **kw,
        )
    )


def _greedy(engine: Engine) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(
            f"g{i}", p, SamplingParams(max_tokens=STEPS, ignore_eos=True), hold_kv=True
        )
    while engine.has_unfinished():
        engine.step()
    return [list(engine.info(f"g{i}").token_ids[len(p) :]) for i, p in enumerate(PROMPTS)]


def test_greedy_tokens_equal_transformers_on_the_same_tensors(
    release: tuple[str, Path, Path],
) -> None:
    import transformers

    layout, path, ref = release
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    # V3: the e4m3 weights dequantized while loading (fp8 kept is the next test's).
    assert _greedy(_engine(path, weight_dtype="bf16")) == expected


@pytest.mark.parametrize("release", [V3], indirect=True)  # FP8 and MTP are the V3 layout's
def test_the_v3_release_keeps_its_fp8_and_loads_its_mtp_module(
    release: tuple[str, Path, Path],
) -> None:
    layout, path, _ = release
    assert layout == V3
    tensors = _tensors(path)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    kept = dict(load(str(path)).model.named_parameters())  # auto: the release's FP8 kept
    assert kept[name].dtype == FP8_DTYPE
    assert torch.equal(kept[name].view(torch.uint8), tensors[name].view(torch.uint8))
    assert torch.equal(kept[name + "_scale_inv"], tensors[name + "_scale_inv"])
    assert not any(k.startswith("mtp.") for k in kept)  # the MTP layer skipped when not asked
    with_mtp = load(str(path), with_mtp=True, weight_dtype="bf16").model
    params = dict(with_mtp.named_parameters())
    want = _dequantized(path)
    for suffix in (
        "eh_proj.weight",
        "self_attn.kv_b_proj.weight",
        "shared_head.head.weight",
        "enorm.weight",
    ):
        assert torch.equal(params[f"mtp.0.{suffix}"], want[f"model.layers.{LAYERS}.{suffix}"]), (
            suffix
        )
    gate_up = params["mtp.0.mlp.experts.w13"][5]
    assert torch.equal(gate_up[:128], want[f"model.layers.{LAYERS}.mlp.experts.5.gate_proj.weight"])


@pytest.mark.parametrize("release", [V3], indirect=True)  # scales are the V3 layout's
def test_a_scale_in_the_next_shard_than_its_weight_still_loads(
    release: tuple[str, Path, Path],
) -> None:
    """Nothing in the format keeps a weight and its scale in one shard; this release splits
    one pair (the shard cut falls between them), and the loads above read it."""
    layout, path, _ = release
    assert layout == V3
    where = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    split = [
        k
        for k in where
        if k.endswith("_scale_inv") and where[k] != where[k.removesuffix("_scale_inv")]
    ]
    assert split, "expected a weight and its scale in different shards"
