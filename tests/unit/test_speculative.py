"""Speculative decoding with the MTP head: what a caller gets must not change, only how fast.

Greedy output is compared token for token with the engine decoding one token a step, on the
tiny preset's random MTP head (drafts nearly always rejected), on the test model whose MTP head
predicts exactly (all accepted) or is perturbed (some accepted, attention still mattering), and
on random configs beyond the presets; through chunked prefill, prefix hits, preemption, KV
export/import, stop tokens and length limits. Sampling is checked statistically.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections import Counter

import pytest
import torch

from libs.common.sampling import Constraint, SamplingParams
from libs.engine.engine import Engine, EngineConfig, InvalidRequest
from libs.engine.kv.transfer import decode_frame
from libs.engine.loader import LoadedModel
from libs.engine.model.model import DeepseekForCausalLM
from libs.engine.presets import PRESETS, init_random_weights
from libs.engine.speculative import (
    AcceptanceModel,
    choose_drafts,
    greedy_accept,
    make_mtp_test_model,
    verify_row,
)
from tests.unit.test_engine import prompt, run

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def variant(loaded: LoadedModel, layer_scale: float | None, wrong: float = 0.0) -> LoadedModel:
    """The preset itself (None) or its MTP test model (a copy)."""
    if layer_scale is None:
        return loaded
    model = copy.deepcopy(loaded.model)
    make_mtp_test_model(model, layer_scale, wrong, seed=1)
    return LoadedModel(model, f"{loaded.model_id}-mtp{layer_scale}-{wrong}", loaded.source)


def make(loaded: LoadedModel, k: int, **kw: object) -> Engine:
    base: dict[str, object] = dict(
        model="tiny", block_size=16, num_kv_blocks=256, time_budget_s=None, with_mtp=True
    )
    base.update(kw)
    return Engine(EngineConfig(speculative_tokens=k, **base), loaded=loaded)  # type: ignore[arg-type]


REQS = {
    "a": (prompt(5, 1), GREEDY),
    "b": (prompt(40, 2), SamplingParams(max_tokens=17, ignore_eos=True)),
    "c": (prompt(77, 3), SamplingParams(max_tokens=1, ignore_eos=True)),
    "d": (prompt(16, 4), SamplingParams(max_tokens=2, ignore_eos=True)),
}


@pytest.mark.parametrize("layer_scale,wrong", [(None, 0.0), (0.0, 0.0), (0.0, 0.4), (0.3, 0.0)])
@pytest.mark.parametrize("schedule", ["confidence", "all"])
def test_greedy_output_is_the_one_token_engines(tiny_mtp, layer_scale, wrong, schedule) -> None:
    loaded = variant(tiny_mtp, layer_scale, wrong)
    want = run(make(loaded, 0), REQS)
    eng = make(loaded, 4, speculative_schedule=schedule)
    assert run(eng, REQS) == want
    stats = eng.speculative.stats
    assert stats.verified > 0 and stats.accepted <= stats.verified <= stats.drafted
    if layer_scale == 0.0 and wrong == 0.0:
        assert stats.accepted == stats.verified  # the exact head: every draft is right
    if layer_scale == 0.0 and wrong:
        assert 0 < stats.accepted < stats.verified
    assert eng.blocks.num_free == 256 or eng.blocks.num_cached > 0
    eng.blocks.check()


def test_fewer_steps_when_drafts_are_right(tiny_mtp) -> None:
    """The exact head emits up to K + 1 tokens a step: 24 tokens in a handful of steps."""
    eng = make(variant(tiny_mtp, 0.0), 4)
    eng.add_request("x", prompt(9), GREEDY)
    steps = 0
    last = None
    while eng.has_unfinished():
        for ev in eng.step():
            last = ev
        steps += 1
    assert last is not None and last.finished
    stats = eng.speculative.stats
    assert last.speculative == (stats.drafted, stats.verified, stats.accepted)  # its own counts
    assert steps <= 1 + math.ceil(23 / 5) + 1  # prefill, then 5 tokens a step
    stats = eng.speculative.stats
    assert stats.accepted == stats.verified and stats.emitted >= 20


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_tokens_per_step=24),  # long prompts prefilled in chunks
        dict(num_kv_blocks=14),  # preemption by recompute
    ],
    ids=["chunked", "preempt"],
)
def test_greedy_equal_through_chunks_and_preemption(tiny_mtp, kw) -> None:
    loaded = variant(tiny_mtp, 0.0, 0.3)
    reqs = {
        f"r{i}": (prompt(30 + 9 * i, 20 + i), SamplingParams(max_tokens=40, ignore_eos=True))
        for i in range(4)
    }
    want = run(make(loaded, 0, num_kv_blocks=256), reqs)
    eng = make(loaded, 3, **kw)
    assert run(eng, reqs) == want
    if "num_kv_blocks" in kw:
        assert eng.scheduler.num_preemptions > 0, "the test must actually preempt"
        assert eng.blocks.num_free == 14
    eng.blocks.check()


def test_a_prompt_chunk_that_samples_nothing_gets_no_drafts(tiny_mtp) -> None:
    """A prompt prefilled in chunks: each chunk's MTP KV is written, and drafts come only with
    the sampled token of its last chunk (earlier ones would be thrown away unverified)."""
    eng = make(variant(tiny_mtp, 0.0), 3, max_tokens_per_step=16, overlap=False)
    eng.add_request("a", prompt(40, 5), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(2):  # 16 + 16 of the 40 prompt tokens
        assert not [ev for ev in eng.step() if ev.token_id is not None]
        assert "a" not in eng.speculative.drafts
    assert [ev.token_id is not None for ev in eng.step()] == [True]  # the last 8, a token
    drafts, confidences = eng.speculative.drafts["a"]
    assert len(drafts) == 3 and len(confidences) == 3
    # Drafts outside the vocabulary (memory overwritten on the device) are named on the host
    # before a verification step would feed them to an embedding lookup.
    eng.step()
    picked, _ = eng.speculative._pending
    picked[0][0].fill_(eng.model_config.vocab_size + 5)
    with pytest.raises(RuntimeError, match="drafted token ids outside"):
        eng.speculative.drafts


def test_prefix_hits_carry_the_mtp_cache(tiny_mtp) -> None:
    """A second request on a cached prefix drafts as well as the first (the MTP layer's KV
    lives in the same blocks) and decodes the same tokens."""
    loaded = variant(tiny_mtp, 0.0)
    p = prompt(64, 7)
    eng = make(loaded, 3)
    first = run(eng, {"a": (p, GREEDY)})["a"]
    before = dataclasses.replace(eng.speculative.stats)
    second = run(eng, {"b": (p, GREEDY)})["b"]
    assert eng.prefix_cache_hits >= 48
    assert first == second == run(make(loaded, 0), {"c": (p, GREEDY)})["c"]
    after = eng.speculative.stats
    assert after.verified > before.verified
    assert after.accepted - before.accepted == after.verified - before.verified  # all right


def test_stop_tokens_end_verified_runs(tiny_mtp) -> None:
    """A stop token inside the accepted drafts ends the request there; nothing after it."""
    loaded = variant(tiny_mtp, 0.0)
    p = prompt(12, 5)
    free = run(make(loaded, 0), {"x": (p, GREEDY)})["x"]
    stop = free[6]
    sp = SamplingParams(max_tokens=24, stop_token_ids=(stop,))
    want = run(make(loaded, 0), {"x": (p, sp)})["x"]
    assert want[-1] == stop and len(want) <= 7
    eng = make(loaded, 4)
    assert run(eng, {"x": (p, sp)})["x"] == want
    assert not eng.speculative.drafts and eng.blocks.num_used == 0


def prefill_held(eng: Engine, p: list[int], params: SamplingParams) -> int:
    """Prefill ``p`` as request "r" held for export, as prefill's service does; its first token."""
    eng.add_request("r", p, params, hold_kv=True)
    while eng.has_unfinished():
        eng.step()
    return eng.info("r").token_ids[-1]


