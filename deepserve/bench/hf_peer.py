"""transformers on the engine's own weights: the peer baseline of ``deepserve bench engine``.

:func:`build_hf_peer` builds a ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` (by the
engine's ``model_type``) whose parameters *are* the engine's tensors: the transformers model is
constructed on the meta device and every parameter is assigned (``load_state_dict(...,
assign=True)``) a detached alias of ours, so no weight is copied and both models read the same
memory. Names are ours except the routed experts:

* transformers 5's fused experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
  [E, H, I]) are exactly our ``mlp.experts.w13`` / ``w2``; a transposed fused layout
  ([E, H, 2I] / [E, I, H]) gets a transposed view;
* per-expert modules (``mlp.experts.{e}.gate_proj.weight`` etc., older transformers) get
  views ``w13[e, :I]``, ``w13[e, I:]`` and ``w2[e]``;
* the router's ``e_score_correction_bias`` (a buffer there, an fp32 parameter here) is shared too.

Only the rotary tables (non-persistent buffers, computed from the config) are built anew.
transformers is optional at run time (a test extra): importing this module does not need it.

:func:`hf_decode_throughput` times ``generate`` (greedy, EOS ignored, KV cache on) on random
prompts drawn as ``deepserve bench engine`` draws its decode prompts, so both read the same ids.
Decode time is ``t(generate 1 + n new tokens) - t(generate 1 new token)`` over ``n`` steps: the
prefill and first token cancel out.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from libs.engine.config import ModelConfig

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """transformers config kwargs describing the same model as ``cfg`` (as a config.json would)."""
    v3 = cfg.model_type == "deepseek_v3"
    if v3 and (cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc"):
        raise ValueError("transformers' DeepseekV3 routes only with sigmoid scores and noaux_tc")
    if not v3 and (
        cfg.scoring_func != "softmax" or (cfg.norm_topk_prob and cfg.num_experts_per_tok > 1)
    ):
        raise ValueError(
            "transformers' DeepseekV2 routes only with softmax scores and unnormalized top-k"
        )
    rope = cfg.rope
    if rope.type == "default":
        rope_parameters: dict[str, Any] = dict(rope_type="default", rope_theta=rope.theta)
    else:
        rope_parameters = dict(
            rope_type="yarn",
            rope_theta=rope.theta,
            factor=rope.factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            truncate=rope.truncate,
        )
        if rope.mscale:
            rope_parameters["mscale"] = rope.mscale
        if rope.mscale_all_dim:
            rope_parameters["mscale_all_dim"] = rope.mscale_all_dim
    kw: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        first_k_dense_replace=cfg.first_k_dense_replace,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        topk_method=cfg.topk_method,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope_parameters,
        attention_bias=cfg.attention_bias,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids),
        pad_token_id=None,
        hidden_act=cfg.hidden_act,
    )
    if v3:
        kw.update(rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=0)
    return kw


def _our_tensor(
    name: str, shape: torch.Size, ours: Mapping[str, torch.Tensor], inter: int
) -> torch.Tensor:
    """A view of our tensor that transformers' parameter ``name`` of ``shape`` is (no copy)."""
    m = _PER_EXPERT.match(name)
    if m:
        base, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down_proj":
            view = ours[f"{base}.w2"][e]
        else:
            view = (
                ours[f"{base}.w13"][e, :inter]
                if proj == "gate_proj"
                else ours[f"{base}.w13"][e, inter:]
            )
    else:
        own = name.replace(".mlp.experts.gate_up_proj", ".mlp.experts.w13").replace(
            ".mlp.experts.down_proj", ".mlp.experts.w2"
        )
        if own not in ours:
            raise KeyError(f"transformers' {name} has no counterpart {own} in the engine's model")
        view = ours[own]
        if (
            view.dim() == 3
            and tuple(view.shape) != tuple(shape)
            and tuple(view.transpose(1, 2).shape) == tuple(shape)
        ):
            view = view.transpose(1, 2)  # a transposed fused layout: a strided view, still no copy
    if tuple(view.shape) != tuple(shape):
        raise ValueError(
            f"{name}: ours has shape {tuple(view.shape)}, transformers wants {tuple(shape)}"
        )
    return view.detach()  # a new tensor object on the same storage: our Parameters stay untouched


def build_hf_peer(
    model: torch.nn.Module,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
) -> Any:
    """The transformers model of our ``DeepseekForCausalLM`` ``model`` (or a DeepSeek-V4
    ``V4ForCausalLM``: :func:`build_hf_v4_peer`), sharing its weights.

    ``attn_implementation`` / ``experts_implementation``: None for transformers' defaults
    (sdpa, grouped_mm where available); "eager" for the reference loops.
    """
    import transformers

    from libs.engine.v4.model import V4ForCausalLM

    if isinstance(model, V4ForCausalLM):
        return build_hf_v4_peer(model, attn_implementation)

    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    kw = hf_config_kwargs(cfg)
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    config_cls: Any
    model_cls: Any
    if cfg.model_type == "deepseek_v3":
        config_cls, model_cls = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    else:
        config_cls, model_cls = transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM
    hf_cfg = config_cls(**kw)
    dtype = next(model.parameters()).dtype
    hf_cfg.dtype = dtype
    device = next(model.parameters()).device
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    ours = {n: p for n, p in model.named_parameters() if not n.startswith("mtp.")}
    inter = cfg.moe_intermediate_size
    state = {name: _our_tensor(name, t.shape, ours, inter) for name, t in hf.state_dict().items()}
    hf.load_state_dict(state, strict=True, assign=True)
    # Rotary tables are non-persistent buffers: compute them on the CPU from the config, then move.
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(config=hf_cfg).to(device)
    return _ready(hf)


