"""The model/engine flags every engine-wrapping service takes, as one frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libs.common.config import flag

if TYPE_CHECKING:
    from libs.engine.engine import EngineConfig
    from libs.engine.grammar_probe import GrammarBudget


@dataclass(frozen=True)
class ModelFlags:
    model: str = "tiny"  # preset name or checkpoint directory
    device: str = "cpu"
    dtype: str = "auto"
    model_name: str = "deepseek-tiny"  # the served name (heartbeats, routing)
    num_kv_blocks: int = 2048
    block_size: int = 128
    weights_seed: int = 0
    max_tokens_per_step: int = 32768
    max_running: int = 256  # requests in one batch (vLLM's --max-num-seqs)
    max_model_len: int = 0  # context limit in tokens; 0: the model's
    # Seconds one engine step may take by the cost model (prompt chunks are cut to fit it);
    # 0: none, a step's prompt tokens are bounded by max_tokens_per_step alone.
    step_time_budget_s: float = 1.0
    fake_step_ms: float = 2.0  # --model fake: cost of one step
    fake_token_us: float = 2.0  # --model fake: and of each token computed in it
    kv_cache_dtype: str = "auto"  # or fp8 (both instances of a prefill -> decode pair must agree)
    experts: str = "bf16"  # or fp4
    weights: str = "auto"  # bf16 or fp8 (auto: fp8 for FP8 checkpoints, bf16 otherwise)
    # Secret shared by prefill and decode that signs KV frames ("" : unsigned, local use).
    kv_mac_key: str = field(default="", repr=False)
    # Share of the CUDA device's total memory for weights + KV cache + activations; sets the
    # number of KV blocks (overriding num_kv_blocks). None: num_kv_blocks as given.
    gpu_memory_fraction: float | None = None
    # Speculative decoding with the model's MTP layer: drafts per request and step (0: off) and
    # which of them a step verifies. Prefill and decode must agree on whether it is on (the
    # MTP layer's KV travels in the same blocks).
    speculative_tokens: int = 0
    speculative_schedule: str = "confidence"
    # Batch-invariant engine (--batch-invariant): logits independent of batch and chunking.
    # Prefill and decode must agree for a continuation after a failure to be exact.
    batch_invariant: bool = False
    # What compiling one new structured-output constraint may cost (libs/engine/grammar_probe.py):
    # seconds in a probe process (0: unbounded, no probe) and MiB of memory.
    grammar_compile_seconds: float = 5.0
    grammar_memory_mib: int = 256
    # Checkpoint shards read at once while loading (libs/engine/checkpoint_stream.py); on CUDA
    # each holds a pinned buffer of one shard's size (about 4.3 GB for DeepSeek-V3's).
    read_workers: int = 4

    def __post_init__(self) -> None:
        if self.fake_step_ms < 0 or self.fake_token_us < 0:
            raise ValueError("--fake-step-ms and --fake-token-us must be >= 0")
        if not self.model:
            raise ValueError("--model must name a preset or a checkpoint directory")
        if not self.model_name:
            raise ValueError("--model-name must not be empty")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"--kv-cache-dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.experts not in ("bf16", "fp4"):
            raise ValueError(f"--experts must be bf16 or fp4, got {self.experts!r}")
        if self.weights not in ("auto", "bf16", "fp8"):
            raise ValueError(f"--weights must be auto, bf16 or fp8, got {self.weights!r}")
        if self.speculative_tokens < 0:
            raise ValueError(f"--speculative-tokens must be >= 0, got {self.speculative_tokens}")
        if self.speculative_schedule not in ("confidence", "all"):
            raise ValueError(
                "--speculative-schedule must be confidence or all, "
                f"got {self.speculative_schedule!r}"
            )
        if self.gpu_memory_fraction is not None:
            if not 0 < self.gpu_memory_fraction <= 1:
                raise ValueError(
                    f"--gpu-memory-fraction must lie in (0, 1], got {self.gpu_memory_fraction}"
                )
            if not self.device.startswith("cuda"):
                raise ValueError(
                    f"--gpu-memory-fraction applies to CUDA devices, not --device {self.device}; "
                    "on CPU size the cache with --num-kv-blocks"
                )
        if not self.step_time_budget_s >= 0:
            raise ValueError(
                f"--step-time-budget must be >= 0 (0: none), got {self.step_time_budget_s}"
            )
        if self.max_model_len < 0:
            raise ValueError(
                f"--max-model-len must be >= 0 (0: the model's), got {self.max_model_len}"
            )
        if not self.grammar_compile_seconds >= 0:
            raise ValueError(
                "--grammar-compile-seconds must be >= 0 (0: unbounded), "
                f"got {self.grammar_compile_seconds}"
            )
        if self.grammar_memory_mib <= 0:
            raise ValueError(
                f"--grammar-memory-mib must be positive, got {self.grammar_memory_mib}"
            )
        for name in (
            "num_kv_blocks",
            "block_size",
            "max_tokens_per_step",
            "max_running",
            "read_workers",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                )

    def grammar_budget(self) -> GrammarBudget | None:
        """The budget of a new constraint's compile (None: unbounded)."""
        from libs.engine.grammar_probe import GrammarBudget  # torch-free

        if not self.grammar_compile_seconds:
            return None
        return GrammarBudget(self.grammar_compile_seconds, self.grammar_memory_mib)

    def engine_config(self) -> EngineConfig:
        from libs.engine.engine import EngineConfig  # torch: only when an engine is built

        fraction = self.gpu_memory_fraction
        config = EngineConfig(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            seed=self.weights_seed,
            block_size=self.block_size,
            # The fraction sizes the cache once the weights are loaded (libs/engine/parts.py).
            num_kv_blocks=self.num_kv_blocks if fraction is None else None,
            max_tokens_per_step=self.max_tokens_per_step,
            time_budget_s=self.step_time_budget_s or None,
            max_running=self.max_running,
            max_model_len=self.max_model_len or None,
            kv_cache_dtype="fp8" if self.kv_cache_dtype == "fp8" else None,
            expert_dtype="fp4" if self.experts == "fp4" else "auto",
            weight_dtype=self.weights,
            gpu_memory_fraction=fraction,
            kv_mac_key=self.kv_mac_key.encode() or None,
            speculative_tokens=self.speculative_tokens,
            speculative_schedule=self.speculative_schedule,
            batch_invariant=self.batch_invariant,
            read_workers=self.read_workers,
        )
        return config