def test_kv_export_import_then_drafting(tiny_mtp) -> None:
    """Prefill in one engine, decode in another: the hand-off carries the MTP layer's KV, the
    decode engine drafts from its second step on and the tokens are the uninterrupted ones."""
    loaded = variant(tiny_mtp, 0.0)
    p = prompt(45, 8)
    full = run(make(loaded, 0), {"r": (p, GREEDY)})["r"]
    pre = make(loaded, 3)
    first = prefill_held(pre, p, SamplingParams(max_tokens=1, ignore_eos=True))
    frame = pre.export_kv("r", include_partial=True, release=True)
    dec = make(loaded, 3)
    dec.add_request(
        "r", p + [first], SamplingParams(max_tokens=23, ignore_eos=True), kv=frame, prior_outputs=1
    )
    out = [first]
    while dec.has_unfinished():
        out += [ev.token_id for ev in dec.step() if ev.token_id is not None]
    assert out == full
    assert dec.speculative.stats.accepted == dec.speculative.stats.verified > 0


def test_the_handover_carries_drafts_for_decodes_first_step(tiny_mtp) -> None:
    """A speculative prefill drafts for the request it holds for export; the decode engine it
    hands them to verifies them in its first step (all accepted on the exact-head test model)
    and emits what one engine decoding one token a step does. Drafts that cannot be are
    refused by name; an engine that does not speculate ignores them."""
    loaded = variant(tiny_mtp, 0.0)
    p = prompt(45, 8)
    full = run(make(loaded, 0), {"r": (p, GREEDY)})["r"]
    pre = make(loaded, 3)
    first = prefill_held(pre, p, SamplingParams(max_tokens=1, ignore_eos=True))
    drafts = pre.take_drafts("r")
    assert drafts is not None and len(drafts[0]) == 3 and pre.take_drafts("r") is None
    assert drafts[0] == full[1:4]  # the exact head drafts the next tokens
    frame = pre.export_kv("r", include_partial=True, release=True)
    dec = make(loaded, 3, speculative_schedule="all")
    rest = SamplingParams(max_tokens=23, ignore_eos=True)
    dec.add_request("r", p + [first], rest, kv=frame, prior_outputs=1, drafts=drafts)
    events = dec.step()
    assert [ev.token_id for ev in events] == full[1:5]  # three accepted drafts + the bonus
    out = [first, *(ev.token_id for ev in events)]
    while dec.has_unfinished():
        out += [ev.token_id for ev in dec.step() if ev.token_id is not None]
    assert out == full
    with pytest.raises(InvalidRequest, match="at most 3 drafts"):
        make(loaded, 3).add_request("x", p, rest, drafts=([5, 6, 7, 8], [0.5] * 4))
    with pytest.raises(InvalidRequest, match="confidences"):
        make(loaded, 3).add_request("x", p, rest, drafts=([5], [float("nan")]))
    plain = make(loaded, 0)
    plain.add_request("x", p, rest, drafts=([5, 6, 7, 8], [0.5] * 4))  # not speculating
    assert plain.take_drafts("x") is None


