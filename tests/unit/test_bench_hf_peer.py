"""The transformers peer of ``deepserve bench engine`` runs on the engine's own tensors.

fp32 on CPU: the peer's logits equal the engine's (the parity tolerance of
test_parity_transformers), its parameters lie in the engine's storage (no copy), and the
``generate`` timing gives positive figures.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepserve.bench.hf_peer import (
    build_hf_peer,
    decode_prompts,
    hf_decode_throughput,
    shared_fraction,
)
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from tests.hf_reference import build_hf, require_reference, save_hf

require_reference("transformers")

LOGIT_ATOL = 2e-5


def _engine_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """All-position logits of one prompt (as test_parity_transformers.engine_logits)."""
    engine.add_request("p", prompt, SamplingParams(max_tokens=1))
    plan = engine.scheduler.schedule()
    ids, pos, meta, _, _ = engine.runner.prepare(plan)
    hidden = engine.model(ids, pos, meta, engine.cache.layers)
    out = engine.model.logits(hidden)
    engine.abort("p")
    return out


def _check(engine: Engine, attn: str | None) -> None:
    hf = build_hf_peer(engine.model, attn_implementation=attn)
    ours = dict(engine.model.named_parameters())
    theirs = dict(hf.named_parameters())
    # Every big tensor is ours, by address: the embedding, the head, the fused experts.
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
    ):
        assert theirs[name].data_ptr() == ours[name].data_ptr(), name
    for layer in range(
        engine.model_config.first_k_dense_replace, engine.model_config.num_hidden_layers
    ):
        base = f"model.layers.{layer}.mlp.experts."
        spans = [
            (t.data_ptr(), t.data_ptr() + t.nbytes) for t in (ours[base + "w13"], ours[base + "w2"])
        ]
        experts = [t for n, t in theirs.items() if n.startswith(base)]
        assert experts and all(any(a <= t.data_ptr() < b for a, b in spans) for t in experts), base
    assert shared_fraction(hf, engine.model) == 1.0
    prompt = torch.randint(
        2, engine.model_config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    mine = _engine_logits(engine, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert ref.std() > 0.01
    diff = (mine - ref).abs().max().item()
    assert diff <= LOGIT_ATOL, f"peer logits differ from the engine's by {diff:.2e}"
    r = hf_decode_throughput(hf, 2, 16, 2, "cpu")
    assert r["tokens_per_s"] > 0 and r["per_user_tokens_per_s"] > 0 and r["first_token_seconds"] > 0
    assert r["batch"] == 2 and r["context"] == 16


def test_peer_shares_the_tiny_presets_weights() -> None:
    engine = Engine(
        EngineConfig(
            model="tiny", device="cpu", dtype="float32", num_kv_blocks=16, time_budget_s=None
        )
    )
    _check(engine, None)  # transformers' defaults, as the bench runs it


def test_peer_of_a_v2_checkpoint(tmp_path: Path) -> None:
    path = save_hf(build_hf("v2-group-limited", seed=3), tmp_path / "v2")
    engine = Engine(
        EngineConfig(
            model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, time_budget_s=None
        )
    )
    _check(engine, "eager")


def test_decode_prompts_are_the_benchs() -> None:
    g = torch.Generator().manual_seed(3)
    want = [torch.randint(3, 1000, (8,), generator=g).tolist() for _ in range(3)]
    assert decode_prompts(3, 8, 1000).tolist() == want
