"""The cost model's FLOPs for DeepSeek-V2/V3 against what PyTorch's FLOP counter sees the engine
do in one step (as tests/unit/test_v4_engine.py checks V4's), on small random V2 and V3 configs
whose vocabulary (512) leaves the layers, not the head, most of the work. The scheduler sizes
prompt chunks by these numbers: a user sees a wrong estimate as steps that overrun their time
budget (slow streams) or chunks smaller than they could be (slow prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.flop_counter import FlopCounterMode

from libs.common.sampling import SamplingParams
from libs.engine.cost_model import StepShape
from libs.engine.engine import Engine, EngineConfig
from tests.hf_reference import build_hf, require_reference, save_hf

require_reference("transformers")

BLOCK = 16


@pytest.fixture(scope="module", params=["v2-softmax-greedy", "v3-yarn-grouped"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(build_hf(request.param, seed=1), tmp_path_factory.mktemp(request.param))


def ids(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 500 + 3 for i in range(n)]


def counted_step(path: Path, before: int, q: int) -> tuple[float, Engine]:
    """FLOPs of the step that computes ``q`` new tokens after ``before`` cached ones."""
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            block_size=BLOCK,
            num_kv_blocks=64,
            time_budget_s=None,
        )
    )
    assert before % BLOCK == 0  # the context is whole cached blocks: only q tokens computed
    if before:
        engine.add_request("ctx", ids(before, 1), SamplingParams(max_tokens=1), hold_kv=True)
        while engine.has_unfinished():
            engine.step()
    prompt = ids(before, 1) + ids(q, 2)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    with FlopCounterMode(display=False) as counter:
        engine.step()
    assert engine.info("r").num_cached_tokens == before, "the context was not reused"
    return float(counter.get_total_flops()), engine


@pytest.mark.parametrize("q", [1, 17, 64])
def test_a_prompt_costs_what_the_step_computes(checkpoint: Path, q: int) -> None:
    """A fresh prompt: exactly the counted FLOPs, once the pairs a causal kernel skips are
    added back (the CPU path computes the whole q x q square and masks it)."""
    counted, engine = counted_step(checkpoint, 0, q)
    masked = q * (q - 1) // 2
    estimate = engine.cost.flops(StepShape(((q, q),)))
    assert estimate + engine.cost.attn_flops_per_pair * masked == counted


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="the cost model prices every (query, key) pair in the expanded form, "
    "2*L*heads*(qk_head_dim + v_head_dim); decode runs the absorbed form, "
    "2*L*heads*(2*kv_lora_rank + qk_rope_head_dim), and the expanded path re-projects the "
    "cached context. Measured here (CPU, fp32): v2-softmax-greedy decode at context 289, "
    "852,672 FLOPs counted, 630,720 estimated (-26%); at DeepSeek-V3's widths the pair cost "
    "is 1088 vs 320 per head. Strict: drop this mark once the model counts the absorbed form",
)
@pytest.mark.parametrize(("before", "q"), [(32, 1), (288, 1), (288, 37)])
def test_a_step_over_cached_context_costs_what_the_step_computes(
    checkpoint: Path, before: int, q: int
) -> None:
    """Within 3% (as V4's): decode, and a prompt chunk after a cached prefix."""
    counted, engine = counted_step(checkpoint, before, q)
    estimate = engine.cost.flops(StepShape(((q, before + q),)))
    masked = q * (q - 1) // 2
    assert estimate + engine.cost.attn_flops_per_pair * masked == pytest.approx(counted, rel=0.03)


def test_the_counter_sees_the_absorbed_decode(tmp_path: Path) -> None:
    """What the xfail above measures, pinned so the figure in its reason stays true: a decode
    at context c costs the fresh one-token step (one pair, expanded) with its pair priced
    absorbed instead, plus an absorbed pair per cached token: per layer and head,
    2 * (2 * kv_lora_rank + qk_rope_head_dim) each (the projections cost the same both ways)."""
    path = save_hf(build_hf("v2-softmax-greedy", seed=1), tmp_path / "v2")
    one, engine = counted_step(path, 0, 1)
    cfg = engine.model_config
    per_pair = 2 * cfg.num_hidden_layers * cfg.num_attention_heads
    per_pair *= 2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for before in (32, 288):
        counted, _ = counted_step(path, before, 1)
        assert counted == one - engine.cost.attn_flops_per_pair + per_pair * (before + 1)
    assert (one, counted) == (354_240, 852_672)