def test_prefill_hands_over_the_mtp_layers_kv(tiny_mtp) -> None:
    """The blocks a speculative prefill exports hold the MTP layer's KV of every prompt
    position, the same bytes an engine that went on decoding computed there; an engine that
    does not speculate leaves that layer's pages unwritten. (The preset's own MTP head, whose
    attention reads that KV.)"""
    p = prompt(48, 11)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def blocks(eng: Engine, sp: SamplingParams) -> bytes:
        eng.add_request("r", p, sp, hold_kv=True)
        while eng.has_unfinished():
            eng.step()
        frame = eng.export_kv("r")
        header, payload = decode_frame(frame)
        return bytes(payload)[: 3 * header.bytes_per_block]

    handed = blocks(make(tiny_mtp, 3), one)
    assert handed == blocks(make(tiny_mtp, 3), SamplingParams(max_tokens=6, ignore_eos=True))
    assert handed != blocks(make(tiny_mtp, 0), one)


def _random_config(i: int):
    tiny = PRESETS["tiny"]
    variants = [
        dict(
            q_lora_rank=None,
            scoring_func="softmax",
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
        dict(
            num_hidden_layers=4,
            first_k_dense_replace=2,
            num_attention_heads=8,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
        ),
        dict(
            hidden_size=96,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=2,
        ),
    ]
    return dataclasses.replace(tiny, **variants[i])


@pytest.mark.parametrize("i", [0, 1, 2])
def test_greedy_equal_on_random_configs(i: int) -> None:
    cfg = _random_config(i)
    model = DeepseekForCausalLM(cfg, torch.float32, "cpu", with_mtp=True)
    init_random_weights(model, 100 + i)
    make_mtp_test_model(model, 0.2, 0.0)
    loaded = LoadedModel(model, f"random{i}", "tiny")
    reqs = {"a": (prompt(21, i), GREEDY), "b": (prompt(50, i + 9), GREEDY)}
    eng = make(loaded, 3)
    assert run(eng, reqs) == run(make(loaded, 0), reqs)
    assert eng.speculative.stats.verified > 0


# -- the parts ------------------------------------------------------------------------------
def test_greedy_accept() -> None:
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all right: a bonus token
    assert greedy_accept([1], []) == [1]
    assert greedy_accept([4, 6], [5]) == [4]


def test_choose_drafts_spends_step_time_on_likely_drafts() -> None:
    model = AcceptanceModel()
    for _ in range(400):  # verification has seen these bins: their rates are what was observed
        model.observe([0.95] * 10, 9)  # 9 of 10 accepted
        model.observe([0.15, 0.15], 1)  # 1 of 2
        model.observe([0.85] * 7, 6)  # 6 of 7
    assert 0.9 < model.rate(0.95) < 0.92 and 0.5 < model.rate(0.15) < 0.53
    confs = [[0.95, 0.9, 0.85], [0.15, 0.1, 0.1], [0.9, 0.2, 0.9]]
    limits = [3, 3, 1]
    flat = choose_drafts(confs, limits, model, lambda m: 1.0)  # extra tokens cost nothing
    assert flat == [3, 3, 1]
    assert choose_drafts(confs, limits, model, lambda m: 1.0, "all") == [3, 3, 1]
    # each draft token adds 20% / 30% to the step: the likely drafts pay, the unlikely do not
    assert choose_drafts(confs, limits, model, lambda m: 1.0 + 0.2 * m) == [3, 0, 1]
    assert choose_drafts(confs, limits, model, lambda m: 1.0 + 0.3 * m) == [1, 0, 1]
    # observed rejections at high confidence: the model stops trusting those drafts
    for _ in range(4000):
        model.observe([0.95], 0)
    assert model.rate(0.95) < 0.5
    assert choose_drafts([[0.95, 0.95]], [2], model, lambda m: 1.0 + 0.6 * m) == [0]


def test_unobserved_confidence_is_explored() -> None:
    """A head that is right while unsure (confidence 0.01) still gets its drafts verified at
    first, and once verification has seen them accepted they keep being verified."""
    model = AcceptanceModel()
    cost = lambda m: 1.0 + 0.2 * m  # noqa: E731
    assert choose_drafts([[0.01, 0.01]], [2], model, cost) != [0]
    for _ in range(50):
        model.observe([0.01, 0.01], 2)
    assert model.rate(0.01) > 0.9
    assert choose_drafts([[0.01, 0.01]], [2], model, cost) == [2]


CHI2_CRIT_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, alpha = 0.001


def _chi2(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(i, 0) - n * float(p)) ** 2 / (n * float(p)) for i, p in enumerate(probs))


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_rejection_sampling_gives_the_targets_distribution(draft: int) -> None:
    """First and second emitted tokens over 20,000 runs against the target (chi-square, 5
    degrees of freedom, alpha = 0.001). Power: a verifier off by 2 points of probability in
    one cell (compensated in another) gives a noncentrality of at least 20000 * 0.02**2 *
    (1/0.30 + 1/0.25) = 58.7, which the test detects with probability above 0.999; the
    negative control below shows a real mistake caught."""
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    p1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.22, 0.28])
    probs = torch.stack([p0, p1, p0.flip(0)])
    gen = torch.Generator().manual_seed(draft)
    n = 20000
    first: Counter = Counter()
    second: Counter = Counter()
    for _ in range(n):
        out = verify_row(probs, [draft, 4], lambda _pos: gen, 10)
        first[out[0]] += 1
        if out[0] == draft and len(out) > 1:
            second[out[1]] += 1
    assert _chi2(first, p0, n) < CHI2_CRIT_DF5_P001
    m = sum(second.values())
    assert m > 500 and _chi2(second, p1, m) < CHI2_CRIT_DF5_P001


