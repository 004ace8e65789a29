"""Expert parallelism inside CUDA graphs (issue 36 item 1), on one GPU: an EP group of one
rank over NCCL runs every MoE layer's fixed-shape exchange with real ``all_to_all_single``
calls, so the capture of the NCCL exchange, the replay with new inputs, and the engine's decode
graphs under EP are all exercised as on N GPUs.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.common.sampling import SamplingParams  # noqa: E402
from libs.engine.config import ModelConfig  # noqa: E402
from libs.engine.engine import Engine, EngineConfig  # noqa: E402
from libs.engine.ep import fixed  # noqa: E402
from libs.engine.ep.group import EPGroup  # noqa: E402
from libs.engine.ep.moe import EPExperts  # noqa: E402
from libs.engine.ep.placement import EMPTY, Placement  # noqa: E402
from libs.engine.llm import LLM  # noqa: E402
from libs.engine.model.moe import Experts  # noqa: E402

CFG = ModelConfig(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
)


@pytest.fixture(scope="module")
def group() -> Iterator[EPGroup]:
    g = EPGroup.single("cuda")
    yield g
    # The engines' CUDA graphs hold NCCL work of this group's communicator: free them, and let
    # the device finish, before the communicator goes (destroying it under live graphs hung).
    gc.collect()
    torch.cuda.synchronize()
    g.close()


def _routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, CFG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    idx = torch.argsort(torch.rand(t, 16, generator=gen), dim=1)[:, :4].cuda()
    return x, torch.rand(t, 4, generator=gen).cuda(), idx


def _local(placement: Placement) -> Experts:
    """Random bf16 experts holding rank 0's slots of ``placement``, run by the fused kernel."""
    local = Experts(CFG, torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        local.w13.normal_(0, 0.05)
        local.w2.normal_(0, 0.05)
    local.keep_slots(placement.experts_of(0))
    local.use_kernels = True
    return local


def test_the_fixed_exchange_replays_from_a_cuda_graph(group) -> None:
    """Captured once for 32 tokens under a group bound of 48 (another rank's step is bigger:
    a third of the buffer rows are padding), replayed with other tokens and routes: the same
    output as the layer run eagerly, bit for bit."""
    placement = Placement(
        16, ((3, 5, 0, 7, 1, EMPTY, 6, 2, 5, 4, 0, 8, 9, 10, 11, 12, 13, 14, 15),)
    )
    layer = EPExperts(_local(placement), group, placement, fixed.StepBound(tokens=48))
    x, w, idx = _routing(32, 0)
    static = [x.clone(), w.clone(), idx.clone()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            layer(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = layer(*static)
    for seed in (1, 2):
        x, w, idx = _routing(32, seed)
        for s, v in zip(static, (x, w, idx)):
            s.copy_(v)
        graph.replay()
        with torch.inference_mode():
            want = layer(x, w, idx)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("live", [None, 20])
def test_the_fused_exchange_gives_the_torch_exchanges_numbers(group, live) -> None:
    """The Triton dispatch and combine (libs/engine/kernels/ep_exchange.py, compiled here) and
    the PyTorch ops they replace: the same outputs bit for bit and the same load counts, with
    a group bound above the rank's tokens and, with ``live``, a graph's padding rows."""
    placement = Placement(16, ((3, 5, 0, 7, 1, EMPTY, 6, 2, 5, 4, 15, 8, 9, 10, 11, 12, 13, 14),))
    base = _local(placement)
    x, w, idx = _routing(32, 3)
    outs, loads = [], []
    for fused in (False, True):
        bound = fixed.StepBound(
            tokens=48, live=None if live is None else torch.tensor([live]).cuda()
        )
        layer = EPExperts(copy.deepcopy(base), group, placement, bound)
        layer.fused_exchange = fused
        with torch.inference_mode():
            outs.append(layer(x, w, idx)[: live or 32])
        loads.append(layer.load.clone())
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    assert torch.equal(loads[1], loads[0]) and int(loads[0].sum()) == (live or 32) * 4


def test_an_ep_engine_replays_decode_graphs_with_the_eager_tokens(group) -> None:
    """The tiny model (fp32) as rank 0 of a one-rank NCCL group: decode steps replay the
    graphs (MoE exchanges inside them) and give the tokens of the same engine without graphs."""
    prompts = [
        [(i * 7919 + s * 104729) % 120000 + 3 for i in range(n)]
        for s, n in enumerate([5, 23, 40, 9])
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # fp32: graph and eager rounding stay too close to flip a greedy token.
    base = dict(
        model="tiny",
        device="cuda",
        dtype="float32",
        num_kv_blocks=64,
        max_running=8,
        time_budget_s=None,
    )
    outs = {}
    for graphs in (False, True):
        engine = Engine(EngineConfig(**base, cuda_graphs=graphs), ep=group)
        assert engine.runner.cuda_graphs == graphs
        got = LLM(engine=engine).generate(copy.deepcopy(prompts), params, decode_text=False)
        outs[graphs] = [o.token_ids for o in got]
        if graphs:
            replays = sum(g.steps for g in engine.runner.graph_sets["decode"].graphs.values())
            assert replays >= params.max_tokens - 1
        del engine
    assert outs[True] == outs[False]