def add_model_flags(
    parser: argparse.ArgumentParser,
    *,
    max_tokens_per_step: int = 32768,
    step_time_budget: float = 1.0,
) -> None:
    """The engine flags; a service whose steps mix roles passes its own step defaults."""
    flag(
        parser,
        "--model",
        default="tiny",
        help="model preset (tiny, v2-lite, v3-slice), checkpoint dir, Hugging Face repo id "
        "ORG/NAME[@REVISION] (fetched into the HF cache; HF_HUB_OFFLINE, HF_TOKEN), "
        "or fake (a deterministic hash, no model: load tests)",
    )
    flag(parser, "--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    flag(
        parser,
        "--dtype",
        default="auto",
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16",
    )
    flag(
        parser,
        "--model-name",
        default="deepseek-tiny",
        help="served model name",
        aliases=("--served-model-name",),
    )
    flag(parser, "--num-kv-blocks", type=int, default=2048, help="KV cache size in blocks")
    flag(
        parser,
        "--gpu-memory-fraction",
        type=float,
        default=None,
        help="CUDA only: share (0, 1] of the device's total memory for this instance's "
        "weights, KV cache and activations; the KV cache gets what is left after the "
        "weights and a step's activation reserve (overrides --num-kv-blocks)",
        aliases=("--gpu-memory-utilization",),
    )
    flag(parser, "--block-size", type=int, default=128, help="tokens per KV block")
    flag(parser, "--weights-seed", type=int, default=0, help="seed of a preset's random weights")
    flag(
        parser,
        "--max-tokens-per-step",
        type=int,
        default=max_tokens_per_step,
        help="token budget of one engine step (it also sizes the activation reserve)",
        aliases=("--max-num-batched-tokens",),
    )
    flag(
        parser,
        "--max-running",
        type=int,
        default=256,
        help="requests one engine step may carry",
        aliases=("--max-num-seqs",),
    )
    flag(
        parser,
        "--max-model-len",
        type=int,
        default=0,
        help="a request's context limit in tokens (0: the model's max_position_embeddings)",
    )
    flag(
        parser,
        "--step-time-budget",
        type=float,
        default=step_time_budget,
        help="seconds one engine step may take by the calibrated cost model: prompt chunks "
        "are cut to fit it (beside running decodes it bounds the time between their tokens); "
        "0: none (--max-tokens-per-step alone bounds a step)",
    )
    flag(
        parser,
        "--kv-cache-dtype",
        default="auto",
        help="fp8: e4m3 KV cache (1.79x the tokens per GiB); prefill and decode must agree",
    )
    flag(
        parser,
        "--experts",
        default="bf16",
        help="fp4: routed experts in e2m1 with a scale per 32 (a DeepSeek-V4 release's MXFP4 "
        "experts stay FP4 either way)",
    )
    flag(
        parser,
        "--weights",
        default="auto",
        help="fp8: e4m3 weights with 128x128 block scales (a bf16 model quantized at load); "
        "auto: fp8 for DeepSeek's FP8 checkpoints (kept as they are), bf16 otherwise and with "
        "--experts fp4 or --batch-invariant (a DeepSeek-V4 release keeps both its FP8 "
        "projections and its FP4 experts); bf16: FP8 checkpoints dequantized at load",
    )
    flag(
        parser,
        "--speculative-tokens",
        type=int,
        default=0,
        help="speculative decoding: the model's MTP layer drafts up to this many tokens per "
        "request and step, verified losslessly (0: off); prefill and decode must agree on on/off",
    )
    flag(
        parser,
        "--speculative-schedule",
        default="confidence",
        help="which drafts a step verifies: confidence (expected tokens per second of step "
        "time, calibrated online) or all",
    )
    flag(
        parser,
        "--batch-invariant",
        type=bool,
        default=False,
        help="batch-invariant engine: a request's logits do not depend on its batch or on how "
        "its prompt was chunked, so greedy output reproduces and a continuation after an "
        "instance fails is exact (slower; bf16 weights); prefill and decode must agree",
    )
    flag(
        parser,
        "--kv-mac-key",
        default="",
        help="secret that signs the KV frames this engine exports and must sign those it "
        "imports (kvstore, hand-off); the same on every prefill and decode instance, known to "
        "nothing else; pass it through the environment, not the command line. Empty: frames "
        "are not signed (local use)",
    )
    flag(
        parser,
        "--grammar-compile-seconds",
        type=float,
        default=5.0,
        help="seconds compiling one new structured-output constraint (JSON schema, regex, "
        "grammar) may take, timed in a probe process that is killed past it; the request is "
        "then refused with a 400 naming this limit (0: unbounded, no probe)",
    )
    flag(
        parser,
        "--grammar-memory-mib",
        type=int,
        default=256,
        help="MiB of memory compiling one new structured-output constraint may take, and its "
        "compiled grammar may hold; past it the request is refused with a 400 naming this limit",
    )
    flag(
        parser,
        "--read-workers",
        type=int,
        default=4,
        help="checkpoint shards read at once while loading, overlapped with placing the one "
        "before; on CUDA each holds a page-locked buffer of one shard (about 4.3 GB for "
        "DeepSeek-V3's shards): fewer on a host short of memory, more on fast NVMe arrays",
    )
    flag(
        parser,
        "--fake-step-ms",
        type=float,
        default=2.0,
        help="--model fake: milliseconds per step",
    )
    flag(
        parser,
        "--fake-token-us",
        type=float,
        default=2.0,
        help="--model fake: microseconds per token computed in a step",
    )


def model_flags_from(args: argparse.Namespace) -> ModelFlags:
    from libs.engine.hub import resolve_model  # torch-free

    return ModelFlags(
        # A Hub repo id (ORG/NAME[@REVISION]) becomes its snapshot directory in the HF cache.
        model=resolve_model(args.model),
        device=args.device,
        dtype=args.dtype,
        model_name=args.model_name,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        weights_seed=args.weights_seed,
        max_tokens_per_step=args.max_tokens_per_step,
        max_running=args.max_running,
        max_model_len=args.max_model_len,
        step_time_budget_s=args.step_time_budget,
        fake_step_ms=args.fake_step_ms,
        fake_token_us=args.fake_token_us,
        kv_cache_dtype=args.kv_cache_dtype,
        experts=args.experts,
        weights=args.weights,
        gpu_memory_fraction=args.gpu_memory_fraction,
        kv_mac_key=args.kv_mac_key,
        speculative_tokens=args.speculative_tokens,
        batch_invariant=args.batch_invariant,
        speculative_schedule=args.speculative_schedule,
        grammar_compile_seconds=args.grammar_compile_seconds,
        grammar_memory_mib=args.grammar_memory_mib,
        read_workers=args.read_workers,
    )
