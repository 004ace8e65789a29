"""DeepSeek-V4 reference model on a CUDA device: transformers parity (fp32, the random configs
of tests/hf_reference.py) and V4-Flash widths (bf16, the v4-flash-slice preset)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.engine.v4.config import V4Config  # noqa: E402
from libs.engine.v4.load import generate_v4, load_v4  # noqa: E402
from libs.engine.v4.model import V4ForCausalLM, V4State  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", ["v4-mixed", "v4-default-schedule-yarn", "v4-wide-streams"])
def test_parity_with_transformers_on_device(name: str) -> None:
    from tests.hf_reference import build_hf_v4, require_reference

    transformers = require_reference("transformers")  # pinned in the test extra: has V4
    assert hasattr(transformers, "DeepseekV4ForCausalLM"), transformers.__version__
    hf = build_hf_v4(name).to(CUDA)
    ours = V4ForCausalLM(V4Config.from_hf(hf.config.to_dict())).to(CUDA)
    ours.load_hf_state(hf.state_dict())
    ids = torch.randint(2, 256, (41,), generator=torch.Generator().manual_seed(1)).to(CUDA)
    with torch.no_grad():
        want = hf(ids[None], use_cache=False).logits[0]
    got = ours(ids, V4State.empty(ours.cfg))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.xfail(
    reason="H200, 25be9ab: steps 0-2 within 2% of the full pass, step 3 (position 603, where a "
    "CSA window closes during decode) 8.2%; on CPU (v4-tiny, bf16) the two agree exactly; "
    "cause not measured yet. Strict: the day it passes, XPASS fails the run -- drop this mark",
    strict=True,
)
def test_flash_widths_run_and_decode_consistently() -> None:
    """V4-Flash's widths in bf16: a 600-token prompt (CSA and HCA entries, windows of 128),
    then decode; each decoded step's logits match a fresh pass over the whole sequence."""
    net = load_v4("v4-flash-slice", CUDA, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, net.cfg.vocab_size, (600,), generator=g)
    out = generate_v4(net, prompt.tolist(), max_tokens=6, ignore_eos=True)
    seq = torch.tensor([*prompt.tolist(), *out.token_ids[:-1]], device=CUDA)
    full = net(seq, V4State.empty(net.cfg))
    assert bool(full.isfinite().all())
    st = V4State.empty(net.cfg)
    step = net(seq[:600], st)[-1]
    for i, tok in enumerate(out.token_ids[:-1]):
        rel = (step - full[599 + i]).norm() / full[599 + i].norm()
        assert rel < 2e-2, f"step {i}: {rel:.3g}"
        step = net(torch.tensor([tok], device=CUDA), st)[-1]


def test_the_batched_engine_serves_v4_on_device() -> None:
    """The engine's V4 runner on CUDA (fp32): requests of different lengths together, greedy
    tokens equal to each request alone; the state handed to a second engine continues the
    same."""
    from libs.common.sampling import SamplingParams
    from libs.engine.engine import Engine, EngineConfig

    config = EngineConfig(model="v4-tiny", device="cuda", dtype="float32", block_size=16)
    a, b = Engine(config), Engine(config)
    net = load_v4("v4-tiny", CUDA, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = {f"r{n}": torch.randint(3, 120000, (n,), generator=g).tolist() for n in (5, 40, 150)}
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    for rid, p in prompts.items():
        a.add_request(rid, p, greedy)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while a.has_unfinished():
        for ev in a.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
    for rid, p in prompts.items():
        assert out[rid] == list(generate_v4(net, p, 10, ignore_eos=True).token_ids), rid
    p = prompts["r150"]
    a.add_request("h", p, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    first = [ev.token_id for ev in a.step() if ev.token_id is not None]
    while a.has_unfinished():
        first += [ev.token_id for ev in a.step() if ev.token_id is not None]
    frame = a.export_kv("h", include_partial=True, release=True)
    b.add_request(
        "h", p + first, SamplingParams(max_tokens=9, ignore_eos=True), kv=frame, prior_outputs=1
    )
    rest: list[int] = []
    while b.has_unfinished():
        rest += [ev.token_id for ev in b.step() if ev.token_id is not None]
    assert first + rest == out["r150"]


def test_v4_kernels_at_flash_widths_match_pytorch_in_bf16() -> None:
    """The decode attention (64 heads of 512, a window of 128 rows and 512 picked entries out
    of a pool), the indexer (64 heads of 128 over 2,000 keys) and the clamped-SwiGLU MoE at
    V4-Flash's widths, bf16 inputs, against the fp32 references on the same inputs."""
    from libs.engine.kernels.fused_moe import fused_moe, fused_moe_reference
    from libs.engine.kernels.v4_attention import (
        indexer_scores,
        indexer_scores_reference,
        sparse_decode_attention,
        sparse_decode_attention_reference,
    )

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    g = torch.Generator(device=CUDA).manual_seed(0)
    b, h, d = 16, 64, 512
    q = torch.randn(b, h, d, device=CUDA, generator=g).bfloat16()
    rows = torch.randn(b * 2000, d, device=CUDA, generator=g).bfloat16()
    index = torch.randint(0, rows.shape[0], (b, 640), device=CUDA, generator=g).int()
    index[3, 100:] = -1
    sinks = torch.randn(h, device=CUDA, generator=g)
    ref = sparse_decode_attention_reference(q, rows, index, sinks, d**-0.5)
    assert rel(sparse_decode_attention(q, rows, index, sinks, d**-0.5), ref) < 1e-2
    qi = torch.randn(b, 64, 128, device=CUDA, generator=g).bfloat16()
    w = torch.randn(b, 64, device=CUDA, generator=g)
    starts = torch.arange(b, device=CUDA, dtype=torch.int32) * 2000
    counts = torch.full((b,), 2000, device=CUDA, dtype=torch.int32)
    counts[5] = 700
    want = indexer_scores_reference(qi, w, rows[:, :128], starts, counts, 2000, 128**-0.5)
    got = indexer_scores(qi, w, rows[:, :128], starts, counts, 2000, 128**-0.5)
    seen = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), seen)
    assert rel(got[seen], want[seen]) < 1e-2
    x = torch.randn(64, 4096, device=CUDA, generator=g).bfloat16()
    w13 = (torch.randn(16, 4096, 4096, device=CUDA, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(16, 4096, 2048, device=CUDA, generator=g) * 0.05).bfloat16()
    ids = torch.stack([torch.randperm(16, device=CUDA, generator=g)[:6] for _ in range(64)])
    wts = torch.rand(64, 6, device=CUDA, generator=g)
    want = fused_moe_reference(x, w13, w2, wts, ids, swiglu_limit=10.0)
    assert rel(fused_moe(x, w13, w2, wts, ids, swiglu_limit=10.0), want) < 2e-2
