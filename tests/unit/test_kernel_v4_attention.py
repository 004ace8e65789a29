"""DeepSeek-V4's Triton kernels (libs/engine/kernels/v4_attention.py, and the fused MoE's
clamped SwiGLU) against plain PyTorch on Triton's interpreter, and the V4 model with its
kernels on against the model without them: same logits, same greedy tokens through the engine.

Inputs are random and strided where the callers pass views; the gather index holds ``-1``
holes, repeats and a query with no rows at all; outputs are poisoned first. fp32 throughout
(the interpreter's bf16 ``tl.dot`` is wrong; bf16 runs in tests/gpu/test_v4_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kernels.fused_moe import fused_moe, fused_moe_reference
from libs.engine.kernels.v4_attention import (
    indexer_scores,
    indexer_scores_reference,
    sparse_decode_attention,
    sparse_decode_attention_reference,
)
from libs.engine.v4.load import generate_v4
from libs.engine.v4.model import V4ForCausalLM, V4State
from libs.engine.v4.serving import v4_parts
from tests.hf_reference import build_hf_v4, ours_of


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_decode_attention_matches_pytorch(splits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    b, h, d, n, k = 4, 5, 64, 90, 70
    q = torch.randn(b, h, d + 8, generator=gen)[..., :d]  # strided heads
    rows = torch.randn(n, d, generator=gen)
    index = torch.randint(0, n, (b, k), generator=gen, dtype=torch.int32)
    index[0, ::3] = -1  # holes
    index[1, 40:] = -1  # a short query
    index[2] = -1  # nothing to attend to: zeros
    index[3, :10] = 7  # a row gathered repeatedly counts each time
    sinks = torch.randn(h, generator=gen)
    ref = sparse_decode_attention_reference(q, rows, index, sinks, d**-0.5)
    out = sparse_decode_attention(q, rows, index, sinks, d**-0.5, num_splits=splits)
    assert _rel(out, ref) < 1e-5
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # The sink takes mass: a larger one changes every output row, as in the reference.
    bigger = sparse_decode_attention(q, rows, index, sinks + 3.0, d**-0.5, num_splits=splits)
    again = sparse_decode_attention_reference(q, rows, index, sinks + 3.0, d**-0.5)
    assert _rel(bigger, again) < 1e-5
    assert float((bigger[:2] - out[:2]).norm()) > 0.2 * float(out[:2].norm())


def test_indexer_scores_match_pytorch_and_mark_what_a_query_cannot_see() -> None:
    gen = torch.Generator().manual_seed(1)
    b, hi, d = 3, 6, 32
    keys = torch.randn(200, d, generator=gen)
    starts = torch.tensor([0, 70, 150], dtype=torch.int32)
    counts = torch.tensor([70, 0, 45], dtype=torch.int32)
    q = torch.randn(b, hi, d, generator=gen)
    w = torch.randn(b, hi, generator=gen)
    ref = indexer_scores_reference(q, w, keys, starts, counts, 80, d**-0.5)
    out = indexer_scores(q, w, keys, starts, counts, 80, d**-0.5)
    seen = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), seen)
    assert int(seen.sum()) == 115
    assert torch.allclose(out[seen], ref[seen], rtol=1e-5, atol=1e-5)


def test_fused_moe_clamps_the_swiglu_as_v4_does() -> None:
    gen = torch.Generator().manual_seed(2)
    t, h, i, e, k = 9, 64, 32, 8, 2
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.5
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=gen)
    ref = fused_moe_reference(x, w13, w2, wts, ids, swiglu_limit=1.5)
    out = fused_moe(x, w13, w2, wts, ids, swiglu_limit=1.5)
    assert _rel(out, ref) < 1e-5
    unclamped = fused_moe_reference(x, w13, w2, wts, ids)
    assert _rel(unclamped, ref) > 0.1  # the limit bites on these inputs


@pytest.fixture(scope="module")
def net() -> V4ForCausalLM:
    return ours_of(build_hf_v4("v4-mixed"))  # CSA layers pick 3 of their entries


def test_v4_decode_through_the_kernels_gives_the_reference_logits(net: V4ForCausalLM) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=gen) for n in (3, 21, 40)]
    states = [V4State.empty(net.cfg) for _ in prompts]
    for p, st in zip(prompts, states, strict=True):
        net.forward(p, st)
    twins = copy.deepcopy(states)
    step = torch.randint(2, 256, (3, 4), generator=gen)
    try:
        for j in range(4):  # decode steps, every sequence one token
            chunks = [step[i, j : j + 1] for i in range(3)]
            net.set_kernels(False)
            ref = net.forward_batch(chunks, states)
            net.set_kernels(True)
            out = net.forward_batch(chunks, twins)
            assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), j
    finally:
        net.set_kernels(False)


def test_the_engine_with_v4_kernels_decodes_each_request_as_alone(net: V4ForCausalLM) -> None:
    config = EngineConfig(model="v4", kernels="triton", block_size=16, max_tokens_per_step=64)
    eng = Engine(config, parts=v4_parts(config, net, "net-k"))
    try:
        net.warm_kernels()  # what v4_parts runs on CUDA: every kernel variant, dummy inputs
        gen = torch.Generator().manual_seed(4)
        prompts = {f"r{n}": torch.randint(2, 256, (n,), generator=gen).tolist() for n in (5, 33)}
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        for rid, p in prompts.items():
            eng.add_request(rid, p, params)
        out: dict[str, list[int]] = {rid: [] for rid in prompts}
        while eng.has_unfinished():
            for ev in eng.step():
                if ev.token_id is not None:
                    out[ev.request_id].append(ev.token_id)
    finally:
        net.set_kernels(False)
    for rid, p in prompts.items():
        assert out[rid] == list(generate_v4(net, p, 8, ignore_eos=True).token_ids), rid


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_hyper_connection_mix_matches_pytorch(n: int) -> None:
    """Sinkhorn in one launch: pre, post and the doubly stochastic comb of 70 tokens (three
    programs, the last partial), stream counts that are and are not powers of two."""
    from libs.engine.kernels.v4_mix import hc_mix, hc_mix_reference

    gen = torch.Generator().manual_seed(n)
    mixed = torch.randn(70, (2 + n) * n, generator=gen) * 2
    base = torch.randn((2 + n) * n, generator=gen)
    scale = torch.rand(3, generator=gen) + 0.5
    want = hc_mix_reference(mixed, base, scale, n, 20, 1e-6)
    got = hc_mix(mixed, base, scale, n, 20, 1e-6)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    comb = got[2]
    ones = torch.ones(70, n)
    assert torch.allclose(comb.sum(dim=-2), ones, atol=1e-4)  # columns after the last pass
    assert torch.allclose(comb.sum(dim=-1), ones, atol=0.1)  # rows, nearly (20 passes)
