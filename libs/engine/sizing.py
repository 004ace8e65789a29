"""How much of its GPU a V2/V3 engine takes: the memory plan before loading, the KV blocks after.

:func:`memory_plan_for` counts, before any weight is read, what ``config``'s model needs on a
CUDA GPU (weights at the chosen precision, a step's activations, at least one step's KV
blocks) against ``--gpu-memory-fraction`` of it; :func:`kv_blocks_for` sizes the paged KV
cache once the weights are loaded (``num_kv_blocks``, ``kv_cache_bytes``, the fraction, or
90 % of the free memory beside a step's activation reserve).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .config import ModelConfig
from .hub import model_label
from .kv.cache import DTYPE_NAMES
from .kv.layout import CacheSpec, mla_cache_spec
from .loader import resolve_weight_dtype
from .memory_plan import MemoryPlan, plan_memory
from .parts import max_model_len
from .presets import PRESETS

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .ep.group import EPGroup

log = logging.getLogger(__name__)
_GIB = float(1 << 30)


def memory_plan_for(
    config: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    expert_slots: tuple[int, ...] | None = None,
    ep: EPGroup | None = None,
) -> MemoryPlan:
    """What ``config``'s model needs on ``device`` (a CUDA GPU) before anything is loaded:
    weights at the chosen precision and EP slots, a step's activation reserve and the KV
    blocks (as many as ``num_kv_blocks`` says, else one step's), against ``--gpu-memory-
    fraction`` of the GPU's total memory (or, without a fraction, its free memory)."""
    dtype_bytes = torch.finfo(config.torch_dtype).bits // 8
    with_mtp = config.with_mtp or config.speculative_tokens > 0
    kv_dtype = config.kv_cache_dtype or DTYPE_NAMES[config.torch_dtype]
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    spec = mla_cache_spec(cfg, "plan", config.block_size, kv_dtype, num_layers=layers)
    minimum = config.num_kv_blocks is None and config.kv_cache_bytes is None
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.kv_cache_bytes is not None and config.gpu_memory_fraction is None:
        blocks = config.kv_cache_bytes // spec.bytes_per_block
    else:
        minimum, blocks = True, -(-config.max_tokens_per_step // config.block_size)
    fraction = config.gpu_memory_fraction
    if fraction is None:
        gpu = torch.cuda.mem_get_info(device)[0]
    else:
        gpu = torch.cuda.get_device_properties(device).total_memory
    return plan_memory(
        cfg,
        model=model_label(config.model),
        dtype_bytes=dtype_bytes,
        weights=resolve_weight_dtype(config.model, _weight_dtype(config)),
        experts="fp4" if config.expert_dtype == "fp4" else "model",
        activation_bytes=step_activation_bytes(
            cfg,
            step_tokens=config.max_tokens_per_step,
            sample_rows=min(config.max_running, config.max_tokens_per_step),
            context_tokens=max_model_len(config, cfg),
            dtype_bytes=dtype_bytes,
        ),
        kv_bytes_per_block=spec.bytes_per_block,
        kv_blocks=blocks,
        kv_is_minimum=minimum,
        gpu_bytes=gpu,
        fraction=fraction,
        ep=ep.size if ep is not None else 1,
        expert_slots=len(expert_slots) if expert_slots is not None else None,
        with_mtp=with_mtp,
        preset=config.model in PRESETS,
    )


def _weight_dtype(config: EngineConfig) -> str:
    """``config.weight_dtype``, with ``auto`` made bf16 where FP8 weights cannot serve (FP4
    experts, batch-invariant mode): an FP8 checkpoint is then dequantized at load."""
    if config.weight_dtype == "auto" and (config.expert_dtype == "fp4" or config.batch_invariant):
        return "bf16"
    return config.weight_dtype


def kv_blocks_for(
    config: EngineConfig, cfg: ModelConfig, spec: CacheSpec, device: torch.device
) -> int:
    fraction = config.gpu_memory_fraction
    if fraction is not None:
        return _blocks_for_fraction(config, cfg, spec, device, fraction)
    budget = config.kv_cache_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int((free - _activation_reserve(config, cfg)) * 0.9)
        else:
            budget = 1 << 30
    n = budget // spec.bytes_per_block
    if n <= 0:
        raise ValueError(f"kv_cache_bytes={budget} holds no {spec.bytes_per_block}-byte block")
    return int(n)


def _activation_reserve(config: EngineConfig, cfg: ModelConfig) -> int:
    """Bytes a full step's activations need beside the cache: per token of the step,
    the routed-expert buffers (k x (2H + 3I): gathered input, gate/up, SiLU·up, outputs)
    and ~16 hidden-sized tensors (projections, residuals, norms), in the model dtype."""
    per_token = (
        cfg.num_experts_per_tok * (2 * cfg.hidden_size + 3 * cfg.moe_intermediate_size)
        + 16 * cfg.hidden_size
    )
    return int(config.max_tokens_per_step * per_token * torch.finfo(config.torch_dtype).bits // 8)


def _blocks_for_fraction(
    config: EngineConfig,
    cfg: ModelConfig,
    spec: CacheSpec,
    device: torch.device,
    fraction: float,
) -> int:
    """KV blocks for ``--gpu-memory-fraction``: measured after the weights are loaded, from
    this process's own allocator (``memory_reserved``), so engines that load side by side on
    one GPU do not see each other's weights as used or free memory."""
    if device.type != "cuda":
        raise ValueError(
            f"--gpu-memory-fraction applies to CUDA devices, not {device}; "
            "size the cache with --num-kv-blocks"
        )
    torch.cuda.empty_cache()  # load-time temporaries: not held, the cache may have them
    total = torch.cuda.get_device_properties(device).total_memory
    held = torch.cuda.memory_reserved(device)
    reserve = step_activation_bytes(
        cfg,
        step_tokens=config.max_tokens_per_step,
        sample_rows=min(config.max_running, config.max_tokens_per_step),
        context_tokens=max_model_len(config, cfg),
        dtype_bytes=torch.finfo(config.torch_dtype).bits // 8,
    )
    n = kv_blocks_for_fraction(
        total_bytes=total,
        fraction=fraction,
        held_bytes=held,
        reserve_bytes=reserve,
        bytes_per_block=spec.bytes_per_block,
        block_size=config.block_size,
        step_tokens=config.max_tokens_per_step,
    )
    log.info(
        "engine: %d KV blocks (%.2f GiB) in %.2f of %.1f GiB on %s: %.2f GiB held after "
        "loading, %.2f GiB activation reserve",
        n,
        n * spec.bytes_per_block / _GIB,
        fraction,
        total / _GIB,
        device,
        held / _GIB,
        reserve / _GIB,
    )
    return n


def kv_blocks_for_fraction(
    *,
    total_bytes: int,
    fraction: float,
    held_bytes: int,
    reserve_bytes: int,
    bytes_per_block: int,
    block_size: int,
    step_tokens: int,
) -> int:
    """KV blocks that fit in ``fraction`` x ``total_bytes`` beside ``held_bytes`` (what the
    process holds once its weights are loaded) and ``reserve_bytes`` (a step's activations).

    :class:`~libs.engine.kv.cache.PagedKVCache` allocates one scratch block beyond the blocks
    it manages; that block is paid for here. Raises ValueError, naming the numbers, when fewer
    blocks fit than one ``step_tokens``-token step needs.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must lie in (0, 1], got {fraction}")
    budget = int(fraction * total_bytes) - held_bytes - reserve_bytes
    n = budget // bytes_per_block - 1  # the scratch block
    need = -(-step_tokens // block_size)
    if n < need:
        raise ValueError(
            f"--gpu-memory-fraction {fraction:g} of {total_bytes / _GIB:.1f} GiB = "
            f"{fraction * total_bytes / _GIB:.2f} GiB, minus {held_bytes / _GIB:.2f} GiB held "
            f"after loading the weights and {reserve_bytes / _GIB:.2f} GiB reserved for a "
            f"{step_tokens}-token step's activations, leaves room for {max(n, 0)} KV blocks of "
            f"{bytes_per_block / (1 << 20):.2f} MiB; one step needs {need}. Raise the fraction, "
            "lower --max-tokens-per-step, or use --kv-cache-dtype fp8 / --experts fp4"
        )
    return int(n)


def step_activation_bytes(
    cfg: ModelConfig,
    *,
    step_tokens: int,
    sample_rows: int,
    context_tokens: int,
    dtype_bytes: int,
) -> int:
    """A conservative bound on one step's activations beside weights and cache (an estimate
    from the shapes, not a measured forward: the forward needs the cache to exist).

    Per token of the step, in the model dtype, all counted as live at once although the
    layer runs them one after another: ~16 hidden-sized tensors (residual stream, norms,
    projections); the queries (q_nope + q_pe, their concatenation, the output); the larger
    of a MoE layer (k x (2H + 3I) for the routed experts' gathered inputs, gate/up, SiLU-up
    and outputs, 3 x shared x I for the shared experts, fp32 router scores) and a dense
    MLP (3 x intermediate). Per context token of one prompt (prefill attends to the whole
    context, up to ``context_tokens``): the gathered latents and the up-projected per-head
    keys and values. Per sampled row: the vocabulary logits in the model dtype, in fp32
    and the sampler's fp32 copy.
    """
    heads = cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    per_token = 16 * cfg.hidden_size + heads * (2 * qk + cfg.v_head_dim)
    moe = 0
    if cfg.has_moe:
        moe = (
            cfg.num_experts_per_tok * (2 * cfg.hidden_size + 3 * cfg.moe_intermediate_size)
            + 3 * cfg.n_shared_experts * cfg.moe_intermediate_size
            + 2 * cfg.n_routed_experts
        )
    per_token += max(moe, 3 * cfg.intermediate_size)
    per_context = cfg.kv_cache_dim + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim + qk)
    elements = step_tokens * per_token + context_tokens * per_context
    logits = sample_rows * cfg.vocab_size * (dtype_bytes + 8)
    return elements * dtype_bytes + logits
