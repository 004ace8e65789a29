"""DeepSeek-V4 (libs/engine/v4) against transformers' DeepseekV4ForCausalLM, fp32 on CPU.

Random configs whose layer schedules, windows, compression rates, hyper-connection widths,
routing and RoPE differ from the defaults and each other (tests/hf_reference.py). Prompts are
longer than the window and cover several compressed windows, so every path shows: the sliding
window, CSA's overlapping pooling and indexer top-k, HCA's pooling, hash routing, sinks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepserve.cli import main
from libs.engine.v4.config import CSA, HCA, SLIDING, V4Config
from libs.engine.v4.load import generate_v4, is_v4, load_v4
from libs.engine.v4.model import V4ForCausalLM, V4State
from tests.hf_reference import V4_CONFIGS, build_hf_v4, ours_of

PROMPT = 41  # > 2 windows of 16, > 5 HCA windows of 8, odd: windows left open at the end


def _pair(name: str) -> tuple[torch.nn.Module, V4ForCausalLM]:
    hf = build_hf_v4(name)
    return hf, ours_of(hf)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(V4_CONFIGS))
def pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, V4ForCausalLM]:
    return _pair(request.param)


def test_config_reads_what_transformers_built(pair: tuple[torch.nn.Module, V4ForCausalLM]) -> None:
    hf, ours = pair
    c = hf.config
    assert ours.cfg.layer_types == tuple(c.layer_types)
    assert ours.cfg.mlp_layer_types == tuple(c.mlp_layer_types)
    assert (ours.cfg.csa_rate, ours.cfg.hca_rate) == (
        c.compress_rates[CSA],
        c.compress_rates[HCA],
    )
    assert ours.cfg.qk_rope_head_dim == c.qk_rope_head_dim
    assert {SLIDING, CSA, HCA} >= set(ours.cfg.layer_types)


def test_prefill_logits_match(pair: tuple[torch.nn.Module, V4ForCausalLM]) -> None:
    hf, ours = pair
    ids = _ids(PROMPT)
    with torch.no_grad():
        want = hf(ids[None], use_cache=False).logits[0]
    got = ours(ids, V4State.empty(ours.cfg))
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    assert want.std() > 0.05  # the logits are not flat: a wrong block would show


def test_greedy_decode_matches_transformers_generate(
    pair: tuple[torch.nn.Module, V4ForCausalLM],
) -> None:
    """transformers decodes through its own V4 caches (window, compressor buffers, overlap,
    emitted entries); ours through V4State. Same tokens, same logits every step."""
    hf, ours = pair
    prompt, n = _ids(23, seed=2), 24
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(
            prompt[None],
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    st = V4State.empty(ours.cfg)
    logits = ours(prompt, st)[-1]
    tokens = []
    for step in range(n):
        torch.testing.assert_close(logits, out.logits[step][0], rtol=0, atol=5e-5)
        tokens.append(int(logits.argmax()))
        logits = ours(torch.tensor([tokens[-1]]), st)[-1]
    assert tokens == out.sequences[0, len(prompt) :].tolist()
    assert st.seen == len(prompt) + n


@pytest.mark.parametrize("cuts", [(1,), (7, 8), (16, 17, 33), (40,)])
def test_chunked_prefill_equals_one_pass(
    pair: tuple[torch.nn.Module, V4ForCausalLM], cuts: tuple[int, ...]
) -> None:
    """Chunk boundaries inside windows, at window edges, one token at a time: the state
    carries the open window, the overlap series and the ring exactly."""
    _, ours = pair
    ids = _ids(PROMPT)
    whole = ours(ids, V4State.empty(ours.cfg))
    st = V4State.empty(ours.cfg)
    bounds = [0, *cuts, PROMPT]
    parts = [ours(ids[a:b], st) for a, b in zip(bounds, bounds[1:], strict=False)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=2e-5)


def test_a_checkpoint_that_does_not_match_is_refused() -> None:
    hf = build_hf_v4("v4-mixed")
    cfg = V4Config.from_hf({**hf.config.to_dict(), "num_hidden_layers": 3, "layer_types": None})
    with pytest.raises(ValueError, match="does not match"):
        V4ForCausalLM(cfg).load_hf_state(hf.state_dict())
    with pytest.raises(ValueError, match="layer types"):
        V4Config.from_hf({**hf.config.to_dict(), "layer_types": ["full_attention"] * 4})


def test_checkpoint_directory_loads_as_transformers_saved_it(tmp_path: Path) -> None:
    hf = build_hf_v4("v4-mixed")
    hf.save_pretrained(tmp_path / "ckpt")
    assert is_v4(str(tmp_path / "ckpt")) and not is_v4(str(tmp_path))
    net = load_v4(str(tmp_path / "ckpt"))
    ids = _ids(PROMPT, seed=3)
    with torch.no_grad():
        want = hf(ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(net(ids, V4State.empty(net.cfg)), want, rtol=0, atol=5e-5)


def test_preset_generation_equals_recomputing_every_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """v4-tiny: each greedy token is what a fresh full pass over prompt + tokens so far picks
    (the carried state is exact), and `deepserve generate` (the batched engine) prints them."""
    net = load_v4("v4-tiny")
    prompt = [5, 17, 300, 4000, 77, 9, 12000, 41, 8, 2, 61, 99, 1000, 3, 3, 3, 7, 30, 31]
    out = generate_v4(net, prompt, max_tokens=8, ignore_eos=True)
    seq = list(prompt)
    for tok in out.token_ids:
        logits = net(torch.tensor(seq), V4State.empty(net.cfg))[-1]
        assert int(logits.argmax()) == tok
        seq.append(tok)
    assert len(set(out.token_ids)) > 1  # not a degenerate model
    args = ["generate", "--model", "v4-tiny", "--max-tokens", "8", "--ignore-eos", "--json"]
    assert main([*args, "--prompt-ids", ",".join(map(str, prompt))]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == list(out.token_ids)
    # The CLI runs V4 on the batched engine: every sampling option, the same seeded draws.
    sampled = ["--prompt", "x", "--top-k", "5", "--temperature", "0.9", "--seed", "4"]
    assert main([*args, *sampled]) == 0
    first = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args, *sampled]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first and len(first) == 8
    # And over an EP group of two CPU ranks (tests/unit/test_ep_v4.py): the same draws.
    assert main([*args, *sampled, "--ep", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first