def test_the_distribution_test_catches_a_biased_verifier() -> None:
    """Negative control: accepting the draft with p(d) + 0.02 fails the same test."""
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts: Counter = Counter()
    for _ in range(n):
        u = float(torch.rand((), generator=gen))
        if u < float(p0[0]) + 0.02:
            counts[0] += 1
            continue
        rest = p0.clone()
        rest[0] = 0
        counts[int(torch.multinomial(rest / rest.sum(), 1, generator=gen))] += 1
    assert _chi2(counts, p0, n) > CHI2_CRIT_DF5_P001


def test_sampled_engine_output_has_the_targets_distribution(tiny_mtp) -> None:
    """Engine level: the first two output tokens of 400 sampled requests (top-k 3, so few
    outcomes; 3 tokens each, so the second is a verified draft), speculative against one
    token a step; the two samples' joint histograms agree (chi-square two-sample test,
    alpha = 0.001)."""
    loaded = variant(tiny_mtp, 0.0)
    p = prompt(10, 3)
    n = 400

    def histogram(k: int) -> Counter:
        eng = make(loaded, k, num_kv_blocks=2048, max_running=512)
        reqs = {
            f"s{i}": (
                p,
                SamplingParams(temperature=1.0, top_k=3, seed=i, max_tokens=3, ignore_eos=True),
            )
            for i in range(n)
        }
        out = run(eng, reqs)
        if k:
            assert eng.speculative.stats.verified > 0.9 * n
        return Counter(tuple(v[:2]) for v in out.values())

    a, b = histogram(0), histogram(3)
    cells = sorted(set(a) | set(b))
    stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)
    df = len(cells) - 1
    # Wilson-Hilferty approximation of the chi-square quantile at 1 - 0.001 (z = 3.09)
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, (stat, crit, a, b)


