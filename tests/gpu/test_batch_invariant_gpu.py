"""Batch-invariant mode on a GPU, at V2-Lite's widths in bf16, through the Triton kernels and
CUDA graphs: a request's log probabilities are the same bits alone, beside other requests,
with its prompt chunked, and when a continuation re-prefills its decoded tokens.

The default engine is run on the same requests and its differences are printed (not
asserted: they are what the mode removes, and their size is a property of cuBLAS).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.common.sampling import SamplingParams  # noqa: E402
from libs.engine.engine import Engine, EngineConfig  # noqa: E402
from libs.engine.loader import load  # noqa: E402
from tests.unit.test_batch_invariant import serve  # noqa: E402

SP = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def v2_lite():
    return load("v2-lite", "cuda", torch.bfloat16, seed=0)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (300, 7, 130, 33, 520)]


def _engine(loaded, invariant: bool, **kw) -> Engine:
    cfg = dict(
        model="v2-lite",
        device="cuda",
        num_kv_blocks=64,
        max_running=16,
        time_budget_s=None,
        batch_invariant=invariant,
    )
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), loaded=loaded)


def _runs(loaded, invariant: bool) -> dict[str, list]:
    prompts = _prompts(loaded.model.cfg.vocab_size)
    x = prompts[0]
    others = {f"o{i}": (p, SP) for i, p in enumerate(prompts[1:])}
    alone = serve(_engine(loaded, invariant), {"x": (x, SP)})["x"]
    together = serve(_engine(loaded, invariant), {"x": (x, SP), **others})["x"]
    chunked = serve(_engine(loaded, invariant, max_tokens_per_step=128), {"x": (x, SP), **others})[
        "x"
    ]
    sent = [t for t, *_ in alone[:5]]
    rest = SamplingParams(max_tokens=7, ignore_eos=True, logprobs=5)
    cont = serve(_engine(loaded, invariant, max_tokens_per_step=96), {"x": (x + sent, rest)})["x"]
    return {"alone": alone, "together": together, "chunked": chunked, "continued": cont}


def _max_diff(a: list, b: list) -> float:
    return max(abs(p[1] - q[1]) for p, q in zip(a, b, strict=True))


def test_logprobs_are_the_same_bits_in_any_batch_and_chunking(v2_lite) -> None:
    runs = _runs(v2_lite, invariant=True)
    default = _runs(v2_lite, invariant=False)
    for name, r in (("invariant", runs), ("default", default)):
        print(
            f"{name}: max |dlogprob| vs alone: together {_max_diff(r['together'], r['alone']):.3g}"
            f"  chunked {_max_diff(r['chunked'], r['alone']):.3g}"
            f"  continued {_max_diff(r['continued'], r['alone'][5:]):.3g}"
        )
    assert runs["together"] == runs["alone"]
    assert runs["chunked"] == runs["alone"]
    assert runs["continued"] == runs["alone"][5:]


def test_invariant_engine_stays_close_to_the_default(v2_lite) -> None:
    """Same model, other summation orders: a first greedy token picked by both engines has log
    probabilities within bf16 noise, and a token picked by the invariant engine alone is a near
    tie in the default engine's top 5 (a different pick's log probability is another token's:
    comparing it with the default's says nothing). How many picks differ is not asserted: the
    random-weight model's distributions are flat, and on an H100 two of five first tokens were
    ties at bf16 resolution (gaps 1/16 and 1/64 nats)."""
    prompts = _prompts(v2_lite.model.cfg.vocab_size)
    reqs = {f"r{i}": (p, SP) for i, p in enumerate(prompts)}
    inv = serve(_engine(v2_lite, True), reqs)
    ref = serve(_engine(v2_lite, False), reqs)
    same, ties = [], []
    for r in reqs:
        (tok, lp, _, _), (ref_tok, ref_lp, ref_top_ids, ref_top_lps) = inv[r][0], ref[r][0]
        if tok == ref_tok:
            same.append(abs(lp - ref_lp))
        else:
            assert tok in ref_top_ids, f"{r}: {tok} is not in the default engine's top 5"
            ties.append(ref_lp - ref_top_lps[ref_top_ids.index(tok)])
    worst = max(same, default=0.0)
    print(f"first tokens equal {len(same)}/{len(reqs)}, max |dlogprob| {worst:.3g}, gaps {ties}")
    assert worst < 0.25
    assert all(gap < 0.25 for gap in ties)
