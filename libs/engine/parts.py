"""What an :class:`~libs.engine.engine.Engine` runs on, and the factory that builds it for a model.

The engine owns the policy (scheduler, block accounting, KV frames); the parts it is handed
own the bytes: a :class:`StepRunner` computes each scheduled step and a :class:`KVBlockStore`
holds the KV of each block id. :func:`build_parts` loads a model and builds the real ones
(paged cache, sampler, model runner with its CUDA graphs); the deterministic fake engine
(``libs.serving.fake_engine``) plugs a hash and a dict into the same engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from libs.common.sampling import SamplingParams, TokenLogprob

from .config import ModelConfig
from .cost_model import CostModel
from .hub import model_label, resolve_model
from .kv.cache import DTYPE_NAMES, TORCH_DTYPES, PagedKVCache
from .kv.layout import CacheSpec, mla_cache_spec
from .loader import LoadedModel, load, model_config, resolve_weight_dtype
from .memory_plan import MemoryPlan, plan_memory
from .presets import PRESETS
from .runner import Launched, ModelRunner
from .sampler import Sampler
from .scheduler import StepPlan

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .ep.group import EPGroup
    from .ep.placement import Placement
    from .ep.runtime import EPRuntime

log = logging.getLogger(__name__)
_GIB = float(1 << 30)


class KVBlockStore(Protocol):
    """The KV cache as the engine sees it: bytes per block id.

    Block ids are the engine's (its :class:`BlockManager` decides who owns one and when it
    may be overwritten); the store only keeps ``spec.bytes_per_block`` bytes for each.
    """

    def read_blocks(self, blocks: Sequence[int]) -> bytes:
        """Block-major bytes of ``blocks``, in order."""
        ...

    def write_blocks(self, blocks: Sequence[int], payload: bytes | memoryview) -> None:
        """Overwrite ``blocks`` with ``payload`` (``len(blocks)`` blocks, block-major)."""
        ...

    # The halves that keep bulk copies off the engine thread.
    def gather_async(self, blocks: Sequence[int]) -> Any:
        """Start copying ``blocks`` out (engine thread); the result's ``result()`` (any
        thread) returns their bytes; the blocks may be reused as soon as this returns."""
        ...

    def stage(self, payloads: Sequence[bytes | memoryview]) -> Any:
        """Make whole blocks ready to write (any thread, no page touched)."""
        ...

    def write_staged(self, blocks: Sequence[int], staged: Any, start: int = 0) -> None:
        """Write staged rows ``start ..`` into ``blocks`` (engine thread)."""
        ...

    # Another process's pool on this host (kv/peer.py).
    def share(self) -> bytes | None:
        """A handle another process maps with :meth:`open_peer`; None if not shareable."""
        ...

    def open_peer(self, handle: bytes) -> Any:
        """Map another pool of this layout; raises ``PeerUnavailable`` if not reachable."""
        ...

    def copy_from_peer(self, src: Any, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> Any:
        """Copy blocks from a mapped pool into ours; returns an event to wait on (or None)."""
        ...


class StepRunner(Protocol):
    """Computes scheduled steps: ``launch`` may return before the step is done (overlap);
    ``collect`` waits for it and returns the sampled id per sampling request and the
    step's seconds (what calibrates the cost model)."""

    def launch(
        self,
        plan: StepPlan,
        params: Sequence[SamplingParams],
        prev: Launched | None,
        num_generated: Sequence[int] | None = None,
        histories: Sequence[tuple[int, list[int], int]] | None = None,
        *,
        masks_fn: Callable[[], tuple[list[int], torch.Tensor] | None] | None = None,
    ) -> Launched:
        """``params``: per sampling seq of ``plan``, in plan order; ``prev``: the step in flight;
        ``num_generated`` (when a seq sets min_tokens) and ``histories`` (when one uses a
        penalty): see :meth:`ModelRunner.launch`."""
        ...

    def collect(self, launched: Launched) -> tuple[dict[str, int], float]: ...

    def logprobs(self, launched: Launched) -> dict[str, TokenLogprob]:
        """After ``collect``: the logprobs of the requests that asked, by request id."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop what the runner keeps for it."""
        ...


@dataclass(frozen=True)
class EngineParts:
    model_id: str  # names the weights: part of every KV frame's identity
    model_config: ModelConfig
    spec: CacheSpec
    cache: KVBlockStore
    num_blocks: int
    cost: CostModel
    runner: StepRunner
    device: torch.device = torch.device("cpu")
    loaded: LoadedModel | None = None  # the model behind a ModelRunner; None for a fake
    ep: EPRuntime | None = None  # this rank's side of an expert-parallel group; None: alone


