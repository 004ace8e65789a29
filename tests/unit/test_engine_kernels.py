"""The engine's kernel path (Triton decode attention, fused MoE, fused norms/RoPE, fused prompt
attention), run on the CPU through Triton's interpreter, against the plain PyTorch path.

The same code runs compiled on a GPU (tests/gpu/test_engine_gpu.py checks it there with CUDA
graphs); here it proves the wiring: decodes as the batch tail, placeholders from the step in
flight, paged block tables, FP8 cache reads and FP4 expert dequantization inside the kernels.
"""

from __future__ import annotations

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.loader import load

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=5, ignore_eos=True)


def _prompts() -> list[list[int]]:
    return [
        [(i * 7919 + s * 104729) % 120000 + 3 for i in range(n)]
        for s, n in enumerate([1, 9, 40, 17])
    ]


def _serve(loaded, sp: SamplingParams, **kw) -> dict[str, list[int]]:
    engine = Engine(
        EngineConfig(
            model="tiny",
            block_size=16,
            num_kv_blocks=64,
            time_budget_s=None,
            max_tokens_per_step=48,
            **kw,
        ),
        loaded=loaded,
    )
    out: dict[str, list[int]] = {}
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, sp)
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for ev in engine.step():
            out[ev.request_id].append(ev.token_id)
    assert engine.blocks.num_free == 64
    return out


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_kernel_path_gives_the_reference_tokens(tiny_loaded, sp: SamplingParams) -> None:
    # 48 tokens per step: the 40-token prompt is chunked, so steps mix prompt chunks and decodes.
    ref = _serve(tiny_loaded, sp, kernels="torch", overlap=False)
    assert _serve(tiny_loaded, sp, kernels="triton", overlap=True) == ref


def test_fp8_cache_and_fp4_experts_run_through_the_kernels() -> None:
    """Each quantized format gives the same tokens through the kernels as through PyTorch."""
    for kw in ({"kv_cache_dtype": "fp8"}, {"expert_dtype": "fp4"}):
        loaded = load("tiny", "cpu", torch.float32, seed=0)  # fp4 converts the model: its own copy
        ref = _serve(loaded, GREEDY, kernels="torch", **kw)
        assert _serve(loaded, GREEDY, kernels="triton", **kw) == ref, kw


def test_shapes_the_kernels_do_not_take_are_refused_by_name(tiny_loaded) -> None:
    with pytest.raises(ValueError, match="block_size=8"):
        Engine(
            EngineConfig(model="tiny", block_size=8, num_kv_blocks=64, kernels="triton"),
            loaded=tiny_loaded,
        )