def test_logprobs_of_verified_tokens_are_the_plain_engines(tiny_mtp) -> None:
    """A request asking for logprobs is drafted for too; each token's logprob and top-N are
    what decoding one token a step reports."""
    loaded = variant(tiny_mtp, 0.0, 0.3)
    sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)

    def events(k: int) -> list:
        eng = make(loaded, k)
        eng.add_request("x", prompt(30, 9), sp)
        out = []
        while eng.has_unfinished():
            out += [ev for ev in eng.step() if ev.token_id is not None]
        if k:
            assert eng.speculative.stats.accepted > 0
        return out

    plain, spec = events(0), events(3)
    assert [e.token_id for e in spec] == [e.token_id for e in plain]
    for a, b in zip(spec, plain, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        assert a.logprobs.top_ids == b.logprobs.top_ids
        assert a.logprobs.logprob == pytest.approx(b.logprobs.logprob, abs=1e-4)
        assert a.logprobs.top_logprobs == pytest.approx(b.logprobs.top_logprobs, abs=1e-4)


def test_min_tokens_holds_in_verified_runs(tiny_mtp) -> None:
    """A stop token the drafts propose before min_tokens is not taken: the rows short of it
    have their stop tokens masked, as one token a step's sampler masks them."""
    loaded = variant(tiny_mtp, 0.0)
    p = prompt(12, 5)
    free = run(make(loaded, 0), {"x": (p, GREEDY)})["x"]
    stop = free[2]
    sp = SamplingParams(max_tokens=24, stop_token_ids=(stop,), min_tokens=8)
    want = run(make(loaded, 0), {"x": (p, sp)})["x"]
    assert stop not in want[:8] and len(want) > 8  # the rule is in force here
    eng = make(loaded, 4)
    assert run(eng, {"x": (p, sp)})["x"] == want
    assert eng.speculative.stats.verified > 0


@pytest.mark.parametrize(
    "layer_scale,pen",
    [
        (None, dict(repetition_penalty=1.3)),  # the preset: outputs repeat, penalties bite
        (None, dict(frequency_penalty=2.0, presence_penalty=2.0)),
        (0.0, dict(repetition_penalty=1.3)),  # drafts accepted; prompt tokens penalized
    ],
)
def test_penalized_requests_are_drafted_for_and_decode_the_same(tiny_mtp, layer_scale, pen) -> None:
    loaded = variant(tiny_mtp, layer_scale)
    p = prompt(12, 1)
    free = run(make(loaded, 0), {"x": (p, GREEDY)})["x"]
    if layer_scale == 0.0:  # the head's next tokens are in the prompt: the penalty bites
        p = free[3:15] + p
        free = run(make(loaded, 0), {"x": (p, GREEDY)})["x"]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **pen)
    want = run(make(loaded, 0), {"x": (p, sp)})["x"]
    assert want != free  # the penalties change the output
    eng = make(loaded, 4)
    assert run(eng, {"x": (p, sp)})["x"] == want
    assert eng.speculative.stats.verified > 0


