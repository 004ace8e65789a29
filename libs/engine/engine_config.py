"""How an :class:`~libs.engine.engine.Engine` is set up: one frozen, validated config.

Every field has a default that serves a preset on the CPU; ``deepserve``'s flags
(``libs/serving/model_flags.py``) build one per engine service. Validation happens on creation
(``ValueError`` naming the field); nothing here reads files or the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ep.eplb import EplbConfig
from .features import Setup, check
from .kv.cache import TORCH_DTYPES
from .load_progress import ProgressSink
from .speculative import SCHEDULES


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # preset name or checkpoint directory
    device: str = "cpu"
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    seed: int = 0  # preset weights
    block_size: int = 128
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    kv_cache_dtype: str | None = None  # None: the model dtype
    max_tokens_per_step: int = 32768
    time_budget_s: float | None = 1.0
    max_running: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    sampler_seed: int | None = None
    absorb_decode: bool = True
    with_mtp: bool = False
    kernels: str = (
        "auto"  # "triton" (fused attention, Triton decode + MoE), "torch", auto: triton on CUDA
    )
    expert_dtype: str = (
        "auto"  # "fp4": routed experts quantized to e2m1 (converts the loaded model)
    )
    # "fp8": linear and routed-expert weights e4m3 with 128x128 block scales (DeepSeek's FP8
    # format; a bf16 model is quantized at load); "bf16": the model dtype (FP8 checkpoints are
    # dequantized); "auto": fp8 for checkpoints whose config carries that quantization_config.
    weight_dtype: str = "auto"
    cuda_graphs: bool = True  # decode-only steps replay captured graphs (CUDA with kernels)
    # Speculative decoding (libs/engine/speculative/): drafts per request and step made by
    # the model's MTP layer (loaded for it), 0 = off; which drafts a step verifies:
    # "confidence" (expected tokens per second) or "all".
    speculative_tokens: int = 0
    speculative_schedule: str = "confidence"
    # Share of the device's total memory this engine may use for weights + KV + activations
    # (co-located engines split a GPU); sizes the KV cache after loading. None: see above.
    gpu_memory_fraction: float | None = None
    # Signs exported KV frames and requires the signature on import (prefill and decode share
    # it; nobody else holds it). None: frames are neither signed nor checked.
    kv_mac_key: bytes | None = field(default=None, repr=False)
    overlap: bool | None = None  # None: on for CUDA
    # With expert parallelism: EPLB's window and re-placement interval ("decode", "prefill":
    # EplbConfig's defaults for that role, or an EplbConfig); None: no EPLB, placement fixed.
    # Its redundant_per_rank sizes the default placement's spare slots. Ignored without EP.
    eplb: EplbConfig | str | None = None
    # Batch-invariant mode (libs/engine/kernels/invariant.py, MLAttention's invariant
    # path): a request's logits do not depend on its batch, its prompt's chunking, or whether
    # a token was prefilled or decoded, so greedy output reproduces and a continuation after an
    # instance dies is exact. Slower; bf16 weights, no expert parallelism, no V4.
    batch_invariant: bool = False
    # Loading a checkpoint: shards read at once (libs/engine/checkpoint_stream.py; on CUDA
    # each holds a pinned buffer of one shard), and who hears how far the read has got
    # (libs/engine/load_progress.py; called on the loading thread). Neither changes the model.
    read_workers: int = 4
    load_progress: ProgressSink | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.kv_cache_dtype == "fp8":
            object.__setattr__(self, "kv_cache_dtype", "float8_e4m3fn")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in TORCH_DTYPES:
            raise ValueError(f"kv_cache_dtype must be fp8 or one of {sorted(TORCH_DTYPES)}")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be auto, triton or torch, got {self.kernels!r}")
        if self.expert_dtype not in ("auto", "fp4"):
            raise ValueError(f"expert_dtype must be auto or fp4, got {self.expert_dtype!r}")
        if self.weight_dtype not in ("auto", "bf16", "fp8"):
            raise ValueError(f"weight_dtype must be auto, bf16 or fp8, got {self.weight_dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.read_workers < 1:
            raise ValueError(f"read_workers must be at least 1, got {self.read_workers}")
        check(self.setup())  # what the config alone decides; the family's factory the rest
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(
                f"gpu_memory_fraction must lie in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if self.speculative_schedule not in SCHEDULES:
            raise ValueError(
                f"speculative_schedule must be one of {SCHEDULES}, "
                f"got {self.speculative_schedule!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if isinstance(self.eplb, str):
            object.__setattr__(self, "eplb", EplbConfig.named(self.eplb))

    def setup(self, family: str = "", expert_parallel: bool = False) -> Setup:
        """What :mod:`.features` reads of this config (``family`` "": before the model is
        resolved, so no family's rows apply)."""
        return Setup(
            family=family,
            weights=self.weight_dtype,
            experts=self.expert_dtype,
            batch_invariant=self.batch_invariant,
            speculative=self.speculative_tokens > 0,
            expert_parallel=expert_parallel,
            kv_cache_dtype=self.kv_cache_dtype is not None,
            cuda=self.device.startswith("cuda"),
            kernels=self.kernels,
        )

    @property
    def use_kernels(self) -> bool:
        return self.kernels == "triton" or (
            self.kernels == "auto" and self.device.startswith("cuda")
        )

    @property
    def use_overlap(self) -> bool:
        return self.overlap if self.overlap is not None else self.device.startswith("cuda")

    @property
    def eplb_config(self) -> EplbConfig | None:
        assert not isinstance(self.eplb, str)  # resolved on creation
        return self.eplb

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return TORCH_DTYPES[self.dtype]
