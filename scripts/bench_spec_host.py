"""Host time per engine step, speculative decoding against one token a step, on a model whose
compute is negligible: what the scheduler, the draft choice, the verification bookkeeping and
the input preparation cost per step and per request.

Run from the repository root: ``PYTHONPATH=$PWD python3 scripts/bench_spec_host.py``.
The tiny preset cut to one layer and a 2,048-token vocabulary, its MTP head made the test
model's (acceptance level 0.8), greedy, 32-token prompts, overlap off (speculative steps are
synchronous), the PyTorch path; K = 3 with the confidence schedule. Prints milliseconds per
step and microseconds per request-step at batch 16 / 64 / 256, after four warm-up steps, over
ten steps. On a GPU the speculative step's host time is not overlapped with the device's, so
it adds to every step there.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.loader import LoadedModel
from libs.engine.model.model import DeepseekForCausalLM
from libs.engine.presets import PRESETS, init_random_weights
from libs.engine.speculative import make_mtp_test_model


def main() -> None:
    cfg = dataclasses.replace(
        PRESETS["tiny"],
        vocab_size=2048,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        num_nextn_predict_layers=1,
    )
    model = DeepseekForCausalLM(cfg, torch.float32, torch.device("cpu"), with_mtp=True)
    init_random_weights(model, 0)
    make_mtp_test_model(model, 0.0, 0.2, seed=1)
    loaded = LoadedModel(model, "tiny-1-layer-2k-vocab", "tiny")
    for batch in (16, 64, 256):
        for k in (0, 3):
            engine = Engine(
                EngineConfig(
                    model="tiny",
                    num_kv_blocks=batch * 3 + 16,
                    max_running=batch,
                    time_budget_s=None,
                    with_mtp=True,
                    speculative_tokens=k,
                    max_tokens_per_step=65536,
                    overlap=False,
                ),
                loaded=loaded,
            )
            for i in range(batch):
                prompt = [(i * 7 + j * 13) % 2000 + 3 for j in range(32)]
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
            for _ in range(4):
                engine.step()
            steps = tokens = 0
            start = time.perf_counter()
            while engine.has_unfinished() and steps < 10:
                tokens += sum(1 for ev in engine.step() if ev.token_id is not None)
                steps += 1
            per_step = (time.perf_counter() - start) / steps
            print(
                f"batch {batch:3d} K={k}: {per_step * 1e3:7.2f} ms/step, "
                f"{per_step / batch * 1e6:6.1f} us per request-step, "
                f"{tokens / steps / batch:.2f} tokens per request-step",
                flush=True,
            )


if __name__ == "__main__":
    main()