def test_each_verification_row_counts_the_drafts_before_it() -> None:
    """Row i of a verified run is penalized with the i drafts before it as output (a token
    drafted at row 0 is repeated at row 1's candidates), as one token a step would have."""
    from libs.engine.sampler import TokenHistory, apply_penalties, apply_rules
    from libs.engine.scheduler import ScheduledSeq
    from libs.engine.speculative import verification_rules

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    sp = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
    seq = ScheduledSeq("r", 9, 3, (7, 11, 11), (0,), True, 10, num_drafts=2)
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 7]  # prompt of 6, then 4 outputs
    rules = verification_rules(4, [seq], 1, {"r": sp}, {}, {"r": (base, 6)}, None)
    got = apply_rules(logits, rules, ())
    assert torch.equal(got[0], logits[0])  # row 0 is another request's
    for i, hist in enumerate([base, base + [11], base + [11, 11]]):
        one = apply_penalties(
            logits[1 + i : 2 + i], [sp], TokenHistory.build([0], [hist], [6], "cpu")
        )
        assert torch.equal(got[1 + i], one[0]), i


async def test_prefill_service_sends_its_drafts_to_decode(tiny_mtp) -> None:
    """Through the prefill and decode handlers: the DecodeTask carries the drafts prefill's
    engine made, decode verifies them, and the client's tokens are the plain engine's."""
    from libs.common import subjects
    from libs.proto.deepserve.v1 import control_pb2
    from libs.serving.engine_loop import EngineLoop
    from libs.transport.inproc import InProcBus, InProcKVPusher
    from services.decode.handlers import DecodeHandler
    from services.prefill.handlers import PrefillHandler

    class Recording(InProcKVPusher):
        def __init__(self) -> None:
            super().__init__()
            self.tasks: list[control_pb2.DecodeTask] = []

        async def push(self, address, task, kv) -> None:  # type: ignore[no-untyped-def]
            self.tasks.append(task)
            await super().push(address, task, kv)

    loaded = variant(tiny_mtp, 0.0)
    p = prompt(37, 6)
    full = run(make(loaded, 0), {"r": (p, GREEDY)})["r"]
    bus = InProcBus()
    sub = await bus.subscribe(subjects.token_events(">"))
    ploop = EngineLoop(make(loaded, 3), name="p")
    dloop = EngineLoop(make(loaded, 3, speculative_schedule="all"), name="d")
    ploop.start()
    dloop.start()
    try:
        decode = DecodeHandler(
            dloop, bus.publish, instance_id="d0", model_name="m", address="x:0", block_size=16
        )
        pusher = Recording()
        pusher.register("x:0", decode)
        prefill = PrefillHandler(
            ploop,
            bus.publish,
            pusher,
            instance_id="p0",
            model_name="m",
            block_size=16,
            max_model_len=4096,
            same_host_handoff=False,
        )
        prefill.submit(
            control_pb2.PrefillTask(
                request_id="r",
                prompt_token_ids=p,
                sampling=GREEDY.to_proto(),
                decode_instance="d0",
                decode_address="x:0",
                events_subject=subjects.token_events("r"),
            )
        )
        got: dict[int, int] = {}
        done = False
        while not done:
            ev = control_pb2.TokenEvent.FromString((await sub.next_msg(60)).data)
            assert not ev.error, ev.error
            got.update({ev.index + i: t for i, t in enumerate(ev.token_ids)})
            done = ev.finished
        assert [got[i] for i in range(len(got))] == full
        (task,) = pusher.tasks
        assert list(task.draft_token_ids) == full[1:4] and len(task.draft_confidences) == 3
        stats = dloop.engine.speculative.stats
        assert stats.accepted == stats.verified >= 3
    finally:
        await ploop.close()
        await dloop.close()