def build_hf_v4_peer(model: Any, attn_implementation: str | None = None) -> Any:
    """transformers' ``DeepseekV4ForCausalLM`` over our V4 model's tensors: the same names
    (ours follow transformers'), assigned as in :func:`build_hf_peer`; every rotary module is
    built anew from the config it was read from (``model.hf_config``)."""
    import transformers

    if model.hf_config is None:
        raise ValueError("this V4 model does not know the transformers config it came from")
    kw = dict(model.hf_config)
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    hf_cfg = transformers.DeepseekV4Config(**kw)
    dtype = next(model.parameters()).dtype
    hf_cfg.dtype = dtype
    device = next(model.parameters()).device
    model_cls: Any = transformers.DeepseekV4ForCausalLM
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    ours = dict(model.state_dict(keep_vars=True))
    missing = [n for n in hf.state_dict() if n not in ours]
    if missing:
        raise RuntimeError(f"transformers' V4 has tensors ours lacks: {missing[:8]}")
    # Each tensor in the dtype transformers' own loader gives it (its strict keep-in-fp32
    # module names, matched as substrings as its loader does, and for fp16 the others too;
    # the rest in the model's dtype): shared where ours has that dtype, else a converted copy.
    keep = list(getattr(model_cls, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep += getattr(model_cls, "_keep_in_fp32_modules", None) or []

    def loaded(name: str) -> torch.Tensor:
        t: torch.Tensor = ours[name].detach()
        if not t.is_floating_point():
            return t
        want = torch.float32 if any(k in name for k in keep) else dtype
        return t if t.dtype == want else t.to(want)

    hf.load_state_dict({n: loaded(n) for n in hf.state_dict()}, strict=True, assign=True)
    for name, module in list(hf.named_modules()):
        if name.endswith("rotary_emb"):
            parent, _, attr = name.rpartition(".")
            owner = hf.get_submodule(parent) if parent else hf
            setattr(owner, attr, type(module)(config=hf_cfg).to(device))
    return _ready(hf)


def _ready(hf: Any) -> Any:
    """A peer whose every tensor is ours (or rebuilt), frozen, decoding to its full length."""
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors still on the meta device after sharing weights: {left[:8]}")
    hf.requires_grad_(False)
    hf.eval()
    hf.generation_config.eos_token_id = None  # benchmark decodes run to their length
    hf.generation_config.pad_token_id = 0
    return hf


def shared_fraction(hf: torch.nn.Module, model: torch.nn.Module) -> float:
    """Fraction of the transformers model's parameter bytes that lie in our model's storage."""
    spans = []
    for p in model.parameters():
        start = p.untyped_storage().data_ptr()
        spans.append((start, start + p.untyped_storage().nbytes()))
    total = shared = 0
    for p in hf.parameters():
        n = p.numel() * p.element_size()
        total += n
        if any(a <= p.data_ptr() < b for a, b in spans):
            shared += n
    return shared / total if total else 0.0


def decode_prompts(batch: int, context: int, vocab: int) -> torch.Tensor:
    """The prompts ``deepserve bench engine`` decodes at this batch size (same generator,
    same order)."""
    g = torch.Generator().manual_seed(batch)
    return torch.stack([torch.randint(3, vocab, (context,), generator=g) for _ in range(batch)])


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop unreferenced tensors and hand cached device memory back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_decode_throughput(
    hf_model: Any,
    batch: int,
    context: int,
    new_tokens: int,
    device: torch.device | str,
    repeats: int = 1,
) -> dict[str, Any]:
    """Greedy ``generate`` throughput at ``batch`` prompts of ``context`` tokens.

    After one warm-up call, ``generate`` runs with 1 and with ``1 + new_tokens`` new tokens
    (``repeats`` times each, fastest kept); their difference is ``new_tokens`` decode steps.
    """
    device = torch.device(device)
    vocab = int(hf_model.config.vocab_size)
    ids = decode_prompts(batch, context, vocab).to(device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,
                eos_token_id=None,
                pad_token_id=0,
            )
        sync(device)
        seconds = time.perf_counter() - t0
        if out.shape != (batch, context + n):
            raise RuntimeError(
                f"generate returned {tuple(out.shape)}, expected {(batch, context + n)}"
            )
        del out
        return seconds

    peak0 = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        peak0 = torch.cuda.memory_allocated(device)
    try:
        run(2)  # warm-up: kernels, allocator, generation setup
        first = [run(1) for _ in range(repeats)]
        full = [run(1 + new_tokens) for _ in range(repeats)]
    finally:
        free_memory(device)
    t1, tn = min(first), min(full)
    decode_s = tn - t1
    result: dict[str, Any] = {
        "batch": batch,
        "context": context,
        "new_tokens": new_tokens,
        "first_token_seconds": t1,
        "generate_seconds": tn,
        "decode_seconds": decode_s,
        "prefill_tokens_per_s": batch * context / t1,
        "first_token_runs": first,
        "generate_runs": full,
    }
    if decode_s > 0:
        result.update(
            step_seconds=decode_s / new_tokens,
            tokens_per_s=batch * new_tokens / decode_s,
            per_user_tokens_per_s=new_tokens / decode_s,
        )
    else:  # noise larger than the decode itself: fall back to the whole call, stated as such
        result.update(
            step_seconds=tn / (1 + new_tokens),
            tokens_per_s=batch * (1 + new_tokens) / tn,
            per_user_tokens_per_s=(1 + new_tokens) / tn,
            note="t(1+n) <= t(1): decode figure from the whole generate call",
        )
    if device.type == "cuda":
        result["peak_memory_bytes_above_weights"] = torch.cuda.max_memory_allocated(device) - peak0
    result["median_first_token_seconds"] = statistics.median(first)
    return result
