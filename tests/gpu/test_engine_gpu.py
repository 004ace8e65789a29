"""The engine's GPU path (kernels, CUDA graphs, overlap, FP8 KV, FP4 experts) against the
plain PyTorch path on the same weights, on a CUDA device.

* fp32: the kernel path gives the same greedy tokens as the reference path for a mixed batch
  (prompts of several lengths, decodes through CUDA graphs, overlapped steps, a preemption);
* bf16: logits of one batched prefill + 16 decode steps within 2e-2 relative error;
* FP8 KV and FP4 experts: their logits error against bf16 is bounded and printed.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.engine.engine import Engine, EngineConfig  # noqa: E402
from libs.engine.loader import load  # noqa: E402
from libs.engine.sampling_params import SamplingParams  # noqa: E402


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = [1, 7, 130, 300, 33, 64, 5, 257][:n]
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def _serve(engine: Engine, prompts: list[list[int]], sp: SamplingParams) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
    return out


@pytest.mark.parametrize("blocks", [512, 24])  # 24 blocks of 16: forces preemption
def test_kernel_path_gives_reference_tokens_fp32(blocks: int) -> None:
    loaded = load("tiny", "cuda", torch.float32, seed=1)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = _prompts(8, loaded.model.cfg.vocab_size)
    outs = {}
    for kernels in ("torch", "triton"):
        engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", block_size=16,
                                     num_kv_blocks=blocks, time_budget_s=None, kernels=kernels),
                        loaded=loaded)
        outs[kernels] = _serve(engine, prompts, sp)
    assert outs["triton"] == outs["torch"]


def _logits(engine: Engine, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Last-token logits after prefill, then after each of ``steps`` greedy decode steps."""
    rows = []
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    captured: list[torch.Tensor] = []
    original = engine.model.logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        captured.append(out.detach().float().cpu())
        return out

    engine.model.logits = spy  # type: ignore[method-assign]
    engine.runner.cuda_graphs = False  # the spy must see every step
    while engine.has_unfinished():
        engine.step()
    engine.model.logits = original  # type: ignore[method-assign]
    for t in captured:
        rows.append(t[: len(prompts)])
    return torch.stack(rows)


@pytest.mark.parametrize("variant", ["bf16-kernels", "fp8-kv", "fp4-experts"])
def test_quantized_logits_error_is_bounded(variant: str) -> None:
    prompts = _prompts(4, 129280)
    ref_engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", block_size=16,
                                     num_kv_blocks=256, time_budget_s=None, kernels="torch", seed=2))
    ref = _logits(ref_engine, prompts, 16)
    del ref_engine
    kw: dict[str, object] = {"dtype": "bfloat16"}
    if variant == "fp8-kv":
        kw["kv_cache_dtype"] = "fp8"
    if variant == "fp4-experts":
        kw["expert_dtype"] = "fp4"
    engine = Engine(EngineConfig(model="tiny", device="cuda", block_size=16, num_kv_blocks=256,
                                 time_budget_s=None, seed=2, **kw))  # type: ignore[arg-type]
    got = _logits(engine, prompts, 16)
    rel = ((got - ref).norm() / ref.norm()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{variant}: relative logits error vs fp32 reference {rel:.3e}, top-1 agreement {agree:.3f}")
    bound = {"bf16-kernels": 2e-2, "fp8-kv": 5e-2, "fp4-experts": 0.25}[variant]
    assert rel < bound
