"""The fused router kernel (``libs/engine/kernels/router.py``, Triton's interpreter) against
the PyTorch Router on every routing layout DeepSeek uses: V3's sigmoid with the correction
bias and group-limited top-2 group scores, V2-Lite's plain softmax top-6, V2's
group-limited greedy, with and without normalized weights. The same experts for every token,
their weights within an fp32 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from libs.engine.kernels.router import route, supported
from libs.engine.model.moe import Router
from libs.engine.presets import PRESETS

LAYOUTS = {
    "tiny-v3-groups": ("tiny", {}),
    "v2-lite-softmax-top6": ("v2-lite", {}),
    "v3-256-experts-8-groups": ("v3-slice", {}),
    "v2-group-limited-greedy": (
        "v2-lite",
        dict(topk_method="group_limited_greedy", n_group=8, topk_group=3),
    ),
    "v2-lite-normalized": ("v2-lite", dict(norm_topk_prob=True)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_router_picks_the_reference_experts_and_weights(layout: str) -> None:
    preset, over = LAYOUTS[layout]
    cfg = dataclasses.replace(PRESETS[preset], **over)
    assert supported(cfg)
    router = Router(cfg, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(len(layout))
    router.weight.data = torch.randn(router.weight.shape, generator=g)
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:
        bias.data = torch.randn(cfg.n_routed_experts, generator=g) * 0.1
    x = torch.randn(37, cfg.hidden_size, generator=g) * 0.05
    want_w, want_i = router(x)
    got_w, got_i = route(F.linear(x, router.weight), cfg, bias)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    got_sorted, got_order = got_i.sort(-1)
    want_sorted, want_order = want_i.sort(-1)
    assert torch.equal(got_sorted, want_sorted)
    torch.testing.assert_close(
        got_w.gather(1, got_order), want_w.gather(1, want_order), rtol=1e-6, atol=1e-7
    )
    # Best first: the biased (V3) or plain scores of the picks do not increase.
    scores = torch.sigmoid(F.linear(x, router.weight)) if cfg.scoring_func == "sigmoid" else None
    if scores is not None and bias is not None:
        picked = (scores + bias).gather(1, got_i)
        assert bool((picked[:, :-1] >= picked[:, 1:]).all())


def test_layouts_the_kernel_does_not_take_stay_on_pytorch() -> None:
    v2 = dataclasses.replace(PRESETS["v2-lite"], n_routed_experts=160, n_group=8, topk_group=3)
    assert not supported(dataclasses.replace(v2, topk_method="group_limited_greedy"))
