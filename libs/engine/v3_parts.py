"""The DeepSeek-V2/V3 family's engine parts: the model loaded, its paged MLA cache, cost model,
sampler and model runner (:func:`v3_parts`, registered in :mod:`libs.engine.registry`).

With expert parallelism the routed experts are sharded over the group by a placement and the
model is changed in place (:func:`libs.engine.ep.runtime.apply_ep`); on CUDA the memory plan
(:func:`~.sizing.memory_plan_for`) refuses a model that cannot fit before a weight is read.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .config import ModelConfig
from .cost_model import CostModel
from .kv.cache import DTYPE_NAMES, TORCH_DTYPES, PagedKVCache
from .kv.layout import CacheSpec, mla_cache_spec
from .loader import LoadedModel, load, model_config
from .model.model import DeepseekForCausalLM
from .parts import EngineParts, kernels_on, max_model_len, nominal_rates
from .runner import ModelRunner
from .sampler import Sampler
from .sizing import _weight_dtype, kv_blocks_for, memory_plan_for

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .ep.group import EPGroup
    from .ep.placement import Placement
    from .ep.runtime import EPRuntime

log = logging.getLogger(__name__)


def v3_parts(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    ep: EPGroup | None = None,
    placement: Placement | None = None,
) -> EngineParts:
    """Load the model (unless ``loaded``), size and allocate the paged KV cache, build the cost
    model, sampler and model runner, capture the CUDA graphs.

    ``ep``: this process is one rank of an expert-parallel group; the routed experts are
    sharded by ``placement`` (default: contiguous, no spare slots) and the model changed in
    place (a ``loaded`` model given here is this rank's own from then on). The decode CUDA
    graphs stay on: the ranks agree on each step's rows and the MoE exchanges within the
    graphs' sizes are fixed-shape (:mod:`libs.engine.ep.fixed`).
    """
    device = torch.device(config.device)
    dtype = config.torch_dtype
    runtime = None
    if ep is not None:
        from .ep.placement import Placement

        n_experts = (loaded.model.cfg if loaded else model_config(config.model)).n_routed_experts
        placement = placement or Placement.contiguous(n_experts, ep.size)
    keep = placement.experts_of(ep.rank) if ep is not None and placement is not None else None
    if loaded is None and device.type == "cuda":
        plan = memory_plan_for(config, model_config(config.model), device, keep, ep)
        if not plan.fits:
            raise ValueError(plan.refusal())
        log.info("engine: memory plan: %s", plan.line())
    loaded = loaded or load(
        config.model,
        device,
        dtype,
        config.seed,
        config.with_mtp or config.speculative_tokens > 0,
        expert_slots=keep,
        weight_dtype=_weight_dtype(config),
        read_workers=config.read_workers,
        progress=config.load_progress,
    )
    model = loaded.model
    if ep is not None:
        from .ep.runtime import apply_ep

        assert placement is not None
        runtime = apply_ep(model, ep, placement)
    use_kernels = _set_up_model(config, model, device)
    cfg = model.cfg
    kv_dtype = config.kv_cache_dtype or DTYPE_NAMES[dtype]
    spec = mla_cache_spec(
        cfg, loaded.model_id, config.block_size, kv_dtype, num_layers=model.num_cache_layers
    )
    num_blocks = config.num_kv_blocks or kv_blocks_for(config, cfg, spec, device)
    cache = PagedKVCache(spec, num_blocks, device, cfg.qk_rope_head_dim)
    cost = _cost_model(config, model, spec, kv_dtype, device)
    runner = _model_runner(config, model, cache, device, use_kernels, runtime)
    runner.capture_all()
    if config.speculative_tokens:
        _price_verification(runner, cost, config.speculative_tokens)
    return EngineParts(
        loaded.model_id, cfg, spec, cache, num_blocks, cost, runner, device, loaded, runtime
    )


def _set_up_model(config: EngineConfig, model: DeepseekForCausalLM, device: torch.device) -> bool:
    """The model's modes as ``config`` asks (absorbed decode, kernels, FP4 experts,
    batch-invariant arithmetic); whether it runs the Triton kernels."""
    model.set_absorb_decode(config.absorb_decode)
    use_kernels = _kernels_usable(config, model.cfg)
    model.set_kernels(use_kernels)
    if config.expert_dtype == "fp4":
        model.quantize_experts_fp4()
    if config.batch_invariant and device.type == "cuda" and not use_kernels:
        raise ValueError("batch-invariant mode on CUDA needs the Triton kernels for this model")
    model.set_batch_invariant(config.batch_invariant)
    return use_kernels


def _cost_model(
    config: EngineConfig,
    model: DeepseekForCausalLM,
    spec: CacheSpec,
    kv_dtype: str,
    device: torch.device,
) -> CostModel:
    per_layer = spec.bytes_per_block / config.block_size / model.num_cache_layers
    return CostModel.for_model(
        model.cfg,
        torch.finfo(config.torch_dtype).bits // 8,
        torch.finfo(TORCH_DTYPES[kv_dtype]).bits // 8,
        *nominal_rates(device),
        expert_param_bytes=model.experts_method.param_bytes,
        kv_token_layer_bytes=per_layer,
    )


def _model_runner(
    config: EngineConfig,
    model: DeepseekForCausalLM,
    cache: PagedKVCache,
    device: torch.device,
    use_kernels: bool,
    runtime: EPRuntime | None,
) -> ModelRunner:
    cfg = model.cfg
    runner = ModelRunner(
        model,
        cache,
        Sampler(device, config.sampler_seed, cfg.eos_token_ids, config.batch_invariant),
        use_kernels,
        config.cuda_graphs,
        max_model_len(config, cfg),
        # Speculative decoding verifies up to 1 + K rows per request through the same graphs.
        max_graph_batch=config.max_running * (1 + config.speculative_tokens),
        batch_invariant=config.batch_invariant,
        # Steps with prompt chunks replay the decode graphs up to 512 tokens (fewer when a
        # step may not hold that many).
        mixed_graph_rows=min(512, config.max_tokens_per_step),
    )
    if runtime is not None:
        # EP: the ranks agree on each step's rows; up to the decode graphs' largest the MoE
        # exchanges are fixed-shape (no host sync), so the graphs capture them too.
        runtime.use_ladder(runner.graph_sets["decode"].ladder)
        runner.group = runtime
        runtime.idle = runner.replay_idle  # an idle rank steps through the graph too
    return runner


def _price_verification(runner: ModelRunner, cost: CostModel, speculative_tokens: int) -> None:
    """Speculative decoding prices verification rows by the decode graphs' measured times
    (each draft verified is one more row); None on the CPU: the analytic model prices them."""
    try:
        measured = runner.time_decode_graphs()
    except Exception:  # the analytic model still prices them: log, do not fail the engine
        log.exception("engine: timing the decode graphs failed; verification priced analytically")
        measured = None
    if measured:
        cost.set_rows_table(measured, 1 + speculative_tokens)
        log.info(
            "engine: decode step by rows (measured): %s",
            ", ".join(f"{r}: {s * 1e3:.2f} ms" for r, s in sorted(measured.items())),
        )


def _kernels_usable(config: EngineConfig, cfg: ModelConfig) -> bool:
    """The MLA decode kernel takes every DeepSeek checkpoint's widths (512 + 64)."""

    def why() -> str | None:
        from .kernels.mla_decode import unsupported

        return unsupported(cfg.kv_lora_rank, cfg.qk_rope_head_dim, config.block_size)

    return kernels_on(config, why)
