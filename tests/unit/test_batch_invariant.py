"""Batch-invariant mode (``EngineConfig.batch_invariant``, ``--batch-invariant``).

What a user sees: a request's log probabilities are the same numbers, bit for bit, whether it
is served alone or beside other requests, whether its prompt is prefilled whole or in chunks,
and whether its tokens were decoded or re-prefilled by a continuation after a failure. On
this CPU the default engine differs in the last bits in all three (MKL sums a row differently
at different batch sizes; prefill attends in the expanded form, decode in the absorbed one).

The Triton kernels of the mode are checked here against PyTorch under Triton's interpreter
(close, not bitwise: the interpreter's numpy matmul sums a row differently by its place in a
tile, which the GPU's MMA does not); ``tests/gpu/test_batch_invariant_gpu.py`` checks the
bitwise property through them on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kernels.invariant import linear, matmul_nt
from tests.unit.test_engine import run

SP = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(
    temperature=0.9, top_k=40, seed=3, max_tokens=8, ignore_eos=True, logprobs=5
)


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 120000 + 3 for i in range(n)]


def make(loaded, **kw) -> Engine:
    base = dict(
        model="tiny",
        block_size=16,
        num_kv_blocks=256,
        time_budget_s=None,
        batch_invariant=True,
        kernels="torch",
    )
    base.update(kw)
    return Engine(EngineConfig(**base), loaded=loaded)


def serve(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Per request: (token, logprob, top ids, top logprobs) of every generated token."""
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    out: dict[str, list] = {rid: [] for rid in reqs}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                lp = ev.logprobs
                out[ev.request_id].append((ev.token_id, lp.logprob, lp.top_ids, lp.top_logprobs))
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("sp", [SP, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_do_not_depend_on_the_batch_or_the_chunking(
    tiny_loaded, overlap: bool, sp: SamplingParams
) -> None:
    p = prompt(45, 1)
    alone = serve(make(tiny_loaded, overlap=overlap), {"x": (p, sp)})["x"]
    others = {"a": (prompt(7, 2), SP), "b": (prompt(70, 3), SEEDED), "c": (prompt(30, 4), SP)}
    together = serve(make(tiny_loaded, overlap=overlap), {"x": (p, sp), **others})["x"]
    # 16 tokens a step: the prompt comes in three chunks, later ones beside others' decodes.
    chunked = serve(
        make(tiny_loaded, overlap=overlap, max_tokens_per_step=16), {"x": (p, sp), **others}
    )["x"]
    assert together == alone
    assert chunked == alone


def test_a_continuation_reprefilling_decoded_tokens_is_exact(tiny_loaded) -> None:
    """What the entrypoint does after a decode instance dies: prompt + the tokens sent so far
    become a new prompt. Its next tokens' log probabilities equal the uninterrupted run's."""
    p = prompt(45, 5)
    whole = serve(make(tiny_loaded), {"x": (p, SP)})["x"]
    sent = [t for t, *_ in whole[:3]]
    rest = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=5)
    cont = serve(make(tiny_loaded, max_tokens_per_step=20), {"x": (p + sent, rest)})["x"]
    assert cont == whole[3:]


def test_prefix_hits_give_the_same_logprobs(tiny_loaded) -> None:
    engine = make(tiny_loaded)
    shared = prompt(50, 6)
    serve(engine, {"first": (shared + [11, 12], SP)})
    follow = shared + [21, 22, 23]
    engine.add_request("hit", follow, SP, hold_kv=True)
    hit = []
    while engine.has_unfinished():
        hit += [ev.logprobs for ev in engine.step() if ev.token_id is not None]
    assert engine.info("hit").num_cached_tokens == 48  # three whole 16-token blocks
    miss = serve(make(tiny_loaded), {"miss": (follow, SP)})["miss"]
    assert [(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in hit] == [m[1:] for m in miss]


def test_batch_invariant_refuses_what_it_does_not_serve(tiny_loaded) -> None:
    with pytest.raises(ValueError, match="bf16 weights"):
        EngineConfig(model="tiny", batch_invariant=True, weight_dtype="fp8")
    with pytest.raises(ValueError, match="bf16 weights"):
        EngineConfig(model="tiny", batch_invariant=True, expert_dtype="fp4")
    with pytest.raises(ValueError, match="Triton kernels"):
        EngineConfig(model="tiny", device="cuda", batch_invariant=True, kernels="torch")
    with pytest.raises(ValueError, match="batch-invariant mode"):
        Engine(EngineConfig(model="v4-tiny", batch_invariant=True, num_kv_blocks=8))


def test_the_mode_is_per_engine_on_a_shared_model(tiny_loaded) -> None:
    """Engines built on one loaded model: the last one's setting is what the model runs."""
    make(tiny_loaded)
    plain = make(tiny_loaded, batch_invariant=False)
    assert not any(getattr(m, "batch_invariant", False) for m in plain.runner.model.modules())


# -- the product ----------------------------------------------------------------------------
def test_torch_path_rows_do_not_depend_on_the_others() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 37, 96, generator=g)
    w = torch.randn(1, 130, 96, generator=g)
    full = matmul_nt(a, w, kernel=False)
    for row in (0, 5, 16, 36):
        for m in (1, 2, 7, 17):
            part = a[:, max(0, row - m + 1) : row + 1]
            assert torch.equal(matmul_nt(part, w, kernel=False)[:, -1], full[:, row])
    torch.testing.assert_close(full, a @ w.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 5, 70])
