"""The memory plan made before any weight is read (libs/engine/memory_plan.py, sizing.py)."""

from __future__ import annotations

import pytest
import torch

from libs.engine import registry, v3_parts
from libs.engine.config import ModelConfig
from libs.engine.engine import EngineConfig
from libs.engine.kv.layout import mla_cache_spec
from libs.engine.memory_plan import plan_memory, weight_bytes
from libs.engine.model.model import DeepseekForCausalLM
from libs.engine.model.moe import Experts
from libs.engine.presets import PRESETS
from libs.engine.sizing import memory_plan_for, step_activation_bytes

GIB = 1 << 30
H100 = int(79.1 * GIB)


def _held(model: torch.nn.Module) -> int:
    """Bytes the model holds: parameters plus quantized expert tensors."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, Experts) and (m.fp4 is not None or m.fp8 is not None):
            n += sum(t.numel() * t.element_size() for t in m.slot_state())
    return n


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp4", "ep"])
@pytest.mark.parametrize("mtp", [False, True])
def test_weight_bytes_are_what_the_model_holds(mode: str, mtp: bool) -> None:
    cfg = PRESETS["tiny"]
    slots = (0, 3, 5, -1) if mode == "ep" else None
    model = DeepseekForCausalLM(cfg, torch.bfloat16, "cpu", with_mtp=mtp, expert_slots=slots)
    if mode == "fp8":
        model.quantize_weights_fp8()
    if mode == "fp4":
        model.quantize_experts_fp4()
    wb = weight_bytes(
        cfg,
        dtype_bytes=2,
        weights="fp8" if mode == "fp8" else "bf16",
        experts="fp4" if mode == "fp4" else "model",
        expert_slots=len(slots) if slots else None,
        with_mtp=mtp,
    )
    assert wb.params == _held(model)
    assert wb.load_peak >= wb.params and wb.derived > 0


@pytest.mark.parametrize("name", ["v2-lite", "v3-slice"])
def test_weight_bytes_of_the_large_presets(name: str) -> None:
    cfg = PRESETS[name]
    model = DeepseekForCausalLM(cfg, torch.bfloat16, "meta", with_mtp=True)
    assert weight_bytes(cfg, dtype_bytes=2, with_mtp=True).params == _held(model)


def _plan(cfg: ModelConfig, name: str, weights: str, gpu: int, **kw):
    act = step_activation_bytes(
        cfg, step_tokens=8192, sample_rows=256, context_tokens=32768, dtype_bytes=2
    )
    spec = mla_cache_spec(cfg, "x", 128, "bfloat16")
    return plan_memory(
        cfg,
        model=name,
        dtype_bytes=2,
        weights=weights,
        experts=kw.pop("experts", "model"),
        activation_bytes=act,
        kv_bytes_per_block=spec.bytes_per_block,
        kv_blocks=kw.pop("kv_blocks", 64),
        kv_is_minimum=kw.pop("kv_is_minimum", True),
        gpu_bytes=gpu,
        fraction=kw.pop("fraction", 0.9),
        **kw,
    )


def test_v2_lite_fits_an_h100_and_says_so_in_one_line() -> None:
    plan = _plan(PRESETS["v2-lite"], "v2-lite", "bf16", H100)
    assert plan.fits
    line = plan.line()
    assert line.startswith("v2-lite bf16: weights 29.6 GiB + activations ")
    assert "+ KV >= 0." in line and "per GPU = " in line
    assert line.endswith("this GPU has 79.1 GiB x 0.90 = 71.2 GiB") and "\n" not in line
    # The sum is the parts': weights (with first-step copies), activations, KV + scratch.
    assert plan.need_bytes == plan.weights.serving + plan.activation_bytes + 65 * (
        mla_cache_spec(PRESETS["v2-lite"], "x").bytes_per_block
    )
    # Without a fraction the budget is what is free; a KV size asked for is not a minimum.
    free = _plan(PRESETS["v2-lite"], "v2-lite", "bf16", 40 * GIB, fraction=None)
    assert free.line().endswith("this GPU has 40.0 GiB free") and free.fits
    big_kv = _plan(
        PRESETS["v2-lite"], "v2-lite", "bf16", H100, kv_blocks=12_000, kv_is_minimum=False
    )
    msg = big_kv.refusal()
    assert not big_kv.fits and "KV 44.5 GiB" in msg and ">=" not in msg and "--num-kv-blocks" in msg


def test_deepseek_v3_in_fp8_at_ep8_does_not_fit_an_h100() -> None:
    v3 = ModelConfig()  # DeepSeek-V3's shapes
    plan = _plan(v3, "DeepSeek-V3", "fp8", H100, ep=8, expert_slots=32)
    assert not plan.fits
    msg = plan.refusal()
    assert msg.startswith("DeepSeek-V3 in fp8 needs ")
    assert "per GPU at EP 8 (32 of 256 experts)" in msg
    assert "this GPU has 79.1 GiB x 0.90 = 71.2 GiB" in msg and "--ep" in msg
    # Served, its FP8 weights are ~96 GiB a rank; loaded, the rank's experts pass through bf16.
    assert 90 * GIB < plan.weights.serving < 100 * GIB
    assert plan.weights.load_peak > 160 * GIB and "loading holds" in msg
    # At EP 32 a rank's share fits.
    assert _plan(v3, "DeepSeek-V3", "fp8", H100, ep=32, expert_slots=8).fits
    # FP4 experts: 0.5 byte + a bf16 scale per 32 weights, against bf16's 2.
    bf16 = weight_bytes(v3, dtype_bytes=2, expert_slots=32).params
    fp4 = weight_bytes(v3, dtype_bytes=2, experts="fp4", expert_slots=32).params
    assert 0.3 < fp4 / bf16 < 0.45


def test_cuda_engines_refuse_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    props = type("Props", (), {"total_memory": 16 * GIB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d: (12 * GIB, 16 * GIB))

    def no_load(*_a, **_k):
        raise AssertionError("weights read before the plan refused")

    monkeypatch.setattr(v3_parts, "load", no_load)
    config = EngineConfig(model="v2-lite", device="cuda", gpu_memory_fraction=0.9)
    with pytest.raises(ValueError, match=r"v2-lite in bf16 needs 3\d\.\d GiB per GPU: "):
        registry.build_parts(config)
    plan = memory_plan_for(config, PRESETS["v2-lite"], torch.device("cuda"))
    assert plan.gpu_bytes == 16 * GIB and plan.fraction == 0.9 and plan.kv_is_minimum
    fixed = EngineConfig(model="tiny", device="cuda", num_kv_blocks=32)
    plan = memory_plan_for(fixed, PRESETS["tiny"], torch.device("cuda"))
    assert plan.fits and plan.gpu_bytes == 12 * GIB and not plan.kv_is_minimum
    assert plan.line().startswith("tiny bf16: weights ")
