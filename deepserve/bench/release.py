"""Synthetic checkpoints in the layouts DeepSeek released, at any width (no download needed).

What a user downloads from the Hub, reproduced tensor for tensor except for the sizes:

* ``deepseek-v2-lite`` (``deepseek-ai/DeepSeek-V2-Lite``): every tensor bf16; no ``q_lora``
  (``self_attn.q_proj``); softmax greedy routing, no correction bias; 4 shards.
* ``deepseek-v3`` (``deepseek-ai/DeepSeek-V3``, and R1, the same layout): every projection
  inside the decoder layers (attention ``q_a/q_b/kv_a_proj_with_mqa/kv_b/o_proj``; dense,
  shared and routed ``gate/up/down_proj``) in ``float8_e4m3fn`` with a float32
  ``weight_scale_inv`` per 128x128 tile (``[ceil(out/128), ceil(in/128)]``; the weight is
  ``e4m3 * scale`` tile by tile); embeddings, norms, the router's ``gate.weight``, ``lm_head``
  and the MTP module's own ``eh_proj`` / heads bf16; ``gate.e_score_correction_bias`` float32;
  ``config.json`` carries the FP8 ``quantization_config``. The MTP module is the layer after
  the last one (``model.layers.{num_hidden_layers}``: ``embed_tokens``, ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.{norm,head}`` and a full MoE decoder layer); 163 shards.

Both: per-expert names (``mlp.experts.{e}.{gate,up,down}_proj.weight``), shards named
``model-00001-of-000163.safetensors`` (five digits, then six, as DeepSeek writes them), each
with ``{"format": "pt"}`` metadata, and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor: shard}}``); ``config.json`` in the
release's spelling (``architectures``, ``auto_map``, ``torch_dtype``, legacy ``rope_scaling``
with ``type``).

:func:`write_release` takes full-precision tensors under those names (transformers'
``save_pretrained`` writes them so; :func:`with_mtp_layer` adds the MTP module) and a
transformers-style config, and writes the release.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from libs.engine.kernels.fp8_gemm import quantize_fp8_blocks

V2_LITE = "deepseek-v2-lite"
V3 = "deepseek-v3"
LAYOUTS = (V2_LITE, V3)
RELEASE_SHARDS = {V2_LITE: 4, V3: 163}
FP8_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
_ARCH = {V2_LITE: "DeepseekV2", V3: "DeepseekV3"}
_MODEL_TYPE = {V2_LITE: "deepseek_v2", V3: "deepseek_v3"}
# Projections of a decoder layer: e4m3 in the V3 release (the MTP module's eh_proj is not).
_FP8_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight")


def is_fp8_in_release(name: str) -> bool:
    """Whether the V3 release stores ``name`` as e4m3 with a ``weight_scale_inv``."""
    return (
        ".layers." in name and name.endswith(_FP8_SUFFIXES) and not name.endswith("eh_proj.weight")
    )


def release_config(layout: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (transformers' ``to_dict()`` or a release's) as the release spells it."""
    out = {k: v for k, v in config.items() if not k.startswith("_") and k != "rope_parameters"}
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    out.update(
        architectures=[f"{_ARCH[layout]}ForCausalLM"],
        auto_map={
            "AutoConfig": f"configuration_deepseek.{_ARCH[layout]}Config",
            "AutoModel": f"modeling_deepseek.{_ARCH[layout]}Model",
            "AutoModelForCausalLM": f"modeling_deepseek.{_ARCH[layout]}ForCausalLM",
        },
        model_type=_MODEL_TYPE[layout],
        torch_dtype="bfloat16",
        rope_theta=theta,
        rope_scaling=None if kind == "default" else {"type": kind, **rope},
    )
    out.pop("dtype", None)
    if layout == V3:
        out["quantization_config"] = dict(FP8_QUANTIZATION)
    return out


