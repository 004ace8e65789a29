"""DeepSeek-V4 in the batched engine (libs/engine/v4/serving.py): several requests at once,
prompts chunked across steps and blocks, greedy output equal to one request alone through
its own state (generate_v4); prefix hits, KV hand-off to another engine, preemption and
eviction restore the state from its blocks and change nothing; another model's KV is refused.
On random configs whose windows and compression rates differ, with block sizes the rates do
and do not divide."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kv.transfer import KVFormatError
from libs.engine.v4 import serving
from libs.engine.v4.blocks import restore_open
from libs.engine.v4.load import generate_v4
from libs.engine.v4.model import V4ForCausalLM
from libs.engine.v4.serving import V4Runner, v4_parts
from tests.hf_reference import V4_CONFIGS, build_hf_v4, ours_of

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=list(V4_CONFIGS))
def net(request: pytest.FixtureRequest) -> V4ForCausalLM:
    return ours_of(build_hf_v4(request.param))


def engine(net: V4ForCausalLM, model_id: str = "net-a", **kw) -> Engine:
    config = EngineConfig(model="v4", **{"block_size": 16, "max_tokens_per_step": 48, **kw})
    return Engine(config, parts=v4_parts(config, net, model_id))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(eng: Engine, reqs: dict[str, list[int]], params: SamplingParams = GREEDY, **kw):
    for rid, prompt in reqs.items():
        eng.add_request(rid, prompt, params, **kw)
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    cached: dict[str, int] = {}
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
            if ev.finished:
                cached[ev.request_id] = ev.num_cached_tokens
    return out, cached


def alone(net: V4ForCausalLM, prompt: Sequence[int], n: int = 12) -> list[int]:
    return list(generate_v4(net, prompt, n, ignore_eos=True).token_ids)


@pytest.mark.parametrize("block_size", [16, 20])
def test_batched_requests_equal_each_request_alone(net: V4ForCausalLM, block_size: int) -> None:
    prompts = {f"r{k}": ids(n, k) for k, n in enumerate((3, 17, 45, 70))}
    out, _ = run(engine(net, block_size=block_size), prompts)
    for rid, p in prompts.items():
        assert out[rid] == alone(net, p), rid


def test_a_repeated_prompt_hits_the_prefix_cache_and_continues_the_same(
    net: V4ForCausalLM,
) -> None:
    eng = engine(net)
    p = ids(50, 7)
    first, c1 = run(eng, {"a": p})
    again, c2 = run(eng, {"b": p + [9]})  # shares 3 full blocks of 16
    assert c1["a"] == 0 and c2["b"] == 48
    assert first["a"] == alone(net, p)
    assert again["b"] == alone(net, p + [9])
    runner = eng.runner
    assert isinstance(runner, V4Runner) and not runner.states  # finished: nothing held


def test_prefill_hands_its_state_to_another_engine(net: V4ForCausalLM) -> None:
    """The disaggregated path: prefill computes the prompt and samples one token, exports
    the state (the last block part-way through), decode imports it and goes on."""
    p = ids(37, 3)
    pre, dec = engine(net), engine(net)
    first, _ = run(pre, {"r": p}, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    frame = pre.export_kv("r", include_partial=True, release=True)
    rest, cached = run(
        dec,
        {"r": p + first["r"]},
        SamplingParams(max_tokens=11, ignore_eos=True),
        kv=frame,
        prior_outputs=1,
    )
    assert cached["r"] == len(p)  # nothing recomputed
    assert first["r"] + rest["r"] == alone(net, p)


def test_full_blocks_travel_as_kvstore_frames(net: V4ForCausalLM) -> None:
    p = ids(40, 5)
    src, dst = engine(net), engine(net)
    run(src, {"r": p}, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    blocks = src.export_blocks("r")
    assert len(blocks) == 2  # the full blocks of 40 tokens
    out, cached = run(dst, {"r": p}, kv=[f for _, _, f in blocks])
    assert cached["r"] == 32
    assert out["r"] == alone(net, p)


def test_preempted_and_evicted_requests_are_restored_from_their_blocks(
    net: V4ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    restores: list[int] = []

    def counted(blocks, model):
        restores.append(len(blocks))
        return restore_open(blocks, model)

    monkeypatch.setattr(serving, "restore_open", counted)
    # 12 blocks of 16 for 4 requests of up to 4 blocks each: some get preempted.
    prompts = {f"r{k}": ids(n, 20 + k) for k, n in enumerate((30, 33, 41, 20))}
    eng = engine(net, num_kv_blocks=12)
    preempted: list[str] = []
    schedule = eng.scheduler.schedule

    def watched():
        plan = schedule()
        preempted.extend(plan.preempted)
        return plan

    monkeypatch.setattr(eng.scheduler, "schedule", watched)
    out, _ = run(eng, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert preempted
    for rid, p in prompts.items():
        assert out[rid] == alone(net, p, 20), rid
    restores.clear()
    small = engine(net)
    runner = small.runner
    assert isinstance(runner, V4Runner)
    runner.max_states = 1  # one live state: the others restored from their blocks each step
    out, _ = run(small, prompts)
    assert restores and max(restores) >= 2  # mid-request, from several blocks
    for rid, p in prompts.items():
        assert out[rid] == alone(net, p), rid


def test_another_models_state_is_refused(net: V4ForCausalLM) -> None:
    p = ids(20, 1)
    src = engine(net, model_id="net-a")
    run(src, {"r": p}, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    frame = src.export_kv("r", include_partial=True)
    with pytest.raises(KVFormatError):
        engine(net, model_id="net-b").add_request("r", p + [5], GREEDY, kv=frame)


def test_features_the_v4_engine_does_not_have_are_refused_by_name(net: V4ForCausalLM) -> None:
    config = EngineConfig(model="v4", speculative_tokens=2, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="speculative decoding, a KV cache dtype"):
        v4_parts(config, net, "net-a")


def test_the_preset_serves_by_name() -> None:
    eng = Engine(EngineConfig(model="v4-tiny", block_size=16))
    out, _ = run(eng, {"r": ids(20, 2)}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out["r"]) == 3
    assert eng.model_id.startswith("v4-tiny-seed0@")


def test_the_cost_model_counts_the_flops_a_forward_does() -> None:
    """Decode: within 3% of what torch's FLOP counter sees the model do. A prompt chunk: at
    most that (the reference computes masked pairs a kernel skips; the model counts the work
    that matters, as MFU does)."""
    from torch.utils.flop_counter import FlopCounterMode

    from libs.engine.cost_model import StepShape
    from libs.engine.v4.cost import v4_cost_model
    from libs.engine.v4.load import load_v4
    from libs.engine.v4.model import V4State

    model = load_v4("v4-tiny")
    cost = v4_cost_model(model, 1e11, 1e10)
    for before, q in [(0, 1), (40, 1), (700, 1), (0, 64), (300, 37)]:
        state = V4State.empty(model.cfg)
        if before:
            model.forward_batch([torch.tensor(ids(before, 1))], [state])
        with FlopCounterMode(display=False) as counter:
            model.forward_batch([torch.tensor(ids(q, 2))], [state])
        counted = counter.get_total_flops()
        estimate = cost.flops(StepShape(((q, before + q),)))
        if q == 1:
            assert estimate == pytest.approx(counted, rel=0.03), before
        else:
            assert 0.5 * counted < estimate <= counted, (before, q)


def test_the_transformers_peer_runs_on_the_engines_own_tensors() -> None:
    """bench engine's peer for V4: transformers' model over our parameters (none copied),
    the same greedy tokens."""
    from deepserve.bench.hf_peer import build_hf_peer, shared_fraction
    from libs.engine.v4.load import load_v4

    model = load_v4("v4-tiny")
    hf = build_hf_peer(model, "eager")
    assert type(hf).__name__ == "DeepseekV4ForCausalLM"
    assert shared_fraction(hf, model) == 1.0
    prompt = [(i * 7919) % 128000 + 3 for i in range(40)]
    out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert out[0, 40:].tolist() == alone(model, prompt, 6)


def test_the_engines_sampling_features_serve_v4() -> None:
    """The V4 runner samples through the engine's own sampler: a constraint holds (a digits
    regex), logprobs are the model's log-softmax at each position, seeded sampling repeats."""
    from libs.common.sampling import Constraint
    from libs.engine.tokenizer import load_tokenizer
    from libs.engine.v4.load import load_v4
    from libs.engine.v4.model import V4State

    eng = Engine(EngineConfig(model="v4-tiny", block_size=16))
    model = load_v4("v4-tiny")
    p = ids(20, 9)
    digits = SamplingParams(max_tokens=6, constraint=Constraint("regex", "[0-9]{30}"))
    logprobs = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=11)
    for rid, sp in (("digits", digits), ("lp", logprobs), ("s1", seeded), ("s2", seeded)):
        eng.add_request(rid, p, sp)
    out: dict[str, list] = {}
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.token_id is not None:
                out.setdefault(ev.request_id, []).append(ev)
    tok = load_tokenizer()
    assert all(tok.id_to_token(ev.token_id).isdigit() for ev in out["digits"])
    assert [e.token_id for e in out["s1"]] == [e.token_id for e in out["s2"]]
    seq = p + [ev.token_id for ev in out["lp"]]
    ref = model(torch.tensor(seq), V4State.empty(model.cfg)).log_softmax(-1)
    for i, ev in enumerate(out["lp"]):
        assert ev.logprobs is not None and len(ev.logprobs.top_ids) == 2
        want = float(ref[len(p) - 1 + i, ev.token_id])
        assert ev.logprobs.logprob == pytest.approx(want, abs=1e-4)
