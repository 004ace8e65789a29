"""``deepserve bench engine`` on the CPU at the smallest sizes: the JSON keys, the transformers
peer, the quality check and the plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from deepserve.bench import engine as bench
from deepserve.cli import main as cli
from tests.hf_reference import require_reference

require_reference("transformers")


def test_bench_engine_cpu_writes_keys_and_plot(tmp_path: Path) -> None:
    require_reference("matplotlib")
    out, png = tmp_path / "engine.json", tmp_path / "engine.png"
    rc = cli(
        [
            "bench",
            "engine",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--prefill-tokens",
            "64",
            "--decode-batches",
            "1,2",
            "--context",
            "32",
            "--decode-steps",
            "2",
            "--transformers-batches",
            "1",
            "--transformers-steps",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    for key in (
        "decode_tokens_per_s",
        "decode_roofline_fraction",
        "prefill_mfu",
        "prefill_tokens_per_s",
        "decode_per_user_tokens_per_s",
        "transformers_decode_tokens_per_s",
        "speedup_vs_transformers",
    ):
        assert r[key] and all(v > 0 for v in r[key].values()), key
    assert set(r["decode_tokens_per_s"]) == {"1", "2"} and set(
        r["transformers_decode_tokens_per_s"]
    ) == {"1"}
    assert r["transformers"]["weights_shared_fraction"] == 1.0
    assert (
        r["transformers_decode"][0]["context"] == 32
        and r["transformers_decode"][0]["new_tokens"] == 2
    )
    assert "skipped" in r["quality"] and r["options"]["kv_cache_dtype"] == "auto"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _quality_args() -> argparse.Namespace:
    return argparse.Namespace(
        preset="tiny",
        device="cpu",
        dtype="float32",
        quality_prompts=2,
        quality_tokens=24,
        quality_steps=3,
    )


def test_quality_is_exact_for_identical_engines_and_measures_a_narrower_kv_cache() -> None:
    same = bench.bench_quality(_quality_args(), {})
    assert same["rows"] == 2 * 4 and same["max_abs_diff"] == 0.0 and same["top1_agreement"] == 1.0
    # bf16 KV under an fp32 model: a real, small error, read back through the cache while decoding.
    q = bench.bench_quality(_quality_args(), {"kv_cache_dtype": "bfloat16"})
    assert q["decode"]["rows"] == 2 * 3 and q["prefill"]["rows"] == 2
    assert (
        0 < q["relative_error"] < 0.05
        and 0 < q["decode"]["max_abs_diff"]
        and q["top1_agreement"] >= 0.8
    )


def test_fp8_kv_flag_reports_quality(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    args = [
        "bench",
        "engine",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--prefill-tokens",
        "64",
        "--decode-batches",
        "1",
        "--context",
        "32",
        "--decode-steps",
        "2",
        "--no-transformers",
        "--kv-cache-dtype",
        "fp8",
        "--quality-prompts",
        "2",
        "--quality-tokens",
        "40",
        "--quality-steps",
        "4",
        "--json",
        str(out),
    ]
    try:
        assert cli(args) == 0
    except NotImplementedError as exc:  # an engine without fp8 cache writes on this CPU build
        pytest.skip(f"fp8 KV cache not runnable on this CPU: {exc}")
    r = json.loads(out.read_text())
    assert r["engine_config_overrides"] == {"kv_cache_dtype": "float8_e4m3fn"}
    q = r["quality"]
    assert q["rows"] == 10 and 0 < q["relative_error"] < 0.5 and 0 <= q["top1_agreement"] <= 1
    assert r["transformers_decode"] == [] and "skipped" in r["transformers"]


def test_engine_options_map_flags_to_config_fields() -> None:
    ns = argparse.Namespace(
        kv_cache_dtype="fp8", experts="fp4", no_cuda_graphs=True, no_overlap=True, kernels="torch"
    )
    assert bench.engine_options(ns) == {
        "kv_cache_dtype": "float8_e4m3fn",
        "expert_dtype": "fp4",
        "cuda_graphs": False,
        "overlap": False,
        "kernels": "torch",
    }
    assert bench.engine_options(argparse.Namespace()) == {}
    assert torch.is_tensor(bench.decode_prompts(1, 4, 100))


def test_speculative_decode_counts_every_token_emitted() -> None:
    """With --speculative-tokens a decode step emits up to 1 + K tokens per request: tokens/s
    counts them (on the exact-head test model every draft is accepted: 3 per step and
    request with K = 2), not one per request and step."""
    import copy

    from libs.engine.engine import Engine, EngineConfig
    from libs.engine.loader import LoadedModel, load
    from libs.engine.speculative import make_mtp_test_model

    ns = argparse.Namespace(speculative_tokens=2, speculative_schedule="all")
    opts = bench.engine_options(ns)
    assert opts == {"speculative_tokens": 2, "speculative_schedule": "all"}
    loaded = load("tiny", "cpu", torch.float32, 0, with_mtp=True)
    model = copy.deepcopy(loaded.model)
    make_mtp_test_model(model, 0.0, 0.0, seed=1)
    exact = LoadedModel(model, loaded.model_id + "-exact", loaded.source)
    config = EngineConfig(
        model="tiny", block_size=16, num_kv_blocks=256, time_budget_s=None, **opts
    )
    limits = {"copy_bytes_per_s": 1e10, "matmul_flops_per_s": 1e11}
    out = bench.bench_decode(Engine(config, loaded=exact), 2, 40, 4, limits, 129280)
    assert out["tokens_per_s"] * out["step_seconds"] == pytest.approx(2 * 3)
