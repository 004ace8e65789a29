"""Our engine against transformers on the same weights: logits and greedy continuations.

fp32 on CPU. Tolerance: max |ours - theirs| <= 2e-5 absolute on logits whose spread is O(1)
(differences come only from summation order: absorbed vs expanded attention, fused vs looped
experts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from tests.hf_reference import (
    CONFIGS,
    build_hf,
    hf_greedy,
    hf_logits,
    require_reference,
    save_hf,
)

require_reference("transformers")

LOGIT_ATOL = 2e-5
PROMPT_LENGTHS = (1, 7, 130, 300)  # single token, short, just over a block, several blocks


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def engine_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All-position logits of the prompts, computed together in one batched step."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=1))
    plan = engine.scheduler.schedule()
    assert len(plan.seqs) == len(prompts) and all(s.sample for s in plan.seqs), "expected one step"
    ids, pos, meta, seqs, _ = engine.runner.prepare(plan)
    hidden = engine.model(ids, pos, meta, engine.cache.layers)
    logits = engine.model.logits(hidden)
    by_id, row = {}, 0
    for s in seqs:
        by_id[s.request_id] = logits[row : row + s.num_tokens]
        row += s.num_tokens
    out = [by_id[s.request_id] for s in plan.seqs]
    for i in range(len(prompts)):
        engine.abort(f"p{i}")
    return out


def _engine(path: Path, **kw: object) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            block_size=16,
            num_kv_blocks=256,
            time_budget_s=None,
            **kw,
        )
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = build_hf(request.param, seed=len(request.param))
    path = save_hf(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, path


def test_logits_match_transformers_on_a_mixed_batch(saved) -> None:
    name, hf, path = saved
    engine = _engine(path)
    prompts = _prompts(engine.model_config.vocab_size, seed=3)
    ours = engine_logits(engine, prompts)
    for prompt, mine in zip(prompts, ours):
        ref = hf_logits(hf, prompt)
        assert ref.std() > 0.1, "reference logits are degenerate; the comparison would be vacuous"
        diff = (mine - ref).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{name}: prompt of {len(prompt)} tokens differs by {diff:.2e}"


@pytest.mark.parametrize("absorb", [True, False])
def test_greedy_continuations_match_transformers(saved, absorb: bool) -> None:
    name, hf, path = saved
    engine = _engine(path, absorb_decode=absorb)
    prompts = _prompts(engine.model_config.vocab_size, seed=5)[1:]
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=32, ignore_eos=True), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    for i, p in enumerate(prompts):
        ours = list(engine.info(f"g{i}").token_ids[len(p) :])
        assert ours == hf_greedy(hf, p, 32), f"{name}: greedy continuation differs for prompt {i}"


@pytest.mark.parametrize(
    "saved,layout",
    [*((name, "fused") for name in sorted(CONFIGS)), ("v3-yarn-grouped", "sharded")],
    indirect=["saved"],
)  # one config is enough for sharding
def test_checkpoint_layouts_load_the_same_weights(saved, layout: str, tmp_path: Path) -> None:
    name, hf, path = saved
    other = save_hf(hf, tmp_path / layout, layout)
    a = _engine(path)
    b = _engine(other)
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), f"{layout}: {ka} differs"
