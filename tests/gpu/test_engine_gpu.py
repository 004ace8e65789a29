"""The engine's GPU path (kernels, CUDA graphs, overlap, FP8 KV, FP4 experts) against the
plain PyTorch path on the same weights, on a CUDA device.

* fp32: the kernel path gives the same greedy tokens as the reference path for a mixed batch
  (prompts of several lengths, decodes through CUDA graphs, overlapped steps, a preemption);
* bf16 kernels against the fp32 reference (no worse than bf16 PyTorch), and FP8 KV / FP4
  experts against bf16: logits of a batched prefill and 16 teacher-forced decode steps (same
  tokens fed to both), relative error bounded and printed.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from deepserve.bench.engine import capture_logits, compare_logits, quality_inputs  # noqa: E402
from libs.common.sampling import SamplingParams  # noqa: E402
from libs.engine.engine import Engine, EngineConfig  # noqa: E402
from libs.engine.loader import load  # noqa: E402


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


# Penalties read the history on the device (the newest token from the step in flight) and
# min_tokens masks EOS: the same tokens through CUDA graphs and overlap as eagerly.
PENALIZED = SamplingParams(
    max_tokens=24, min_tokens=24, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=1
)


@pytest.mark.parametrize("blocks", [512, 24])  # 24 blocks of 16: forces preemption
@pytest.mark.parametrize(
    "sp", [SamplingParams(max_tokens=24, ignore_eos=True), PENALIZED], ids=["plain", "penalized"]
)
def test_kernel_path_gives_reference_tokens_fp32(blocks: int, sp: SamplingParams) -> None:
    loaded = load("tiny", "cuda", torch.float32, seed=1)
    prompts = _prompts(8, loaded.model.cfg.vocab_size)
    outs = {}
    for kernels in ("torch", "triton"):
        engine = Engine(
            EngineConfig(
                model="tiny",
                device="cuda",
                dtype="float32",
                block_size=16,
                num_kv_blocks=blocks,
                time_budget_s=None,
                kernels=kernels,
            ),
            loaded=loaded,
        )
        outs[kernels] = _serve(engine, prompts, sp)
    assert outs["triton"] == outs["torch"]


def _forced(variant: dict[str, object], prompts: list[list[int]], forced: list[list[int]]):
    engine = Engine(
        EngineConfig(
            model="tiny",
            device="cuda",
            block_size=16,
            num_kv_blocks=256,
            time_budget_s=None,
            seed=2,
            **variant,
        )
    )  # type: ignore[arg-type]
    rows = capture_logits(engine, prompts, forced)
    del engine
    torch.cuda.empty_cache()
    return rows


@pytest.mark.parametrize(
    "variant,bound",
    [
        # Bounds from the fp32 CPU reference on this tiny random model: fp8 6.2e-2, fp4 7.5e-2.
        ({"dtype": "bfloat16", "kv_cache_dtype": "fp8"}, 0.1),
        ({"dtype": "bfloat16", "expert_dtype": "fp4"}, 0.15),
    ],
)
def test_quantized_logits_error_against_bf16_is_bounded(
    variant: dict[str, object], bound: float
) -> None:
    """Same weights, same (teacher-forced) tokens: only the quantization differs."""
    prompts, forced = quality_inputs(129280, 4, 200, 16)
    ref = _forced({"dtype": "bfloat16"}, prompts, forced)
    got = _forced(variant, prompts, forced)
    stats = compare_logits(got, ref, 200)
    print(
        f"{variant}: relative logits error vs bf16 {stats['relative_error']:.3e}, "
        f"top-1 agreement {stats['top1_agreement']:.3f}"
    )
    assert stats["relative_error"] < bound


def test_bf16_kernel_path_adds_no_error_beyond_bf16() -> None:
    """Against the fp32 reference, the bf16 kernel path errs no more than bf16 PyTorch does."""
    prompts, forced = quality_inputs(129280, 4, 200, 16)
    ref = _forced({"dtype": "float32", "kernels": "torch"}, prompts, forced)
    plain = compare_logits(
        _forced({"dtype": "bfloat16", "kernels": "torch"}, prompts, forced), ref, 200
    )
    fast = compare_logits(_forced({"dtype": "bfloat16"}, prompts, forced), ref, 200)
    print(
        f"vs fp32: bf16 kernels {fast['relative_error']:.3e} (top-1 {fast['top1_agreement']:.3f}), "
        f"bf16 PyTorch {plain['relative_error']:.3e} (top-1 {plain['top1_agreement']:.3f})"
    )
    assert fast["relative_error"] <= 1.5 * plain["relative_error"] + 1e-3