def test_triton_product_matches_torch(m: int) -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, m, 72, generator=g)
    w = torch.randn(3, 80, 72, generator=g)
    got = matmul_nt(a, w, kernel=True)
    torch.testing.assert_close(got, a @ w.transpose(1, 2), rtol=1e-5, atol=1e-4)
    # Strided views (MLA's per-head products) and a linear with bias.
    at = torch.randn(m, 3, 72, generator=g).transpose(0, 1)
    torch.testing.assert_close(
        matmul_nt(at, w, kernel=True), at @ w.transpose(1, 2), rtol=1e-5, atol=1e-4
    )
    b = torch.randn(80, generator=g)
    torch.testing.assert_close(
        linear(a[0], w[0], b, kernel=True),
        torch.nn.functional.linear(a[0], w[0], b),
        rtol=1e-5,
        atol=1e-4,
    )


def test_product_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"a \[B, M, K\]"):
        matmul_nt(torch.zeros(2, 3), torch.zeros(1, 4, 3), kernel=False)
    with pytest.raises(ValueError, match="dtype|is torch"):
        matmul_nt(torch.zeros(1, 2, 3), torch.zeros(1, 4, 3, dtype=torch.float64), kernel=False)


def test_invariant_fused_moe_matches_the_reference() -> None:
    from libs.engine.kernels.fused_moe import fused_moe, fused_moe_reference

    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 128, generator=g)
    w13 = torch.randn(8, 128, 128, generator=g) / 10
    w2 = torch.randn(8, 128, 64, generator=g) / 10
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(9)])
    wt = torch.rand(9, 3, generator=g)
    got = fused_moe(x, w13, w2, wt, ids, invariant=True)
    torch.testing.assert_close(got, fused_moe_reference(x, w13, w2, wt, ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="its own config"):
        fused_moe(x, w13, w2, wt, ids, invariant=True, config={"BLOCK_M": 16})


def test_kernel_path_gives_the_torch_paths_tokens(tiny_loaded) -> None:
    """The invariant kernel path (interpreted) serves the same greedy tokens as its PyTorch
    twin: single-split decode kernel for prompt rows, the fixed-config GEMM and fused MoE."""
    reqs = {"a": (prompt(20, 7), SamplingParams(max_tokens=2, ignore_eos=True))}
    torch_path = run(make(tiny_loaded, overlap=False), reqs)
    kernel_path = run(make(tiny_loaded, kernels="triton", overlap=False), reqs)
    assert kernel_path == torch_path


# -- flags ------------------------------------------------------------------------------------
def test_flags_reach_the_engines(capsys) -> None:
    import argparse
    import json

    from deepserve.cli import main
    from deepserve.up import engine_args
    from libs.serving.model_flags import add_model_flags, model_flags_from

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    assert (
        model_flags_from(parser.parse_args(["--batch-invariant"])).engine_config().batch_invariant
    )
    assert not model_flags_from(parser.parse_args([])).engine_config().batch_invariant
    # deepserve up gives every engine (prefill, decode, aggregated) the same engine flags.
    assert engine_args(0, True) == {
        "prefill": ["--batch-invariant"],
        "decode": ["--batch-invariant"],
        "aggregated": ["--batch-invariant"],
    }
    assert engine_args(2, False) == {
        "prefill": ["--speculative-tokens", "2"],
        "decode": ["--speculative-tokens", "2"],
        "aggregated": ["--speculative-tokens", "2"],
    }
    assert engine_args(0, False) is None
    args = ["generate", "--model", "tiny", "--prompt-ids", "5,6,7", "--max-tokens", "4", "--json"]
    assert main([*args, "--batch-invariant"]) == 0
    invariant = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == invariant  # same model, same tokens
    assert main([*args, "--batch-invariant", "--ep", "2"]) == 2


def test_speculative_verification_gives_one_token_decodings_logprobs() -> None:
    """With the mode on, a draft verified in a (1 + K)-row step sees exactly the logits a
    one-token step gives, so speculative decoding is lossless to the last bit of every
    logprob, accepted drafts and rejected ones alike (greedy requests)."""
    import copy

    from libs.engine.loader import LoadedModel, load
    from libs.engine.speculative import make_mtp_test_model

    base = load("tiny", "cpu", torch.float32, 0, with_mtp=True)
    model = copy.deepcopy(base.model)
    make_mtp_test_model(model, 0.0, 0.4, seed=1)  # about 60% of drafts right
    loaded = LoadedModel(model, f"{base.model_id}-mtp", base.source)
    # Greedy: a sampled request's draws are the target distribution's, not the same draws.
    reqs = {"x": (prompt(30, 8), SP), "y": (prompt(9, 9), SP)}
    plain = serve(make(loaded, with_mtp=True), reqs)
    spec = make(loaded, with_mtp=True, speculative_tokens=3, speculative_schedule="all")
    assert serve(spec, reqs) == plain
    stats = spec.speculative.stats
    assert 0 < stats.accepted < stats.verified


def test_drafts_after_catch_up_equal_a_fresh_prefills_drafts() -> None:
    """The MTP layer catches up on each step's accepted tokens as single-token rows. With the
    mode on, the drafts it then makes are the same bits as those of an engine that prefilled
    the whole sequence at once -- which holds only if every catch-up row got its own hidden
    state, position and KV. The exact test head, given a small dependence on the hidden state
    (the test head alone ignores it): drafts mostly right, so catch-ups span several rows,
    and their confidences depend on which hidden state each row got."""
    import copy

    from libs.engine.loader import LoadedModel, load
    from libs.engine.speculative import make_mtp_test_model

    base = load("tiny", "cpu", torch.float32, 0, with_mtp=True)
    model = copy.deepcopy(base.model)
    make_mtp_test_model(model, 0.0, 0.0)
    hidden = model.cfg.hidden_size
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model.mtp[0].eh_proj.weight[:, hidden:] = torch.randn(hidden, hidden, generator=g) * 1e-3
    loaded = LoadedModel(model, f"{base.model_id}-mtp-h", base.source)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    eng = make(loaded, with_mtp=True, speculative_tokens=3, speculative_schedule="all")
    p = prompt(20, 10)
    eng.add_request("x", p, greedy)
    out: list[int] = []
    checked = 0
    while eng.has_unfinished() and checked < 3:
        out += [ev.token_id for ev in eng.step() if ev.token_id is not None]
        if len(out) < 2 or "x" not in eng.speculative.drafts:
            continue
        fresh = make(loaded, with_mtp=True, speculative_tokens=3, speculative_schedule="all")
        fresh.add_request("x", p + out[:-1], greedy)
        first = [ev.token_id for ev in fresh.step() if ev.token_id is not None]
        assert first == out[-1:]
        assert fresh.speculative.drafts["x"] == eng.speculative.drafts["x"]
        checked += 1
    assert checked == 3
    assert eng.speculative.stats.accepted > 2  # catch-ups of more than one row happened