def max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    return min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def build_parts(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    ep: EPGroup | None = None,
    placement: Placement | None = None,
) -> EngineParts:
    """Today's set-up: load the model (unless ``loaded``), size and allocate the paged KV
    cache, build the cost model, sampler and model runner, capture the CUDA graphs.

    ``ep``: this process is one rank of an expert-parallel group; the routed experts are
    sharded by ``placement`` (default: contiguous, no spare slots) and the model changed in
    place (a ``loaded`` model given here is this rank's own from then on). CUDA graphs are
    off then: every MoE layer's exchange sizes change from step to step.
    """
    from .v4.load import is_v4

    source = resolve_model(config.model)  # a Hub repo id: its snapshot directory
    if source != config.model:
        config = dataclasses.replace(config, model=source)
    if config.batch_invariant and ep is not None:
        raise ValueError("batch-invariant mode does not run with expert parallelism yet")
    if is_v4(config.model):
        if ep is not None:
            raise ValueError("DeepSeek-V4 models do not run with expert parallelism yet")
        if loaded is not None:
            raise ValueError("a loaded V2/V3 model cannot serve a DeepSeek-V4 name")
        from .v4.serving import v4_parts

        return v4_parts(config)
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
    )
    model = loaded.model
    if ep is not None:
        from .ep.runtime import apply_ep

        assert placement is not None
        runtime = apply_ep(model, ep, placement)
    model.set_absorb_decode(config.absorb_decode)
    use_kernels = _kernels_usable(config, model.cfg)
    model.set_kernels(use_kernels)
    if config.expert_dtype == "fp4":
        model.quantize_experts_fp4()
    if config.batch_invariant and device.type == "cuda" and not use_kernels:
        raise ValueError("batch-invariant mode on CUDA needs the Triton kernels for this model")
    model.set_batch_invariant(config.batch_invariant)
    cfg = model.cfg
    kv_dtype = config.kv_cache_dtype or DTYPE_NAMES[dtype]
    spec = mla_cache_spec(
        cfg, loaded.model_id, config.block_size, kv_dtype, num_layers=model.num_cache_layers
    )
    num_blocks = config.num_kv_blocks or _blocks_for_memory(config, cfg, spec, device)
    cache = PagedKVCache(spec, num_blocks, device, cfg.qk_rope_head_dim)
    per_layer = spec.bytes_per_block / config.block_size / model.num_cache_layers
    cost = CostModel.for_model(
        cfg,
        torch.finfo(dtype).bits // 8,
        torch.finfo(TORCH_DTYPES[kv_dtype]).bits // 8,
        *_nominal_rates(device),
        expert_param_bytes=0.5 + 2 / 32
        if config.expert_dtype == "fp4"
        else 1 + 4 / 128**2
        if model.weight_dtype == "fp8"
        else None,
        kv_token_layer_bytes=per_layer,
    )
    graphs = config.cuda_graphs
    if runtime is not None and graphs and use_kernels and device.type == "cuda":
        log.info("engine: CUDA graphs off with expert parallelism (exchange sizes vary per step)")
        graphs = False
    runner = ModelRunner(
        model,
        cache,
        Sampler(device, config.sampler_seed, cfg.eos_token_ids, config.batch_invariant),
        use_kernels,
        graphs,
        max_model_len(config, cfg),
        # Speculative decoding verifies up to 1 + K rows per request through the same graphs.
        max_graph_batch=config.max_running * (1 + config.speculative_tokens),
        batch_invariant=config.batch_invariant,
        # Steps with prompt chunks replay the decode graphs up to 512 tokens (fewer when a
        # step may not hold that many).
        mixed_graph_rows=min(512, config.max_tokens_per_step),
    )
    runner.capture_all()
    if config.speculative_tokens:
        # Speculative decoding prices verification rows by the decode graphs' measured times
        # (each draft verified is one more row); None on the CPU: the analytic model prices them.
        try:
            measured = runner.time_decode_graphs()
        except Exception:  # the analytic model still prices them: log, do not fail the engine
            log.exception(
                "engine: timing the decode graphs failed; verification priced analytically"
            )
            measured = None
        if measured:
            cost.set_rows_table(measured, 1 + config.speculative_tokens)
            log.info(
                "engine: decode step by rows (measured): %s",
                ", ".join(f"{r}: {s * 1e3:.2f} ms" for r, s in sorted(measured.items())),
            )
    return EngineParts(
        loaded.model_id, cfg, spec, cache, num_blocks, cost, runner, device, loaded, runtime
    )


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


def _kernels_usable(config: EngineConfig, cfg: ModelConfig) -> bool:
    """The MLA decode kernel takes every DeepSeek checkpoint's widths (512 + 64)."""

    def why() -> str | None:
        from .kernels.mla_decode import unsupported

        return unsupported(cfg.kv_lora_rank, cfg.qk_rope_head_dim, config.block_size)

    return kernels_on(config, why)


def kernels_on(config: EngineConfig, why: Callable[[], str | None]) -> bool:
    """Whether the engine runs its Triton kernels: ``kernels="auto"`` on CUDA unless ``why()``
    names a width they do not take (then PyTorch, with a warning); ``"triton"`` refuses such
    a model; ``"torch"`` never."""
    if not config.use_kernels:
        return False
    reason = why()
    if reason is None:
        return True
    if config.kernels == "triton":
        raise ValueError(f"kernels='triton' cannot serve this model: {reason}")
    log.warning("engine: PyTorch instead of the kernels: %s", reason)
    return False


def _blocks_for_memory(
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


def _nominal_rates(device: torch.device) -> tuple[float, float]:
    """Starting FLOP/s and bytes/s for the cost model; calibrated by measured steps."""
    if device.type == "cuda":
        return 6e14, 4e12  # H200-class bf16 dense / HBM; the calibration corrects the rest
    return 5e10, 1e10
