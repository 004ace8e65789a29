"""vLLM's flag names work where a vLLM user types them: on ``deepserve up`` and on every
engine service, meaning what they mean in vLLM (the context limit, a step's token budget,
the batch size, the served name, the share of the GPU, the API's address and key)."""

from __future__ import annotations

from typing import Any

import pytest

from deepserve import cli
from deepserve.up import vllm_args
from services.aggregated.config import build_parser as aggregated_parser
from services.aggregated.config import config_from as aggregated_config
from services.prefill.config import build_parser as prefill_parser
from services.prefill.config import config_from as prefill_config


def test_up_takes_vllms_names_and_hands_each_to_the_services_it_concerns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def fake_run_up(*args: Any, **kwargs: Any) -> int:
        seen["args"], seen["kwargs"] = args, kwargs
        return 0

    monkeypatch.setattr("deepserve.up.run_up", fake_run_up)
    argv = ["up", "--served-model-name", "my-model", "--gpu-memory-utilization", "0.5"]
    argv += ["--max-model-len", "8192", "--max-num-batched-tokens", "4096"]
    argv += ["--max-num-seqs", "64", "--host", "0.0.0.0", "--api-key", "sk-1"]
    assert cli.main(argv) == 0
    kw = seen["kwargs"]
    assert seen["args"][4] == "my-model" and kw["gpu_memory_fraction"] == 0.5
    assert kw["api_key"] == "sk-1"
    more = kw["more_args"]
    engine = ["--max-model-len", "8192", "--max-tokens-per-step", "4096", "--max-running", "64"]
    assert more["prefill"] == more["decode"] == more["aggregated"] == engine
    assert more["entrypoint"] == ["--max-context", "8192"]
    assert more["recipe"] == ["--max-context", "8192", "--host", "0.0.0.0"]
    assert vllm_args() == {}  # nothing given: every service keeps its defaults


def test_engine_services_read_vllms_names_as_their_own() -> None:
    vllm = ["--served-model-name", "m", "--max-num-batched-tokens", "2048"]
    vllm += ["--max-num-seqs", "32", "--max-model-len", "4096"]
    for build, config in ((prefill_parser, prefill_config), (aggregated_parser, aggregated_config)):
        engine = config(build().parse_args(vllm)).model.engine_config()
        assert (engine.max_tokens_per_step, engine.max_running, engine.max_model_len) == (
            2048,
            32,
            4096,
        )
        assert config(build().parse_args(vllm)).model.model_name == "m"