def release_tensors(layout: str, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (full precision, release names) in the release's dtypes, scales beside their
    weights."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if layout == V3 and is_fp8_in_release(name):
            q = quantize_fp8_blocks(t.float())
            out[name] = q.q.contiguous()
            out[name[: -len("weight")] + "weight_scale_inv"] = q.scale.float().contiguous()
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def with_mtp_layer(
    state: Mapping[str, torch.Tensor], num_hidden_layers: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """``state`` plus a V3 MTP module at ``model.layers.{num_hidden_layers}``: a decoder layer
    shaped as the last one (random, ~N(0, 0.05); norms near 1), ``embed_tokens`` and
    ``shared_head.head`` shaped as the model's, ``enorm``/``hnorm``/``shared_head.norm`` and
    ``eh_proj`` [hidden, 2 * hidden]."""
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{num_hidden_layers - 1}.", f"model.layers.{num_hidden_layers}."
    out = dict(state)

    def rand(shape: torch.Size | tuple[int, ...], norm: bool = False) -> torch.Tensor:
        if norm:
            return 1.0 + 0.1 * (torch.rand(shape, generator=g) - 0.5)
        return 0.05 * torch.randn(shape, generator=g)

    for name, t in state.items():
        if name.startswith(last):
            out[mtp + name[len(last) :]] = rand(t.shape, norm="norm" in name)
    hidden = state["model.embed_tokens.weight"].shape[1]
    out[mtp + "embed_tokens.weight"] = rand(state["model.embed_tokens.weight"].shape)
    out[mtp + "shared_head.head.weight"] = rand(state["lm_head.weight"].shape)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[mtp + norm + ".weight"] = rand((hidden,), norm=True)
    out[mtp + "eh_proj.weight"] = rand((hidden, 2 * hidden))
    return out


def release_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a release of ``config`` (transformers' or a release's config.json) holds, by
    its release name, in full-precision shapes (scales are :func:`scale_shape`); the MTP
    modules (``num_nextn_predict_layers``) as the layers after the last."""
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    heads, nope = int(config["num_attention_heads"]), int(config["qk_nope_head_dim"])
    rope, vd = int(config["qk_rope_head_dim"]), int(config["v_head_dim"])
    q_lora, kv_lora = config.get("q_lora_rank"), int(config["kv_lora_rank"])
    inter, moe = int(config["intermediate_size"]), int(config["moe_intermediate_size"])
    experts, shared = int(config["n_routed_experts"]), int(config.get("n_shared_experts") or 0)
    layers, dense = int(config["num_hidden_layers"]), int(config.get("first_k_dense_replace", 0))
    v3 = config.get("model_type") == "deepseek_v3" or "DeepseekV3" in str(
        config.get("architectures")
    )
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}

    def mlp(pre: str, width: int) -> None:
        out.update({pre + "gate_proj.weight": (width, h), pre + "up_proj.weight": (width, h)})
        out[pre + "down_proj.weight"] = (h, width)

    def layer(i: int, moe_layer: bool) -> None:
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = (h,)
        a = pre + "self_attn."
        if q_lora:
            out[a + "q_a_proj.weight"] = (int(q_lora), h)
            out[a + "q_a_layernorm.weight"] = (int(q_lora),)
            out[a + "q_b_proj.weight"] = (heads * (nope + rope), int(q_lora))
        else:
            out[a + "q_proj.weight"] = (heads * (nope + rope), h)
        out[a + "kv_a_proj_with_mqa.weight"] = (kv_lora + rope, h)
        out[a + "kv_a_layernorm.weight"] = (kv_lora,)
        out[a + "kv_b_proj.weight"] = (heads * (nope + vd), kv_lora)
        out[a + "o_proj.weight"] = (h, heads * vd)
        out[pre + "post_attention_layernorm.weight"] = (h,)
        if not moe_layer:
            mlp(pre + "mlp.", inter)
            return
        out[pre + "mlp.gate.weight"] = (experts, h)
        if v3:
            out[pre + "mlp.gate.e_score_correction_bias"] = (experts,)
        for e in range(experts):
            mlp(f"{pre}mlp.experts.{e}.", moe)
        if shared:
            mlp(pre + "mlp.shared_experts.", moe * shared)

    for i in range(layers):
        layer(i, i >= dense)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    for j in range(int(config.get("num_nextn_predict_layers") or 0)):
        pre = f"model.layers.{layers + j}."
        out[pre + "embed_tokens.weight"] = (v, h)
        out[pre + "enorm.weight"] = (h,)
        out[pre + "hnorm.weight"] = (h,)
        out[pre + "eh_proj.weight"] = (h, 2 * h)
        layer(layers + j, True)
        out[pre + "shared_head.norm.weight"] = (h,)
        out[pre + "shared_head.head.weight"] = (v, h)
    return out


def synthetic_state(
    config: Mapping[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random tensors for every name of :func:`release_shapes` (~N(0, 0.02); norms near 1,
    the correction bias small), in ``dtype``: weights a load benchmark can read."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in release_shapes(config).items():
        t = torch.empty(shape, dtype=torch.float32)
        if "norm" in name:
            t.uniform_(0.9, 1.1, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        out[name] = t.to(dtype)
    return out


def shard_name(index: int, count: int) -> str:
    """DeepSeek's spelling: ``model-00001-of-000163.safetensors``."""
    return f"model-{index:05d}-of-{count:06d}.safetensors"


def split_shards(names: list[str], sizes: Mapping[str, int], shards: int) -> list[list[str]]:
    """``names`` in order, cut into ``shards`` runs of about equal bytes (never empty)."""
    shards = max(1, min(shards, len(names)))
    target = sum(sizes.values()) / shards
    out: list[list[str]] = [[]]
    acc = 0
    for i, n in enumerate(names):
        left = len(names) - i
        if (
            out[-1]
            and len(out) < shards
            and (acc >= target * len(out) or left <= shards - len(out))
        ):
            out.append([])
        out[-1].append(n)
        acc += sizes[n]
    return out


def write_release(
    out: Path,
    layout: str,
    config: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    shards: int | None = None,
) -> Path:
    """Write ``state`` (full precision, release names; with the MTP layer if ``config`` has
    ``num_nextn_predict_layers``) and ``config`` at ``out`` as ``layout`` is released;
    ``shards`` defaults to the release's count (fewer where there are fewer tensors)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = release_config(layout, config)
    tensors = release_tensors(layout, state)
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    runs = split_shards(list(tensors), sizes, shards or RELEASE_SHARDS[layout])
    weight_map: dict[str, str] = {}
    for i, run in enumerate(runs, 1):
        name = shard_name(i, len(runs))
        save_file({k: tensors[k] for k in run}, str(out / name), metadata={"format": "pt"})
        weight_map.update((k, name) for k in run)
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {
        "_from_model_config": True,
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def scale_shape(weight: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """``weight_scale_inv``'s shape for a [out, in] weight: one scale per 128x128 tile."""
    return math.ceil(weight[0] / 128), math.ceil(weight[1] / 128)
