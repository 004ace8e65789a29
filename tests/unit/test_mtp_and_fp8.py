"""MTP layers and FP8 block-quantized checkpoints load and compute as their references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.engine.engine import Engine, EngineConfig
from libs.engine.kv.cache import LayerCache
from libs.engine.loader import CheckpointError, load
from libs.engine.model.attention import AttentionMetadata, SeqAttention
from tests.hf_reference import build_hf, require_reference, save_hf

require_reference("transformers")


def _with_mtp_tensors(src: Path, dst: Path, n_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """Copy a checkpoint and add one MTP layer (model.layers.N.*) built from layer N-1's shapes."""
    dst.mkdir()
    state = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n_layers - 1}."
    mtp = {}
    for k, v in state.items():
        if k.startswith(last):
            mtp[f"model.layers.{n_layers}." + k[len(last) :]] = v + 0.02 * torch.randn(
                v.shape, generator=g
            )
    h = state["model.embed_tokens.weight"].shape[1]
    pre = f"model.layers.{n_layers}."
    mtp[pre + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    mtp[pre + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    mtp[pre + "eh_proj.weight"] = 0.08 * torch.randn(h, 2 * h, generator=g)
    mtp[pre + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    mtp[pre + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    mtp[pre + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file({**state, **mtp}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(
        (src / "config.json")
        .read_text()
        .replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1')
    )
    return mtp


def test_mtp_layer_matches_a_transformers_decoder_layer_reference(tmp_path: Path) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    hf = build_hf("v3-yarn-grouped", seed=11)
    base = save_hf(hf, tmp_path / "base")
    n = hf.config.num_hidden_layers
    mtp = _with_mtp_tensors(base, tmp_path / "mtp", n, seed=12)
    loaded = load(str(tmp_path / "mtp"), with_mtp=True)
    assert len(loaded.model.mtp) == 1
    assert len(load(str(tmp_path / "mtp")).model.mtp) == 0  # skipped unless asked for
    claims = tmp_path / "claims-mtp"
    claims.mkdir()
    (claims / "model.safetensors").write_bytes((base / "model.safetensors").read_bytes())
    (claims / "config.json").write_text((tmp_path / "mtp" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="lacks"):  # required when asked for
        load(str(claims), with_mtp=True)

    L = 20
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(L, hf.config.hidden_size, generator=g)
    next_ids = torch.randint(0, hf.config.vocab_size, (L,), generator=g)
    pos = torch.arange(L)
    kv = torch.zeros(32, loaded.model.cfg.kv_cache_dim)
    r = loaded.model.cfg.kv_lora_rank
    cache = LayerCache(kv[:, :r], kv[:, r:], kv=kv)
    meta = AttentionMetadata(pos.clone(), [SeqAttention(0, L, pos.clone(), pos.clone())])
    with torch.inference_mode():
        _, ours = loaded.model.mtp[0].predict(hidden, next_ids, pos, meta, cache)

    pre = f"model.layers.{n}."
    layer = DeepseekV3DecoderLayer(hf.config, layer_idx=n).eval()
    own = {
        k[len(pre) :]: v
        for k, v in mtp.items()
        if k.startswith(pre)
        and k[len(pre) :].split(".")[0]
        in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    }
    experts = hf.config.n_routed_experts  # transformers holds experts fused in memory
    own["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat(
                (
                    own.pop(f"mlp.experts.{e}.gate_proj.weight"),
                    own.pop(f"mlp.experts.{e}.up_proj.weight"),
                )
            )
            for e in range(experts)
        ]
    )
    own["mlp.experts.down_proj"] = torch.stack(
        [own.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(experts)]
    )
    layer.load_state_dict(own)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(hf.config.hidden_size, hf.config.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[pre + name + ".weight"])
    with torch.no_grad():
        emb = torch.nn.functional.embedding(next_ids, mtp[pre + "embed_tokens.weight"])
        x = (
            torch.cat((norms["enorm"](emb), norms["hnorm"](hidden)), -1)
            @ mtp[pre + "eh_proj.weight"].T
        )
        cos_sin = DeepseekV3RotaryEmbedding(hf.config)(x[None], pos[None])
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        x = layer(x[None], attention_mask=mask, position_embeddings=cos_sin)[0]
        ref = norms["shared_head.norm"](x) @ mtp[pre + "shared_head.head.weight"].T
    assert (ours - ref).abs().max().item() < 2e-5


def _quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    tr, tc = -(-rows // 128), -(-cols // 128)
    scale = torch.empty(tr, tc)
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(tr):
        for j in range(tc):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = tile.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_quantized_weights_are_dequantized_on_load(tmp_path: Path) -> None:
    hf = build_hf("v3-yarn-grouped", seed=13)
    base = save_hf(hf, tmp_path / "base")
    state = load_file(str(base / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"  # 64 x 32: one partial tile
    big = "model.layers.0.mlp.gate_proj.weight"  # 160 x 64: two row tiles
    expected = {}
    for k in (name, big):
        q, s = _quantize_fp8(state[k])
        state[k], state[k + "_scale_inv"] = q, s
        rows, cols = q.shape
        expected[k] = (
            q.float() * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        )
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((base / "config.json").read_text())
    params = dict(Engine(EngineConfig(model=str(out), num_kv_blocks=8)).model.named_parameters())
    for k, want in expected.items():
        assert torch.equal(params[k], want), k
        assert (
            params[k] - load_file(str(base / "model.safetensors"))[k]
        ).abs().max() < 0.1 * want.abs().max()
