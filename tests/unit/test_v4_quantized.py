"""DeepSeek-V4 quantized as released: routed experts held in FP4 (e2m1, a scale per 32 along
K) -- the release's MXFP4 moved into the fused MoE's layout without rounding, ``--experts fp4``
on a preset, the PyTorch and kernel paths (Triton's interpreter here), FP4 slots under expert
parallelism -- and ``--weights fp8`` on a preset. The release checkpoint itself loads with its
experts in FP4 and its projections in FP8 in tests/unit/test_v4_release.py."""

from __future__ import annotations

import copy

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.block_scales import dequantize, mxfp4_as_kernel_fp4
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kernels.fused_moe import Fp4Weight, dequantize_fp4
from libs.engine.llm import LLM
from libs.engine.model.layers import Fp8Linear
from libs.engine.v4.load import generate_v4, load_v4
from libs.engine.v4.model import V4ForCausalLM, V4State
from libs.engine.v4.moe import Experts
from libs.serving.ep.generate import collect_outputs
from tests.unit.test_ep_v4 import replaced_live

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
ENGINE = dict(block_size=16, num_kv_blocks=48, time_budget_s=None)
PROMPTS = [
    [(i * 7919 + s * 104729) % 120000 + 3 for i in range(n)] for s, n in enumerate([5, 23, 40])
]


def _experts(net: V4ForCausalLM) -> list[Experts]:
    return [m for m in net.modules() if isinstance(m, Experts)]


def test_release_mxfp4_moves_into_the_kernel_layout_without_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 6, 128
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    exponents = torch.randint(100, 150, (n, k // 32), generator=gen, dtype=torch.uint8)
    want = dequantize(packed.view(torch.int8), exponents)  # the release's reading
    scales = [exponents]
    if hasattr(torch, "float8_e8m0fnu"):
        scales.append(exponents.view(torch.float8_e8m0fnu))
    for scale in scales:
        codes, bf16 = mxfp4_as_kernel_fp4(packed.view(torch.int8), scale)
        assert codes.shape == (n, k // 2) and bf16.dtype == torch.bfloat16
        got = dequantize_fp4(Fp4Weight(codes[None], bf16[None]), torch.float32)[0]
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="multiple of 64"):
        mxfp4_as_kernel_fp4(packed[:, :16], exponents[:, :1])


def test_fp4_experts_compute_what_their_decoded_values_compute() -> None:
    """A preset quantized to FP4 gives bit for bit the logits of the same model holding the
    decoded values in its parameters; the experts keep 9/16 of a byte per weight."""
    net = load_v4("v4-tiny")
    net.quantize_experts_fp4()
    decoded = load_v4("v4-tiny")
    for ours, theirs in zip(_experts(net), _experts(decoded), strict=True):
        assert ours.fp4 is not None and ours.gate_up_proj.numel() == 0
        gate_up, down = ours.fp4
        theirs.gate_up_proj.data.copy_(dequantize_fp4(gate_up, torch.float32))
        theirs.down_proj.data.copy_(dequantize_fp4(down, torch.float32))
        assert gate_up.nbytes * 16 == theirs.gate_up_proj.numel() * 9
    ids = torch.tensor(PROMPTS[1])
    got = net(ids, V4State.empty(net.cfg))
    assert torch.equal(got, decoded(ids, V4State.empty(decoded.cfg)))
    plain = load_v4("v4-tiny")
    assert not torch.equal(got, plain(ids, V4State.empty(plain.cfg)))  # FP4 changed something


def test_fp4_experts_through_the_fused_moe_kernel() -> None:
    """The kernel path (decoding inside its GEMMs) against the PyTorch path, one layer."""
    net = load_v4("v4-tiny")
    net.quantize_experts_fp4()
    experts = _experts(net)[1]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, net.cfg.hidden_size, generator=gen)
    idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=gen)
    ref = experts(x, w, idx)
    kernel = copy.deepcopy(experts)
    kernel.use_kernels = True
    got = kernel(x, w, idx)
    assert (got - ref).norm() / ref.norm() < 1e-5


def test_engine_with_fp4_experts_generates_the_reference_tokens() -> None:
    """``--experts fp4`` on a V4 preset: the engine's greedy tokens are the reference
    generator's on the same quantized model."""
    llm = LLM(engine=Engine(EngineConfig(model="v4-tiny", expert_dtype="fp4", **ENGINE)))
    assert all(e.fp4 is not None for e in _experts(llm.engine.runner.net))
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, decode_text=False)]
    net = load_v4("v4-tiny")
    net.quantize_experts_fp4()
    assert got == [generate_v4(net, p, 5, ignore_eos=True).token_ids for p in PROMPTS]


def test_fp4_slots_move_between_ranks() -> None:
    """Three ranks hold FP4 slots (codes and scales travel together), replicated and then
    re-placed live: the tokens of one FP4 engine."""
    llm = LLM(engine=Engine(EngineConfig(model="v4-tiny", expert_dtype="fp4", **ENGINE)))
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, decode_text=False)]
    results = replaced_live(PROMPTS, expert_dtype="fp4")
    assert [o.token_ids for o in collect_outputs(results, len(PROMPTS))] == want


def test_engine_with_fp8_projections_generates_the_reference_tokens() -> None:
    """``--weights fp8`` on a V4 preset: its FP8 projections are e4m3 linears, and the
    engine's greedy tokens are the reference generator's on the same quantized model."""
    llm = LLM(engine=Engine(EngineConfig(model="v4-tiny", weight_dtype="fp8", **ENGINE)))
    net = llm.engine.runner.net
    modules = dict(net.named_modules())
    assert all(isinstance(modules[n], Fp8Linear) for n in net.fp8_projections())
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, decode_text=False)]
    ref = load_v4("v4-tiny", weights="fp8")
    assert got == [generate_v4(ref, p, 5, ignore_eos=True).token_ids for p in PROMPTS]
