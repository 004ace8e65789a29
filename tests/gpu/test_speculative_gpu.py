"""Speculative decoding on the device's kernel path: verification rows run as batched decode
rows through the Triton MLA decode kernel, and they and the MTP passes (catch-up rows, each
depth's drafts, the head's pick) replay captured CUDA graphs; greedy tokens equal one token a
step's."""

from __future__ import annotations

import copy

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.loader import LoadedModel, load
from libs.engine.speculative import make_mtp_test_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("layer_scale,wrong", [(0.0, 0.3), (0.3, 0.0)])
def test_greedy_speculative_equals_one_token_a_step_on_device(layer_scale, wrong) -> None:
    base = load("tiny", "cuda", torch.float32, 0, with_mtp=True)
    model = copy.deepcopy(base.model)
    make_mtp_test_model(model, layer_scale, wrong, seed=1)
    loaded = LoadedModel(model, "tiny-mtp-test", "tiny")
    prompts = [[(i * 7919 + j * 104729) % 120000 + 3 for i in range(20 + 37 * j)] for j in range(6)]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)

    def run(k: int) -> tuple[list[list[int]], Engine]:
        eng = Engine(
            EngineConfig(
                model="tiny",
                device="cuda",
                dtype="float32",
                num_kv_blocks=64,
                speculative_tokens=k,
                speculative_schedule="all",
                with_mtp=True,
            ),
            loaded=loaded,
        )
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, sp)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished():
            for ev in eng.step():
                if ev.token_id is not None:
                    got[ev.request_id].append(ev.token_id)
        return list(got.values()), eng

    want, _ = run(0)
    got, eng = run(3)
    assert got == want
    assert eng.speculative is not None and eng.speculative.stats.verified > 0
    assert eng.runner.use_kernels and eng.runner.cuda_graphs
    for name in ("decode", "mtp", "mtp_head"):
        assert sum(g.steps for g in eng.runner.graph_sets[name].graphs.values()) > 0, name
