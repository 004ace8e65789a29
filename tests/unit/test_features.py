"""The engine's feature combinations and quantization methods (issue 34 item 3).

What a user would notice: a combination the engine does not run is refused up front with a
sentence naming both features (not a crash mid-load), the same sentence from every entry
point; and an expert stored as FP8 or FP4 stays so through expert-parallel slot moves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.engine_config import EngineConfig
from libs.engine.features import REFUSED, Setup, check, refusals
from libs.engine.model.moe import Experts
from libs.engine.model.quant import Bf16Experts, Fp4Experts, Fp8Experts

ROOT = Path(__file__).resolve().parents[2]


def test_a_plain_engine_is_refused_nothing() -> None:
    assert refusals(Setup(family="deepseek-v3")) == []
    assert refusals(EngineConfig(model="tiny").setup("deepseek-v4")) == []


@pytest.mark.parametrize("row", REFUSED, ids=lambda r: " + ".join(r.features))
def test_every_row_of_the_table_refuses_by_name(row) -> None:
    """Each row is reachable: some setup makes exactly its sentence appear."""
    candidates = [
        Setup(family=f, weights=w, experts=e, batch_invariant=b, speculative=s,
              expert_parallel=p, kv_cache_dtype=k, cuda=c, kernels=kn)
        for f in ("deepseek-v3", "deepseek-v4")
        for w in ("auto", "fp8")
        for e in ("auto", "fp4")
        for b in (False, True)
        for s in (False, True)
        for p in (False, True)
        for k in (False, True)
        for c in (False, True)
        for kn in ("auto", "torch")
    ]  # fmt: skip
    hit = next(s for s in candidates if refusals(s, (row,)))
    with pytest.raises(ValueError) as err:
        check(hit)
    if row.reason == "V4":
        assert f"DeepSeek-V4 models are served without {row.features[1]}" in str(err.value)
    else:
        assert row.reason in str(err.value)


def test_v4_hears_every_feature_it_lacks_in_one_sentence() -> None:
    setup = Setup(family="deepseek-v4", speculative=True, batch_invariant=True, kv_cache_dtype=True)
    assert refusals(setup) == [
        "DeepSeek-V4 models are served without speculative decoding, a KV cache dtype, "
        "batch-invariant mode for now"
    ]


def test_the_config_refuses_what_it_alone_decides() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        EngineConfig(model="tiny", weight_dtype="fp8", expert_dtype="fp4")
    # the family is not known before the model resolves: a V4 name is checked by its factory
    EngineConfig(model="v4-tiny", speculative_tokens=2)


def test_no_combination_is_refused_outside_the_table() -> None:
    """The sentences that refuse a pair of features live in libs/engine/features.py only."""
    pattern = re.compile(r"does not run with|do not run with|served without")
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "libs").rglob("*.py")
        if p.name != "features.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


def _experts() -> Experts:
    cfg = ModelConfig(
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        hidden_size=128, moe_intermediate_size=128,
    )  # fmt: skip
    ex = Experts(cfg, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ex.w13.data.copy_(torch.randn(ex.w13.shape, generator=g) * 0.05)
    ex.w2.data.copy_(torch.randn(ex.w2.shape, generator=g) * 0.05)
    return ex


@pytest.mark.parametrize("method", ["fp8", "fp4"])
def test_a_quantized_expert_keeps_its_method_through_slot_moves(method: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=g)
    idx = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 2], [0, 1], [3, 3]])
    weights = torch.rand(6, 2, generator=g)
    ex = _experts()
    assert isinstance(ex.method, Bf16Experts)
    exact = ex(x, weights, idx)
    ex.quantize_fp8() if method == "fp8" else ex.quantize_fp4()
    kind = Fp8Experts if method == "fp8" else Fp4Experts
    assert isinstance(ex.method, kind) and ex.w13.numel() == 0  # the bf16 copy is freed
    quantized = ex(x, weights, idx)
    # quantized, so not exact, but near (FP4's e2m1 is coarse: within a quarter of the range)
    bound = 0.1 if method == "fp8" else 0.25
    assert 0 < (quantized - exact).abs().max() < bound * exact.abs().max()
    ex.keep_slots((3, 0))  # one EP rank's slots: expert 3 then expert 0
    assert isinstance(ex.method, kind) and len(ex.slot_state()) == 4
    local = torch.tensor([[1, 0], [0, 0]])  # rows: slot 1 = expert 0, slot 0 = expert 3
    assert torch.allclose(ex(x[[0, 5]], weights[[0, 5]], local), quantized[[0, 5]], atol=1e-5)
    with pytest.raises(ValueError, match="already"):
        ex.quantize_fp4() if method == "fp8" else ex.quantize_fp8()