DIGITS = SamplingParams(max_tokens=12, constraint=Constraint("regex", "[0-9]{60}"))


def _decode_all(eng: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.token_id is not None:
                out.setdefault(ev.request_id, []).append(ev.token_id)
    return out


def test_verification_rows_of_a_constrained_request_follow_its_grammar(tiny_mtp) -> None:
    """Drafts handed over with a constrained request's KV are verified row by row under the
    grammar: row i allows what may follow the first i drafts, so a right draft is kept and a
    wrong but allowed one is replaced by the constrained target's token; a draft the grammar
    refuses, and all after it, are not verified. The output is the one-token-a-step engine's."""
    from libs.engine.tokenizer import load_tokenizer

    tok = load_tokenizer()
    p = prompt(30, 5)
    full = run(make(tiny_mtp, 0), {"r": (p, DIGITS)})["r"]
    assert all(tok.id_to_token(t).isdigit() for t in full), "the constraint holds"
    pre = make(tiny_mtp, 0)
    prefill_held(pre, p, dataclasses.replace(DIGITS, max_tokens=1))
    frame = pre.export_kv("r", include_partial=True, release=True)
    rest = dataclasses.replace(DIGITS, max_tokens=11)

    def first_step(drafts: list[int]) -> tuple[Engine, list[int]]:
        eng = make(tiny_mtp, 3, speculative_schedule="all")
        offered = (drafts, [0.9] * len(drafts))
        eng.add_request("r", p + full[:1], rest, kv=frame, prior_outputs=1, drafts=offered)
        return eng, [ev.token_id for ev in eng.step()]

    seven, eight = tok.token_to_id("7"), tok.token_to_id("8")
    wrong = seven if full[3] != seven else eight  # allowed by the grammar, not the target's
    eng, first = first_step(full[1:3] + [wrong])
    assert first == full[1:4]  # two kept, the third replaced by the target's token
    assert (eng.speculative.stats.verified, eng.speculative.stats.accepted) == (3, 2)
    assert [full[0], *first, *_decode_all(eng)["r"]] == full
    eng, first = first_step([full[1], tok.token_to_id("abc"), full[3]])
    assert eng.speculative.stats.verified == 1 and first == full[1:3]  # cut before "abc"
    assert [full[0], *first, *_decode_all(eng)["r"]] == full


@pytest.mark.parametrize("layer_scale", [None, 0.0])
def test_constrained_requests_are_drafted_for_and_stay_constrained(tiny_mtp, layer_scale) -> None:
    """With the engine's own drafts: greedy constrained output equals the one-token engine's
    (JSON schema and a regex beside an unconstrained request); sampled output still follows
    its grammar."""
    from libs.engine.tokenizer import load_tokenizer

    loaded = variant(tiny_mtp, layer_scale)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reqs = {
        "json": (
            prompt(20, 1),
            SamplingParams(max_tokens=16, constraint=Constraint("json_schema", json.dumps(schema))),
        ),
        "digits": (prompt(33, 2), DIGITS),
        "free": (prompt(9, 3), GREEDY),
    }
    want = run(make(loaded, 0), reqs)
    assert run(make(loaded, 3, speculative_schedule="all"), reqs) == want
    tok = load_tokenizer()
    sampled = dataclasses.replace(DIGITS, temperature=1.0, seed=7)
    got = run(make(loaded, 3, speculative_schedule="all"), {"s": (prompt(12, 4), sampled)})["s"]
    assert len(got) == 12 and all(tok.id_to_token(t).isdigit() for t in got)


def test_kernel_path_catch_up_rows_give_the_one_token_engines_tokens(tiny_mtp) -> None:
    """Through the Triton kernels (interpreted): a step's catch-ups as single-token decode rows
    beside prompt catch-ups (a long prompt chunked in). The exact head's drafts are all
    accepted only if every catch-up row got its own hidden state and position; the tokens are
    the one-token kernel engine's."""
    loaded = variant(tiny_mtp, 0.0)
    reqs = {
        "a": (prompt(6, 1), SamplingParams(max_tokens=8, ignore_eos=True)),
        "b": (prompt(40, 2), SamplingParams(max_tokens=5, ignore_eos=True)),
    }
    kw: dict[str, object] = dict(kernels="triton", overlap=False, max_tokens_per_step=24)
    want = run(make(loaded, 0, **kw), reqs)
    eng = make(loaded, 3, speculative_schedule="all", **kw)
    assert run(eng, reqs) == want
    stats = eng.speculative.stats
    assert stats.verified > 0 and stats.accepted == stats.verified


def _confident(tiny_mtp, requests: int, max_tokens: int) -> tuple[LoadedModel, dict]:
    """The tiny MTP test model with a confident head, half its vocabulary remapped, and
    ``requests`` greedy requests of 20 prompt tokens."""
    model = copy.deepcopy(tiny_mtp.model)
    make_mtp_test_model(model, 0.0, 0.5, seed=1, confident=True)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = {f"r{i}": (prompt(20, i), sp) for i in range(requests)}
    return LoadedModel(model, "tiny-confident", tiny_mtp.source), reqs


def test_a_confident_head_separates_right_drafts_from_wrong_ones(tiny_mtp) -> None:
    """make_mtp_test_model(confident=True): right drafts come with high confidence, wrong ones
    with low, acceptance stays about 1 - wrong_fraction, and the main model's greedy output is
    still what speculation must reproduce."""
    loaded, reqs = _confident(tiny_mtp, requests=6, max_tokens=16)
    want = run(make(loaded, 0), reqs)
    eng = make(loaded, 3)
    seen: list[tuple[list[float], int]] = []
    spec = eng.speculative
    assert spec is not None
    observe = spec.acceptance.observe
    spec.acceptance.observe = lambda c, n: (seen.append((list(c), n)), observe(c, n))[1]
    assert run(eng, reqs) == want
    right = [c for cs, n in seen for c in cs[:n]]
    wrong = [cs[n] for cs, n in seen if n < len(cs)]
    assert len(right) > 20 and len(wrong) > 20
    assert min(right) > 0.5 > max(wrong)
    first = [n > 0 for cs, n in seen]  # the first draft: right unless its token was remapped
    assert 0.3 < sum(first) / len(first) < 0.7


def test_measured_step_times_make_the_confidence_schedule_skip_unlikely_drafts(tiny_mtp) -> None:
    """With verification rows priced by a measured table where each row costs a tenth of a
    step, the confidence schedule verifies the confident drafts and leaves the unconfident ones
    (what verify-all pays for), for the same tokens."""
    loaded, reqs = _confident(tiny_mtp, requests=4, max_tokens=24)
    want = run(make(loaded, 0), reqs)
    stats = {}
    for schedule in ("all", "confidence"):
        eng = make(loaded, 3, speculative_schedule=schedule)
        eng.scheduler.cost.set_rows_table({r: 0.01 * (10 + r) / 10 for r in range(1, 65)}, 4)
        assert run(eng, reqs) == want
        assert eng.speculative is not None
        stats[schedule] = eng.speculative.stats
    every, chosen = stats["all"], stats["confidence"]
    assert chosen.verified < 0.75 * every.verified
    assert chosen.accepted / chosen.verified > every.accepted / every.verified + 0.15
